"""What the driver adds to every train result as ``result["recorder"]``: writers' and env runners' counters
summed, the policy lag, and TianJi's three rates (produced, stored, consumed) since the last result."""

from __future__ import annotations

import math
import numbers
import time
from collections import Counter
from typing import Any, Callable

from rllib_recorder._rllib_compat import env_steps_sampled
from rllib_recorder.format.lag import PERCENTILES, lag_summary

RUNNER_SUMS = ("samples", "chunks_written", "env_steps_sampled", "env_steps_written", "chunks_dropped",
               "env_steps_dropped", "rows_dropped", "chunks_failed", "env_steps_failed", "rows_failed", "wait_s",
               "errors", "backlog_bytes")

# A durable run's (``output_dir`` a URI): segments sealed and uploaded, and the upload backlog on the nodes.
UPLOAD_SUMS = ("segments_sealed", "segments_uploaded", "bytes_uploaded", "upload_s", "upload_errors",
               "upload_backlog_segments", "upload_backlog_bytes", "upload_backpressure_s")

WRITER_SUMS = ("env_steps", "agent_steps", "chunks", "raw_bytes", "disk_bytes", "write_s",
               "duplicate_chunks", "errors", "cpu_s", "steps_uncommitted", "bytes_uncommitted")


def sum_stats(writer_stats: list[dict[str, Any]], *, run_dir: str, errors_here: int, learner_version: int,
              learners_reporting: int) -> dict[str, Any]:
    """Sums writer and env-runner counters into one flat dict of recorder metrics (``errors_here``: errors the
    driver counted itself)."""
    writers: Counter[str] = Counter()
    runners: Counter[str] = Counter()
    lag: Counter[int] = Counter()
    max_wait = 0.0
    for stats in writer_stats:
        writers.update({k: stats.get(k, 0) for k in WRITER_SUMS})
        lag.update({int(k): v for k, v in stats.get("policy_lag_counts", {}).items()})
        for runner in stats.get("runners", {}).values():
            runners.update({k: runner.get(k, 0) for k in RUNNER_SUMS})
            max_wait = max(max_wait, runner.get("max_wait_s", 0.0))
    lags = lag_summary(lag)
    uploads = {k: sum(s.get(k, 0) for s in writer_stats) for k in UPLOAD_SUMS} \
        if any("segments_uploaded" in s for s in writer_stats) else {}
    if uploads:
        uploads["last_upload_error"] = next((s["last_upload_error"] for s in writer_stats
                                             if s.get("last_upload_error")), None)
    last_error = next((s["last_error"] for s in writer_stats if s.get("last_error")), None) or next(
        (r["last_error"] for s in writer_stats for r in s.get("runners", {}).values() if r.get("last_error")),
        None)
    # Each env-runner process sends under its own sender id: more than one per file is a restart.
    restarts = sum(max(0, n - 1) for s in writer_stats for n in s.get("senders", {}).values())
    return {
        "run_dir": run_dir,
        "env_steps_stored": writers["env_steps"], "agent_steps_stored": writers["agent_steps"],
        "chunks_stored": writers["chunks"], "raw_bytes": writers["raw_bytes"],
        "disk_bytes": writers["disk_bytes"], "writer_busy_s": writers["write_s"],
        "writer_cpu_s": round(writers["cpu_s"], 3),
        "duplicate_chunks": writers["duplicate_chunks"],
        "steps_uncommitted": writers["steps_uncommitted"], "spool_backlog_bytes": runners["backlog_bytes"],
        "sampler_wait_s": runners["wait_s"],
        "sampler_max_wait_s": max_wait, "chunks_dropped": runners["chunks_dropped"],
        "env_steps_dropped": runners["env_steps_dropped"],
        "rows_dropped": runners["rows_dropped"], "chunks_failed": runners["chunks_failed"],
        "rows_failed": runners["rows_failed"], "env_steps_failed": runners["env_steps_failed"],
        "errors": writers["errors"] + runners["errors"] + runners["chunks_failed"] + errors_here,
        "learner_version": learner_version,
        "last_error": last_error, "runner_restarts_seen": restarts,
        "learners_reporting": learners_reporting,
        "policy_lag_mean": lags["mean"] if lags["steps"] else 0.0,
        "policy_lag_max": lags["max"] if lags["steps"] else 0,
        "policy_lag_hist": lags["hist"], "policy_lag_unknown_steps": lags["unknown"],
        **{f"policy_lag_p{p}": lags[f"p{p}"] for p in PERCENTILES},
        **uploads,
    }


