"""The writer: appends chunks to one HDF5 file per env runner; a plain class the pool makes an actor."""

from __future__ import annotations

import bisect
import errno
import gc
import logging
import os
import socket
import time
import traceback
from collections import Counter
from typing import Any, Callable

import h5py

from rllib_recorder.errors import RecorderError, WriterError
from rllib_recorder.format import append, commits, datasets, durable, layout, open_columns, segments, sound_files
from rllib_recorder.format.chunks import Chunk
from rllib_recorder.format.lag import chunk_learner_version, count_lags, step_lags

logger = logging.getLogger(__name__)

# Learner versions kept for look-ups (APPO reports many per second); the older half goes when full.
MAX_VERSION_REPORTS = 200_000


class RecordingWriter:
    """Owns the files of the env runners assigned to it, inside one run directory.

    ``append`` is idempotent per (sender_id, seq): a chunk re-sent after a writer
    restart or a lost acknowledgement is acknowledged again but stored once.
    """

    # Dead space tolerated beyond the data before a file is compacted mid-run.
    compact_slack_bytes = 8 << 20

    def __init__(self, run_dir: str, run_id: str, storage: datasets.StorageOptions, file_tag: str = "",
                 on_sealed: Callable[[str], None] | None = None, seed: Callable[[str], None] | None = None) -> None:
        self.run_dir = run_dir
        self.seed = seed  # fetches a stream's state from the target when this node has none (``Publisher.seed``)
        # Segmented (a durable target): files are sealed by size or age and handed to ``on_sealed``.
        self.on_sealed = on_sealed
        self._opened_at: dict[tuple[int, bool], float] = {}
        self.run_id = run_id
        self.storage = storage
        self.file_tag = file_tag
        # (wall time, learner version) as reported by the learners, oldest first, versions increasing.
        self._versions: list[tuple[float, int]] = []
        self._files: dict[tuple[int, bool], h5py.File] = {}
        self._columns: dict[tuple[int, bool], open_columns.OpenColumns] = {}
        self._paths: set[str] = set()
        self._rebuilt: set[tuple[int, bool]] = set()
        # Files whose bytes HDF5 may not all have written in this process: found on disk (another process had
        # them, maybe killed mid-append) or after a failed append. The others are remembered as sound when closed.
        self._untrusted: set[tuple[int, bool]] = set()
        # per file, per sender id: the first seq not yet committed (seqs number a sender's samples, in order)
        self._committed: dict[tuple[int, bool], dict[bytes, int]] = {}
        self._sender_stats: dict[str, dict[str, Any]] = {}
        self._lag: Counter[int] = Counter()
        self._totals = Counter()
        self._last_error: str | None = None
        # Dead space: files never reuse freed space while open (crash safety, see datasets.StorageOptions),
        # so a file is compacted when its dead space outgrows its data. Data = chunk storage + heap bytes.
        self._heap: Counter[tuple[int, bool]] = Counter()
        self._next_check: dict[tuple[int, bool], int] = {}
        os.makedirs(run_dir, exist_ok=True)  # on a node whose output_dir is node-local, the driver made none

    def __reduce__(self) -> Any:
        raise TypeError(
            "RecordingWriter holds open HDF5 files and cannot be pickled; "
            "use the writer actor handle from the pool instead"
        )

    def append(
        self, worker_index: int, is_evaluation: bool, sender_id: bytes, seq: int, chunk: Chunk,
        sender_stats: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Stores one chunk unless already committed; returns the acknowledgement."""
        key = (worker_index, is_evaluation)
        if sender_stats is not None:
            self.report(worker_index, is_evaluation, sender_stats)
        try:
            h5 = self._file(key)
        except BaseException as e:  # e.g. repairing a file on a full disk
            path = os.path.join(self.run_dir, layout.file_name(worker_index, is_evaluation, self.file_tag))
            raise self._error(e, path) from e
        if seq < self._committed[key].get(sender_id, 0):
            self._totals["duplicate_chunks"] += 1
            return {"seq": seq, "duplicate": True, "rows": 0}
        start = time.perf_counter()
        learner_version = chunk_learner_version(self.learner_version_at(chunk.sampled_at_s), chunk.policy_versions)
        try:
            append.append_chunk(
                h5, chunk, sender_id=sender_id, seq=seq, learner_version=learner_version,
                options=self.storage, columns=self._columns[key], sender_stats=sender_stats,
            )
        except BaseException as e:
            # Close the file: reopening drops the rows no commit names, so a re-send is clean.
            path = h5.filename
            # Release the datasets the failed append's frames still hold before closing their file:
            # HDF5 segfaults (H5D_close) when they are garbage-collected after a close that failed.
            traceback.clear_frames(e.__traceback__)
            gc.collect()
            self._untrusted.add(key)
            self._close_file(key)
            raise self._error(e, path) from e
        self._committed[key][sender_id] = seq + chunk.num_samples
        self._heap[key] += commits.heap_bytes(chunk)
        self._maybe_compact(key)
        self._account(chunk, time.perf_counter() - start, learner_version)
        self._maybe_seal(key)
        return {"seq": seq, "duplicate": False, "rows": chunk.agent_steps}

    def open_file(self, key: tuple[int, bool]) -> None:
        """Opens (creating or repairing if needed) the file of ``key``; raises the one-line error of ``append``."""
        try:
            self._file(key)
        except BaseException as e:
            raise self._error(e, os.path.join(self.run_dir, layout.file_name(*key, self.file_tag))) from e

    def committed_upto(self, key: tuple[int, bool], sender_id: bytes) -> int:
        """The first seq of ``sender_id`` that the file of ``key`` does not commit yet (0: none committed)."""
        return self._committed.get(key, {}).get(sender_id, 0)

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def _error(self, error: BaseException, path: str) -> BaseException:
        """Counts a failed append and returns the one-line error to raise (the caller counts it as an error once)."""
        self._totals["append_failures"] += 1
        error = _clear_error(error, path)
        self._last_error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        return error

    def report(self, worker_index: int, is_evaluation: bool, sender_stats: dict[str, Any]) -> None:
        """Takes the counters of an env-runner process incarnation (a sender), as carried by its spool records."""
        stem = layout.file_name(worker_index, is_evaluation, self.file_tag)[: -len(".h5")]
        self._sender_stats[f"{stem}/{sender_stats.get('sender_id', '')}"] = sender_stats

    def set_learner_version(self, version: int, at_s: float | None = None) -> None:
        """The learner finished weights ``version`` at wall time ``at_s`` (default: now).

        Reports of older or equal versions are ignored (several learners report the same
        version); a report timed before the previous one counts from the previous one's time.
        """
        at_s = time.time() if at_s is None else float(at_s)
        if self._versions and int(version) <= self._versions[-1][1]:
            return
        if self._versions:
            at_s = max(at_s, self._versions[-1][0])
        self._versions.append((at_s, int(version)))
        if len(self._versions) > MAX_VERSION_REPORTS:
            del self._versions[: len(self._versions) // 2]

    def learner_version_at(self, at_s: float) -> int:
        """The newest learner version finished at or before wall time ``at_s`` (-1: unknown)."""
        i = bisect.bisect_right(self._versions, (at_s, float("inf")))
        return self._versions[i - 1][1] if i else -1

    def stats(self) -> dict[str, Any]:
        """Totals since start: rows, chunks, bytes, write time, policy lag, per-runner stats."""
        return {
            **dict(self._totals),
            "files": len(self._files),
            "files_written": sorted(self._paths),
            "node": socket.gethostname(),
            # CPU time of the process the writer runs in (its own actor process under Ray): the recorder's
            # cost on the machine, beside the sampler's wait time
            "cpu_s": time.process_time(),
            "disk_bytes": sum(_path_size(os.path.join(self.run_dir, p)) for p in self._paths),
            "policy_lag_counts": dict(self._lag),
            "runners": dict(self._sender_stats),
            "last_error": self._last_error,
            "senders": {layout.file_name(*k, self.file_tag): len(c) for k, c in self._committed.items()},
        }

    def close(self) -> dict[str, Any]:
        """Flushes, closes and compacts every file; returns the final stats."""
        for key in list(self._files):
            self._columns.pop(key).clear()
            h5 = self._files.pop(key)
            path, data = h5.filename, self._data_bytes(key, h5)
            h5.flush()
            if self.storage.fsync:
                os.fsync(h5.id.get_vfd_handle())
            h5.close()
            self._compact_if_worth(path, data)  # the file is final now
            if self.on_sealed is not None:
                self._seal_closed(path)
            elif key not in self._untrusted:  # every byte of it HDF5 wrote here: readers need not probe it
                sound_files.remember(path)
        return self.stats()

    def _maybe_seal(self, key: tuple[int, bool]) -> None:
        """Seals the file of ``key`` into a segment once it is big or old enough; never raises (the chunk is
        committed: a seal that fails is counted and tried again after the next append)."""
        if self.on_sealed is None or key not in self._files:
            return
        h5 = self._files[key]
        big = self.storage.segment_bytes and _size(h5) >= self.storage.segment_bytes
        old = self.storage.segment_s and time.monotonic() - self._opened_at[key] >= self.storage.segment_s
        if not (big or old):
            return
        try:
            path, data = h5.filename, self._data_bytes(key, h5)
            self._close_file(key)
            self._compact_if_worth(path, data)
            self._seal_closed(path)
        except Exception as e:  # noqa: BLE001
            self._totals["seal_errors"] += 1
            self._last_error = f"sealing {os.path.basename(h5.filename)}: {type(e).__name__}: {e}"
            logger.warning("rllib_recorder: %s", self._last_error)

    def _seal_closed(self, path: str) -> None:
        """Moves the closed file ``path`` into its segments (an empty one is removed) and hands it on."""
        sealed = segments.seal_or_drop(self.run_dir, path)
        if sealed is not None:
            self.on_sealed(sealed)
            self._totals["segments_sealed"] += 1

    def _compact_if_worth(self, path: str, data: int) -> None:
        """A closed file whose dead space is worth a sixteenth of its data is worth one copy, as it stays as it is
        from now on (small files too: copying a few MiB takes milliseconds)."""
        if _path_size(path) - data > max(data // 16, 32 << 10):
            self._compact_closed(path)

    def _data_bytes(self, key: tuple[int, bool], h5: h5py.File) -> int:
        return commits.datasets_bytes(h5) + self._heap[key]

    def _maybe_compact(self, key: tuple[int, bool]) -> None:
        """Compacts the file of ``key`` once its dead space outgrows its data; never raises."""
        h5 = self._files[key]
        size = _size(h5)
        if size <= self._next_check.get(key, 0):
            return
        try:
            data = self._data_bytes(key, h5)
            if commits.should_compact(size, data, self.compact_slack_bytes):
                path = h5.filename
                self._close_file(key)
                self._compact_closed(path)
                h5 = self._file(key)
                data = self._data_bytes(key, h5)
            self._next_check[key] = 2 * data + self.compact_slack_bytes
        except Exception as e:  # the chunk is committed: its acknowledgement must not fail
            logger.warning("rllib_recorder: could not reopen %s after compacting it (%s: %s); the next "
                           "append reopens it", layout.file_name(*key, self.file_tag), type(e).__name__, e)
            self._files.pop(key, None)
            self._columns.pop(key, None)
            self._untrusted.add(key)

    def _compact_closed(self, path: str) -> None:
        """Compacts a closed file; a failure (e.g. a full disk) leaves it as it was, and is only counted."""
        start = time.perf_counter()
        try:
            saved = commits.compact(path)
        except Exception as e:  # commits.compact removed its temporary copy
            self._totals["compact_errors"] += 1
            logger.warning("rllib_recorder: compacting %s failed (%s: %s); the file is intact, only larger",
                           path, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        self._totals["compactions"] += 1
        self._totals["compacted_bytes"] += saved
        self._totals["compact_s"] += time.perf_counter() - start

    def _file(self, key: tuple[int, bool]) -> h5py.File:
        if key not in self._files:
            worker_index, is_evaluation = key
            path = os.path.join(self.run_dir, layout.file_name(worker_index, is_evaluation, self.file_tag))
            created = not os.path.exists(path)
            if not created and key not in self._rebuilt:  # another process wrote it before
                self._untrusted.add(key)
            carry = {}
            if created and self.on_sealed is not None:  # a new segment: it carries what the stream committed
                if self.seed is not None:
                    self.seed(os.path.basename(path)[:-3])
                carry = segments.carry_attrs(*segments.state_before(self.run_dir, os.path.basename(path)[:-3]))
            h5 = append.open_for_append(path, {
                "run_id": self.run_id, "worker_index": worker_index, "is_evaluation": is_evaluation, **carry,
            }, self.storage.file_space)
            owner = h5.attrs.get("run_id")
            if owner != self.run_id:
                h5.close()
                raise RecorderError(
                    f"{path} belongs to run {owner!r}, not {self.run_id!r}; "
                    "record each run into its own directory"
                )
            if created and self.storage.fsync:  # the new file's name, not only its bytes, survives a power loss
                h5.flush()
                durable.fsync_dir(self.run_dir)
            self._files[key] = h5
            self._columns[key] = open_columns.OpenColumns(h5)
            # Whatever the file holds when opened counts as data (a conservative start).
            self._heap[key] = max(0, _path_size(path) - commits.datasets_bytes(h5))
            self._paths.add(os.path.relpath(path, self.run_dir))
            committed, totals = segments.stream_state(h5)  # with what sealed segments committed before it
            self._committed[key] = committed
            self._opened_at[key] = time.monotonic()
            if key not in self._rebuilt:  # totals survive a writer restart: what the file holds counts
                self._rebuilt.add(key)
                self._totals.update(totals)
        return self._files[key]

    def _close_file(self, key: tuple[int, bool]) -> None:
        self._columns.pop(key).clear()  # its datasets must be closed before their file
        h5 = self._files.pop(key)
        path = h5.filename
        try:
            h5.close()
        except Exception:  # a full disk may refuse the flush; reopening repairs from the commit
            logger.warning("rllib_recorder: closing %s after a failed append failed", path)

    def _account(self, chunk: Chunk, write_s: float, learner_version: int) -> None:
        self._totals["chunks"] += 1
        self._totals["env_steps"] += chunk.env_steps
        self._totals["agent_steps"] += chunk.agent_steps
        self._totals["raw_bytes"] += chunk.nbytes
        self._totals["write_s"] += write_s
        for stream in chunk.streams.values():
            self._lag.update(count_lags(step_lags(learner_version, stream.steps["weights_seq_no"])))


def _size(h5: h5py.File) -> int:
    return _path_size(h5.filename)


def _path_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _clear_error(error: BaseException, path: str) -> BaseException:
    """A one-line WriterError naming the file, the cause and the fix (other errors unchanged)."""
    if isinstance(error, RecorderError) or not isinstance(error, (OSError, RuntimeError)):
        return error
    text = str(error)
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in text or "errno = 28" in text:
        return WriterError(f"disk full: cannot write {path} (No space left on device); free space on that "
                           "file system or choose another output_dir")
    return WriterError(f"cannot write {path} ({type(error).__name__}: {text.splitlines()[0] if text else ''}); "
                       "check the file system of output_dir")
