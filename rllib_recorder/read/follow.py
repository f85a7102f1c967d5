"""Following a run while it records: each stored chunk, or each episode, once, as soon as it is committed.

A reader in another process sees what the writers have committed: every poll reopens the run's files (an HDF5
file opened earlier does not see rows appended since) and reads only what is new past the commit records it had
read. The run is followed until its manifest says it ended and nothing of it is alive here (``format.liveness``);
then what remains is read once more, and, when following episodes, the episodes the run's end cut off follow.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Callable, Iterator

from rllib_recorder.errors import SchemaError
from rllib_recorder.format.liveness import recording_now
from rllib_recorder.format.manifest import ENDED_STATUSES, read_manifest
from rllib_recorder.format.probe import stamp
from rllib_recorder.read.records import Batch, Episode
from rllib_recorder.read.worker_file import WorkerFile


def follow(run_dir: str, *, episodes: bool = False, poll_s: float = 0.5, timeout_s: float | None = None,
           evaluation: bool | None = False, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[Batch | Episode]:
    """Yields every stored chunk (``Batch``) of ``run_dir``, or with ``episodes`` every episode (``Episode``, once
    its last fragment is committed; the ones the run's end cut off at the end), each exactly once, in commit order
    per file, until the run has ended and all of it is read. ``timeout_s``: stop following after that long."""
    seen_batches: dict[str, int] = {}
    seen_fragments: dict[tuple[str, str], int] = {}
    open_episodes: dict[tuple[str, str, str], None] = {}  # (file, agent, eps_id) with fragments but not done
    started = clock()
    while True:
        ended = _ended(run_dir)  # before reading: what is committed by now is all there is when it ended
        for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "*.h5"))):
            f = WorkerFile(path)
            try:
                if evaluation is not None and f.is_evaluation != evaluation:
                    continue
                if episodes:
                    yield from _new_episodes(f, seen_fragments, open_episodes)
                else:
                    for batch in f.batches_in_order(seen_batches.get(path, 0)):
                        seen_batches[path] = batch.row + 1
                        yield batch
            except (SchemaError, OSError, KeyError):
                # A file read while its writer flushes may look damaged for a moment: read it again at the next
                # poll, from where this one stopped. Once the run has ended, damage is damage.
                if ended:
                    raise
            finally:
                f.close()
        if ended or (timeout_s is not None and clock() - started > timeout_s):
            break
        sleep(poll_s)
    for path, agent, eps_id in list(open_episodes) if ended else []:  # cut off by the run's end
        f = WorkerFile(path)
        try:
            yield f.episode(eps_id, agent)
        finally:
            f.close()


def follow_files(run_dir: str, *, poll_s: float = 0.5, timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                 ) -> Iterator[tuple[list[str], bool]]:
    """Yields at every poll ``(changed, ended)``: the run's worker files whose stamp (size, mtime, inode) changed
    since the poll before (every file at the first), and whether the run has ended; the poll that finds it ended
    is the last. Nothing is read here: a caller reopens the files it is given (an HDF5 file opened before does
    not see rows appended since) and reads their indexes, however large the run (the viewer's live stream)."""
    stamps: dict[str, tuple[int, int, int] | None] = {}
    started = clock()
    while True:
        ended = _ended(run_dir)  # before looking: what is committed by now is all there is when it ended
        changed = []
        for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "*.h5"))):
            now = stamp(path)
            if now != stamps.get(path, ()):
                stamps[path] = now
                changed.append(path)
        yield changed, ended
        if ended or (timeout_s is not None and clock() - started > timeout_s):
            return
        sleep(poll_s)


def _ended(run_dir: str) -> bool:
    manifest = read_manifest(run_dir)
    return manifest.get("status") in ENDED_STATUSES and recording_now(run_dir, manifest) is None


def _new_episodes(f: WorkerFile, seen: dict[tuple[str, str], int],
                  open_episodes: dict[tuple[str, str, str], None]) -> Iterator[Episode]:
    """The episodes of ``f`` whose last fragment was committed since the last call."""
    for agent in f.agents:
        frags = f.fragments(agent)
        done = frags["terminated"] | frags["truncated"]
        for i in range(seen.get((f.path, agent), 0), len(frags["eps_id"])):
            eps_id = frags["eps_id"][i].decode()
            if done[i]:
                yield f.episode(eps_id, agent, frags)
                open_episodes.pop((f.path, agent, eps_id), None)
            else:
                open_episodes[f.path, agent, eps_id] = None
            seen[f.path, agent] = i + 1


def follow_latency_s(item: Batch, now: float | None = None) -> float:
    """Seconds from a followed chunk's first sample (``sampled_at_s``) to now: how late following sees it."""
    return (time.time() if now is None else now) - float(item.info["sampled_at_s"])

