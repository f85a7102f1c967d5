"""Pure conversion of RLlib samples (episodes, SampleBatch, MultiAgentBatch) into columnar chunks."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rllib_recorder.errors import ConversionError

DEFAULT_AGENT = "default_agent"
EPS_ID_DTYPE = np.dtype("S36")
# Where on_episode_start leaves (kind, bytes) of the env's start state in ``episode.custom_data``.
START_STATE_KEY = "rllib_recorder.start_state"
# SampleBatch columns with a fixed place in the schema; every other per-row column
# of an old-stack batch is kept under extra_model_outputs/.
_OLD_STACK_KNOWN = {
    "obs", "new_obs", "actions", "rewards", "terminateds", "truncateds", "infos",
    "eps_id", "t", "unroll_id", "agent_index", "weights_seq_no", "dones",
}  # fmt: skip


@dataclass
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
    # Columns the env runner sent as exact uint8 codes of float32 values (``encode_stream``):
    # ``{"steps/obs": (scale, offset)}``; the float32 value of a code is ``code * scale + offset``.
    encoded: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Step columns held as frame stacks (``stack_frames``): ``{"obs": 4}``; the column holds each row's newest
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


@dataclass
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


@dataclass(frozen=True)
class ConvertOptions:
    """What to keep when converting (mirrors the recorder settings)."""

    record_infos: bool = True
    record_extra_model_outputs: bool = True
    # Send exact-uint8 float32 images as uint8 codes, encoded per episode before anything is concatenated.
    encode_images: bool = False
    # Send frame-stacked observations as their newest frames (``stack_frames``), per episode.
    stack_frames: bool = False


def episodes_to_chunk(
    episodes: Sequence[Any], options: ConvertOptions = ConvertOptions(), sampled_at_s: float = 0.0
) -> Chunk:
    """Converts new-stack ``SingleAgentEpisode``/``MultiAgentEpisode`` fragments to a chunk."""
    parts: dict[str, list[tuple[Any, str, Any]]] = {}  # agent key -> (episode, episode id, module id)
    env_steps = 0
    for episode in episodes:
        if hasattr(episode, "agent_episodes"):
            env_steps += int(episode.env_steps())
            for agent_id, agent_episode in episode.agent_episodes.items():
                if len(agent_episode) == 0:
                    continue
                parts.setdefault(str(agent_id), []).append((agent_episode, str(episode.id_), agent_episode.module_id))
        else:
            env_steps += len(episode)
            if len(episode) == 0:
                continue
            parts.setdefault(_agent_key(episode.agent_id), []).append((episode, str(episode.id_), episode.module_id))
    streams = {key: _episodes_stream(group, options) for key, group in parts.items()}
    return Chunk(streams=streams, env_steps=env_steps, sampled_at_s=sampled_at_s)


def batch_to_chunk(
    batch: Any, options: ConvertOptions = ConvertOptions(), policy_version: int = -1,
    sampled_at_s: float = 0.0,
) -> Chunk:
    """Converts an old-stack ``SampleBatch`` or ``MultiAgentBatch`` to a chunk.

    A ``MultiAgentBatch`` gives one stream per policy; its rows keep their
    ``agent_index``. ``policy_version`` is the worker's ``weights_seq_no``.
    """
    if hasattr(batch, "policy_batches"):
        policy_batches, env_steps = batch.policy_batches, int(batch.env_steps())
    else:
        policy_batches, env_steps = {"default_policy": batch}, len(batch["rewards"])
    single_agent = list(policy_batches) == ["default_policy"] and not np.any(
        np.asarray(policy_batches["default_policy"].get("agent_index", 0))
    )
    streams = {
        DEFAULT_AGENT if single_agent else str(policy_id): _sample_batch_stream(
            policy_batch, str(policy_id), options, policy_version
        )
        for policy_id, policy_batch in policy_batches.items()
        if len(policy_batch["rewards"])
    }
    if options.encode_images:
        streams = {key: encode_stream(stream) for key, stream in streams.items()}
    return Chunk(streams=streams, env_steps=env_steps, sampled_at_s=sampled_at_s)


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
        streams = [unstack_stream(s, s.stacked.keys() - stacked.keys()) for s in streams]
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


# (scale, offset) of the float32 images RLlib's wrappers make from uint8 frames: u8 / 128 - 1 (Atari) and u8 / 255.
IMAGE_ENCODINGS = ((np.float32(1 / 128), np.float32(-1.0)), (np.float32(1 / 255), np.float32(0.0)))


def encode_uint8(values: np.ndarray, scale: np.float32, offset: np.float32, block_rows: int = 8) -> np.ndarray | None:
    """The uint8 codes of float32 ``values`` if every value is exactly ``code * scale + offset``, else None.

    Works in blocks of rows that stay in the CPU cache (about 6x faster than whole-array passes on
    Atari chunks); a value out of range, not on the grid or NaN fails the round trip.
    """
    out = np.empty(values.shape, np.uint8)
    inv, shift = np.float32(1 / scale), np.float32(-offset / scale)
    scratch = np.empty(values[:block_rows].shape, np.float32)
    with np.errstate(invalid="ignore"):
        for i in range(0, len(values), block_rows):
            rows = values[i:i + block_rows]
            tmp, codes = scratch[:len(rows)], out[i:i + block_rows]
            np.multiply(rows, inv, out=tmp)
            tmp += shift
            np.copyto(codes, tmp, casting="unsafe")
            np.multiply(codes, scale, out=tmp)
            tmp += offset
            if not np.array_equal(tmp, rows):
                return None
    return out


def decode_codes(codes: np.ndarray, scale: float, offset: float) -> np.ndarray:
    """The float32 values of uint8 ``codes`` (exact inverse of ``encode_uint8``)."""
    out = codes.astype(np.float32)
    out *= np.float32(scale)
    out += np.float32(offset)
    return out


def encode_image(values: np.ndarray) -> tuple[np.ndarray, tuple[np.float32, np.float32]] | None:
    """(uint8 codes, (scale, offset)) of a float32 image column (3 or more dims) that lies exactly on one of
    ``IMAGE_ENCODINGS``, else None.

    Grids are tried in order, each only if the first row lies on it; a row of zeros lies on both (black in
    ``u8 / 255``, code 128 in ``u8 / 128 - 1``), so a column is checked whole against each such grid.
    """
    if not _image_like(values) or not len(values):
        return None
    for scale, offset in IMAGE_ENCODINGS:
        if encode_uint8(values[:1], scale, offset) is not None:
            codes = encode_uint8(values, scale, offset)
            if codes is not None:
                return codes, (scale, offset)
    return None


def _image_like(values: np.ndarray) -> bool:
    """A float32 column of 3 or more dims: the only kind ``encode_image`` may store as uint8."""
    return values.dtype == np.float32 and values.ndim >= 3


def image_grid(values: np.ndarray) -> tuple[np.float32, np.float32] | None:
    """The (scale, offset) of ``IMAGE_ENCODINGS`` on which every value of a float32 image column lies, if any."""
    encoded = encode_image(values)
    return None if encoded is None else encoded[1]


def encode_images(chunk: Chunk) -> Chunk:
    """``chunk`` with every float32 image column that holds exact uint8 codes as uint8 (``encode_stream``)."""
    return Chunk(streams={key: encode_stream(s) for key, s in chunk.streams.items()}, env_steps=chunk.env_steps,
                 num_samples=chunk.num_samples, sampled_at_s=chunk.sampled_at_s)


def encode_stream(stream: Stream) -> Stream:
    """``stream`` with every float32 image column (3 or more dims) that holds exact uint8 codes as uint8.

    Runs in the env runner on each episode's columns as they are converted (``ConvertOptions.encode_images``):
    a quarter of the bytes to concatenate when samples are coalesced, through the object store and in the
    outbox's window, and the writer need not check the frames. A column that is not exact stays float32 (the
    writer then checks it, and falls back as before). Lossless either way.
    """
    if not any(_image_like(v) for cols in (stream.steps, stream.fragments) for v in cols.values()):
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


# Frame stacks. RLlib's Atari wrappers (and others) observe the K latest frames stacked on the last axis,
# (84, 84, 4): each row repeats K - 1 frames of the row before. Such a column is sent and stored as the newest
# frame of each row (last axis of size 1) plus, per fragment, the K - 1 older frames of its first row
# (``fragments/head_<path>``), a quarter of the bytes to send, compress and store for K = 4. Lossless: every
# chunk is checked, and a column whose rows do not repeat their frames stays as full stacks.
HEAD_PREFIX = "head_"
MAX_STACK = 16


def stack_frames(stream: Stream, lengths: Sequence[int]) -> Stream:
    """``stream`` with each observation column that is a stack of frames (4+ dims, last axis 2..MAX_STACK, each row
    repeating the row before shifted by one frame within each fragment) held as its newest frames.

    ``lengths``: the rows of each fragment, in order (a fragment's first row has no row before it: its older
    frames go to ``fragments/head_<path>``). Columns stacked already, and every other column, are left as they are.
    """
    found: dict[str, int] = {}
    for path, values in stream.steps.items():
        if (path.startswith("obs") and path not in stream.stacked and values.ndim >= 4
                and 2 <= values.shape[-1] <= MAX_STACK and values.dtype.kind in "biuf" and len(values)
                and _repeats_frames(values, lengths)):
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


def fragment_starts(lengths: Sequence[int], start: int = 0) -> np.ndarray:
    """The first row of each of consecutive fragments of ``lengths`` rows, the first at row ``start``."""
    return start + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def _repeats_frames(values: np.ndarray, lengths: Sequence[int]) -> bool:
    """Whether each row but a fragment's first holds the row before's frames 1.. as its frames ..-1, bit for bit."""
    if len(lengths) == 0 or min(lengths) < 1 or sum(lengths) != len(values):
        return False
    start = 0
    for n in lengths:
        if n > 1 and not _rows_repeat(values[start:start + n]):
            return False
        start += n
    return True


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rows_repeat(rows: np.ndarray, block_rows: int = 8) -> bool:
    """``_repeats_frames`` of one fragment. A pixel's stack of 2, 4 or 8 bytes is compared as one integer (older
    frames shifted down against newer ones masked), in blocks of rows that stay in the CPU cache: 0.6 ms for 200
    Atari rows, against 10 ms for one strided comparison of the whole arrays."""
    k, size = rows.shape[-1], rows.itemsize
    word = _WORDS.get(k * size) if sys.byteorder == "little" and rows.flags.c_contiguous else None
    if word is not None:
        packed = rows.view(word)[..., 0]
        shift, mask = word(8 * size), word((1 << (8 * size * (k - 1))) - 1)
        for i in range(1, len(packed), block_rows):
            cur = packed[i:i + block_rows]
            if not np.array_equal(cur & mask, packed[i - 1:i - 1 + len(cur)] >> shift):
                return False
        return True
    bits = rows.view(f"u{size}")  # bit-exact: -0.0 is not 0.0, a NaN equals itself
    for i in range(1, len(bits), block_rows):
        cur = bits[i:i + block_rows]
        if not np.array_equal(cur[..., :-1], bits[i - 1:i - 1 + len(cur), ..., 1:]):
            return False
    return True


def unstack_stream(stream: Stream, paths: Iterable[str]) -> Stream:
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


def unstack_frames(newest: np.ndarray, newest_start: int, heads: np.ndarray, first_rows: Sequence[int],
                   start: int, stop: int) -> np.ndarray:
    """The full frame stacks of rows ``start:stop`` of a stacked column.

    ``newest``: the stored rows (last axis of size 1) from row ``newest_start`` to ``stop``; it must begin at or
    before ``max(start - K + 1, first_rows[0])``. ``heads`` and ``first_rows``: the head frames and the first row
    of each fragment that holds rows of ``start:stop``, in row order.
    """
    k = heads.shape[-1] + 1
    out = np.empty((max(stop - start, 0),) + newest.shape[1:-1] + (k,), np.result_type(newest, heads))
    ends = list(first_rows[1:]) + [stop]
    for head, first, end in zip(heads, first_rows, ends):
        lo, hi = max(start, int(first)), min(stop, int(end))
        if lo >= hi:
            continue
        p = lo - (k - 1)  # the first frame row lo needs: head frames stand for the rows first-K+1 .. first-1
        frames = np.moveaxis(newest[max(p, first) - newest_start:hi - newest_start, ..., 0], 0, -1)
        seq = np.concatenate([head[..., max(p - first + k - 1, 0):], frames], axis=-1)
        out[lo - start:hi - start] = np.moveaxis(np.lib.stride_tricks.sliding_window_view(seq, k, axis=-1), -2, 0)
    return out


def flatten_value(prefix: str, value: Any, containers: dict[str, str]) -> dict[str, np.ndarray]:
    """Flattens a batched (possibly nested Dict/Tuple) value to ``{path: array}``.

    Dict keys and tuple positions become path components; ``containers`` records
    which paths are dicts and which are tuples.
    """
    if type(value) is np.ndarray and value.dtype.kind not in "UO":  # the common case, without ABC checks
        return {prefix: value}
    if isinstance(value, Mapping):
        containers[prefix] = "dict"
        out: dict[str, np.ndarray] = {}
        for key in value:
            if "/" in str(key):
                raise ConversionError(f"space key {key!r} in {prefix!r} contains '/'; rename the key")
            out.update(flatten_value(f"{prefix}/{key}", value[key], containers))
        return out
    if isinstance(value, tuple):
        containers[prefix] = "tuple"
        out = {}
        for i, item in enumerate(value):
            out.update(flatten_value(f"{prefix}/{i}", item, containers))
        return out
    array = np.asarray(value)
    if array.dtype.kind == "U":  # gymnasium Text spaces: store UTF-8 bytes (HDF5 has no UCS-4)
        return {prefix: np.char.encode(array, "utf-8")}
    if array.dtype == object:
        raise ConversionError(
            f"column {prefix!r} holds Python objects, not numbers; "
            "use a gymnasium space with a numeric dtype"
        )
    return {prefix: array}


def infos_to_json(infos: Iterable[Any]) -> str:
    """Encodes a fragment's infos as one JSON list (numpy values become lists/numbers)."""
    return _INFOS_JSON.encode(list(infos))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


