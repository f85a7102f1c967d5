"""A run's steps as numpy batches for your own training loop: read block by block, shuffled in a bounded buffer.

Memory holds one block of rows per column (``block_rows``), the shuffle buffer and one batch, whatever the size of
the run. Columns are the stored step columns by path (``obs``, ``obs/pos``, ``actions``, ``rewards``,
``extra_model_outputs/vf_preds``, ...) and these derived ones:

* ``next_obs`` (``next_obs/pos``, ...): the observation after each step: the next row of its fragment, the stored
  final observation of the fragment, or the first row of the fragment that continues its episode;
  ``has_next_obs`` is False where none of them is stored (the observation itself is given there);
* ``policy_lag``: learner version minus behaviour version (-1: unknown; docs/FORMAT.md, "Policy lag");
* ``worker_index``, ``agent_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from rllib_recorder.errors import ConversionError
from rllib_recorder.format import h5file
from rllib_recorder.format.lag import rows_learner_version, step_lags
from rllib_recorder.read.episodes import BLOCK_BYTES, BLOCK_ROWS
from rllib_recorder.read.worker_file import WorkerFile, read_node

DERIVED = ("next_obs", "has_next_obs", "policy_lag", "worker_index", "agent_id")


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of one agent's steps in one file: a unit of reading."""

    file: WorkerFile
    agent: str
    start: int
    stop: int


