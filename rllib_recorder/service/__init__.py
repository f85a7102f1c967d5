"""The driver side and its actors: the run's lifecycle, the writer pool and writers, learner hooks, metrics,
recovery.
"""