# One encoder for every episode's infos (json.dumps with options builds a new encoder on every call).
_INFOS_JSON = json.JSONEncoder(default=_json_default, separators=(",", ":"))


def _agent_key(agent_id: Any) -> str:
    return DEFAULT_AGENT if agent_id is None else str(agent_id)


def _eps_ids_array(eps_ids: Sequence[Any]) -> np.ndarray:
    """One ``EPS_ID_DTYPE`` value per episode id; ConversionError for an id that does not fit."""
    encoded = [str(e).encode() for e in eps_ids]
    too_long = next((e for e in encoded if len(e) > EPS_ID_DTYPE.itemsize), None)
    if too_long is not None:
        raise ConversionError(
            f"episode id {too_long.decode()!r} is longer than {EPS_ID_DTYPE.itemsize} bytes; "
            "use RLlib's default (uuid hex) episode ids"
        )
    return np.array(encoded, dtype=EPS_ID_DTYPE)


def _all_items(buffer: Any) -> Any:
    """``buffer.get()``: an RLlib InfiniteLookbackBuffer's items after its lookback, what an episode's getters
    (``get_observations()`` ...) return. Read directly when the buffer holds one finalized numpy array, as
    RLlib's own fast path does, without the four calls it makes first (seven such reads per episode)."""
    data = buffer.data
    if buffer.finalized and type(data) is np.ndarray:
        return data[buffer.lookback:]
    return buffer.get()


