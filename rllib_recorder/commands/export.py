"""Exporting a run: RLlib's columnar offline input (parquet) and Minari datasets."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable

import h5py
import numpy as np

from rllib_recorder.commands.replay import env_factory
from rllib_recorder.errors import ExportError
from rllib_recorder.extras import require_extra
from rllib_recorder.read.records import Episode
from rllib_recorder.read.run import Run

ROWS_PER_PARQUET_FILE = 50_000
EPISODES_PER_WRITE = 32  # Minari episodes written at a time


def export_rllib(run: Run, out_dir: str, progress: Callable[[int], None] | None = None) -> list[str]:
    """Writes the run's steps as parquet in RLlib's columnar offline format; returns the files.

    Train from it with ``config.offline_data(input_=out_dir)`` (e.g. ``BCConfig``, new API stack).
    """
    pq = require_extra("pyarrow.parquet")
    from ray.data.block import BlockAccessor  # numpy tensors -> Arrow tensor columns, as Ray Data reads them

    _check_single_agent(run, "rllib")
    os.makedirs(out_dir, exist_ok=True)
    files: list[str] = []
    # RLlib's OfflinePreLearner's default input schema (new_obs from next_obs)
    columns = ["eps_id", "obs", "next_obs", "actions", "rewards", "terminateds", "truncateds"]
    # Every step, also of an episode whose final observation was not stored (its next observation is the
    # observation itself, as offline_input gives it): read block by block, so memory holds one parquet file's rows.
    for batch in run.iter_batches(ROWS_PER_PARQUET_FILE, columns=columns):
        table = {"eps_id": batch["eps_id"].astype(str), "obs": batch["obs"], "new_obs": batch["next_obs"],
                 **{k: batch[k] for k in ("actions", "rewards", "terminateds", "truncateds")}}
        path = os.path.join(out_dir, f"part-{len(files):05d}.parquet")
        pq.write_table(BlockAccessor.batch_to_block(table), path)
        files.append(path)
        if progress is not None:
            progress(len(batch["rewards"]))
    if not files:
        raise ExportError(f"run {run.path} holds no steps to export")
    return files


def export_minari(run: Run, out_dir: str, dataset_id: str | None = None, spaces: tuple[Any, Any] | None = None,
                  progress: Callable[[int], None] | None = None) -> str:
    """Writes the run as a Minari dataset under ``out_dir`` (its MINARI_DATASETS_PATH); returns the dataset id.

    Every stored episode with its final observation becomes a Minari episode, written ``EPISODES_PER_WRITE`` at a
    time: memory holds a few episodes, whatever the run's size. ``spaces`` are the env's (observation, action)
    spaces, inferred from the first episode when None. When the run's env is a gymnasium id registered here, the
    dataset carries its ``EnvSpec``, so ``dataset.recover_environment()`` makes it.
    """
    minari = require_extra("minari")
    from minari.data_collector.episode_buffer import EpisodeBuffer

    _check_single_agent(run, "minari")
    dataset_id = dataset_id or default_dataset_id(run)
    os.makedirs(out_dir, exist_ok=True)
    previous = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = os.path.abspath(out_dir)
    dataset, pending = None, []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # minari's advice on optional metadata (author email, ...)
            for episode in run.episodes():
                if _has_final_obs(episode):
                    pending.append(EpisodeBuffer(
                        observations=episode.obs, actions=episode.actions, rewards=episode.rewards.tolist(),
                        terminations=episode.terminateds.tolist(), truncations=episode.truncateds.tolist(),
                        infos={}))
                if progress is not None:
                    progress(len(episode))
                if len(pending) >= EPISODES_PER_WRITE:
                    dataset, pending = _write_minari(minari, run, dataset_id, dataset, pending, spaces), []
            if pending:
                dataset = _write_minari(minari, run, dataset_id, dataset, pending, spaces)
    except ValueError as e:
        raise ExportError(f"minari refused the dataset ({e}); pass another --dataset-id or a new -o") from None
    finally:
        if previous is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = previous
    if dataset is None:
        raise ExportError(f"run {run.path} holds no episodes to export")
    return dataset_id


def _write_minari(minari: Any, run: Run, dataset_id: str, dataset: Any, buffers: list[Any],
                  spaces: tuple[Any, Any] | None) -> Any:
    """Creates the dataset with its first episodes, or adds episodes to it."""
    if dataset is not None:
        dataset.storage.update_episodes(buffers)
        return dataset
    observation_space, action_space = spaces or infer_spaces(buffers[0])
    return minari.create_dataset_from_buffers(
        dataset_id, buffers, observation_space=observation_space, action_space=action_space,
        env=recorded_env_spec(run), algorithm_name=str(run.manifest.get("algorithm")), author="rllib_recorder",
        description=f"exported by rllib_recorder from {os.path.abspath(run.path)} (env {run.manifest.get('env')})",
    )


def recorded_env_spec(run: Run) -> Any:
    """The gymnasium ``EnvSpec`` of the run's env when it is a plain gymnasium id registered here (a name the
    recorder gave RLlib's Atari wrappers is not: its frames are not the raw env's); else None. The manifest is
    data: only ids already registered (after at most importing ``ale_py``) are looked up."""
    from rllib_recorder.commands.experiment import ATARI_NAME
    from rllib_recorder.commands.replay import recorded_gym_id
    from rllib_recorder.errors import ReplayError

    name = run.manifest.get("env")
    if not isinstance(name, str) or ATARI_NAME.match(name):
        return None
    try:
        recorded_gym_id(run, name, name)
    except ReplayError:
        return None
    import gymnasium as gym

    return gym.spec(name.rpartition(":")[2])


def default_dataset_id(run: Run) -> str:
    """``rllib-recorder/<run dir name>-v0`` with the characters Minari allows."""
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", os.path.basename(os.path.normpath(run.path)))
    return f"rllib-recorder/{name}-v0"


def infer_spaces(buffer: Any) -> tuple[Any, Any]:
    """(observation, action) spaces that hold the stored arrays: Box for observations, Discrete for int actions."""
    import gymnasium as gym

    obs, actions = np.asarray(buffer.observations), np.asarray(buffer.actions)
    observation_space = gym.spaces.Box(-np.inf, np.inf, obs.shape[1:], obs.dtype)
    if actions.dtype.kind in "iu" and actions.ndim == 1:
        return observation_space, gym.spaces.Discrete(int(actions.max()) + 1)
    return observation_space, gym.spaces.Box(-np.inf, np.inf, actions.shape[1:], actions.dtype)


def _has_final_obs(episode: Episode) -> bool:
    return isinstance(episode.obs, np.ndarray) and len(episode.obs) == len(episode) + 1 and len(episode) > 0


def _check_single_agent(run: Run, target: str) -> None:
    for f in run.files:
        for agent in f.agents:
            if agent != "default_agent":
                raise ExportError(f"export --to {target} takes single-agent runs; {f.path} holds agent {agent!r}")
            steps = f.h5[f"agents/{agent}/steps"]
            if not isinstance(steps["obs"], h5py.Dataset) or not isinstance(steps["actions"], h5py.Dataset):
                raise ExportError(f"export --to {target} takes Box/Discrete spaces; {f.path} stores nested "
                                  "observations or actions (a Dict or Tuple space)")


def recorded_spaces(run: Run) -> tuple[Any, Any] | None:
    """The recorded env's spaces when the env can be made here, else None (export infers them)."""
    try:
        env = env_factory(run)[1]()
    except Exception:  # any env that can't be made here: the spaces come from the data
        return None
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()
