"""Flow control in the env runner: sequence numbers, coalescing, the in-flight window, acks, re-sends."""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from rllib_recorder.convert import Chunk, encode_images, merge_chunks

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """How an outbox reaches its writer (Ray in production, a fake in tests)."""

    def send(self, sender_id: bytes, seq: int, chunk: Chunk, stats: dict[str, Any]) -> Any:
        """Starts storing ``chunk``; returns a handle that completes with the ack."""

    def wait(self, handles: list[Any], timeout_s: float) -> list[Any]:
        """Returns the handles that have completed (at least one unless timed out)."""

    def result(self, handle: Any) -> dict[str, Any]:
        """The ack of a completed handle; raises if storing failed."""

    def retryable(self, error: Exception) -> bool:
        """True if the writer may store the chunk when it is sent again (e.g. it restarted)."""


@dataclass
class _InFlight:
    seq: int
    chunk: Chunk
    handle: Any
    attempts: int = 1
    retry_at_s: float | None = None


@dataclass
class OutboxStats:
    """Counters of one env runner's outbox (reported to the writers and in train results)."""

    samples: int = 0
    chunks_sent: int = 0
    chunks_acked: int = 0
    rows_acked: int = 0
    chunks_dropped: int = 0
    rows_dropped: int = 0
    resends: int = 0
    send_errors: int = 0
    chunks_failed: int = 0
    rows_failed: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0
    chunks_in_flight: int = 0
    rows_pending: int = 0
    last_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


class Outbox:
    """Numbers chunks, coalesces small ones, bounds what is unacknowledged, re-sends failures.

    Lossless by default: when ``window`` chunks are unacknowledged, ``add`` waits for
    one acknowledgement (at most ``max_wait_s``; the time is counted). With
    ``policy="drop"`` the new chunk is dropped and counted instead. A chunk stays
    here until its writer acknowledges it, so a writer that dies and restarts gets
    it again (the writer skips what it already committed).
    """

    def __init__(
        self, transport: Transport, *, window: int = 4, policy: str = "block",
        coalesce_rows: int = 0, coalesce_s: float = 0.0, coalesce_bytes: int = 0, max_wait_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
        sender_id: bytes | None = None, encode: bool = False,
    ) -> None:
        self.transport = transport
        # send exact-uint8 float32 images as uint8 codes (convert.encode_images); a bound runner's conversion has
        # encoded each episode already (those columns are skipped), this encodes what was converted before binding
        self.encode = encode
        self.window = window
        self.policy = policy
        self.coalesce_rows = coalesce_rows
        self.coalesce_s = coalesce_s
        self.coalesce_bytes = coalesce_bytes
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.sleep = sleep
        self.sender_id = sender_id or uuid.uuid4().hex.encode()
        self.stats = OutboxStats()
        self._next_seq = 0
        self._pending: list[Chunk] = []
        self._pending_bytes = 0
        self._pending_since: float | None = None
        self._pending_versions: tuple[int, ...] = ()
        self._in_flight: OrderedDict[int, _InFlight] = OrderedDict()

    def add(self, chunk: Chunk) -> None:
        """Queues one sample's chunk; sends once enough rows (or bytes, or time) have piled up.

        Samples taken with other behaviour-policy versions than those held are never coalesced
        with them: a stored chunk's learner version is looked up at its first sample's time, and
        must hold for every step in it (see docs/FORMAT.md, "Policy lag").
        """
        self.stats.samples += 1
        versions = _versions(chunk)
        if self._pending and versions != self._pending_versions:
            self.flush()
        self._pending_versions = versions
        if not self._pending:
            self._pending_since = self.clock()
        self._pending.append(chunk)
        self.stats.rows_pending += chunk.agent_steps
        self._pending_bytes += chunk.held_nbytes  # as held: an Atari sample's codes, not its float32 stacks
        self.poll()
        if (self.stats.rows_pending >= self.coalesce_rows
                or (self.coalesce_bytes and self._pending_bytes >= self.coalesce_bytes)
                or self.clock() - self._pending_since >= self.coalesce_s):
            self.flush()

    def flush(self) -> None:
        """Sends what is pending as one chunk (waiting for window space if needed)."""
        if not self._pending:
            return
        chunk = merge_chunks(self._pending)
        if self.encode:
            chunk = encode_images(chunk)
        self._pending, self._pending_since, self._pending_bytes = [], None, 0
        self.stats.rows_pending = 0
        if len(self._in_flight) >= self.window and not self._make_room():
            self.stats.chunks_dropped += 1
            self.stats.rows_dropped += chunk.agent_steps
            return
        seq = self._next_seq
        self._next_seq += 1
        handle = self.transport.send(self.sender_id, seq, chunk, self.stats_dict())
        self._in_flight[seq] = _InFlight(seq, chunk, handle)
        self.stats.chunks_sent += 1
        self.stats.chunks_in_flight = len(self._in_flight)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Collects finished acknowledgements and re-sends failed chunks; returns acks taken."""
        self._resend_due()
        waiting = [f.handle for f in self._in_flight.values() if f.retry_at_s is None]
        if not waiting:
            if timeout_s > 0 and self._in_flight:  # all are backing off: sleep, don't spin
                next_retry = min(f.retry_at_s for f in self._in_flight.values())
                self.sleep(max(0.0, min(timeout_s, next_retry - self.clock())))
            return 0
        done = self.transport.wait(waiting, timeout_s)
        acked = 0
        by_handle = {f.handle: f for f in self._in_flight.values()}
        for handle in done:
            flight = by_handle[handle]
            try:
                ack = self.transport.result(handle)
            except Exception as e:
                if self.transport.retryable(e):  # the writer died: keep the chunk, retry later
                    self._schedule_resend(flight, e)
                else:  # the writer refused the chunk: re-sending cannot help
                    self._fail(flight, e)
                continue
            del self._in_flight[flight.seq]
            self.stats.chunks_acked += 1
            self.stats.rows_acked += int(ack.get("rows", 0))
            acked += 1
        self.stats.chunks_in_flight = len(self._in_flight)
        return acked

    def drain(self, timeout_s: float) -> int:
        """Sends everything pending and waits for every ack; returns chunks left unacknowledged."""
        self.flush()
        deadline = self.clock() + timeout_s
        while self._in_flight and self.clock() < deadline:
            self.poll(timeout_s=min(0.5, max(0.0, deadline - self.clock())))
        return len(self._in_flight)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def stats_dict(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def _make_room(self) -> bool:
        """Lossless: wait for an ack. Drop policy: report no room at once."""
        self.poll()
        if len(self._in_flight) < self.window:
            return True
        if self.policy == "drop":
            return False
        start = self.clock()
        while len(self._in_flight) >= self.window:
            waited = self.clock() - start
            if waited >= self.max_wait_s:
                logger.error(
                    "rllib_recorder: no writer acknowledgement for %.0f s; dropping a chunk "
                    "(raise drain_timeout_s or check the writer actors)", waited,
                )
                self.stats.send_errors += 1
                self._account_wait(waited)
                return False
            self.poll(timeout_s=min(0.5, self.max_wait_s - waited))
        self._account_wait(self.clock() - start)
        return True

    def _account_wait(self, waited: float) -> None:
        self.stats.wait_s += waited
        self.stats.max_wait_s = max(self.stats.max_wait_s, waited)

    def _schedule_resend(self, flight: _InFlight, error: Exception) -> None:
        backoff = min(5.0, 0.05 * 2 ** min(flight.attempts, 10))
        flight.retry_at_s = self.clock() + backoff
        self.stats.send_errors += 1
        if flight.attempts == 1:
            logger.warning(
                "rllib_recorder: writer failed to store chunk %d (%s: %s); re-sending",
                flight.seq, type(error).__name__, error,
            )

    def _fail(self, flight: _InFlight, error: Exception) -> None:
        del self._in_flight[flight.seq]
        self.stats.chunks_failed += 1
        self.stats.rows_failed += flight.chunk.agent_steps
        cause = getattr(error, "cause", None) or error  # a Ray task error wraps the writer's own
        self.stats.last_error = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}"
        if self.stats.chunks_failed == 1:
            logger.error(
                "rllib_recorder: the writer refused chunk %d (%s); it is counted as failed, "
                "recording goes on (further refusals are not logged)", flight.seq, error,
            )

    def _resend_due(self) -> None:
        now = self.clock()
        for flight in self._in_flight.values():
            if flight.retry_at_s is not None and now >= flight.retry_at_s:
                flight.handle = self.transport.send(self.sender_id, flight.seq, flight.chunk, self.stats_dict())
                flight.retry_at_s = None
                flight.attempts += 1
                self.stats.resends += 1


def _versions(chunk: Chunk) -> tuple[int, ...]:
    """The distinct behaviour-policy versions in ``chunk``, ascending."""
    versions = chunk.policy_versions
    if len(versions) and versions.min() == versions.max():  # the usual sample: one version, no sort needed
        return (int(versions[0]),)
    return tuple(np.unique(versions).tolist())
