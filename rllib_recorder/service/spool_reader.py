"""One sender's spool as its writer reads it: where the writer stands, the next complete record, what to delete."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rllib_recorder.format.liveness import HEARTBEAT_NAME, process_identity
from rllib_recorder.format.spool import Record, read_record
from rllib_recorder.format.spool_files import segment_name, segments_of


# A directory a writer lists on every tick is listed again only when its mtime moved (a new runner, a new
# segment), or this long after it was last listed (file systems with coarse mtimes).
RELIST_EVERY_S = 1.0


@dataclass
class Relisting:
    """When a directory is worth listing again: its stamp (mtimes) moved since it was last listed, or
    ``RELIST_EVERY_S`` passed, or it has no stamp (None: it could not be stat'ed)."""

    stamp: Any = None
    at: float = float("-inf")

    def due(self, stamp: Any) -> bool:
        now = time.monotonic()
        if stamp is not None and stamp == self.stamp and now - self.at < RELIST_EVERY_S:
            return False
        self.stamp, self.at = stamp, now
        return True


@dataclass
class SenderSpool:
    """Where the writer stands in one sender's spool, and reading it record by record."""

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
    listing: Relisting = field(default_factory=Relisting)  # a runner starts a new segment only now and then
    removed_below: int = -1  # segments before this one are deleted
    _listed_segments: list[int] = field(default_factory=list)

    @property
    def read(self) -> tuple[int, int]:
        """(segment, offset) up to which records were read."""
        return (-1, 0) if self.segment is None else (self.segment, self.offset)

    @property
    def settled(self) -> bool:
        """Every complete record read is committed, and nothing failed or was damaged."""
        return self.damaged is None and self.failing is None and self.committed >= self.read

    def next_record(self, nothing_buffered: Callable[[], bool]) -> Record | None:
        """The next complete record, or None when there is none yet; moves on to the next segment once the runner
        has (a segment the runner left is complete). ``nothing_buffered()``: every record read so far is committed."""
        while True:
            if self.fd is None and not self.open_next():
                return None
            size = os.fstat(self.fd).st_size
            where = os.path.join(self.directory, segment_name(self.segment))
            record = read_record(self.fd, self.offset, size, where)
            if record is not None:
                self.offset = record.end
                return record
            later = [i for i in self._segments() if i > self.segment]
            if not later:
                return None  # the sender is still writing this segment (or died after its last record)
            # the runner moved on: this segment is complete (a torn tail it left on a failed write is skipped)
            if nothing_buffered():  # what is read and not buffered is committed
                self.committed = max(self.committed, (later[0], 0))
            self.close()
            self.segment, self.offset = later[0], 0

    def _segments(self) -> list[int]:
        """The segments of the directory, listed again only when that is due (``Relisting``)."""
        try:
            mtime: int | None = os.stat(self.directory).st_mtime_ns
        except OSError:
            mtime = None
        if self.listing.due(mtime):
            self._listed_segments = segments_of(self.directory)
        return self._listed_segments

    def open_next(self) -> bool:
        """Opens the segment to read (the first one, if none was read yet); False when there is none."""
        if self.segment is None:
            segments = segments_of(self.directory)
            if not segments:
                return False
            self.segment, self.offset = segments[0], 0
            self.committed = (segments[0], 0)
        try:
            self.fd = os.open(os.path.join(self.directory, segment_name(self.segment)), os.O_RDONLY)
        except FileNotFoundError:
            return False
        return True

    def end(self) -> tuple[int, int]:
        """(segment, offset) of the end of what the runner has written."""
        segments = segments_of(self.directory)
        if not segments:
            return (-1, 0)
        last = os.path.join(self.directory, segment_name(segments[-1]))
        try:
            return (segments[-1], os.path.getsize(last))
        except OSError:
            return (segments[-1], 0)

    def close(self) -> None:
        """Closes the segment being read."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def remove_committed_segments(self) -> None:
        """Deletes every segment before the one holding the first record not yet committed."""
        done_segment, _ = self.committed
        if done_segment <= self.removed_below:
            return  # nothing new to delete (the directory is not listed for it)
        for index in segments_of(self.directory):
            if index < done_segment:
                remove_file(os.path.join(self.directory, segment_name(index)))
        self.removed_below = done_segment

    def remove(self) -> None:
        """Deletes this sender's spool (all of it is committed)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def touch_heartbeats(root: str, stems: set[str], now: float, claimed: set[str]) -> None:
    """Marks the spools of ``stems`` as read by a live writer (``recover`` and waiting runners look at it). The
    first touch of a stem by this process names it in the heartbeat (a restarted writer is another process), and
    the stem goes into ``claimed``."""
    for stem in stems:
        path = os.path.join(root, stem, HEARTBEAT_NAME)
        try:
            if stem not in claimed:
                with open(path, "w") as f:  # who the writer is, for recover's liveness check
                    f.write(process_identity())
                claimed.add(stem)
            os.utime(path, (now, now))
        except OSError:  # the runner then waits at most drain_timeout_s
            pass


def rmdir_if_empty(path: str) -> None:
    try:
        heartbeat = os.path.join(path, HEARTBEAT_NAME)
        if os.path.isdir(path) and set(os.listdir(path)) <= {HEARTBEAT_NAME}:
            remove_file(heartbeat)
            os.rmdir(path)
    except OSError:
        pass


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
