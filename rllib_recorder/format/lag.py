"""Policy lag: how far behind the learner each stored step's behaviour policy was, and its summaries."""

from __future__ import annotations

from typing import Any

import numpy as np

UNKNOWN = -1

PERCENTILES = (50, 90, 99)


def chunk_learner_version(learner_version: int, behaviour_versions: np.ndarray) -> int:
    """The learner version stored with a chunk: never older than a behaviour version in it.

    A runner can only act with weights the learner has produced, so a behaviour version above the
    learner version looked up by time means the learner's report had not arrived yet (or clocks
    differ between nodes): the behaviour version is then the better bound. Unknown stays unknown.
    """
    if learner_version < 0:
        return UNKNOWN
    known = behaviour_versions[behaviour_versions >= 0]
    return max(int(learner_version), int(known.max())) if len(known) else int(learner_version)


def step_lags(learner_version: np.ndarray, weights_seq_no: np.ndarray) -> np.ndarray:
    """Per step: learner version minus behaviour version; -1 where either is unknown."""
    learner_version = np.asarray(learner_version, np.int64)
    weights_seq_no = np.asarray(weights_seq_no, np.int64)
    known = (learner_version >= 0) & (weights_seq_no >= 0)
    return np.where(known, learner_version - weights_seq_no, UNKNOWN).astype(np.int64)


def rows_learner_version(fragments: dict[str, np.ndarray], batch_learner_version: np.ndarray,
                         num_rows: int, start: int = 0) -> np.ndarray:
    """The learner version of step rows ``start .. start + num_rows`` of one agent, from its episode index (the
    fragments holding those rows, or all of them) and the batch index."""
    out = np.full(num_rows, UNKNOWN, np.int64)
    stop = start + num_rows
    for batch, first, n in zip(fragments["batch"].tolist(), fragments["first_row"].tolist(),
                               fragments["num_rows"].tolist()):
        lo, hi = max(first, start), min(first + n, stop)
        if hi > lo:
            out[lo - start:hi - start] = batch_learner_version[batch]
    return out


def lag_summary(counts: dict[int, int]) -> dict[str, Any]:
    """Histogram, mean, max and percentiles of known lags; ``unknown`` counts steps without one."""
    unknown = int(counts.get(UNKNOWN, 0))
    known = {int(k): int(v) for k, v in sorted(counts.items()) if int(k) >= 0 and v}
    total = sum(known.values())
    out: dict[str, Any] = {"steps": total, "unknown": unknown, "hist": {str(k): v for k, v in known.items()}}
    if not total:
        return {**out, "mean": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    values = np.array(list(known), np.int64)
    cumulative = np.cumsum(list(known.values()))
    for p in PERCENTILES:
        out[f"p{p}"] = int(values[np.searchsorted(cumulative, np.ceil(total * p / 100))])
    out["mean"] = float(sum(k * v for k, v in known.items()) / total)
    out["max"] = int(values.max())
    return out


def count_lags(lags: np.ndarray) -> dict[int, int]:
    values, counts = np.unique(np.asarray(lags, np.int64), return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))
