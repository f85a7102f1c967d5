"""The records a reader gives: a stitched Episode and a stored Batch, small frozen dataclasses, and an episode as
RLlib's SingleAgentEpisode or SampleBatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rllib_recorder.errors import ConversionError


# What episode assembly reads of one worker file: a ``read.worker_file.WorkerFile`` (named here, not imported, so
# that the assembly modules and the file module do not import each other).
FileOfSteps = Any


# An Episode's fields, in the order its repr and equality know them, with the default of those that may be left out.
EPISODE_FIELDS = ("eps_id", "agent_id", "worker_index", "obs", "actions", "rewards", "terminateds", "truncateds", "t",
                  "weights_seq_no", "extra_model_outputs", "infos", "module_id", "start_state_kind", "start_state",
                  "policy_lag", "env_t")
_DEFAULTS = {"extra_model_outputs": dict, "infos": lambda: None, "module_id": str, "start_state_kind": str,
             "start_state": bytes, "policy_lag": lambda: np.zeros(0, np.int64), "env_t": lambda: np.zeros(0, np.int64)}


MISSING = object()  # what a view's field() gives for a field it does not hold


class Episode:
    """One agent's episode, stitched from its fragments; arrays are numpy.

    ``obs`` has one more row than ``actions`` when the last observation is stored; ``next_obs`` is ``obs[1:]``.
    Nested observations are dicts/tuples of arrays. ``env_t`` (multi-agent episodes, new stack, schema 2.2): the
    env step of each observation in ``obs``; else empty. ``policy_lag``: learner minus behaviour version per step.

    Read, immutable. An episode streamed by ``run.episodes()`` whose steps sit in one fragment holds views into the
    block of columns it was read with (no copy; it keeps that block alive while it lives) and makes each field
    when first asked for (``infos`` is parsed then): building one costs about a microsecond.
    """

    __slots__ = ("_values", "_make", "_n")

    def __init__(self, *, eps_id: str, agent_id: str, worker_index: int, lazy: Any = None, **values: Any) -> None:
        """``lazy``: makers of fields not given: a dict of callables by name, or a view whose ``field(name)`` makes
        one (or gives ``MISSING``); a field neither given nor made takes its default (empty)."""
        unknown = set(values) - set(EPISODE_FIELDS)
        if unknown:
            raise TypeError(f"Episode got unknown fields {sorted(unknown)}")
        object.__setattr__(self, "_values", {"eps_id": eps_id, "agent_id": agent_id, "worker_index": worker_index,
                                             **values})
        object.__setattr__(self, "_make", lazy or {})
        object.__setattr__(self, "_n", None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        values = self._values
        if values is None:  # an episode made by the reader's fast path: every field from its view
            values = {}
            object.__setattr__(self, "_values", values)
        if name not in values:
            make = self._make
            made = make.field(name) if hasattr(make, "field") else MISSING
            if made is not MISSING:
                values[name] = made
            elif type(make) is dict and name in make:
                values[name] = make.pop(name)()
            elif name in _DEFAULTS:
                values[name] = _DEFAULTS[name]()
            elif name in EPISODE_FIELDS:
                raise AttributeError(f"Episode has no {name!r}")
            else:
                raise AttributeError(f"'Episode' object has no attribute {name!r}")
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"an Episode is read-only: can't set {name!r}")

    def __reduce__(self) -> Any:
        return _episode, ({name: getattr(self, name) for name in EPISODE_FIELDS},)

    def __len__(self) -> int:
        return self._n if self._n is not None else len(self.rewards)

    @property
    def next_obs(self) -> Any:
        return map_arrays(lambda a: a[1:], self.obs)

    @property
    def episode_return(self) -> float:
        return float(np.sum(self.rewards))

    @property
    def is_done(self) -> bool:
        return bool(len(self) and (self.terminateds[-1] or self.truncateds[-1]))

    def to_single_agent_episode(self) -> Any:
        """This episode as RLlib's ``SingleAgentEpisode`` (numpy)."""
        return to_single_agent_episode(self)

    def to_sample_batch(self) -> Any:
        """This episode as RLlib's ``SampleBatch`` (obs, new_obs, actions, rewards, ...)."""
        return to_sample_batch(self)

    def __repr__(self) -> str:
        shapes = map_arrays(lambda a: f"{a.dtype}{list(a.shape)}", self.obs)
        return (f"Episode(eps_id={self.eps_id!r}, agent_id={self.agent_id!r}, worker={self.worker_index}, "
                f"len={len(self)}, return={self.episode_return:.3g}, obs={shapes})")


