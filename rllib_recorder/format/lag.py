"""Policy lag and the three rates (produced, stored, consumed): pure numpy over the stored indexes."""

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
                         num_rows: int) -> np.ndarray:
    """The learner version of every step row of one agent, from its episode index and the batch index."""
    out = np.full(num_rows, UNKNOWN, np.int64)
    for batch, first, n in zip(fragments["batch"].tolist(), fragments["first_row"].tolist(),
                               fragments["num_rows"].tolist()):
        out[first:first + n] = batch_learner_version[batch]
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


def stored_rates(batches: list[dict[str, np.ndarray]], steps_sampled: int | None = None) -> dict[str, Any]:
    """Produced and stored env steps per second from batch indexes (all files of a run).

    Produced: steps over the span of their sampling times; stored: the same steps over the span
    from the first sampling to the last commit. Writers that keep up give nearly equal rates and a
    small write delay (``written_at_s - sampled_at_s``). ``steps_sampled`` (RLlib's count, from the
    manifest) also counts steps sampled but never stored.
    """
    sampled = np.concatenate([b["sampled_at_s"] for b in batches if len(b.get("seq", ()))] or [np.zeros(0)])
    written = np.concatenate([b["written_at_s"] for b in batches if len(b.get("seq", ()))] or [np.zeros(0)])
    steps = int(sum(int(b["env_steps"].sum()) for b in batches if len(b.get("seq", ()))))
    if len(sampled) < 2:
        return {"produced_steps_per_s": None, "stored_steps_per_s": None, "write_delay_s_p50": None,
                "write_delay_s_max": None}
    start = float(sampled.min())
    produced = steps_sampled if steps_sampled else steps
    sample_span, store_span = float(sampled.max()) - start, float(written.max()) - start
    delay = written - sampled
    return {
        "produced_steps_per_s": produced / sample_span if sample_span > 0 else None,
        "stored_steps_per_s": steps / store_span if store_span > 0 else None,
        "write_delay_s_p50": float(np.median(delay)), "write_delay_s_max": float(delay.max()),
    }


def interval_rates(before: tuple[float, int, int, int] | None, now: tuple[float, int, int, int]) -> dict[str, float]:
    """Produced, stored and consumed steps per second between two (time, produced, stored, consumed) readings."""
    if before is None or now[0] <= before[0]:
        return {}
    dt = now[0] - before[0]
    return {
        "produced_steps_per_s": (now[1] - before[1]) / dt,
        "stored_steps_per_s": (now[2] - before[2]) / dt,
        "consumed_steps_per_s": (now[3] - before[3]) / dt,
    }