def _episodes_stream(items: Sequence[tuple[Any, str, Any]], options: ConvertOptions) -> Stream:
    """One agent's stream of episode fragments ``(episode, episode id, module id)``, in order.

    Only what each episode holds (observations, actions, rewards, model outputs, its last observation) is taken
    episode by episode, as a small stream (image columns encoded there, before anything is concatenated, with
    ``options.encode_images``); the columns made from counts and flags (``terminateds``, ``eps_id``, ``t``, the
    fragment table) are built once for all of them: a CartPole sample holds ~25 episodes of ~20 steps.
    """
    containers: dict[str, str] = {}
    parts: list[Stream] = []
    lengths, t_starts, terminated, truncated, has_last, returns = [], [], [], [], [], []
    infos: list[str] = []
    for episode, eps_id, _ in items:
        n = len(episode)
        obs_cols = flatten_value("obs", _all_items(episode.observations), containers)
        num_obs = len(next(iter(obs_cols.values())))
        if num_obs not in (n, n + 1):
            raise ConversionError(
                f"episode {eps_id} has {num_obs} observations for {n} actions; "
                "expected one more observation than actions"
            )
        steps = {k: v[:n] for k, v in obs_cols.items()}
        steps.update(flatten_value("actions", _all_items(episode.actions), containers))
        steps["rewards"] = rewards = np.asarray(_all_items(episode.rewards))
        extras = episode.extra_model_outputs if hasattr(episode, "extra_model_outputs") else {}
        versions = _all_items(extras["weights_seq_no"]) if "weights_seq_no" in extras else None
        steps["weights_seq_no"] = (
            np.asarray(versions, dtype=np.int64) if versions is not None else np.full(n, -1, np.int64)
        )
        if options.record_extra_model_outputs:
            for key in sorted(k for k in extras if k != "weights_seq_no"):
                steps.update(
                    flatten_value(f"extra_model_outputs/{key}", _all_items(extras[key]), containers)
                )
        has_last_obs = num_obs == n + 1
        last = {
            "last_" + path: column[n:n + 1] if has_last_obs else np.zeros((1,) + column.shape[1:], column.dtype)
            for path, column in obs_cols.items()
        }
        part = Stream(steps=steps, fragments=last)
        part = encode_stream(part) if options.encode_images else part
        parts.append(stack_frames(part, [n]) if options.stack_frames else part)
        lengths.append(n)
        t_starts.append(episode.t_started)
        terminated.append(bool(episode.is_terminated))
        truncated.append(bool(episode.is_truncated))
        has_last.append(has_last_obs)
        returns.append(float(rewards.sum()))
        if options.record_infos:
            infos.append(infos_to_json(_all_items(episode.infos)))
    stream = concat_streams(parts)  # checks that every episode has the same columns; new dicts, or parts[0]'s
    eps_ids = _eps_ids_array([eps_id for _, eps_id, _ in items])
    steps = stream.steps
    steps.update(_position_columns(lengths, t_starts, terminated, truncated, eps_ids))
    fragments = _fragment_columns(
        eps_id=eps_ids, num_rows=lengths, t_start=t_starts, terminated=terminated, truncated=truncated,
        ret=returns, module_id=[module_id for _, _, module_id in items], has_last_obs=has_last,
    )
    fragments.update(stream.fragments)
    fragments.update(_start_state_columns([episode for episode, _, _ in items]))
    if options.record_infos:
        fragments["infos"] = np.array(infos, dtype=object)
    for path, kind in list(containers.items()):
        if path.startswith("obs"):
            containers["last_" + path] = kind
    return Stream(steps=steps, fragments=fragments, containers=containers, encoded=stream.encoded,
                  stacked=stream.stacked)


