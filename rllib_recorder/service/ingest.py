"""The writer's side of the spool: read what env runners handed over, coalesce it, commit it, delete it.

A writer owns some env runners' files (``owns(stem)``). Each ``poll`` reads every complete new record of their
senders' spools, buffers the chunks per file and commits a file's buffer once it holds ``coalesce_rows`` rows or
``coalesce_bytes`` bytes, once its oldest sample would otherwise wait longer than ``coalesce_s``, when another
sender or another behaviour-policy version comes, or on ``poll(final=True)``. A spool segment is deleted once
every record in it is committed. Nothing here needs the env runner: a runner killed after writing a record has
handed it over, and a writer that restarts reads the spools again and skips what its files already commit.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rllib_recorder.errors import SchemaError, WriterError
from rllib_recorder.format.chunks import Chunk, merge_chunks
from rllib_recorder.format.liveness import HEARTBEAT_NAME, heartbeat_owner
from rllib_recorder.format.spool import (
    KIND_CHUNK,
    KIND_END,
    SPOOL_DIR,
    Record,
    parse_stem,
    read_record,
    segment_name,
    segments_of,
    sender_dirs,
)

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 1.0
RETRY_AFTER_S = 5.0


@dataclass
class _Sender:
    """Where the writer stands in one sender's spool."""

    stem: str
    sender: str
    directory: str
    key: tuple[int, bool]
    segment: int | None = None  # segment being read
    offset: int = 0
    fd: int | None = None
    committed: tuple[int, int] = (-1, 0)  # (segment, offset) up to which every record is committed
    stats: dict[str, Any] = field(default_factory=dict)
    ended: bool = False
    retry_at_s: float = 0.0
    failing: str | None = None  # why the last commit failed (None once one succeeds)
    refused_steps: int = 0  # env steps of chunks a writer can never store (their data is refused)
    refused_error: str | None = None
    damaged: str | None = None

    @property
    def read(self) -> tuple[int, int]:
        """(segment, offset) up to which records were read."""
        return (-1, 0) if self.segment is None else (self.segment, self.offset)

    @property
    def settled(self) -> bool:
        """Every complete record read is committed, and nothing failed or was damaged."""
        return self.damaged is None and self.failing is None and self.committed >= self.read


@dataclass
class _Buffer:
    """Chunks of one file waiting to be committed together: one sender, one set of policy versions."""

    sender: _Sender
    records: list[Record] = field(default_factory=list)
    ends: list[tuple[int, int]] = field(default_factory=list)  # position after each record
    rows: int = 0
    nbytes: int = 0
    versions: tuple[int, ...] = ()
    oldest_s: float | None = None


