"""What `rllib-recorder info` reports: one run's summary, or every run below a folder."""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator

import numpy as np

from rllib_recorder.commands.verify import run_status
from rllib_recorder.errors import SchemaError
from rllib_recorder.format import counters, h5file, liveness
from rllib_recorder.format.lag import count_lags, lag_summary
from rllib_recorder.format.manifest import ENDED_STATUSES, read_manifest
from rllib_recorder.read.run import open_run
from rllib_recorder.read import accounting


def summarize(run_dir: str) -> dict[str, Any]:
    """What a person wants at a glance about a run; ``unknown`` says why a value that is None is not known."""
    with open_run(run_dir) as run:
        manifest = run.manifest
        totals = manifest.get("totals") or {}
        returns, episodes, steps = [], 0, 0
        lags: Counter[int] = Counter()
        for f in run.files:
            with h5file.damaged_file_errors(f.path):
                file_steps, file_episodes, file_returns = _file_summary(f)
                if not f.is_evaluation:
                    for agent in f.agents:
                        lags.update(count_lags(f.policy_lag(agent)))
            steps, episodes, returns = steps + file_steps, episodes + file_episodes, returns + file_returns
        disk = sum(f.stored_bytes() for f in run.files)
        raw = totals.get("raw_bytes") or 0
        status = run_status(run_dir, manifest)
        recording = str(status).startswith("recording")
        unexplained = None if recording else accounting.unexplained_steps(manifest, accounting.accounts(manifest,
                                                                                                        run.files))
        summary = {
            "run_dir": run_dir, "target": manifest.get("target"), "trial": manifest.get("trial_name") or manifest.get("trial"),
            "status": status, "ended_by": manifest.get("ended_by"), "algorithm": manifest.get("algorithm"),
            "env": manifest.get("env"), "api_stack": manifest.get("api_stack"),
            "started_at": manifest.get("started_at"), "finished_at": manifest.get("finished_at"),
            "recording_s": _span_s(manifest.get("started_at"), manifest.get("finished_at")),
            "files": len(run.files), "nodes": manifest.get("nodes"), "env_steps": steps,
            "episodes_finished": episodes,
            "return_mean": float(np.mean(returns)) if returns else None,
            "return_min": float(np.min(returns)) if returns else None,
            "return_max": float(np.max(returns)) if returns else None,
            "disk_bytes": disk, "raw_bytes": raw or None,
            "compression_ratio": round(raw / disk, 2) if raw and disk else None,
            "env_steps_not_stored": _not_stored(totals) if not recording else None,
            "env_steps_unexplained": unexplained,
            "chunks_dropped": totals.get("chunks_dropped"), "errors": totals.get("errors"),
            "policy_lag": lag_summary(lags),
            "rates": run_rates(run, totals),
        }
    summary["unknown"] = _unknown(summary, manifest, recording)
    return summary


def _not_stored(totals: dict[str, Any]) -> int | None:
    senders = totals.get("senders")
    if not isinstance(senders, dict) or not senders:
        return None
    return sum(sum(int(stats.get(k) or 0) for k in counters.CAUSES) for stats in senders.values()
               if isinstance(stats, dict))


def _span_s(start: Any, end: Any) -> float | None:
    import datetime

    try:
        parse = lambda text: datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z")  # noqa: E731
        return max(0.0, (parse(end) - parse(start)).total_seconds())
    except (TypeError, ValueError):
        return None


def _unknown(summary: dict[str, Any], manifest: dict[str, Any], recording: bool) -> dict[str, str]:
    """Why each value that is None is not known (for a person reading ``info``)."""
    why: dict[str, str] = {}
    if summary["finished_at"] is None:
        why["finished_at"] = "still recording" if recording else "the recording never closed (run recover)"
    if summary["recording_s"] is None and summary["finished_at"] is not None:
        why["recording_s"] = "the manifest's start or end time is not a time"
    if summary["return_mean"] is None:
        why["return_mean"] = "no episode has finished yet" if summary["env_steps"] else "nothing is stored yet"
    if summary["compression_ratio"] is None:
        why["compression_ratio"] = ("the raw size is counted when the recording ends" if recording
                                    or summary["raw_bytes"] is None else "no bytes stored")
    if summary["env_steps_not_stored"] is None:
        why["env_steps_not_stored"] = ("counted when the recording ends" if recording else
                                       "the manifest holds no env runner counts (recorded by an older recorder)")
    lag = summary["policy_lag"]
    if not lag["steps"]:
        why["policy_lag"] = ("the old API stack records no policy version" if manifest.get("api_stack") == "old"
                             else "no step has a known policy version")
    why.update(summary["rates"].pop("unknown", {}))
    return why


