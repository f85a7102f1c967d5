"""What the viewer computes of each worker file from its indexes, once per file stamp: episodes, batches, lags;
and of a run, from its files' aggregates: the episode table, return curves and rates."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rllib_recorder.read.worker_file import WorkerFile, _remembered
from rllib_recorder.view.catalog import Handle, file_stamp, guarded

# Per-file aggregates, by key, with the file's stamp when made (``read.worker_file._remembered``: a value is kept
# only if the file did not change while it was made); one entry per file and agent, whatever the file's size.
_INDEX: dict[Any, Any] = {}
_EPISODES: dict[Any, Any] = {}
_BATCHES: dict[Any, Any] = {}
_LAGS: dict[Any, Any] = {}


@dataclass(frozen=True)
class FileEpisodes:
    """One agent's episodes in one worker file, from its episode index, in the order their latest fragment was
    stored (so the finished ones only ever gain episodes at the end)."""

    eps_id: list[str]
    length: np.ndarray
    ret: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    end_row: np.ndarray  # the agent's rows stored in the file once the episode's latest fragment was
    end_batch: np.ndarray  # the batch-index row of the chunk that carried that fragment
    in_batch: np.ndarray  # the agent's rows of that chunk up to the episode's end

    @property
    def done(self) -> np.ndarray:
        return self.terminated | self.truncated


def _kept_while(path: str, opened: Any) -> Callable[[], bool]:
    """A ``keep`` for ``_remembered``: the file is still as it was when its handle was opened (a handle opened
    before an append reads the older commit, which must not be remembered under the newer stamp)."""
    return lambda: file_stamp(path) == opened


def file_index(f: WorkerFile, agent: str, opened: Any) -> dict[str, np.ndarray]:
    """The agent's episode index (``WorkerFile.fragments``), read once per file stamp: every frames request and
    episode of the file looks its fragments up in it."""
    return _remembered(_INDEX, (f.path, agent), f.path, lambda: f.fragments(agent), _kept_while(f.path, opened))


def file_episodes(f: WorkerFile, agent: str, opened: Any) -> FileEpisodes:
    return _remembered(_EPISODES, (f.path, agent), f.path, lambda: episodes_of(file_index(f, agent, opened)),
                       _kept_while(f.path, opened))


def episodes_of(frags: dict[str, np.ndarray]) -> FileEpisodes:
    """Episodes from an agent's episode index: lengths and returns summed over fragments, the end from its
    latest fragment."""
    ids = frags["eps_id"]
    n = len(ids)
    if not n:
        empty = np.zeros(0, np.int64)
        return FileEpisodes([], empty, np.zeros(0), np.zeros(0, bool), np.zeros(0, bool), empty, empty, empty)
    unique, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    latest = np.full(len(unique), -1, np.int64)
    np.maximum.at(latest, inverse, np.arange(n))
    order = np.argsort(latest, kind="stable")
    latest = latest[order]
    length = np.bincount(inverse, weights=frags["num_rows"], minlength=len(unique))[order].astype(np.int64)
    ret = np.bincount(inverse, weights=frags["return"].astype(np.float64), minlength=len(unique))[order]
    names = [e.decode("utf-8", "replace") for e in unique[order].tolist()]
    end_row = (frags["first_row"][latest] + frags["num_rows"][latest]).astype(np.int64)
    batch = frags["batch"].astype(np.int64)
    _, in_batch = np.unique(batch, return_inverse=True)  # a batch's first row: the least of its fragments'
    batch_first = np.full(int(in_batch.max()) + 1, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(batch_first, in_batch.reshape(-1), frags["first_row"].astype(np.int64))
    return FileEpisodes(names, length, ret, frags["terminated"][latest].astype(bool),
                        frags["truncated"][latest].astype(bool), end_row, batch[latest],
                        end_row - batch_first[in_batch.reshape(-1)[latest]])


def file_batches(f: WorkerFile, opened: Any) -> dict[str, np.ndarray]:
    """The batch index columns the viewer uses: env steps, when sampled and when written."""
    def make() -> dict[str, np.ndarray]:
        batches = f.batches() if f.commit["batches"] else {}
        return {k: np.asarray(batches.get(k, np.zeros(0)), np.float64)
                for k in ("env_steps", "sampled_at_s", "written_at_s")}

    return _remembered(_BATCHES, f.path, f.path, make, _kept_while(f.path, opened))


def file_lags(f: WorkerFile, agent: str, opened: Any) -> dict[int, int]:
    """Steps per policy lag (learner version minus behaviour version) of the steps whose versions are known."""
    def make() -> dict[int, int]:
        lags = f.policy_lag(agent)
        values, counts = np.unique(lags[lags >= 0], return_counts=True)
        return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}

    return _remembered(_LAGS, (f.path, agent), f.path, make, _kept_while(f.path, opened))


@dataclass
class FileInfo:
    """A worker file as the viewer lists it."""

    name: str
    worker: int
    evaluation: bool
    agents: list[str]
    disk_bytes: int
    error: str | None = None


@dataclass
class RunTable:
    """Every agent episode of a run, one entry per array index (numpy, for sorting and paging)."""

    file: np.ndarray  # index into files
    agent: np.ndarray  # str
    eps_id: np.ndarray  # str
    length: np.ndarray
    ret: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    evaluation: np.ndarray
    worker: np.ndarray
    x: np.ndarray  # where the episode ended on the run's axis of env steps (``run_clock``)
    order: np.ndarray  # when it ended, in its file: the position among its file's episodes

    @property
    def done(self) -> np.ndarray:
        return self.terminated | self.truncated


def opened_stamp(handle: Handle, path: str) -> Any:
    return dict(handle.stamps[1:]).get(path)


def files_of(handle: Handle) -> list[FileInfo]:
    """The run's worker files (damaged ones with why), in name order."""
    if "files" in handle.memo:
        return handle.memo["files"]
    out = []
    for f in handle.run.files:
        info, error = guarded(lambda: FileInfo(os.path.basename(f.path), f.worker_index, f.is_evaluation,
                                               f.agents, f.stored_bytes()))
        out.append(info or FileInfo(os.path.basename(f.path), -1, False, [], _size(f.path), error))
    for path, why in handle.run.damaged.items():
        out.append(FileInfo(os.path.basename(path), -1, False, [], _size(path), " ".join(why.split())))
    handle.memo["files"] = out = sorted(out, key=lambda i: i.name)
    return out


