"""Pure conversion of RLlib samples into columnar chunks: the parts both API stacks share, and new-stack episodes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rllib_recorder._rllib_compat import episode_custom_data
from rllib_recorder.errors import ConversionError
from rllib_recorder.format.chunks import (
    DEFAULT_AGENT,
    EPS_ID_DTYPE,
    Chunk,
    Stream,
    concat_streams,
    newest_frames,
    uint8_stream,
)

# Where on_episode_start leaves (kind, bytes) of the env's start state in ``episode.custom_data``.
START_STATE_KEY = "rllib_recorder.start_state"


@dataclass(frozen=True)
class ConvertOptions:
    """What to keep when converting (mirrors the recorder settings)."""

    record_infos: bool = True
    record_extra_model_outputs: bool = True
    # Send exact-uint8 float32 images as uint8 codes, encoded per episode before anything is concatenated.
    encode_images: bool = False
    # Send frame-stacked observations as their newest frames (``newest_frames``), per episode.
    stack_frames: bool = False


def episodes_to_chunk(
    episodes: Sequence[Any], options: ConvertOptions = ConvertOptions(), sampled_at_s: float = 0.0
) -> Chunk:
    """Converts new-stack ``SingleAgentEpisode``/``MultiAgentEpisode`` fragments to a chunk."""
    # agent key -> (episode, episode id, module id, env_t of each observation (multi-agent only))
    parts: dict[str, list[tuple[Any, str, Any, np.ndarray | None]]] = {}
    env_steps = 0
    for episode in episodes:
        if hasattr(episode, "agent_episodes"):
            env_steps += int(episode.env_steps())
            for agent_id, agent_episode in episode.agent_episodes.items():
                if len(agent_episode) == 0:
                    continue
                parts.setdefault(str(agent_id), []).append((agent_episode, str(episode.id_), agent_episode.module_id,
                                                            agent_env_ts(episode, agent_id, agent_episode)))
        else:
            env_steps += len(episode)
            if len(episode) == 0:
                continue
            parts.setdefault(agent_key(episode.agent_id), []).append(
                (episode, str(episode.id_), episode.module_id, None))
    streams = {key: _episodes_stream(group, options) for key, group in parts.items()}
    return Chunk(streams=streams, env_steps=env_steps, sampled_at_s=sampled_at_s)


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


def agent_key(agent_id: Any) -> str:
    return DEFAULT_AGENT if agent_id is None else str(agent_id)


def eps_ids_array(eps_ids: Sequence[Any]) -> np.ndarray:
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


def agent_env_ts(episode: Any, agent_id: Any, agent_episode: Any) -> np.ndarray:
    """The env step (``env_t``, counted from the episode's reset) of each observation an agent's fragment holds,
    from the multi-agent episode's ``env_t_to_agent_t`` map; -1 for an observation older than the map's lookback
    (only a continuing fragment's first one can be: it is the previous fragment's last observation, whose
    ``env_t_last_obs`` the reader takes)."""
    num_obs = len(agent_episode.observations)
    out = np.full(num_obs, -1, np.int64)
    mapping = episode.env_t_to_agent_t.get(agent_id)
    if mapping is None:
        return out
    first, base = agent_episode.t_started, episode.env_t_started - mapping.lookback
    for j, agent_t in enumerate(mapping.data):
        if not isinstance(agent_t, str) and 0 <= agent_t - first < num_obs:  # "S": the agent did not step
            out[agent_t - first] = base + j
    return out


def _episodes_stream(items: Sequence[tuple[Any, str, Any, np.ndarray | None]], options: ConvertOptions) -> Stream:
    """One agent's stream of episode fragments ``(episode, episode id, module id, env_t of each observation)``,
    in order.

    Only what each episode holds (observations, actions, rewards, model outputs, its last observation) is taken
    episode by episode, as a small stream (image columns encoded there, before anything is concatenated, with
    ``options.encode_images``); the columns made from counts and flags (``terminateds``, ``eps_id``, ``t``, the
    fragment table) are built once for all of them: a CartPole sample holds ~25 episodes of ~20 steps.
    """
    containers: dict[str, str] = {}
    parts: list[Stream] = []
    lengths, t_starts, terminated, truncated, has_last, returns = [], [], [], [], [], []
    infos: list[str] = []
    env_ts, env_ts_last = [], []
    for episode, eps_id, _, obs_env_t in items:
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
        part = uint8_stream(part) if options.encode_images else part
        parts.append(newest_frames(part, [n]) if options.stack_frames else part)
        if obs_env_t is not None:
            env_ts.append(obs_env_t[:n])
            env_ts_last.append(int(obs_env_t[n]) if has_last_obs else -1)
        lengths.append(n)
        t_starts.append(episode.t_started)
        terminated.append(bool(episode.is_terminated))
        truncated.append(bool(episode.is_truncated))
        has_last.append(has_last_obs)
        returns.append(float(rewards.sum()))
        if options.record_infos:
            infos.append(infos_to_json(_all_items(episode.infos)))
    stream = concat_streams(parts)  # checks that every episode has the same columns; new dicts, or parts[0]'s
    eps_ids = eps_ids_array([item[1] for item in items])
    steps = stream.steps
    steps.update(position_columns(lengths, t_starts, terminated, truncated, eps_ids))
    fragments = fragment_columns(
        eps_id=eps_ids, num_rows=lengths, t_start=t_starts, terminated=terminated, truncated=truncated,
        ret=returns, module_id=[item[2] for item in items], has_last_obs=has_last,
    )
    if env_ts:  # multi-agent episodes: where each agent's rows sit among the env's steps (schema 2.2)
        steps["env_t"] = np.concatenate(env_ts)
        fragments["env_t_last_obs"] = np.asarray(env_ts_last, dtype=np.int64)
    fragments.update(stream.fragments)
    fragments.update(_start_state_columns([item[0] for item in items]))
    if options.record_infos:
        fragments["infos"] = np.array(infos, dtype=object)
    for path, kind in list(containers.items()):
        if path.startswith("obs"):
            containers["last_" + path] = kind
    return Stream(steps=steps, fragments=fragments, containers=containers, encoded=stream.encoded,
                  stacked=stream.stacked)


def position_columns(lengths: list[int], t_starts: list[int], terminated: list[bool], truncated: list[bool],
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
        captured = episode_custom_data(episode).get(START_STATE_KEY) if episode.t_started == 0 else None
        kind, blob = "", b""
        if captured is not None:  # envstate.Captured: packed now that the first step's outcome is known
            first_step_ended = len(episode) == 1 and bool(episode.is_terminated or episode.is_truncated)
            kind, blob = captured.kind, captured.pack(first_step_ended)
        states[i] = np.frombuffer(blob, dtype=np.uint8)
        kinds.append(kind)
    return {"start_state": states, "start_state_kind": np.array(kinds, dtype=object)}


def fragment_columns(
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