def run_rates(run: Any, totals: dict[str, Any]) -> dict[str, Any]:
    """TianJi's three rates of a run (training files), in env steps per second.

    Produced and stored come from the batch index (see ``stored_rates``); consumed is the env steps
    handed to the learners to train on (each once, ``learner.ConsumedSteps``), kept in the manifest at the
    last train result, over the time from the first stored sample to that result. ``unknown`` says why a rate
    is None.
    """
    batches = [f.batches() for f in run.files if not f.is_evaluation and f.commit["batches"]]
    rates = stored_rates(batches, totals.get("env_steps_sampled"))
    consumed, last = totals.get("env_steps_consumed"), totals.get("last_result_at_s")
    first = min((float(b["sampled_at_s"].min()) for b in batches), default=None)
    span = last - first if last and first else None
    rates["consumed_steps_per_s"] = consumed / span if consumed and span and span > 0 else None
    why: dict[str, str] = {}
    stored_samples = sum(len(b["sampled_at_s"]) for b in batches)
    for key in ("produced_steps_per_s", "stored_steps_per_s", "write_delay_s_p50"):
        if rates[key] is None:
            why[key] = (f"a rate needs two stored samples; this run has {stored_samples}" if stored_samples < 2
                        else "all stored samples were taken at the same moment")
    if rates["consumed_steps_per_s"] is None:
        why["consumed_steps_per_s"] = (
            "recorded before rllib_recorder counted each trained step once" if "env_steps_trained" in totals
            and "env_steps_consumed" not in totals else
            "no train() result has reached the manifest yet" if last is None else
            "the learners have trained on nothing yet" if not consumed else
            "the first stored sample came after the last train() result")
    rates["unknown"] = why
    return rates


def _file_summary(f: Any) -> tuple[int, int, list[float]]:
    steps = int(f.batches()["env_steps"].sum()) if f.commit["batches"] else 0
    episodes, returns = 0, []
    for agent in f.agents:
        frags = f.fragments(agent)
        done = frags["terminated"] | frags["truncated"]
        episodes += int(done.sum())
        by_id: dict[bytes, float] = defaultdict(float)
        for eps, ret in zip(frags["eps_id"].tolist(), frags["return"].tolist()):
            by_id[eps] += ret
        returns += [by_id[e] for e in frags["eps_id"][done].tolist()]
    return steps, episodes, returns


# Folders ``info`` does not look into for runs: Tune's own storage beside the recordings (``train`` keeps it in
# ``<output_dir>/_tune``) and hidden folders (spools, caches).
SKIPPED_DIRS = ("_tune",)

MAX_DEPTH = 8

MAX_DIRS = 20_000


def find_runs(root: str) -> list[str]:
    """Every run directory (one holding ``manifest.json``) at or below ``root``, sorted; a run's own folder is
    not looked into. Walks at most ``MAX_DEPTH`` levels and ``MAX_DIRS`` folders, follows no symbolic link."""
    if os.path.isfile(os.path.join(root, "manifest.json")):
        return [root]
    found, seen = [], 0
    stack = [(root, 0)]
    while stack and seen < MAX_DIRS:
        folder, depth = stack.pop()
        seen += 1
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") or entry.name in SKIPPED_DIRS or not entry.is_dir(follow_symlinks=False):
                continue
            if os.path.isfile(os.path.join(entry.path, "manifest.json")):
                found.append(entry.path)
            elif depth + 1 < MAX_DEPTH:
                stack.append((entry.path, depth + 1))
    return sorted(found)