def _size(path: str) -> int:
    stamp = file_stamp(path)
    return stamp[0] if stamp else 0


def readable(handle: Handle, evaluation: bool | None = None) -> list[tuple[WorkerFile, FileInfo]]:
    """The run's worker files whose header could be read, with what the viewer lists of each (``evaluation``:
    only training files (False), only evaluation files (True), or all)."""
    infos = {info.name: info for info in files_of(handle)}
    out = []
    for f in handle.run.files:
        info = infos.get(os.path.basename(f.path))
        if info is not None and info.worker >= 0 and (evaluation is None or info.evaluation == evaluation):
            out.append((f, info))
    return out


def worker_file(handle: Handle, name: str) -> WorkerFile | None:
    """The readable worker file of that name, or None."""
    return next((f for f, info in readable(handle) if info.name == name), None)


def run_episodes(handle: Handle) -> tuple[RunTable, list[str]]:
    """The run's episode table (every readable file) and the files whose indexes could not be read, with why."""
    if "episodes" in handle.memo:
        return handle.memo["episodes"]
    files = files_of(handle)
    clock = run_clock(handle)
    parts, problems = [], []
    found = {info.name: f for f, info in readable(handle)}
    for k, info in enumerate(files):
        f = found.get(info.name)
        if f is None or info.error:
            continue
        opened = opened_stamp(handle, f.path)
        for agent in info.agents:
            eps, error = guarded(lambda: file_episodes(f, agent, opened))
            if error:
                problems.append(f"{info.name}: {error}")
                info.error = info.error or error
                continue
            batches, _ = guarded(lambda: file_batches(f, opened))
            parts.append((k, agent, info, eps, clock(f.path, batches, eps)))
    handle.memo["episodes"] = out = (_table(parts), problems)
    return out


def _table(parts: list[tuple[int, str, FileInfo, FileEpisodes, np.ndarray]]) -> RunTable:
    def cat(values: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype)

    sizes = [len(e.eps_id) for _, _, _, e, _ in parts]
    return RunTable(
        file=cat([np.full(n, k) for n, (k, *_) in zip(sizes, parts)], np.int64),
        agent=cat([np.full(n, a, dtype=object) for n, (_, a, *_) in zip(sizes, parts)], object),
        eps_id=cat([np.array(e.eps_id, dtype=object) for *_, e, _ in parts], object),
        length=cat([e.length for *_, e, _ in parts], np.int64), ret=cat([e.ret for *_, e, _ in parts], np.float64),
        terminated=cat([e.terminated for *_, e, _ in parts], bool),
        truncated=cat([e.truncated for *_, e, _ in parts], bool),
        evaluation=cat([np.full(n, i.evaluation) for n, (_, _, i, *_) in zip(sizes, parts)], bool),
        worker=cat([np.full(n, i.worker) for n, (_, _, i, *_) in zip(sizes, parts)], np.int64),
        x=cat([x for *_, x in parts], np.float64), order=cat([np.arange(n) for n in sizes], np.int64))