def _position_columns(lengths: list[int], t_starts: list[int], terminated: list[bool], truncated: list[bool],
                      eps_ids: np.ndarray) -> dict[str, np.ndarray]:
    """``terminateds``, ``truncateds``, ``eps_id`` and ``t`` of consecutive episode fragments, built at once."""
    if len(lengths) == 1:  # complete_episodes: one episode per sample, where numpy's fixed costs count most
        n, t0 = lengths[0], t_starts[0]
        columns = {"terminateds": np.zeros(n, dtype=bool), "truncateds": np.zeros(n, dtype=bool)}
        columns["terminateds"][-1], columns["truncateds"][-1] = terminated[0], truncated[0]
        columns["eps_id"] = np.full(n, eps_ids[0], dtype=eps_ids.dtype)
        columns["t"] = np.arange(t0, t0 + n, dtype=np.int64)
        return columns
    counts = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(counts) - 1
    total = int(ends[-1]) + 1
    columns = {}
    for name, flags in (("terminateds", terminated), ("truncateds", truncated)):
        columns[name] = np.zeros(total, dtype=bool)
        columns[name][ends] = flags
    columns["eps_id"] = np.repeat(eps_ids, counts)
    # t of row i of episode j: t_starts[j] + (i - first row of episode j)
    first_rows = ends + 1 - counts
    columns["t"] = np.arange(total, dtype=np.int64) + np.repeat(np.asarray(t_starts, np.int64) - first_rows, counts)
    return columns


