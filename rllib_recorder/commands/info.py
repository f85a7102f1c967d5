"""Run summaries and integrity checks behind `rllib-recorder info` and `verify`."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any, Callable

import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import codecs, h5file, layout, liveness
from rllib_recorder.format.lag import count_lags, lag_summary, stored_rates
from rllib_recorder.read import accounting
from rllib_recorder.read.reader import open_run

# Manifest states of a run whose recording ended (on a stop, an exit or a signal, or repaired by recover).
ENDED = ("finished", "interrupted", "recovered")


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
        disk = sum(os.path.getsize(f.path) for f in run.files)
        raw = totals.get("raw_bytes") or 0
        status = _status(run_dir, manifest)
        recording = str(status).startswith("recording")
        summary = {
            "run_dir": run_dir, "trial": manifest.get("trial_name") or manifest.get("trial"),
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
    return sum(sum(int(stats.get(k) or 0) for k in accounting.CAUSES) for stats in senders.values()
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


def _status(run_dir: str, manifest: dict[str, Any]) -> Any:
    live = liveness.recording_now(run_dir, manifest)
    return manifest.get("status") if live is None else f"recording ({live})"


def run_rates(run: Any, totals: dict[str, Any]) -> dict[str, Any]:
    """TianJi's three rates of a run (training files), in env steps per second.

    Produced and stored come from the batch index (see ``staleness.stored_rates``); consumed is the env steps
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


def verify_run(run_dir: str) -> list[str]:
    """Every problem found in a run (empty when it is sound)."""
    return verify_report(run_dir)["problems"]


def verify_report(run_dir: str, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``problems`` (the run is not sound), ``notes`` (steps counted as not stored, by cause) and ``summary``
    (``all N sampled env steps stored``, or how many are). ``progress(1)`` is called after each file."""
    problems: list[str] = []
    with open_run(run_dir) as run:
        live = liveness.recording_now(run_dir, run.manifest)
        if live is None and run.manifest.get("status") not in ENDED:
            problems.append(f"manifest status is {run.manifest.get('status')!r}, not 'finished' "
                            "(run 'rllib-recorder recover' if its driver was killed)")
        problems += _missing_files(run)
        stored = 0
        for f in run.files:
            with h5file.damaged_file_errors(f.path):
                problems += [f"{os.path.basename(f.path)}: {p}" for p in _verify_file(f)]
                stored += int(f.batches()["env_steps"].sum()) if f.commit["batches"] else 0
            if progress is not None:
                progress(1)
        runs = accounting.accounts(run.manifest, run.files)
        gaps, notes = accounting.check(runs, stored, ended=live is None)
    summary = accounting.summary_line(runs)
    if live is not None:  # the rest is still in the runners' spools: accounted when the run ends
        summary = f"recording now ({live}); checked what is committed so far" + (f": {summary}" if summary else "")
    return {"problems": problems + gaps, "notes": notes, "summary": summary, "recording": live}


def _missing_files(run: Any) -> list[str]:
    """Files the manifest lists that are not in the run directory here (written on another node)."""
    files = run.manifest.get("files")
    here = {os.path.basename(f.path) for f in run.files}
    if not isinstance(files, dict):
        return []
    return [f"{name} is not here: it was written on node {info.get('node_id')} ({info.get('node_ip')}, "
            f"{info.get('hostname')}); collect the run with 'rllib-recorder gather {run.path} --to DIR'"
            for name, info in sorted(files.items()) if name not in here]


def _verify_file(f: Any) -> list[str]:
    problems = []
    commit = f.commit
    batches = f.batches()
    if commit["batches"] and len(batches["seq"]) != commit["batches"]:
        problems.append(f"batch index has {len(batches['seq'])} rows, commit says {commit['batches']}")
    for sender in set(batches.get("sender_id", np.array([])).tolist()):
        # 2.1 numbers samples: a batch row commits seq .. seq + num_samples - 1 (as commits.committed_upto reads);
        # earlier files (no sender counter columns) number their chunks
        mine = batches["sender_id"] == sender
        per_sample = "sender_env_steps_sampled" in batches and "num_samples" in batches
        counts = batches["num_samples"][mine] if per_sample else np.ones(int(mine.sum()), np.int64)
        order = np.argsort(batches["seq"][mine], kind="stable")
        seqs, counts = batches["seq"][mine][order], counts[order]
        starts = np.concatenate([[0], (seqs + counts)[:-1]])
        if len(np.unique(seqs)) != len(seqs) or (seqs < starts).any():
            problems.append(f"sender {sender.decode()}: duplicate sequence numbers")
        if (seqs > starts).any():
            problems.append(f"sender {sender.decode()}: gaps in sequence numbers {seqs.tolist()[:20]}")
    for agent in f.agents:
        rows, _ = commit["agents"].get(agent, (0, 0))
        frags = f.fragments(agent)
        if int(frags["num_rows"].sum()) != rows:
            problems.append(f"{agent}: fragments cover {int(frags['num_rows'].sum())} rows, commit says {rows}")
        ends = frags["first_row"] + frags["num_rows"]
        if len(ends) and (np.sort(frags["first_row"])[1:] != np.sort(ends)[:-1]).any():
            problems.append(f"{agent}: fragments overlap or leave holes")
        problems += _continuity(agent, frags)
        problems += _stack_problems(f, agent, commit["agents"].get(agent, (0, 0))[1])
    return problems


def _stack_problems(f: Any, agent: str, num_fragments: int) -> list[str]:
    """Frame-stacked step columns whose head frames (a row per fragment) are missing or short."""
    steps, fragments = f.h5[f"agents/{agent}/steps"], f.h5[f"agents/{agent}/fragments"]
    problems = []
    for path in f.column_paths(agent):
        head = codecs.HEAD_PREFIX + path
        if layout.FRAME_STACK_ATTR in steps[path].attrs and (head not in fragments
                                                             or len(fragments[head]) < num_fragments):
            problems.append(f"{agent}: steps/{path} stores frame stacks as newest frames, but fragments/{head} is "
                            "missing or short, so its stacks can't be rebuilt")
    return problems


def _continuity(agent: str, frags: dict[str, np.ndarray]) -> list[str]:
    problems = []
    order = np.lexsort((frags["t_start"], frags["eps_id"]))
    ids, t0, n = frags["eps_id"][order], frags["t_start"][order], frags["num_rows"][order]
    for i in range(1, len(order)):
        if ids[i] == ids[i - 1] and t0[i] != t0[i - 1] + n[i - 1]:
            problems.append(f"{agent}: episode {ids[i].decode()} jumps from t={t0[i - 1] + n[i - 1]} to t={t0[i]}")
    return problems


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
