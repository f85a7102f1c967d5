"""What `rllib-recorder verify` checks: schema, row counts, sequence numbers, episode continuity, completeness."""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from rllib_recorder.format import frames, h5file, layout, liveness
from rllib_recorder.format.manifest import ENDED_STATUSES
from rllib_recorder.read import accounting
from rllib_recorder.read.run import open_run


def run_status(run_dir: str, manifest: dict[str, Any]) -> Any:
    live = liveness.recording_now(run_dir, manifest)
    return manifest.get("status") if live is None else f"recording ({live})"


def verify_run(run_dir: str) -> list[str]:
    """Every problem found in a run (empty when it is sound)."""
    return verify_report(run_dir)["problems"]


def verify_report(run_dir: str, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """``problems`` (the run is not sound), ``notes`` (steps counted as not stored, by cause) and ``summary``
    (``all N sampled env steps stored``, or how many are). ``progress(1)`` is called after each file."""
    problems: list[str] = []
    with open_run(run_dir) as run:
        live = liveness.recording_now(run_dir, run.manifest)
        if live is None and run.manifest.get("status") not in ENDED_STATUSES:
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
        rllib_gaps = accounting.rllib_gaps(run.manifest, runs)
        if live is None:
            gaps += rllib_gaps
        elif rllib_gaps:  # RLlib's count runs ahead of the commits while the writers coalesce: not yet a gap
            notes.append(f"{accounting.unexplained_steps(run.manifest, runs)} env steps RLlib sampled are not "
                         "committed yet (still in the runners' spools); verify again once the run has ended")
        summary = accounting.summary_line(runs, run.manifest)
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
        head = frames.HEAD_PREFIX + path
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