def _start_state_columns(episodes: Sequence[Any]) -> dict[str, np.ndarray]:
    """The start states kept by on_episode_start, stored with each episode's first fragment only."""
    states, kinds = np.empty(len(episodes), dtype=object), []
    for i, episode in enumerate(episodes):
        captured = getattr(episode, "custom_data", {}).get(START_STATE_KEY) if episode.t_started == 0 else None
        kind, blob = "", b""
        if captured is not None:  # envstate.Captured: packed now that the first step's outcome is known
            first_step_ended = len(episode) == 1 and bool(episode.is_terminated or episode.is_truncated)
            kind, blob = captured.kind, captured.pack(first_step_ended)
        states[i] = np.frombuffer(blob, dtype=np.uint8)
        kinds.append(kind)
    return {"start_state": states, "start_state_kind": np.array(kinds, dtype=object)}


def _fragment_columns(
    *, eps_id: np.ndarray, num_rows: list, t_start: list, terminated: list, truncated: list,
    ret: list, module_id: list, has_last_obs: list,
) -> dict[str, np.ndarray]:
    return {
        "eps_id": eps_id,  # already EPS_ID_DTYPE: the ids the step column holds
        "num_rows": np.asarray(num_rows, dtype=np.int64),
        "t_start": np.asarray(t_start, dtype=np.int64),
        "terminated": np.asarray(terminated, dtype=bool),
        "truncated": np.asarray(truncated, dtype=bool),
        "return": np.asarray(ret, dtype=np.float64),
        "module_id": np.array(["" if m is None else str(m) for m in module_id], dtype=object),
        "has_last_obs": np.asarray(has_last_obs, dtype=bool),
    }