def blocks_of(files: Sequence[WorkerFile], block_bytes: int = BLOCK_BYTES, multiple: int = 1,
              columns: Sequence[str] | None = None) -> list[Block]:
    """Every file's every agent's committed rows, in blocks of at most ``BLOCK_ROWS`` rows and about
    ``block_bytes`` bytes of step columns as the reader gives them (uint8 codes as float32, stacks rebuilt), or
    of ``multiple`` rows if those are more; a whole number of ``multiple`` rows (batches are cut from a block
    without a copy, and a batch spans two blocks only where a file or agent ends)."""
    out = []
    for f in files:
        for agent in f.agents:
            rows = f.num_rows(agent)
            asked = None if columns is None else [c[len("next_"):] if c.startswith("next_") else c for c in columns]
            step = int(min(BLOCK_ROWS, max(1, block_bytes // f.row_bytes(agent, asked))))
            step = max(multiple, step // multiple * multiple)
            out += [Block(f, agent, a, min(a + step, rows)) for a in range(0, rows, step)]
    return out


def read_block(block: Block, columns: Sequence[str], decode: bool = True) -> dict[str, np.ndarray]:
    """The asked columns of one block (flat paths; derived ones computed from the fragment index). ``decode``
    False leaves image columns stored as uint8 codes as codes (``WorkerFile.encoding`` says how to decode)."""
    f, agent, a, b = block.file, block.agent, block.start, block.stop
    stored = f.column_paths(agent)
    with h5file.damaged_file_errors(f.path):
        out: dict[str, np.ndarray] = {}
        for path in columns:
            if path in stored:
                out[path] = f.column(agent, path, slice(a, b), decode=decode)
            elif path not in DERIVED and not path.startswith("next_obs"):
                raise ConversionError(f"{f.path} has no step column {path!r} for agent {agent!r}; it has "
                                      f"{', '.join(stored)} and the derived {', '.join(DERIVED)}")
        if any(c.startswith("next_obs") or c == "has_next_obs" for c in columns):
            paths = [p for p in stored if p.split("/")[0] == "obs"]
            next_obs, has_next = _next_obs(f, agent, a, b, paths, {p: out[p] for p in paths if p in out}, decode)
            out.update({"next_" + p: v for p, v in next_obs.items() if "next_" + p in columns or "next_obs" in columns})
            if "has_next_obs" in columns:
                out["has_next_obs"] = has_next
        if "policy_lag" in columns:
            out["policy_lag"] = step_lags(_learner_rows(f, agent, a, b), f.column(agent, "weights_seq_no", slice(a, b)))
        if "worker_index" in columns:
            out["worker_index"] = np.full(b - a, f.worker_index, np.int64)
        if "agent_id" in columns:
            out["agent_id"] = np.full(b - a, agent)
    return out


def _fragment_span(f: WorkerFile, agent: str, a: int, b: int) -> tuple[int, int, dict[str, np.ndarray]]:
    """(lo, hi, columns) of the fragments that hold rows ``[a, b)`` (fragments are stored in row order)."""
    group = f.h5[f"agents/{agent}/fragments"]
    count = f.commit["agents"].get(agent, (0, 0))[1]
    first_rows = group["first_row"][:count]
    lo = max(int(np.searchsorted(first_rows, a, "right")) - 1, 0)
    hi = int(np.searchsorted(first_rows, b, "left"))
    names = ("eps_id", "t_start", "num_rows", "first_row", "batch", "has_last_obs")
    return lo, hi, {k: group[k][lo:hi] for k in names if k in group}


def _learner_rows(f: WorkerFile, agent: str, a: int, b: int) -> np.ndarray:
    versions = f.learner_version_column()
    if versions is None:
        return np.full(b - a, -1, np.int64)
    return rows_learner_version(_fragment_span(f, agent, a, b)[2], versions, b - a, start=a)


def _next_obs(f: WorkerFile, agent: str, a: int, b: int, paths: list[str], read: dict[str, np.ndarray],
              decode: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per observation path, the observation after each row of ``[a, b)``, and whether it is stored; ``read``:
    the paths' rows ``[a, b)`` where already read (only row ``b`` is read more)."""
    lo, hi, frags = _fragment_span(f, agent, a, b)
    rows = f.num_rows(agent)
    nxt = {}
    for p in paths:
        if p in read:  # rows a+1 .. b-1 are read: one more row
            more = f.column(agent, p, slice(b, min(b + 1, rows)), decode=decode)
            ahead = np.concatenate([read[p][1:], more])
        else:
            ahead = f.column(agent, p, slice(a + 1, min(b + 1, rows)), decode=decode)  # rows a+1 .. b
        nxt[p] = (ahead if len(ahead) == b - a
                  else np.concatenate([ahead, np.zeros(((b - a) - len(ahead),) + ahead.shape[1:], ahead.dtype)]))
    has = np.ones(b - a, bool)
    group = f.h5[f"agents/{agent}/fragments"]
    last_obs = read_node(group["last_obs"], slice(lo, hi), decode) if "last_obs" in group and hi > lo else None
    for i, (first, n) in enumerate(zip(frags["first_row"].tolist(), frags["num_rows"].tolist())):
        end = first + n - 1  # the fragment's last row: its next observation is not the next row
        if not a <= end < b:
            continue
        row = None
        if frags["has_last_obs"][i] and last_obs is not None:
            row = {p: _at(last_obs, p)[i:i + 1] for p in paths}
        else:
            follow = _continuation(f, agent, frags["eps_id"][i], int(frags["t_start"][i]) + n)
            if follow is not None:
                row = {p: f.column(agent, p, slice(follow, follow + 1), decode=decode) for p in paths}
        if row is None:
            has[end - a] = False
            row = {p: f.column(agent, p, slice(end, end + 1), decode=decode) for p in paths}
        for p in paths:
            nxt[p][end - a] = row[p][0]
    return nxt, has


def _at(value: Any, path: str) -> np.ndarray:
    """The part ``path`` (``obs`` or ``obs/pos``) of an observation read as a nested value."""
    for key in path.split("/")[1:]:
        value = value[int(key)] if isinstance(value, tuple) else value[key]
    return value


def _continuation(f: WorkerFile, agent: str, eps_id: bytes, t: int) -> int | None:
    """The first row of the fragment of episode ``eps_id`` that starts at step ``t``, if this file holds it."""
    frags = f.fragments(agent)
    where = np.flatnonzero((frags["eps_id"] == eps_id) & (frags["t_start"] == t))
    return int(frags["first_row"][where[0]]) if len(where) else None


def iter_batches(files: Sequence[WorkerFile], batch_size: int, *, columns: Sequence[str] | None = None,
                 shuffle: bool = False, buffer_rows: int = 65_536, buffer_bytes: int = 256 << 20,
                 seed: int | None = None, drop_last: bool = False, block_bytes: int = BLOCK_BYTES,
                 shard: tuple[int, int] | None = None, decode: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``batch_size`` rows (the last one smaller unless ``drop_last``), as dicts of numpy arrays.

    ``shuffle``: blocks are read in a random order and rows leave a buffer of at most ``buffer_rows`` rows and
    ``buffer_bytes`` bytes at random, so memory stays bounded whatever the run's size (in order: a block of
    ``block_bytes`` or one batch, whichever is larger, and the batch); ``seed`` makes the order
    repeatable. Without it, rows come file by file, agent by agent, in stored order. ``block_bytes``: how much is
    read at once. ``shard=(i, n)``: only every n-th block from the i-th, so n readers (data loader workers) read
    every row once between them. ``decode=False``: image columns stored as uint8 codes (Atari frames) come as
    those codes, stacks rebuilt (a quarter of the bytes: decode on the GPU with ``WorkerFile.encoding``).
    """
    if batch_size < 1:
        raise ConversionError(f"batch_size must be at least 1; it is {batch_size}")
    blocks = blocks_of(files, block_bytes, 1 if shuffle else batch_size, columns)
    if shard is not None:
        index, count = shard
        if not 0 <= index < count:
            raise ConversionError(f"shard must be (index, count) with 0 <= index < count; it is {shard}")
        blocks = blocks[index::count]
    if not blocks:
        return
    columns = list(columns) if columns is not None else [*blocks[0].file.column_paths(blocks[0].agent), "policy_lag"]
    if not shuffle:
        yield from _in_order((read_block(b, columns, decode) for b in blocks), batch_size, drop_last)
        return
    rng = np.random.default_rng(seed)
    buffer: _ShuffleBuffer | None = None
    for i in rng.permutation(len(blocks)):
        block = read_block(blocks[i], columns, decode)
        if buffer is None:
            row_bytes = max(1, sum(v[:1].nbytes for v in block.values()))
            buffer = _ShuffleBuffer(max(batch_size, min(buffer_rows, buffer_bytes // row_bytes)), rng)
        buffer.add(block)
        while buffer.rows >= buffer.capacity + batch_size:
            yield buffer.take(batch_size)
    while buffer is not None and (buffer.rows >= batch_size or (buffer.rows and not drop_last)):
        yield buffer.take(min(batch_size, buffer.rows))


def _in_order(blocks: Iterator[dict[str, np.ndarray]], batch_size: int,
              drop_last: bool) -> Iterator[dict[str, np.ndarray]]:
    """Batches cut from blocks in order; a batch that spans blocks is the only copy made."""
    parts: list[dict[str, np.ndarray]] = []
    held = 0
    for block in blocks:
        n = len(next(iter(block.values())))
        if not n:
            continue
        at = 0
        if parts:  # a batch begun in the blocks before: completed from this one
            if held + n < batch_size:
                parts.append(block)
                held += n
                continue
            at = batch_size - held
            parts.append({key: v[:at] for key, v in block.items()})
            yield _cut(parts, batch_size)
            held = 0
        items = list(block.items())
        while at + batch_size <= n:  # whole batches of this block: views, no dict of the rest made each time
            yield {key: v[at:at + batch_size] for key, v in items}
            at += batch_size
        if at < n:
            parts.append({key: v[at:] for key, v in items})
            held = n - at
    if held and not drop_last:
        yield _cut(parts, held)


def _cut(parts: list[dict[str, np.ndarray]], k: int) -> dict[str, np.ndarray]:
    """The first ``k`` rows of ``parts`` (removed from them): a view when one part holds them all."""
    first = parts[0]
    n = len(next(iter(first.values())))
    if n >= k:
        parts[0] = {key: v[k:] for key, v in first.items()}
        if n == k:
            parts.pop(0)
        return {key: v[:k] for key, v in first.items()}
    taken, pieces = 0, []
    while taken < k:
        part = parts[0]
        m = len(next(iter(part.values())))
        use = min(m, k - taken)
        pieces.append({key: v[:use] for key, v in part.items()})
        if use == m:
            parts.pop(0)
        else:
            parts[0] = {key: v[use:] for key, v in part.items()}
        taken += use
    return {key: np.concatenate([p[key] for p in pieces]) for key in pieces[0]}


class _ShuffleBuffer:
    """Rows in preallocated arrays; a batch takes random rows and the rows at the end fill their places."""

    def __init__(self, capacity: int, rng: np.random.Generator) -> None:
        self.capacity, self.rng = capacity, rng
        self.arrays: dict[str, np.ndarray] = {}
        self.rows = 0

    def add(self, block: dict[str, np.ndarray]) -> None:
        n = len(next(iter(block.values())))
        if not self.arrays:
            self.arrays = {k: np.empty((self.capacity + n,) + v.shape[1:], v.dtype) for k, v in block.items()}
        for key, values in block.items():
            held = self.arrays[key]
            if self.rows + n > len(held):
                grown = np.empty((n,) + held.shape[1:], held.dtype)
                held = self.arrays[key] = np.concatenate([held[:self.rows], grown])
            held[self.rows:self.rows + n] = values
        self.rows += n

    def take(self, k: int) -> dict[str, np.ndarray]:
        n = self.rows
        picked = np.sort(self.rng.choice(n, k, replace=False))
        holes = picked[picked < n - k]
        movers = np.setdiff1d(np.arange(n - k, n), picked, assume_unique=True)
        out = {}
        for key, held in self.arrays.items():
            out[key] = held[picked]
            held[holes] = held[movers]
        self.rows = n - k
        return out
