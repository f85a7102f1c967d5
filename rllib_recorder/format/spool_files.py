"""Where the spool lives in a run directory: names of its folders and segments, and writing a segment."""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

SPOOL_DIR = ".spool"

SEGMENT_SUFFIX = ".spool"

_STEM = re.compile(r"^(eval-)?worker-(\d{3,9})(\.node\d{1,6})?$")

_SENDER = re.compile(r"^[0-9a-f]{8,64}$")

_SEGMENT = re.compile(r"^(\d{6,12})\.spool$")

_IOV_MAX = 512


def parse_stem(stem: str) -> tuple[int, bool, str] | None:
    """(worker index, is evaluation, node tag) of a spool stem, or None if it is not one."""
    match = _STEM.match(stem)
    if match is None:
        return None
    return int(match.group(2)), bool(match.group(1)), (match.group(3) or "").lstrip(".")


def segment_name(index: int) -> str:
    return f"{index:06d}{SEGMENT_SUFFIX}"


def segment_index(name: str) -> int | None:
    match = _SEGMENT.match(name)
    return int(match.group(1)) if match else None


def is_sender_id(name: str) -> bool:
    return bool(_SENDER.match(name))


class SegmentWriter:
    """Appends records to one sender's spool segments (the env runner's side); not thread-safe."""

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} holds an open spool segment and can't be pickled: "
                        "create it in the process that hands samples over")

    def __init__(self, directory: str, segment_bytes: int = 16 << 20) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        os.makedirs(directory, exist_ok=True)
        self.segments: list[tuple[int, int]] = []  # (index, bytes) of segments not known to be deleted
        self._fd: int | None = None

    def write(self, buffers: list[Any]) -> int:
        """Appends one record (``encode_record``); returns its size. Raises OSError when it can't."""
        size = sum(memoryview(b).nbytes for b in buffers)
        if self._fd is None or (self.segments[-1][1] and self.segments[-1][1] + size > self.segment_bytes):
            self._next_segment()
        index, before = self.segments[-1]
        written = 0
        try:
            for i in range(0, len(buffers), _IOV_MAX):
                written += os.writev(self._fd, buffers[i:i + _IOV_MAX])
            if written != size:  # a short write to a regular file: out of space
                raise OSError(28, f"wrote {written} of {size} bytes into the spool in {self.directory}")
        except OSError:
            self._cut_back(before)
            raise
        self.segments[-1] = (index, before + size)
        return size

    def _cut_back(self, before: int) -> None:
        """After a failed write: drop its torn bytes, and go on in a new segment (the reader skips a torn tail
        of a segment that has a successor, so even a cut that fails leaves the spool readable)."""
        try:
            os.ftruncate(self._fd, before)
        except OSError:
            pass
        self.close()

    def backlog_bytes(self) -> int:
        """Bytes in this sender's segments the writer has not deleted yet (it deletes what it committed)."""
        self.segments = [s for i, s in enumerate(self.segments)
                         if i == len(self.segments) - 1 or os.path.exists(self._path(s[0]))]
        return sum(n for _, n in self.segments)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _next_segment(self) -> None:
        self.close()
        index = self.segments[-1][0] + 1 if self.segments else 0
        self._fd = os.open(self._path(index), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o666)
        self.segments.append((index, 0))

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, segment_name(index))


def sender_dirs(run_dir: str) -> Iterator[tuple[str, str, str]]:
    """(stem, sender id, directory) of every sender spool under ``run_dir`` (names not of our form skipped)."""
    root = os.path.join(run_dir, SPOOL_DIR)
    try:
        stems = sorted(os.listdir(root))
    except OSError:
        return
    for stem in stems:
        if parse_stem(stem) is None:
            continue
        try:
            senders = sorted(os.listdir(os.path.join(root, stem)))
        except OSError:
            continue
        for sender in senders:
            if is_sender_id(sender):
                yield stem, sender, os.path.join(root, stem, sender)


def segments_of(directory: str) -> list[int]:
    """The segment indexes in a sender's spool directory, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(i for i in map(segment_index, names) if i is not None)
