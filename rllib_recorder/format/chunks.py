"""The columnar chunk: what an env runner's samples become, what the spool carries and what a writer appends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from rllib_recorder.errors import ConversionError
from rllib_recorder.format.frames import (
    HEAD_PREFIX,
    decode_codes,
    encode_image,
    fragment_starts,
    image_like,
    repeats_frames,
    unstack_frames,
)

DEFAULT_AGENT = "default_agent"

EPS_ID_DTYPE = np.dtype("S36")


@dataclass(frozen=True)
class Stream:
    """The rows of one agent (or, on the old stack, one policy) in a chunk.

    ``steps`` maps column paths (``obs``, ``obs/pos``, ``actions``, ``rewards``,
    ...) to arrays with one row per step; ``fragments`` maps column paths to arrays
    with one row per episode fragment; ``containers`` marks nested groups
    (``{"obs": "dict"}``) so a reader can rebuild Dict and Tuple values.
    """

    steps: dict[str, np.ndarray]
    fragments: dict[str, np.ndarray]
    containers: dict[str, str] = field(default_factory=dict)
    # Columns the env runner sent as exact uint8 codes of float32 values (``uint8_stream``):
    # ``{"steps/obs": (scale, offset)}``; the float32 value of a code is ``code * scale + offset``.
    encoded: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Step columns held as frame stacks (``newest_frames``): ``{"obs": 4}``; the column holds each row's newest
    # frame (last axis of size 1) and ``fragments/head_<path>`` the older frames of each fragment's first row.
    stacked: dict[str, int] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.steps["rewards"])

    @property
    def held_nbytes(self) -> int:
        """Bytes of the arrays as they are held (encoded columns as codes, frame stacks as newest frames)."""
        return sum(a.nbytes for a in self.steps.values()) + sum(a.nbytes for a in self.fragments.values())

    @property
    def heads(self) -> set[str]:
        """The fragment columns that hold the head frames of the stacked step columns."""
        return {HEAD_PREFIX + path for path in self.stacked} if self.stacked else set()

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.steps.items())
        return f"Stream(rows={self.num_rows}, fragments={len(self.fragments['eps_id'])}, {cols})"


@dataclass(frozen=True)
class Chunk:
    """Everything one or more ``on_sample_end`` calls of one env runner produced."""

    streams: dict[str, Stream]
    env_steps: int
    num_samples: int = 1
    sampled_at_s: float = 0.0

    @property
    def agent_steps(self) -> int:
        return sum(s.num_rows for s in self.streams.values())

    @property
    def policy_versions(self) -> np.ndarray:
        """The behaviour-policy version of every step of every stream (-1: unknown)."""
        parts = [s.steps["weights_seq_no"] for s in self.streams.values() if "weights_seq_no" in s.steps]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the sampled arrays (encoded columns counted as the float32 they stand for, frame stacks as the
        full stacks of every row)."""
        total = 0
        for s in self.streams.values():
            if not s.encoded and not s.stacked:  # most streams: no image column, raw as held
                total += s.held_nbytes
                continue
            heads = s.heads
            for table, cols in (("steps", s.steps), ("fragments", s.fragments)):
                for path, a in cols.items():
                    if table == "fragments" and path in heads:
                        continue  # part of the stacks counted in full below
                    factor = (4 if f"{table}/{path}" in s.encoded else 1) * (
                        s.stacked.get(path, 1) if table == "steps" else 1)
                    total += a.nbytes * factor
        return total

    @property
    def held_nbytes(self) -> int:
        """Bytes of the arrays as held and sent (encoded columns as their uint8 codes, frame stacks as their newest
        frames): what coalescing holds in the env runner's memory, and what a hand-off carries."""
        return sum(s.held_nbytes for s in self.streams.values())

    def __repr__(self) -> str:
        return (
            f"Chunk(env_steps={self.env_steps}, agent_steps={self.agent_steps}, "
            f"samples={self.num_samples}, streams={self.streams!r})"
        )


def concat_streams(streams: Sequence[Stream]) -> Stream:
    """Concatenates streams of one agent row-wise; their columns must match.

    A column every stream holds as uint8 codes of the same grid stays encoded; one that some streams hold
    as codes and others as floats (or on another grid) is decoded where needed and concatenated as float32.
    """
    if len(streams) == 1:
        return streams[0]
    first = streams[0]
    stacked = {k: v for k, v in first.stacked.items() if all(s.stacked.get(k) == v for s in streams)}
    if any(s.stacked.keys() - stacked.keys() for s in streams):  # some parts hold full stacks: all do
        streams = [full_stacks(s, s.stacked.keys() - stacked.keys()) for s in streams]
        first = streams[0]
    for other in streams[1:]:
        if other.steps.keys() != first.steps.keys() or other.fragments.keys() != first.fragments.keys():
            missing = sorted(set(first.steps) ^ set(other.steps) | set(first.fragments) ^ set(other.fragments))
            raise ConversionError(
                f"cannot merge samples whose columns differ ({', '.join(missing)}); "
                "every episode of one agent must carry the same columns"
            )
    encoded = {k: v for k, v in first.encoded.items() if all(s.encoded.get(k) == v for s in streams)}

    def column(table: str, path: str) -> np.ndarray:
        key = f"{table}/{path}"
        parts = [getattr(s, table)[path] for s in streams]
        if key not in encoded and any(key in s.encoded for s in streams):
            parts = [decode_codes(a, *s.encoded[key]) if key in s.encoded else a for s, a in zip(streams, parts)]
        return np.concatenate(parts)

    return Stream(
        steps={k: column("steps", k) for k in first.steps},
        fragments={k: column("fragments", k) for k in first.fragments},
        containers={k: v for s in streams for k, v in s.containers.items()},
        encoded=encoded,
        stacked=stacked,
    )


