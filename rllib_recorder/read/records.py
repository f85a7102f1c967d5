"""The records a reader gives: a stitched Episode and a stored Batch, small frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rllib_recorder.read.to_rllib import to_sample_batch, to_single_agent_episode


@dataclass(frozen=True)
class Episode:
    """One agent's episode, stitched from its fragments; arrays are numpy.

    ``obs`` has one more row than ``actions`` when the last observation is stored;
    ``next_obs`` is ``obs[1:]``. Nested observations are dicts/tuples of arrays.
    """

    eps_id: str
    agent_id: str
    worker_index: int
    obs: Any
    actions: Any
    rewards: np.ndarray
    terminateds: np.ndarray
    truncateds: np.ndarray
    t: np.ndarray
    weights_seq_no: np.ndarray
    extra_model_outputs: dict[str, Any] = field(default_factory=dict)
    infos: list[Any] | None = None
    module_id: str = ""
    start_state_kind: str = ""
    start_state: bytes = field(default=b"", repr=False)
    policy_lag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    def __len__(self) -> int:
        return len(self.rewards)

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
