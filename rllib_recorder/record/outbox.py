"""Flow control in the env runner: every sample into the spool before ``sample()`` returns, a bounded backlog.

The outbox no longer holds samples: each ``on_sample_end`` payload is numbered and written to the runner's spool
(``format/spool``), where a kill of the runner can't take it, and the writer on the same node coalesces and commits
it. What stays is the balance of production and consumption: the spool's backlog (bytes the writer has not
committed and deleted yet) is bounded by ``max_backlog_bytes``; past it ``block`` waits for the writer (time
counted, at most ``max_wait_s``, and not at all once the writer's heartbeat has stopped) and ``drop`` drops the
sample. Every step is counted as sampled, written, dropped (with its cause) or failed.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from rllib_recorder.errors import ConversionError
from rllib_recorder.format.chunks import Chunk, uint8_chunk
from rllib_recorder.format.counters import not_stored_by_sender
from rllib_recorder.format.spool import KIND_CHUNK, KIND_END, KIND_STATS, encode_record
from rllib_recorder.format.spool_files import SegmentWriter

logger = logging.getLogger(__name__)

# A writer whose heartbeat is older than this is not consuming: a blocked sampler stops waiting for it.
WRITER_STALE_S = 30.0
BACKLOG_POLL_S = 0.02


@dataclass
class OutboxStats:
    """Counters of one env-runner process incarnation (a sender); cumulative, carried by every record."""

    samples: int = 0
    chunks_written: int = 0
    env_steps_written: int = 0
    rows_written: int = 0
    chunks_dropped: int = 0
    env_steps_dropped: int = 0
    rows_dropped: int = 0
    chunks_failed: int = 0
    env_steps_failed: int = 0
    rows_failed: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0
    backlog_bytes: int = 0
    last_error: str | None = None
    drop_causes: Counter = field(default_factory=Counter)  # cause -> env steps

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["drop_causes"] = dict(self.drop_causes)
        return out


class Outbox:
    """Numbers each sample and writes it into this sender's spool; bounds the backlog; never holds a sample.

    ``writer_heartbeat_s`` returns the age of the writer's heartbeat (None: not known yet); ``clock`` and
    ``sleep`` are injected so that flow-control tests take milliseconds.
    """

    def __init__(
        self, segments: SegmentWriter, *, policy: str = "block", max_backlog_bytes: int = 256 << 20,
        max_wait_s: float = 120.0, writer_heartbeat_s: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
        encode: bool = False, extra_stats: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.segments = segments
        self.policy = policy
        self.max_backlog_bytes = max_backlog_bytes
        self.max_wait_s = max_wait_s
        self.writer_heartbeat_s = writer_heartbeat_s
        self.clock = clock
        self.sleep = sleep
        self.sender_id = os.path.basename(segments.directory)  # the spool directory names the sender
        # exact-uint8 float32 images are written as uint8 codes (a bound runner's conversion encoded them already)
        self.encode = encode
        self.extra_stats = extra_stats
        self.stats = OutboxStats()
        self.closed = False
        self._unknown_backlog = 0  # bytes written since the backlog was last looked up

    def add(self, chunk: Chunk) -> None:
        """Writes one sample's chunk into the spool (after waiting for room if the backlog is full)."""
        self.stats.samples += 1
        try:
            chunk = uint8_chunk(chunk) if self.encode else chunk
        except Exception as e:  # noqa: BLE001 - a column that can't be encoded is counted, never raised
            self._count_failed(chunk, e)
            return
        cause = self._make_room()
        if cause is not None:
            self._count_drop(chunk, cause)
            return
        seq = self.stats.chunks_written
        try:
            size = self.segments.write(encode_record(KIND_CHUNK, seq, self._meta(chunk), chunk))
        except (OSError, ConversionError) as e:  # a full disk, or a column the spool can't carry
            self._count_failed(chunk, e)
            return
        self.stats.chunks_written += 1
        self.stats.env_steps_written += chunk.env_steps
        self.stats.rows_written += chunk.agent_steps
        self._unknown_backlog += size

    def report(self) -> None:
        """Writes the counters alone (e.g. after an error), so that the writer and the driver see them."""
        self._write_plain(KIND_STATS)

    def close(self) -> dict[str, Any]:
        """Writes the final counters and closes the spool; returns the counters."""
        if not self.closed:
            self._write_plain(KIND_END)
            self.segments.close()
            self.closed = True
        return self.stats_dict()

    def stats_dict(self) -> dict[str, Any]:
        stats = {**self.stats.as_dict(), **self.extra_stats(), "sender_id": self.sender_id}
        stats["env_steps_not_stored"] = not_stored_by_sender(stats)
        return stats

    def _meta(self, chunk: Chunk | None = None) -> dict[str, Any]:
        stats = self.stats_dict()
        if chunk is not None:  # this record's own steps count as written
            for key, n in (("chunks_written", 1), ("env_steps_written", chunk.env_steps),
                           ("rows_written", chunk.agent_steps)):
                stats[key] += n
        return {"sender": self.sender_id, "stats": stats}

    def _write_plain(self, kind: int) -> None:
        try:
            self.segments.write(encode_record(kind, self.stats.chunks_written, self._meta()))
        except OSError as e:  # the counters stay here, and reach the driver when it drains the runner
            self.stats.last_error = _line(e)

    def _make_room(self) -> str | None:
        """None when the backlog has room (after waiting, with ``block``); else why the sample is dropped."""
        if self.stats.backlog_bytes + self._unknown_backlog < self.max_backlog_bytes:
            return None
        if self._backlog() < self.max_backlog_bytes:
            return None
        if self.policy == "drop":
            return "backpressure_drop"
        start = self.clock()
        while self._backlog() >= self.max_backlog_bytes:
            waited = self.clock() - start
            heartbeat = self.writer_heartbeat_s()
            if heartbeat is not None and heartbeat > WRITER_STALE_S:
                self._account_wait(waited)
                return "writer_not_consuming"
            if waited >= self.max_wait_s:
                self._account_wait(waited)
                return "block_timeout"
            self.sleep(BACKLOG_POLL_S)
        self._account_wait(self.clock() - start)
        return None

    def _backlog(self) -> int:
        self.stats.backlog_bytes = self.segments.backlog_bytes()
        self._unknown_backlog = 0
        return self.stats.backlog_bytes

    def _account_wait(self, waited: float) -> None:
        self.stats.wait_s += waited
        self.stats.max_wait_s = max(self.stats.max_wait_s, waited)

    def _count_drop(self, chunk: Chunk, cause: str) -> None:
        self.stats.chunks_dropped += 1
        self.stats.env_steps_dropped += chunk.env_steps
        self.stats.rows_dropped += chunk.agent_steps
        self.stats.drop_causes[cause] += chunk.env_steps
        if self.stats.drop_causes[cause] == chunk.env_steps:
            fix = {"backpressure_drop": "backpressure='drop' drops when the spool's backlog is full",
                   "block_timeout": f"no room in the spool for {self.max_wait_s:.0f} s; raise drain_timeout_s "
                                    "or max_backlog_bytes, or check the writer actors",
                   "writer_not_consuming": "the writer's heartbeat stopped; check the writer actors"}[cause]
            logger.error("rllib_recorder: dropping a sample (%s); further drops are only counted", fix)

    def _count_failed(self, chunk: Chunk, error: Exception) -> None:
        self.stats.chunks_failed += 1
        self.stats.env_steps_failed += chunk.env_steps
        self.stats.rows_failed += chunk.agent_steps
        self.stats.last_error = _line(error)
        if self.stats.chunks_failed == 1:
            logger.error("rllib_recorder: cannot write a sample into the spool (%s); it is counted as failed, "
                         "recording goes on (further failures are not logged)", self.stats.last_error)


def _line(error: Exception) -> str:
    text = (str(error).splitlines() or [""])[0][:300]
    if isinstance(error, OSError) and error.errno == 28:
        return f"WriterError: disk full: cannot write the spool ({text}); free space on that file system or " \
               "choose another output_dir"
    return f"{type(error).__name__}: {text}"


def heartbeat_age_s(path: str, now: Callable[[], float] = time.time) -> float | None:
    """Seconds since the writer last touched its heartbeat file ``path`` (None if it has none yet)."""
    try:
        return max(0.0, now() - os.stat(path).st_mtime)
    except OSError:
        return None