def merge_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """Coalesces several chunks of one env runner into one (streams concatenated in order)."""
    if len(chunks) == 1:
        return chunks[0]
    keys: list[str] = []
    for chunk in chunks:
        keys.extend(k for k in chunk.streams if k not in keys)
    streams = {
        key: concat_streams([c.streams[key] for c in chunks if key in c.streams]) for key in keys
    }
    return Chunk(
        streams=streams,
        env_steps=sum(c.env_steps for c in chunks),
        num_samples=sum(c.num_samples for c in chunks),
        sampled_at_s=chunks[0].sampled_at_s,
    )


def uint8_chunk(chunk: Chunk) -> Chunk:
    """``chunk`` with every float32 image column that holds exact uint8 codes as uint8 (``uint8_stream``)."""
    return Chunk(streams={key: uint8_stream(s) for key, s in chunk.streams.items()}, env_steps=chunk.env_steps,
                 num_samples=chunk.num_samples, sampled_at_s=chunk.sampled_at_s)


def uint8_stream(stream: Stream) -> Stream:
    """``stream`` with every float32 image column (3 or more dims) that holds exact uint8 codes as uint8.

    Runs in the env runner on each episode's columns as they are converted (``ConvertOptions.encode_images``):
    a quarter of the bytes to concatenate when samples are coalesced, through the object store and in the
    outbox's window, and the writer need not check the frames. A column that is not exact stays float32 (the
    writer then checks it, and falls back as before). Lossless either way.
    """
    if not any(image_like(v) for cols in (stream.steps, stream.fragments) for v in cols.values()):
        return stream  # no image column (checked once per episode: most envs have none)
    encoded = dict(stream.encoded)
    tables = {}
    for table, columns in (("steps", stream.steps), ("fragments", stream.fragments)):
        out = dict(columns)
        for path, values in columns.items():
            key = f"{table}/{path}"
            found = None if key in encoded else encode_image(values)
            if found is not None:
                codes, (scale, offset) = found
                out[path], encoded[key] = codes, (float(scale), float(offset))
        tables[table] = out
    return Stream(tables["steps"], tables["fragments"], dict(stream.containers), encoded)


MAX_STACK = 16


def newest_frames(stream: Stream, lengths: Sequence[int]) -> Stream:
    """``stream`` with each observation column that is a stack of frames (4+ dims, last axis 2..MAX_STACK, each row
    repeating the row before shifted by one frame within each fragment) held as its newest frames.

    ``lengths``: the rows of each fragment, in order (a fragment's first row has no row before it: its older
    frames go to ``fragments/head_<path>``). Columns stacked already, and every other column, are left as they are.
    """
    found: dict[str, int] = {}
    for path, values in stream.steps.items():
        if (path.startswith("obs") and path not in stream.stacked and values.ndim >= 4
                and 2 <= values.shape[-1] <= MAX_STACK and values.dtype.kind in "biuf" and len(values)
                and repeats_frames(values, lengths)):
            found[path] = values.shape[-1]
    if not found:
        return stream
    steps, fragments, encoded = dict(stream.steps), dict(stream.fragments), dict(stream.encoded)
    firsts = fragment_starts(lengths)
    for path in found:
        values = stream.steps[path]
        steps[path] = np.ascontiguousarray(values[..., -1:])
        fragments[HEAD_PREFIX + path] = np.ascontiguousarray(values[firsts, ..., :-1])
        if f"steps/{path}" in encoded:
            encoded[f"fragments/{HEAD_PREFIX}{path}"] = encoded[f"steps/{path}"]
    return Stream(steps, fragments, dict(stream.containers), encoded, {**stream.stacked, **found})


def full_stacks(stream: Stream, paths: Iterable[str]) -> Stream:
    """``stream`` with the stacked columns ``paths`` rebuilt as full stacks (their head columns dropped)."""
    paths = [p for p in paths if p in stream.stacked]
    if not paths:
        return stream
    steps, fragments, encoded = dict(stream.steps), dict(stream.fragments), dict(stream.encoded)
    # an episode's part in _episodes_stream has no fragment table yet: it is one fragment
    lengths = stream.fragments["num_rows"] if "num_rows" in stream.fragments else [stream.num_rows]
    firsts = fragment_starts(lengths)
    for path in paths:
        heads = fragments.pop(HEAD_PREFIX + path)
        head_code = encoded.pop(f"fragments/{HEAD_PREFIX}{path}", None)
        step_code = encoded.get(f"steps/{path}")
        if head_code != step_code:  # one of them was sent as codes, the other as floats: both as floats
            heads = decode_codes(heads, *head_code) if head_code else heads
            steps[path] = decode_codes(steps[path], *step_code) if step_code else steps[path]
            encoded.pop(f"steps/{path}", None)
        steps[path] = unstack_frames(steps[path], 0, heads, firsts, 0, len(steps[path]))
    stacked = {k: v for k, v in stream.stacked.items() if k not in paths}
    return Stream(steps, fragments, dict(stream.containers), encoded, stacked)