def _sample_batch_stream(batch: Any, policy_id: str, options: ConvertOptions, version: int) -> Stream:
    n = len(batch["rewards"])
    containers: dict[str, str] = {}
    steps = flatten_value("obs", batch["obs"], containers)
    steps.update(flatten_value("actions", batch["actions"], containers))
    steps["rewards"] = np.asarray(batch["rewards"])
    steps["terminateds"] = np.asarray(batch["terminateds"], dtype=bool)
    steps["truncateds"] = np.asarray(batch["truncateds"], dtype=bool)
    raw_ids = np.asarray(batch["eps_id"])
    steps["eps_id"] = np.array([str(e).encode() for e in raw_ids], dtype=EPS_ID_DTYPE) if n else raw_ids
    steps["t"] = np.asarray(batch["t"], dtype=np.int64)
    steps["weights_seq_no"] = np.full(n, version, dtype=np.int64)
    if "agent_index" in batch:
        steps["agent_index"] = np.asarray(batch["agent_index"], dtype=np.int64)
    if options.record_extra_model_outputs:
        for key in sorted(k for k in batch.keys() if k not in _OLD_STACK_KNOWN):
            value = batch[key]
            if len(value) == n and not key.startswith("state_"):
                steps.update(flatten_value(f"extra_model_outputs/{key}", value, containers))
    # Fragments: maximal runs of one episode with consecutive t.
    ids, t = raw_ids, steps["t"]
    breaks = np.flatnonzero((ids[1:] != ids[:-1]) | (t[1:] != t[:-1] + 1)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.concatenate([breaks, [n]]).astype(np.int64)
    last = ends - 1
    rewards = steps["rewards"].astype(np.float64)
    fragments = _fragment_columns(
        eps_id=steps["eps_id"][starts], num_rows=list(ends - starts), t_start=list(t[starts]),
        terminated=list(steps["terminateds"][last]), truncated=list(steps["truncateds"][last]),
        ret=[float(rewards[s:e].sum()) for s, e in zip(starts, ends)],
        module_id=[policy_id] * len(starts), has_last_obs=[True] * len(starts),
    )
    for path, column in flatten_value("obs", batch["new_obs"], containers).items():
        fragments["last_" + path] = column[last]
    for path, kind in list(containers.items()):
        if path.startswith("obs"):
            containers["last_" + path] = kind
    if options.record_infos and "infos" in batch:
        # Old-stack infos come with new_obs; the fragment's first observation has none.
        infos = list(batch["infos"])
        fragments["infos"] = np.array(
            [infos_to_json([None] + infos[s:e]) for s, e in zip(starts, ends)], dtype=object
        )
    return Stream(steps=steps, fragments=fragments, containers=containers)
