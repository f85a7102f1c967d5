"""Run summaries and integrity checks behind `rllib-recorder info` and `verify`."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from rllib_recorder import accounting, liveness, schema
from rllib_recorder.reader import open_run
from rllib_recorder.staleness import count_lags, lag_summary, stored_rates


# Manifest states of a run whose recording ended (on a stop, an exit or a signal, or repaired by recover).
ENDED = ("finished", "interrupted", "recovered")


def summarize(run_dir: str) -> dict[str, Any]:
    """What a person wants at a glance about a run."""
    with open_run(run_dir) as run:
        manifest = run.manifest
        totals = manifest.get("totals", {})
        returns, episodes, steps = [], 0, 0
        lags: Counter[int] = Counter()
        for f in run.files:
            with schema.damaged_file_errors(f.path):
                file_steps, file_episodes, file_returns = _file_summary(f)
                if not f.is_evaluation:
                    for agent in f.agents:
                        lags.update(count_lags(f.policy_lag(agent)))
            steps, episodes, returns = steps + file_steps, episodes + file_episodes, returns + file_returns
        disk = sum(os.path.getsize(f.path) for f in run.files)
        raw = totals.get("raw_bytes") or 0
        return {
            "run_dir": run_dir, "trial": manifest.get("trial_name") or manifest.get("trial"),
            "status": _status(run_dir, manifest), "algorithm": manifest.get("algorithm"),
            "env": manifest.get("env"), "api_stack": manifest.get("api_stack"),
            "started_at": manifest.get("started_at"), "finished_at": manifest.get("finished_at"),
            "files": len(run.files), "nodes": manifest.get("nodes"), "env_steps": steps,
            "episodes_finished": episodes,
            "return_mean": float(np.mean(returns)) if returns else None,
            "return_min": float(np.min(returns)) if returns else None,
            "return_max": float(np.max(returns)) if returns else None,
            "disk_bytes": disk, "compression_ratio": round(raw / disk, 2) if raw and disk else None,
            "chunks_dropped": totals.get("chunks_dropped"), "errors": totals.get("errors"),
            "policy_lag": lag_summary(lags),
            "rates": run_rates(run, totals),
        }


def _status(run_dir: str, manifest: dict[str, Any]) -> Any:
    live = liveness.recording_now(run_dir, manifest)
    return manifest.get("status") if live is None else f"recording ({live})"


def run_rates(run: Any, totals: dict[str, Any]) -> dict[str, Any]:
    """TianJi's three rates of a run (training files), in env steps per second.

    Produced and stored come from the batch index (see ``staleness.stored_rates``); consumed is the
    learners' lifetime count kept in the manifest at the last train result, over the time from the
    first stored sample to that result.
    """
    batches = [f.batches() for f in run.files if not f.is_evaluation and f.commit["batches"]]
    rates = stored_rates(batches, totals.get("env_steps_sampled"))
    trained, last = totals.get("env_steps_trained"), totals.get("last_result_at_s")
    first = min((float(b["sampled_at_s"].min()) for b in batches), default=None)
    span = last - first if last and first else None
    rates["consumed_steps_per_s"] = trained / span if trained and span and span > 0 else None
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


def verify_report(run_dir: str) -> dict[str, Any]:
    """``problems`` (the run is not sound), ``notes`` (steps counted as not stored, by cause) and ``summary``
    (``all N sampled env steps stored``, or how many are)."""
    problems: list[str] = []
    with open_run(run_dir) as run:
        live = liveness.recording_now(run_dir, run.manifest)
        if live is None and run.manifest.get("status") not in ENDED:
            problems.append(f"manifest status is {run.manifest.get('status')!r}, not 'finished' "
                            "(run 'rllib-recorder recover' if its driver was killed)")
        problems += _missing_files(run)
        stored = 0
        for f in run.files:
            with schema.damaged_file_errors(f.path):
                problems += [f"{os.path.basename(f.path)}: {p}" for p in _verify_file(f)]
                stored += int(f.batches()["env_steps"].sum()) if f.commit["batches"] else 0
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
        # 2.1 numbers samples: a batch row commits seq .. seq + num_samples - 1 (as schema.committed_upto reads);
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
        head = schema.HEAD_PREFIX + path
        if schema.FRAME_STACK_ATTR in steps[path].attrs and (head not in fragments
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


def is_experiment_dir(path: str) -> bool:
    """True for a directory of runs (a Tune experiment): no manifest of its own, runs below it."""
    from rllib_recorder.index import INDEX_NAME, run_dirs

    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "manifest.json"))
            and (bool(run_dirs(path)) or os.path.isfile(os.path.join(path, INDEX_NAME))))


def summarize_experiment(experiment_dir: str) -> dict[str, Any]:
    """One row per run of an experiment directory (from each run's manifest and files), and totals."""
    from rllib_recorder.index import read_index, run_dirs

    indexed = read_index(experiment_dir)["runs"]
    rows = []
    for run_dir in run_dirs(experiment_dir):
        run = summarize(run_dir)
        manifest_trial = run.pop("trial", None)
        lag, rates = run["policy_lag"], run["rates"]
        rows.append({
            "run_dir": os.path.basename(run_dir), "trial": manifest_trial, "status": run["status"],
            "env_steps": run["env_steps"], "files": run["files"], "disk_bytes": run["disk_bytes"],
            "lag_p50": lag["p50"], "lag_p99": lag["p99"], "lag_max": lag["max"], "lag_mean": lag["mean"],
            "produced_steps_per_s": rates["produced_steps_per_s"], "stored_steps_per_s": rates["stored_steps_per_s"],
            "consumed_steps_per_s": rates["consumed_steps_per_s"],
        })
    missing = sorted(set(indexed) - {r["run_dir"] for r in rows})
    totals = {k: sum(r[k] or 0 for r in rows) for k in ("env_steps", "files", "disk_bytes")}
    totals["runs"] = len(rows)
    totals["status"] = dict(sorted(Counter(str(r["status"]) for r in rows).items()))
    return {"experiment_dir": experiment_dir, "runs": rows, "totals": totals, "indexed_but_missing": missing}
