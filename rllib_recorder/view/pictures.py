"""The picture at each step of an episode: stored frames cut from the file by step range (as uint8, exactly as
stored), or the env's own pictures re-simulated from the start state, kept as PNGs in a bounded cache."""

from __future__ import annotations

import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from rllib_recorder.read.worker_file import WorkerFile

# Frames one request may ask for (84x84 Atari frames: 7 KB each).
MAX_FRAMES = 1024
# Bytes of re-simulated pictures (PNG) the server keeps, over all episodes; the least recently used go first.
PICTURE_CACHE_BYTES = 64 << 20


def episode_rows(frags: dict[str, np.ndarray], eps_id: str) -> list[tuple[int, int]]:
    """The file rows ``[first, end)`` of the episode's fragments (``frags``: its agent's episode index), in step
    order."""
    where = np.flatnonzero(frags["eps_id"] == eps_id.encode())
    where = where[np.argsort(frags["t_start"][where], kind="stable")]
    return [(int(frags["first_row"][i]), int(frags["first_row"][i] + frags["num_rows"][i])) for i in where]


def newest(frames: np.ndarray) -> np.ndarray:
    """The picture of each stored observation: grey (H, W) as it is, colour (H, W, 3) as it is, a stack of frames
    on the last axis its newest frame (as ``render`` draws them)."""
    if frames.ndim == 3 or frames.shape[-1] == 3:
        return frames
    return frames[..., -1]


def frames(f: WorkerFile, agent: str, frags: dict[str, np.ndarray], eps_id: str, start: int,
           count: int) -> tuple[np.ndarray, int]:
    """The stored pictures of steps ``[start, start + count)`` of the episode (uint8, rows of (H, W) or (H, W, 3)),
    read only from the fragments that hold them (``frags``: the agent's episode index); and the episode's number
    of steps."""
    pieces, offset = [], 0
    spans = episode_rows(frags, eps_id)
    end = start + min(count, MAX_FRAMES)
    for first, stop in spans:
        n = stop - first
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            codes = f.column(agent, "obs", slice(first + lo - offset, first + hi - offset), decode=False)
            pieces.append(newest(np.asarray(codes)))
        offset += n
    if not pieces:
        raise KeyError(f"episode {eps_id!r} has no steps from {start}")
    return np.ascontiguousarray(np.concatenate(pieces)), offset


def png(picture: np.ndarray) -> bytes:
    """A lossless PNG of an (H, W) grey or (H, W, 3) colour uint8 picture (zlib alone: no imaging library)."""
    picture = np.ascontiguousarray(picture, np.uint8)
    height, width = picture.shape[:2]
    colour = 2 if picture.ndim == 3 else 0
    raw = np.zeros((height, 1 + picture[0].size), np.uint8)  # filter byte 0 (none) before every row
    raw[:, 1:] = picture.reshape(height, -1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 1))
            + chunk(b"IEND", b""))


@dataclass
class _Simulation:
    """An episode being re-simulated: its pictures so far as PNGs, and what makes the next ones."""

    pictures: Iterator[np.ndarray] | None
    made: list[bytes] = field(default_factory=list)
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.made)


class Simulations:
    """Re-simulated pictures by episode, made as far as asked for and kept within ``PICTURE_CACHE_BYTES``."""

    def __init__(self, budget_bytes: int = PICTURE_CACHE_BYTES) -> None:
        self.budget = budget_bytes
        self._episodes: OrderedDict[Any, _Simulation] = OrderedDict()
        self._lock = threading.Lock()

    def picture(self, key: Any, t: int, start: Callable[[], Iterator[np.ndarray]]) -> bytes:
        """The PNG of step ``t``; ``start()`` gives the episode's pictures from its first step when it is not
        under way. IndexError past the episode's end; RuntimeError (its message) when the env can't draw."""
        with self._lock:
            simulation = self._episodes.get(key)
            if simulation is None:
                simulation = self._episodes[key] = _Simulation(None)
            self._episodes.move_to_end(key)
        with simulation.lock:
            if simulation.pictures is None and simulation.error is None and not simulation.made:
                try:
                    simulation.pictures = start()
                except Exception as e:  # the env could not be made: said on the page, in one line
                    simulation.error = _one_line(e)
            while len(simulation.made) <= t and simulation.pictures is not None:
                try:
                    picture = next(simulation.pictures, None)
                except Exception as e:  # the user's env, or a start state it can't take
                    picture, simulation.error = None, _one_line(e)
                if picture is None:
                    simulation.pictures = None
                    break
                simulation.made.append(png(picture))
            if t < len(simulation.made):
                found = simulation.made[t]
            elif simulation.error:
                raise RuntimeError(simulation.error)
            else:
                raise IndexError(f"the episode has {len(simulation.made)} pictures")
        self._trim()
        return found

    def _trim(self) -> None:
        with self._lock:
            total = sum(s.nbytes for s in self._episodes.values())
            while total > self.budget and self._episodes:  # one episode over budget: made again when asked
                _, dropped = self._episodes.popitem(last=False)
                total -= dropped.nbytes


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split()) if not str(error) else " ".join(str(error).split())
