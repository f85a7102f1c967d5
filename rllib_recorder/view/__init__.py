"""The local web viewer of runs and episodes (`rllib-recorder view`): a reader of runs through ``read/``."""