def _episode(values: dict[str, Any]) -> Episode:
    return Episode(**values)


@dataclass(frozen=True)
class Batch:
    """One stored chunk, as the writer stored it: its index row and, per agent, its step columns."""

    worker_index: int
    is_evaluation: bool
    row: int
    info: dict[str, Any]
    steps: dict[str, dict[str, Any]]

    def __repr__(self) -> str:
        rows = {agent: len(cols["rewards"]) for agent, cols in self.steps.items()}
        return f"Batch(worker={self.worker_index}, row={self.row}, seq={self.info.get('seq')}, rows={rows})"


def map_arrays(fn: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: map_arrays(fn, v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(map_arrays(fn, v) for v in value)
    return fn(value)


def unbatch(value: Any, i: int) -> Any:
    """Row ``i`` of a batched (possibly nested dict/tuple) value."""
    if isinstance(value, dict):
        return {k: unbatch(v, i) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(unbatch(v, i) for v in value)
    return value[i]


def to_single_agent_episode(episode: "Episode") -> Any:
    """An RLlib ``SingleAgentEpisode`` (numpy) holding the stored episode."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    n = len(episode)
    if _num_rows(episode.obs) != n + 1:
        raise ConversionError(f"episode {episode.eps_id} has no stored final observation; "
                              "RLlib episodes need one observation more than actions")
    infos = episode.infos if episode.infos and len(episode.infos) == n + 1 else [{}] * (n + 1)
    result = SingleAgentEpisode(
        id_=episode.eps_id, agent_id=None if episode.agent_id == "default_agent" else episode.agent_id,
        module_id=episode.module_id or None,
        observations=[unbatch(episode.obs, i) for i in range(n + 1)],
        actions=[unbatch(episode.actions, i) for i in range(n)],
        rewards=episode.rewards.tolist(), infos=[i if isinstance(i, dict) else {} for i in infos],
        terminated=bool(episode.terminateds[-1]), truncated=bool(episode.truncateds[-1]),
        extra_model_outputs={k: [unbatch(v, i) for i in range(n)] for k, v in episode.extra_model_outputs.items()},
        len_lookback_buffer=0, t_started=int(episode.t[0]) if n else 0,
    )
    result.to_numpy()
    return result


def to_sample_batch(episode: "Episode") -> Any:
    """An RLlib ``SampleBatch`` with one row per step (``new_obs`` from the stored next observations)."""
    from ray.rllib.policy.sample_batch import SampleBatch

    n = len(episode)
    if _num_rows(episode.obs) != n + 1:
        raise ConversionError(f"episode {episode.eps_id} has no stored final observation; new_obs needs it")
    columns = {
        "obs": _slice(episode.obs, 0, n), "new_obs": _slice(episode.obs, 1, n + 1), "actions": episode.actions,
        "rewards": episode.rewards, "terminateds": episode.terminateds, "truncateds": episode.truncateds,
        "eps_id": np.full(n, episode.eps_id), "t": episode.t, "weights_seq_no": episode.weights_seq_no,
        **episode.extra_model_outputs,
        **({"policy_lag": episode.policy_lag} if len(episode.policy_lag) == n else {}),
    }
    return SampleBatch(columns)


def _num_rows(value: Any) -> int:
    while isinstance(value, (dict, tuple)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return len(value)


def _slice(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, dict):
        return {k: _slice(v, start, stop) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_slice(v, start, stop) for v in value)
    return value[start:stop]
