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
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rllib_recorder.errors import SchemaError, WriterError
from rllib_recorder.format.chunks import Chunk, merge_chunks
from rllib_recorder.format.spool import KIND_CHUNK, KIND_END, Record
from rllib_recorder.format.spool_files import SPOOL_DIR, parse_stem, sender_dirs
from rllib_recorder.service.spool_reader import Relisting, SenderSpool, rmdir_if_empty, touch_heartbeats

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 1.0

RETRY_AFTER_S = 5.0


@dataclass
class _Buffer:
    """Chunks of one file waiting to be committed together: one sender, one set of policy versions."""

    sender: SenderSpool
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
        self.senders: dict[tuple[str, str], SenderSpool] = {}
        self.buffers: dict[tuple[int, bool], _Buffer] = {}
        self.errors = 0
        self.last_error: str | None = None
        self._heartbeat_at = 0.0
        self._claimed: set[str] = set()  # stems whose heartbeat names this process
        self._listing = Relisting()  # the spool's directories, as last listed

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
            self._heartbeat_at = now
            touch_heartbeats(self.root, {s.stem for s in self.senders.values()}, now, self._claimed)
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
                sender.remove()
                del self.senders[key]
        for stem in os.listdir(self.root) if os.path.isdir(self.root) else []:
            rmdir_if_empty(os.path.join(self.root, stem))
        rmdir_if_empty(self.root)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()

    # -- reading

    def _discover(self) -> None:
        """Finds new senders' spools. Listing the spool's directories on every tick was most of an idle writer's
        work: they are listed only when that is due (``Relisting``: one of their mtimes moved, a new runner or a
        new incarnation, or a second passed)."""
        if not self._listing.due(_stamps(self.root)):
            return
        for stem, sender_id, directory in sender_dirs(self.run_dir):
            if (stem, sender_id) in self.senders or not self.owns(stem):
                continue
            worker_index, is_evaluation, _ = parse_stem(stem)  # type: ignore[misc]
            self.senders[stem, sender_id] = SenderSpool(stem, sender_id, directory, (worker_index, is_evaluation))

    def _read(self, sender: SenderSpool, now: float, final: bool) -> int:
        committed = 0
        while True:
            try:
                record = sender.next_record(lambda: self._nothing_buffered(sender))
            except (SchemaError, OSError) as e:
                self._damaged(sender, e)
                return committed
            if record is None:
                return committed
            committed += self._take(sender, record, now)
            if sender.retry_at_s > now:  # a commit failed: the records stay in the spool until the retry
                return committed



    def _take(self, sender: SenderSpool, record: Record, now: float) -> int:
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

    def _nothing_buffered(self, sender: SenderSpool) -> bool:
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

    def _store(self, key: tuple[int, bool], sender: SenderSpool, records: list[Record]) -> int:
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

    def _refuse(self, sender: SenderSpool, record: Record, error: Exception) -> None:
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
    def _refusals(sender: SenderSpool) -> dict[str, Any]:
        return {"env_steps_refused": sender.refused_steps, "refused_error": sender.refused_error} \
            if sender.refused_steps else {}

    def _sender_stats(self, sender: SenderSpool) -> dict[str, Any]:
        return {**sender.stats, **self._refusals(sender)}

    def _retry_later(self, sender: SenderSpool, error: Exception) -> None:
        first = sender.failing is None
        self.last_error = sender.failing = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
        self.errors += first  # one error per sender that starts failing, not one per retry
        if first:
            logger.error("rllib_recorder: committing %s's samples failed (%s); they stay in the spool and are "
                         "tried again every %.0f s", sender.stem, self.last_error, RETRY_AFTER_S)
        sender.close()
        sender.segment, sender.offset = sender.committed if sender.committed[0] >= 0 else (None, 0)
        sender.retry_at_s = self.clock() + RETRY_AFTER_S

    def _damaged(self, sender: SenderSpool, error: Exception) -> None:
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
            if sender.ended and sender.committed >= sender.end():
                sender.remove()
                del self.senders[key]
                continue
            sender.remove_committed_segments()


def _stamps(root: str) -> tuple[int, ...] | None:
    """The mtimes of the spool root and of each file's directory in it (a new sender directory moves one)."""
    try:
        with os.scandir(root) as entries:
            stems = sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir())
        return (os.stat(root).st_mtime_ns, *(m for _, m in stems))
    except OSError:
        return None


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
