"""The read side: a run, its worker files, episodes and batches, and their conversions to RLlib, pandas and Ray Data."""
