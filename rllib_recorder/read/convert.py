"""Read data in the shapes users expect: RLlib episodes and SampleBatches, pandas, Ray Data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from rllib_recorder.errors import ConversionError, ExportError

if TYPE_CHECKING:
    from rllib_recorder.read.reader import Episode, Run, WorkerFile  # noqa: F401

# Step columns with one number per row: what a DataFrame holds.
SCALAR_COLUMNS = ("eps_id", "t", "rewards", "terminateds", "truncateds", "weights_seq_no")


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


def to_dataframe(files: Iterable["WorkerFile"]) -> Any:
    """One row per step: worker, agent, the scalar step columns (actions too when they are scalars), policy lag."""
    pd = require_extra("pandas")
    frames = []
    for f in files:
        for agent in f.agents:
            rows = slice(0, f.num_rows(agent))
            data = {"worker_index": f.worker_index, "is_evaluation": f.is_evaluation, "agent_id": agent}
            for path in SCALAR_COLUMNS + ("actions",):
                value = f.column(agent, path, rows) if path in f.h5[f"agents/{agent}/steps"] else None
                if isinstance(value, np.ndarray) and value.ndim == 1:
                    data[path] = value.astype(str) if path == "eps_id" else value
            data["policy_lag"] = f.policy_lag(agent)
            frames.append(pd.DataFrame(data, index=pd.RangeIndex(f.num_rows(agent))))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def to_ray_dataset(run: "Run", *, rows_per_task: int, evaluation: bool | None) -> Any:
    """A ``ray.data.Dataset`` of steps read by one task per (file, agent, row range)."""
    import ray.data

    from rllib_recorder.read.datasource import RecordedStepsDatasource

    return ray.data.read_datasource(RecordedStepsDatasource(run, rows_per_task, evaluation))


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


def require_extra(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"{module} is not installed; pip install 'rllib-recorder[export]'") from None