class Ingest:
    """Reads the spools of the files a writer owns and commits them through ``commit``.

    ``commit(worker_index, is_evaluation, sender_id, seq, chunk, stats)`` stores one coalesced chunk (the
    writer's ``append``); ``committed_upto(key, sender)`` is the first seq not yet committed for that sender.
    """

    def __init__(
        self, run_dir: str, *, owns: Callable[[str], bool], commit: Callable[..., Any],
        committed_upto: Callable[[tuple[int, bool], str], int],
        report: Callable[[tuple[int, bool], dict[str, Any]], Any] = lambda key, stats: None, coalesce_rows: int = 4096,
        coalesce_s: float = 2.0, coalesce_bytes: int = 8 << 20, tick_s: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = os.path.join(run_dir, SPOOL_DIR)
        self.run_dir = run_dir
        self.owns = owns
        self.commit_chunk = commit
        self.committed_upto = committed_upto
        self.report = report
        self.coalesce_rows = coalesce_rows
        self.coalesce_s = coalesce_s
        self.coalesce_bytes = coalesce_bytes
        self.tick_s = tick_s
        self.clock = clock
        self.senders: dict[tuple[str, str], _Sender] = {}
        self.buffers: dict[tuple[int, bool], _Buffer] = {}
        self.errors = 0
        self.last_error: str | None = None
        self._heartbeat_at = 0.0

    def poll(self, final: bool = False) -> int:
        """Reads what is new, commits what is due (everything if ``final``); returns rows committed."""
        now = self.clock()
        self._discover()
        committed = 0
        for sender in list(self.senders.values()):
            if sender.damaged is None and (final or now >= sender.retry_at_s):
                committed += self._read(sender, now, final)
        for key in list(self.buffers):
            if final or self._due(self.buffers[key], now):
                committed += self._commit(key)
        self._collect()
        if now - self._heartbeat_at >= HEARTBEAT_EVERY_S:
            self._heartbeat(now)
        return committed

    def pending(self) -> dict[str, int]:
        """What is read but not committed yet (rows, bytes), and the senders that have not ended."""
        return {"rows": sum(b.rows for b in self.buffers.values()),
                "bytes": sum(b.nbytes for b in self.buffers.values()),
                "open_senders": sum(not s.ended for s in self.senders.values())}

    def leftovers(self) -> dict[str, str]:
        """After a final poll: per sender whose spool is not all committed, why (``stem/sender`` -> cause).

        A spool that ends in a record cut short is not a loss: its runner was killed inside ``on_sample_end``,
        before ``sample()`` returned that sample.
        """
        out = {}
        for sender in self.senders.values():
            if not sender.settled:
                why = sender.damaged and f"damaged spool: {sender.damaged}" or f"not committed: {sender.failing}"
                out[f"{sender.stem}/{sender.sender}"] = why
        return out

    def remove_committed(self) -> None:
        """At the end of the run: deletes every sender spool whose records are all committed."""
        for key, sender in list(self.senders.items()):
            if sender.settled:
                self._close_fd(sender)
                shutil.rmtree(sender.directory, ignore_errors=True)
                del self.senders[key]
        for stem in os.listdir(self.root) if os.path.isdir(self.root) else []:
            _rmdir_if_empty(os.path.join(self.root, stem))
        _rmdir_if_empty(self.root)

    def close(self) -> None:
        for sender in self.senders.values():
            self._close_fd(sender)

    # -- reading

    def _discover(self) -> None:
        for stem, sender_id, directory in sender_dirs(self.run_dir):
            if (stem, sender_id) in self.senders or not self.owns(stem):
                continue
            worker_index, is_evaluation, _ = parse_stem(stem)  # type: ignore[misc]
            self.senders[stem, sender_id] = _Sender(stem, sender_id, directory, (worker_index, is_evaluation))

    def _read(self, sender: _Sender, now: float, final: bool) -> int:
        committed = 0
        while True:
            try:
                record = self._next_record(sender)
            except (SchemaError, OSError) as e:
                self._damaged(sender, e)
                return committed
            if record is None:
                return committed
            committed += self._take(sender, record, now)
            if sender.retry_at_s > now:  # a commit failed: the records stay in the spool until the retry
                return committed

    def _next_record(self, sender: _Sender) -> Record | None:
        while True:
            if sender.fd is None and not self._open_next(sender):
                return None
            size = os.fstat(sender.fd).st_size
            where = os.path.join(sender.directory, segment_name(sender.segment))
            record = read_record(sender.fd, sender.offset, size, where)
            if record is not None:
                sender.offset = record.end
                return record
            later = [i for i in segments_of(sender.directory) if i > sender.segment]
            if not later:
                return None  # the sender is still writing this segment (or died after its last record)
            # the runner moved on: this segment is complete (a torn tail it left on a failed write is skipped)
            if self._nothing_buffered(sender):  # what is read and not buffered is committed
                sender.committed = max(sender.committed, (later[0], 0))
            self._close_fd(sender)
            sender.segment, sender.offset = later[0], 0

    def _open_next(self, sender: _Sender) -> bool:
        if sender.segment is None:
            segments = segments_of(sender.directory)
            if not segments:
                return False
            sender.segment, sender.offset = segments[0], 0
            sender.committed = (segments[0], 0)
        try:
            sender.fd = os.open(os.path.join(sender.directory, segment_name(sender.segment)), os.O_RDONLY)
        except FileNotFoundError:
            return False
        return True

    def _take(self, sender: _Sender, record: Record, now: float) -> int:
        """Buffers a chunk record (or notes counters); returns rows committed to make room for it."""
        position = (sender.segment, record.end)
        if record.meta.get("stats"):
            sender.stats = dict(record.meta["stats"])
            self.report(sender.key, self._sender_stats(sender))
        if record.kind == KIND_END:
            sender.ended = True
        if record.kind != KIND_CHUNK or record.chunk is None or record.seq < self.committed_upto(
                sender.key, sender.sender):
            buffer = self.buffers.get(sender.key)
            if buffer is not None and buffer.sender is sender:
                buffer.ends[-1] = position  # committed with the chunks before it
            else:  # everything of this sender read so far is committed
                sender.committed = position
            return 0
        committed = 0
        buffer = self.buffers.get(sender.key)
        versions = _versions(record.chunk)
        if buffer is not None and (buffer.sender is not sender or buffer.versions != versions):
            committed += self._commit(sender.key)
            buffer = None
        if buffer is None:
            buffer = self.buffers[sender.key] = _Buffer(sender, versions=versions)
        buffer.records.append(record)
        buffer.ends.append(position)
        buffer.rows += record.chunk.agent_steps
        buffer.nbytes += record.chunk.held_nbytes
        sampled_at = record.chunk.sampled_at_s or now
        buffer.oldest_s = sampled_at if buffer.oldest_s is None else min(buffer.oldest_s, sampled_at)
        if buffer.rows >= max(self.coalesce_rows, 1) or (self.coalesce_bytes and buffer.nbytes >= self.coalesce_bytes):
            committed += self._commit(sender.key)
        return committed

    def _nothing_buffered(self, sender: _Sender) -> bool:
        buffer = self.buffers.get(sender.key)
        return buffer is None or buffer.sender is not sender

    # -- committing

    def _due(self, buffer: _Buffer, now: float) -> bool:
        # commit at the last tick before the oldest sample would have waited coalesce_s
        return buffer.oldest_s is None or now + self.tick_s >= buffer.oldest_s + self.coalesce_s

    def _commit(self, key: tuple[int, bool]) -> int:
        buffer = self.buffers.pop(key)
        sender = buffer.sender
        try:
            rows = self._store(key, sender, buffer.records)
        except Exception as e:  # noqa: BLE001 - sorted below: retry what may succeed later, refuse the rest
            if _transient(e):
                self._retry_later(sender, e)
                return 0
            if len(buffer.records) > 1:
                return self._commit_one_by_one(key, buffer)
            self._refuse(sender, buffer.records[0], e)
            rows = 0
        sender.committed = max(sender.committed, buffer.ends[-1])
        sender.failing = None
        return rows

    def _store(self, key: tuple[int, bool], sender: _Sender, records: list[Record]) -> int:
        chunk: Chunk = merge_chunks([r.chunk for r in records if r.chunk is not None])
        self.commit_chunk(key[0], key[1], sender.sender.encode(), records[0].seq, chunk,
                          {**(records[-1].meta.get("stats") or sender.stats), **self._refusals(sender)})
        return chunk.agent_steps

    def _commit_one_by_one(self, key: tuple[int, bool], buffer: _Buffer) -> int:
        """A coalesced commit was refused: store its records one at a time, refusing only the bad ones."""
        sender, rows = buffer.sender, 0
        for record, end in zip(buffer.records, buffer.ends):
            try:
                rows += self._store(key, sender, [record])
            except Exception as e:  # noqa: BLE001
                if _transient(e):
                    self._retry_later(sender, e)
                    return rows
                self._refuse(sender, record, e)
            sender.committed = max(sender.committed, end)
        sender.failing = None
        return rows

    def _refuse(self, sender: _Sender, record: Record, error: Exception) -> None:
        """Counts a chunk (buffered records all hold one) whose data the writer can never store."""
        sender.refused_steps += record.chunk.env_steps
        sender.refused_error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
        self.errors += 1
        self.last_error = sender.refused_error
        if sender.refused_steps == record.chunk.env_steps:
            logger.error("rllib_recorder: a writer refused a sample of %s (%s); its %d env steps are counted as "
                         "refused, recording goes on (further refusals are only counted)", sender.stem,
                         sender.refused_error, record.chunk.env_steps)
        self.report(sender.key, self._sender_stats(sender))

    @staticmethod
    def _refusals(sender: _Sender) -> dict[str, Any]:
        return {"env_steps_refused": sender.refused_steps, "refused_error": sender.refused_error} \
            if sender.refused_steps else {}

    def _sender_stats(self, sender: _Sender) -> dict[str, Any]:
        return {**sender.stats, **self._refusals(sender)}

    def _retry_later(self, sender: _Sender, error: Exception) -> None:
        first = sender.failing is None
        self.last_error = sender.failing = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
        self.errors += first  # one error per sender that starts failing, not one per retry
        if first:
            logger.error("rllib_recorder: committing %s's samples failed (%s); they stay in the spool and are "
                         "tried again every %.0f s", sender.stem, self.last_error, RETRY_AFTER_S)
        self._close_fd(sender)
        sender.segment, sender.offset = sender.committed if sender.committed[0] >= 0 else (None, 0)
        sender.retry_at_s = self.clock() + RETRY_AFTER_S

    def _damaged(self, sender: _Sender, error: Exception) -> None:
        """A record that is not one: stop reading this sender (what is before it was committed)."""
        if not self._nothing_buffered(sender):  # the records before the damage are sound
            self._commit(sender.key)
        sender.damaged = str(error)
        self.errors += 1
        self.last_error = f"{type(error).__name__}: {sender.damaged}"
        logger.error("rllib_recorder: %s; the rest of that spool is left in place", sender.damaged)

    # -- cleaning up

    def _collect(self) -> None:
        """Deletes every spool segment whose records are all committed."""
        for key, sender in list(self.senders.items()):
            if sender.damaged:
                continue
            done_segment, _ = sender.committed
            if sender.ended and sender.committed >= self._end_of(sender):
                self._close_fd(sender)
                shutil.rmtree(sender.directory, ignore_errors=True)
                del self.senders[key]
                continue
            for index in segments_of(sender.directory):
                if index < done_segment:
                    _remove(os.path.join(sender.directory, segment_name(index)))

    def _end_of(self, sender: _Sender) -> tuple[int, int]:
        segments = segments_of(sender.directory)
        if not segments:
            return (-1, 0)
        last = os.path.join(sender.directory, segment_name(segments[-1]))
        try:
            return (segments[-1], os.path.getsize(last))
        except OSError:
            return (segments[-1], 0)

    def _heartbeat(self, now: float) -> None:
        self._heartbeat_at = now
        for stem in {s.stem for s in self.senders.values()}:
            path = os.path.join(self.root, stem, HEARTBEAT_NAME)
            try:
                with open(path, "a") as f:
                    if f.tell() == 0:  # who the writer is, for recover's liveness check
                        f.write(heartbeat_owner())
                os.utime(path, (now, now))
            except OSError:  # the runner then waits at most drain_timeout_s
                pass

    @staticmethod
    def _close_fd(sender: _Sender) -> None:
        if sender.fd is not None:
            os.close(sender.fd)
            sender.fd = None


def _transient(error: Exception) -> bool:
    """A failure of the file system (full disk, I/O error): the same commit may succeed later. Anything else
    (the data does not fit the file) fails the same way every time."""
    return isinstance(error, (OSError, RuntimeError, WriterError))


def _versions(chunk: Chunk) -> tuple[int, ...]:
    versions = chunk.policy_versions
    if not len(versions):
        return ()
    low, high = int(versions.min()), int(versions.max())
    return (low,) if low == high else tuple(sorted(set(versions.tolist())))


def _rmdir_if_empty(path: str) -> None:
    try:
        heartbeat = os.path.join(path, HEARTBEAT_NAME)
        if os.path.isdir(path) and set(os.listdir(path)) <= {HEARTBEAT_NAME}:
            _remove(heartbeat)
            os.rmdir(path)
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def spool_leftovers(run_dir: str) -> list[str]:
    """Sender spools still in a run directory (``stem/sender``): samples handed over but never committed."""
    return [f"{stem}/{sender}" for stem, sender, _ in sender_dirs(run_dir)]