def summarize_folder(folder: str) -> dict[str, Any]:
    """Every run at or below ``folder``: one row each (grouped by the folder that holds it, e.g. a Tune
    experiment), the experiments' indexes checked against their runs, and totals."""
    from rllib_recorder.errors import RecorderError
    from rllib_recorder.format.index import INDEX_NAME, read_index

    if not os.path.isdir(folder):
        raise SchemaError(f"{folder} is not a directory; pass a run directory (it holds manifest.json) or a "
                          "folder of runs")
    rows = []
    for run_dir in find_runs(folder):
        relative = os.path.relpath(run_dir, folder)
        try:
            rows.append(_row(run_dir, relative))
        except RecorderError as e:
            rows.append({"path": relative, "group": os.path.dirname(relative), "error": " ".join(str(e).split())})
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        group = groups.setdefault(row["group"], {"path": row["group"], "runs": 0, "env_steps": 0, "disk_bytes": 0})
        group["runs"] += 1
        group["env_steps"] += row.get("env_steps") or 0
        group["disk_bytes"] += row.get("disk_bytes") or 0
    missing = []
    for group in groups.values():
        where = os.path.join(folder, group["path"])
        group["tune_experiment"] = os.path.isfile(os.path.join(where, INDEX_NAME))
        if group["tune_experiment"]:
            try:
                indexed = read_index(where)["runs"]
            except RecorderError:
                continue
            here = {os.path.basename(r["path"]) for r in rows if r["group"] == group["path"]}
            missing += [os.path.join(group["path"], name) for name in sorted(set(indexed) - here)]
    if not rows and not missing:
        raise SchemaError(f"{folder} is not an rllib_recorder run and holds none below it (a run directory holds "
                          "manifest.json); pass a run directory, e.g. recordings/<experiment>/<trial dir>")
    totals = {k: sum(r.get(k) or 0 for r in rows) for k in ("env_steps", "files", "disk_bytes")}
    totals["runs"] = len(rows)
    totals["groups"] = len(groups)
    totals["unreadable"] = sum(1 for r in rows if "error" in r)
    totals["status"] = dict(sorted(Counter(str(r["status"]) for r in rows if "status" in r).items()))
    return {"folder": folder, "runs": rows, "groups": sorted(groups.values(), key=lambda g: g["path"]),
            "totals": totals, "indexed_but_missing": missing}


def _row(run_dir: str, relative: str) -> dict[str, Any]:
    run = summarize(run_dir)
    lag, rates = run["policy_lag"], run["rates"]
    return {
        "path": relative, "group": os.path.dirname(relative), "run_dir": os.path.basename(run_dir),
        "trial": run["trial"], "status": run["status"], "algorithm": run["algorithm"], "env": run["env"],
        "env_steps": run["env_steps"], "episodes_finished": run["episodes_finished"],
        "return_mean": run["return_mean"], "files": run["files"], "disk_bytes": run["disk_bytes"],
        "lag_p50": lag["p50"], "lag_p99": lag["p99"], "lag_max": lag["max"], "lag_mean": lag["mean"],
        "produced_steps_per_s": rates["produced_steps_per_s"], "stored_steps_per_s": rates["stored_steps_per_s"],
        "consumed_steps_per_s": rates["consumed_steps_per_s"],
    }


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


def follow_counts(run_dir: str, interval_s: float, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> Iterator[dict[str, Any]]:
    """A run's counts every ``interval_s`` while it records, with the env steps stored per second since the last
    one, and once more when it has ended (read from the indexes only: cheap however large the run)."""
    if not os.path.isfile(os.path.join(run_dir, "manifest.json")):
        raise SchemaError(f"{run_dir} is not an rllib_recorder run: it has no manifest.json; --follow follows one "
                          "run directory")
    before: tuple[float, int] | None = None
    while True:
        manifest = read_manifest(run_dir)
        live = liveness.recording_now(run_dir, manifest)
        with open_run(run_dir) as run:
            counts = run.counts()
            disk = sum(f.stored_bytes() for f in run.files)
        now = clock()
        rate = (counts["env_steps"] - before[1]) / (now - before[0]) if before and now > before[0] else None
        before = (now, counts["env_steps"])
        yield {"run_dir": run_dir, "status": manifest.get("status") if live is None else "recording",
               **counts, "disk_bytes": disk, "stored_steps_per_s": rate}
        if live is None and manifest.get("status") in ENDED_STATUSES:
            return
        sleep(interval_s)