def run_clock(handle: Handle) -> Callable[[str, dict[str, np.ndarray] | None, FileEpisodes], np.ndarray]:
    """Where episodes ended on the run's axis of env steps: every training file's batches in the order they were
    sampled, summed; an episode of a training file ends at the steps of the batches before its own plus its rows
    in its own; one of an evaluation file at the training steps sampled by the time its batch was."""
    files, times, steps = [], [], []
    for f, _ in readable(handle, evaluation=False):
        batches, _ = guarded(lambda: file_batches(f, opened_stamp(handle, f.path)))
        if batches is not None:
            files.append(f.path)
            times.append(batches["sampled_at_s"])
            steps.append(batches["env_steps"])
    sampled = np.concatenate(times) if times else np.zeros(0)
    counts = np.concatenate(steps) if steps else np.zeros(0)
    order = np.argsort(sampled, kind="stable")
    before = np.empty(len(order))
    before[order] = np.cumsum(counts[order]) - counts[order]  # steps of every batch sampled before each
    offsets = dict(zip(files, np.cumsum([0] + [len(t) for t in times]).tolist()))
    sorted_times, cumulative = sampled[order], np.cumsum(counts[order])

    def clock(path: str, batches: dict[str, np.ndarray] | None, eps: FileEpisodes) -> np.ndarray:
        if not batches or not len(batches["sampled_at_s"]) or not len(cumulative):
            return np.zeros(len(eps.end_batch))
        rows = np.clip(eps.end_batch, 0, len(batches["sampled_at_s"]) - 1)
        if path in offsets:
            within = np.clip(eps.in_batch, 0, batches["env_steps"][rows])
            return before[offsets[path] + rows] + within
        where = np.searchsorted(sorted_times, batches["sampled_at_s"][rows], "right") - 1
        return np.where(where >= 0, cumulative[np.clip(where, 0, None)], 0.0)

    return clock


def run_lags(handle: Handle) -> dict[int, int]:
    """The policy-lag histogram of the run's training files (as ``plot`` and ``info`` count it)."""
    if "lags" not in handle.memo:
        total: dict[int, int] = {}
        for f, info in readable(handle, evaluation=False):
            for agent in info.agents:
                counts, _ = guarded(lambda: file_lags(f, agent, opened_stamp(handle, f.path)))
                for lag, n in (counts or {}).items():
                    total[lag] = total.get(lag, 0) + n
        handle.memo["lags"] = dict(sorted(total.items()))
    return handle.memo["lags"]


def step_series(handle: Handle, totals: dict[str, Any], points: int = 2000) -> dict[str, Any]:
    """The training files' env steps against the run's seconds (from its first sample): produced (by when each
    batch was sampled) and stored (by when it was written), at most ``points`` each; their slopes are the rates.
    Consumed: the steps the learners trained on by the last train() result the manifest holds."""
    sampled, written, steps = [], [], []
    for f, _ in readable(handle, evaluation=False):
        batches, _ = guarded(lambda: file_batches(f, opened_stamp(handle, f.path)))
        if batches and len(batches["env_steps"]):
            sampled.append(batches["sampled_at_s"])
            written.append(batches["written_at_s"])
            steps.append(batches["env_steps"])
    if not steps:
        return {"produced": {"t_s": [], "steps": []}, "stored": {"t_s": [], "steps": []}, "consumed": None}
    n = np.concatenate(steps)
    start = float(np.concatenate(sampled).min())

    def cumulative(times: np.ndarray) -> dict[str, list[float]]:
        order = np.argsort(times, kind="stable")
        t, total = times[order] - start, np.cumsum(n[order])
        keep = np.unique(np.linspace(0, len(t) - 1, min(points, len(t))).astype(np.int64))
        return {"t_s": [0.0] + t[keep].tolist(), "steps": [0.0] + total[keep].tolist()}

    consumed, last = totals.get("env_steps_consumed"), totals.get("last_result_at_s")
    ok = isinstance(consumed, (int, float)) and isinstance(last, (int, float)) and last > start
    return {"produced": cumulative(np.concatenate(sampled)), "stored": cumulative(np.concatenate(written)),
            "consumed": {"t_s": [0.0, float(last) - start], "steps": [0.0, float(consumed)]} if ok else None}