class RllibSampled:
    """RLlib's count of env steps sampled since an attempt began: its lifetime count less what it had counted before
    the attempt's first iteration (``offset``).

    That is 0 for a new Algorithm, the checkpoint's count for one restored from a checkpoint, and on Ray 2.50-2.52
    the first iteration's over-count (``_rllib_compat.env_steps_sampled``). It is taken once, at the first result:
    the lifetime count less that iteration's own count.
    """

    def __init__(self, offset: int | None = None, evaluation: bool = False) -> None:
        self.offset, self.evaluation = offset, evaluation

    def update(self, result: dict[str, Any]) -> int | None:
        lifetime, this_iteration = env_steps_sampled(result, self.evaluation)
        if lifetime is None:
            return None
        if self.offset is None:
            self.offset = max(0, lifetime - this_iteration) if this_iteration is not None else 0
        return max(0, lifetime - self.offset)


class Rates:
    """TianJi's three rates between train results, and the lifetime counts the manifest keeps at each.

    Produced: sampled by the env runners (RLlib's lifetime count); stored: committed by the writers; consumed:
    handed to the learners to train on, each step once (not once per epoch or minibatch;
    ``learner.ConsumedSteps``). ``steps_not_stored`` is what the env runners sampled and the writers have not
    committed (held, in flight, dropped or failed): writers that keep up hold it near one coalescing window.
    ``clock`` (monotonic seconds) and ``wall`` (Unix seconds) are passed in so that tests need not sleep.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 sampled: RllibSampled | None = None) -> None:
        self.clock, self.wall = clock, wall
        self.sampled = sampled if sampled is not None else RllibSampled()
        self.started = clock()
        self.base: tuple[float, int, int, int] = (self.started, 0, 0, 0)
        self.lifetime: dict[str, float] = {}

    def update(self, stored: int, result: dict[str, Any], consumed: int | None) -> dict[str, Any]:
        """The rates since the last update; ``consumed`` None: the old API stack's own once-per-batch count."""
        produced = self.sampled.update(result) or 0
        if consumed is None:
            consumed = int(result.get("num_env_steps_trained") or 0)
        now = (self.clock(), produced, stored, consumed)
        rates = interval_rates(self.base, now)
        self.base = now
        self.lifetime = {
            "env_steps_sampled": produced, "env_steps_consumed": consumed,
            "recording_s": now[0] - self.started, "last_result_at_s": self.wall(),
        }
        return {**rates, "steps_not_stored": max(0, produced - stored)}


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


def learner_version_of(result: dict[str, Any]) -> int | None:
    """The newest ``weights_seq_no`` a train result reports from its learners (None: none reported)."""
    learners = result.get("learners") or {}
    versions_seen = [
        v["weights_seq_no"] for k, v in learners.items()
        if k != "__all_modules__" and isinstance(v, dict) and "weights_seq_no" in v
    ]
    # APPO reports NaN before its learner's first update.
    versions_seen = [int(x) for x in versions_seen if isinstance(x, numbers.Real) and math.isfinite(x)]
    return max(versions_seen) if versions_seen else None


def find(tree: dict[str, Any], path: tuple[str, ...], default: Any) -> Any:
    """``tree[path[0]][path[1]]...``, or ``default`` where a key is missing."""
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree
