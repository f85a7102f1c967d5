"""Publishing: sealed segments go from a node's staging directory to the durable target, are checked there and
leave the node; each stream's index at the target is rebuilt to name them.

A ``Publisher`` runs one thread per writer. An upload that fails (the store down, credentials refused) is retried
with exponential backoff; sampling and writing go on meanwhile, the sealed segments piling up locally as the
*upload backlog*. Past ``max_upload_backlog_bytes`` the writer stops taking chunks (``backlogged``), so the env
runners' spools fill and the configured back-pressure applies. Nothing is removed locally before the target holds
it, checked (size and SHA-256 read back).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from rllib_recorder.format import segments
from rllib_recorder.format.store import Target

logger = logging.getLogger(__name__)

BACKOFF_S = (1.0, 60.0)  # first and longest wait between attempts


class Publisher:
    """Uploads the sealed segments of the streams ``owns(stem)`` names, oldest first, in a thread."""

    def __init__(self, run_dir: str, target: Target, owns: Any = None, *, max_backlog_bytes: int = 4 << 30,
                 check: bool = True, thread: bool = True) -> None:
        self.run_dir = run_dir
        self.target = target
        self.owns = owns or (lambda stem: True)
        self.max_backlog_bytes = max_backlog_bytes
        self.check = check
        self.totals: Counter[str] = Counter()
        self.last_error: str | None = None
        self._wake = threading.Condition()
        self._publishing = threading.Lock()  # one publisher at a time: the thread or ``drain``
        self._stopped = False
        self._failures = 0
        self._retry_at = 0.0
        self._dirty: set[str] = set()  # streams whose index at the target is older than their records
        if thread:
            threading.Thread(target=self._loop, name="rllib_recorder-publish", daemon=True).start()

    def sealed(self, path: str) -> None:
        """A segment was sealed: wake the thread (never waits for an upload)."""
        with self._wake:
            self._wake.notify()

    def pending(self) -> list[str]:
        """Sealed segments in staging, not yet at the target, oldest first per stream."""
        return [p for stem in segments.stems(self.run_dir) if self.owns(stem)
                for p in segments.sealed(self.run_dir, stem)]

    def backlog_bytes(self) -> int:
        return sum(_size(p) for p in self.pending())

    def backlogged(self) -> bool:
        """Whether the backlog is past its bound: the writer should take no more chunks for now."""
        return self.backlog_bytes() > self.max_backlog_bytes

    def stats(self) -> dict[str, Any]:
        pending = self.pending()
        return {"segments_uploaded": self.totals["segments"], "bytes_uploaded": self.totals["bytes"],
                "upload_s": self.totals["seconds"], "upload_errors": self.totals["errors"],
                "upload_backlog_segments": len(pending), "upload_backlog_bytes": sum(_size(p) for p in pending),
                "last_upload_error": self.last_error}

    def publish_once(self, log: bool = True) -> bool:
        """Uploads every pending segment and rebuilds stale indexes; False at the first failure (counted; logged
        at the first failure of an outage, where ``log``)."""
        try:
            for path in self.pending():
                self._publish(path)
            for stem in sorted(self._dirty):
                self._put_index(stem)
        except Exception as e:  # noqa: BLE001 - the store's errors vary by file system; all are retried
            self.totals["errors"] += 1
            self.last_error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            if log and (self.totals["errors"] == 1 or self._failures == 0):
                logger.warning("rllib_recorder: uploading to %s failed (%s); retrying with backoff, the segments "
                               "wait in %s", self.target.uri_of(""), self.last_error, self.run_dir)
            return False
        return True

    def drain(self, timeout_s: float) -> bool:
        """Publishes everything pending, retrying until ``timeout_s`` (at least one attempt); True when nothing is
        left. Quiet: its caller reports what is left, once."""
        deadline = time.monotonic() + timeout_s
        wait = BACKOFF_S[0]
        while True:
            with self._publishing:
                if self.publish_once(log=False):
                    return True
            if time.monotonic() + wait > deadline:
                return False
            time.sleep(wait)
            wait = min(2 * wait, BACKOFF_S[1])

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            if now >= self._retry_at:
                with self._publishing:
                    if self._stopped:
                        return
                    if self.publish_once():
                        self._failures = 0
                    else:
                        self._failures += 1
                        self._retry_at = now + min(BACKOFF_S[0] * 2 ** (self._failures - 1), BACKOFF_S[1])
            with self._wake:  # a seal wakes it; else it looks again in 5 s, or when the backoff is over
                if self._stopped:
                    return
                wait = self._retry_at - time.monotonic() if self._failures else 5.0
                self._wake.wait(timeout=max(0.05, min(5.0, wait)))

    def seed(self, stem: str) -> None:
        """A stream with no state in this staging directory that the target already holds (a Tune trial retried on
        another node, its earlier node's disk gone): its index and records are fetched from the target, so it goes
        on where it stands there instead of starting over and overwriting it."""
        folder = segments.stem_dir(self.run_dir, stem)
        if os.path.exists(os.path.join(folder, segments.PUBLISHED)) or segments.sealed(self.run_dir, stem):
            return
        if self.target.size(f"{stem}.h5") is None:
            return
        os.makedirs(folder, exist_ok=True)
        fetched = os.path.join(folder, "index.h5.fetched")
        self.target.get(f"{stem}.h5", fetched)
        segments.seed_from_index(self.run_dir, stem, fetched)

    def _publish(self, path: str) -> None:
        stem = os.path.basename(os.path.dirname(path))
        name = os.path.basename(path)
        start = time.perf_counter()
        stored = self.target.put(path, segments.target_segment(stem, name), check=self.check)
        record = segments.describe(path, stored)
        records = [r for r in segments.read_published(self.run_dir, stem) if r["name"] != name] + [record]
        index = segments.index_path(self.run_dir, stem)
        segments.build_index(index, stem, records, path, index if os.path.exists(index) else None)
        segments.write_published(self.run_dir, stem, records)
        self._dirty.add(stem)
        os.remove(path)  # at the target, checked, and named by the local index
        self.totals["segments"] += 1
        self.totals["bytes"] += stored["size"]
        self.totals["seconds"] += time.perf_counter() - start
        self._put_index(stem)

    def _put_index(self, stem: str) -> None:
        self.target.put(segments.index_path(self.run_dir, stem), f"{stem}.h5", replace=True, check=False)
        self._dirty.discard(stem)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def publish_run(run_dir: str, target: Target, config: Any, timeout_s: float) -> dict[str, Any]:
    """Seals every live file left in the staging ``run_dir`` (its writers closed: left spools the driver committed)
    and publishes every sealed segment, retrying until ``timeout_s``; returns the publisher's stats (a backlog left
    is reported, and stays in staging)."""
    import glob

    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "*.h5"))):
        try:
            segments.seal_or_drop(run_dir, path)
        except Exception as e:  # noqa: BLE001 - a damaged file stays in staging for 'recover'
            logger.warning("rllib_recorder: could not seal %s (%s: %s); it stays in %s", path, type(e).__name__, e,
                           run_dir)
    publisher = Publisher(run_dir, target, check=config.check_uploads, thread=False)
    publisher.drain(timeout_s)  # what is left is in the stats: the caller names it, once
    return publisher.stats()
