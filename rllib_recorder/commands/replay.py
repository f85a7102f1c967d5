"""Replaying a run: stream its batches or episodes, and re-simulate episodes from their start states."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import h5py
import numpy as np

from rllib_recorder.commands.envs import import_env_package, make_atari_env
from rllib_recorder.commands.experiment import ATARI_NAME
from rllib_recorder.errors import ReplayError
from rllib_recorder.format import decode
from rllib_recorder.read.records import Batch, Episode, unbatch
from rllib_recorder.read.run import Run
from rllib_recorder.record import envstate


@dataclass(frozen=True)
class Mismatch:
    """The first step where a re-simulated episode differs from the stored one."""

    worker_index: int
    eps_id: str
    step: int
    field: str
    expected: str
    got: str

    def __str__(self) -> str:
        return (f"worker {self.worker_index} episode {self.eps_id} step {self.step}: {self.field} differs: "
                f"expected {self.expected}, got {self.got}")


@dataclass
class CheckReport:
    """What ``check_run`` re-simulated and where it first diverged."""

    env: str
    episodes: int = 0
    steps: int = 0
    mismatches: list[Mismatch] | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches


def batch_record(batch: Batch) -> dict[str, Any]:
    """A JSON-able dict of one stored chunk."""
    return {"worker_index": batch.worker_index, "is_evaluation": batch.is_evaluation, "row": batch.row,
            **batch.info, "steps": {agent: _jsonable(cols) for agent, cols in batch.steps.items()}}


def episode_record(episode: Episode) -> dict[str, Any]:
    """A JSON-able dict of one stored episode."""
    return {"worker_index": episode.worker_index, "eps_id": episode.eps_id, "agent_id": episode.agent_id,
            "module_id": episode.module_id, "len": len(episode), "return": episode.episode_return,
            "obs": _jsonable(episode.obs), "actions": _jsonable(episode.actions),
            "rewards": episode.rewards.tolist(), "terminateds": episode.terminateds.tolist(),
            "truncateds": episode.truncateds.tolist(), "t": episode.t.tolist(),
            "weights_seq_no": episode.weights_seq_no.tolist(),
            "extra_model_outputs": _jsonable(episode.extra_model_outputs), "infos": episode.infos}


def load_callable(target: str) -> Callable[[Any], Any]:
    """The function named ``module:function``; ReplayError names what is missing."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ReplayError(f"--to {target!r} is not 'module:function'; e.g. --to mypkg.sink:consume")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ReplayError(f"--to {target!r} cannot be imported ({e}); is the module on PYTHONPATH?") from None
    if not callable(fn):
        raise ReplayError(f"--to {target!r} is not callable")
    return fn


# Modules a recorded env name may ask to import (gymnasium's "module:id" form): env packages that register
# gymnasium ids and do nothing else. A manifest naming any other module gets "pass --env".
ENV_MODULES = ("ale_py",)

GYM_ID = re.compile(r"(?:(?P<module>[A-Za-z_][A-Za-z0-9_.]*):)?(?P<id>[A-Za-z0-9_./-]{1,200})")


def env_factory(run: Run, env: str | None = None) -> tuple[str, Callable[[], Any]]:
    """(name, make) for the env to re-simulate in: ``env`` (typed by the user) or, when None, the run's recorded
    env.

    ``env`` is a gymnasium id (``CartPole-v1``; ``ale_py:ALE/Breakout-v5`` registers ale_py first), an env name
    the recorder gave RLlib's Atari wrappers (``ale_py:ALE/Breakout-v5-atari84x4``) or ``module:function``
    (called with the run's env_config). The run's own env name is data: it is used only when it is a gymnasium id
    registered here (a ``module:`` prefix only from ``ENV_MODULES``) or such an id with the Atari wrappers;
    nothing a recording names is imported or called otherwise.
    """
    trusted = env is not None
    name = env or run.manifest.get("env")
    if not name or name == "None":
        raise ReplayError(f"run {run.path} records no env name; pass --env")
    env_config = dict(run.manifest.get("env_config") or {})
    atari = ATARI_NAME.match(name)
    if atari:
        if not trusted:
            recorded_gym_id(run, atari["id"], name)
        dim, stack = int(atari["dim"]), int(atari["stack"])
        if not (1 <= dim <= 1024 and 1 <= stack <= 64):
            raise ReplayError(f"env {name!r}: an Atari frame of {dim} pixels with {stack} frames stacked is not "
                              "what RLlib's Atari wrappers make; pass --env")
        return name, lambda: make_atari_env(atari["id"], dim, stack, env_config)
    module, _, attr = name.partition(":")
    if attr.isidentifier() and (trusted or module not in ENV_MODULES):
        if not trusted:
            raise ReplayError(f"run {run.path} names its env {name!r}, a Python function; a recording's contents "
                              f"are never imported or run: pass --env {name} if you trust that code, or a "
                              "gymnasium id")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ReplayError(f"env {name!r} cannot be imported ({e}); "
                              "give a gymnasium id or 'module:function'") from None
        return name, lambda: fn(env_config)
    if not trusted:
        recorded_gym_id(run, name, name)
    return name, lambda: _gym_make(name, env_config)


def env_factory_rendering(run: Run, env: str | None = None) -> tuple[str, Callable[[], Any]]:
    """``env_factory``, for an env that draws itself: a gymnasium id is made with ``render_mode='rgb_array'``."""
    name, make = env_factory(run, env)
    if ATARI_NAME.match(name) or (":" in name and name.partition(":")[2].isidentifier()):
        return name, make  # the Atari wrappers, or the user's own function: as they make it
    env_config = {**dict(run.manifest.get("env_config") or {}), "render_mode": "rgb_array"}
    return name, lambda: _gym_make(name, env_config)


def recorded_gym_id(run: Run, gym_id: str, name: str) -> None:
    """ReplayError unless ``gym_id`` (from the run's manifest) is a gymnasium id registered here, after importing
    at most one of ``ENV_MODULES``."""
    import gymnasium as gym

    match = GYM_ID.fullmatch(gym_id)
    module = match["module"] if match else None
    if not match or (module is not None and module not in ENV_MODULES):
        raise ReplayError(f"run {run.path} names its env {name[:200]!r}, which is not a gymnasium id (a recording's "
                          "contents are never imported or run); pass --env with the env to use")
    if module is not None:
        import_env_package(module)
    if match["id"] not in gym.registry:
        raise ReplayError(f"run {run.path} was recorded in env {name[:200]!r}, which is not a gymnasium id "
                          "registered here (an env registered with tune.register_env, or a package not "
                          "installed); pass --env with a gymnasium id or 'module:function'")


def check_episode(episode: Episode, make_env: Callable[[], Any], env_name: str) -> Mismatch | None:
    """Re-simulates ``episode`` in a fresh env from its start state; the first mismatch, or None."""
    if not episode.start_state_kind:
        raise ReplayError(f"env {env_name} can't be re-simulated (episode {episode.eps_id} of worker "
                          f"{episode.worker_index} has no recorded start state: {_why_no_state(make_env)})")
    env = make_env()
    try:
        env.reset(seed=0)
        envstate.restore(env, episode.start_state_kind, episode.start_state)
        has_last = _rows(episode.obs) == len(episode) + 1
        for i in range(len(episode)):
            obs, reward, terminated, _, _ = env.step(unbatch(episode.actions, i))
            if i + 1 < len(episode) or has_last:
                found = _compare_obs(unbatch(episode.obs, i + 1), obs)
                if found:
                    return Mismatch(episode.worker_index, episode.eps_id, i, "obs", *found)
            if np.float32(reward) != np.float32(episode.rewards[i]):
                return Mismatch(episode.worker_index, episode.eps_id, i, "reward",
                                repr(float(episode.rewards[i])), repr(float(reward)))
            if bool(terminated) != bool(episode.terminateds[i]):
                return Mismatch(episode.worker_index, episode.eps_id, i, "terminated",
                                str(bool(episode.terminateds[i])), str(bool(terminated)))
        return None
    finally:
        env.close()


def check_spaces(run: Run, make_env: Callable[[], Any], env_name: str) -> None:
    """ReplayError unless the env can be restored and its spaces fit what the run stored."""
    env = make_env()
    try:
        env.reset(seed=0)  # classic-control envs have their state only after a reset
        reason = envstate.unsupported_reason(env)
        if reason is not None:
            raise ReplayError(f"env {env_name} can't be re-simulated ({reason})")
        for f in run.files:
            for agent in f.agents:
                if agent != "default_agent":
                    raise ReplayError(f"env {env_name} can't be re-simulated (multi-agent runs are not supported; "
                                      f"{f.path} holds agent {agent!r})")
                stored = f.h5[f"agents/{agent}/steps/obs"]
                if not isinstance(stored, h5py.Dataset):  # nested observations: checked step by step
                    continue
                space = env.observation_space
                stored_dtype = np.dtype(np.float32) if stored.attrs.get("encoding") == "affine_uint8" else stored.dtype
                recorded = decode.row_shape(stored)
                if recorded != tuple(space.shape or ()) or stored_dtype != space.dtype:
                    raise ReplayError(
                        f"env {env_name} does not match the recorded spaces: it observes {space.dtype}"
                        f"{list(space.shape or ())}, the run stored {stored_dtype}{list(recorded)}; "
                        "pass the env the run was recorded with (--env)")
    finally:
        env.close()


def check_run(run: Run, env: str | None = None, progress: Callable[[int], None] | None = None) -> CheckReport:
    """Re-simulates every stored (non-evaluation) episode; the report lists each episode's first mismatch."""
    if run.manifest.get("api_stack") == "old":
        raise ReplayError("this run can't be re-simulated: it was recorded on RLlib's old API stack, "
                          "which records no start states")
    for f in run.files:
        agents = [a for a in f.agents if a != "default_agent"]
        if agents:
            raise ReplayError(f"this run can't be re-simulated: it is multi-agent ({os.path.basename(f.path)} holds "
                              f"agent {agents[0]!r}), and replay --check re-simulates single-agent runs only")
    name, make_env = env_factory(run, env)
    check_spaces(run, make_env, name)
    report = CheckReport(env=name, mismatches=[])
    for episode in run.episodes():
        mismatch = check_episode(episode, make_env, name)
        report.episodes += 1
        report.steps += len(episode)
        if mismatch is not None:
            report.mismatches.append(mismatch)
        if progress is not None:
            progress(len(episode))
    return report


def iter_episodes_and_batches(run: Run, episodes: bool) -> Iterator[Episode | Batch]:
    """Stored episodes, or stored chunks, in recorded order."""
    return run.episodes() if episodes else run.batches()


def _gym_make(name: str, env_config: dict[str, Any]) -> Any:
    import gymnasium as gym

    module, _, _ = name.partition(":")
    try:
        if ":" in name:
            import_env_package(module)
            name = name.partition(":")[2]
        return gym.make(name, **env_config)
    except Exception as e:  # gymnasium raises several kinds for an unknown or misconfigured id
        raise ReplayError(f"env {name!r} cannot be made ({type(e).__name__}: {e}); pass --env with a "
                          "gymnasium id, an '<id>-atari<dim>x<stack>' name or 'module:function'") from None


def _why_no_state(make_env: Callable[[], Any]) -> str:
    env = make_env()
    try:
        env.reset(seed=0)
        reason = envstate.unsupported_reason(env)
        return reason or "it was recorded without start states (an older recorder, or the capture failed)"
    finally:
        env.close()


def _compare_obs(expected: Any, got: Any) -> tuple[str, str] | None:
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.shape != got.shape:
        return f"shape {expected.shape}", f"shape {got.shape}"
    if np.array_equal(expected, got):
        return None
    diff = np.abs(expected.astype(np.float64) - got.astype(np.float64))
    where = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return (f"{expected[where].item()!r} at index {tuple(int(i) for i in where)}",
            f"{got[where].item()!r} ({int((diff > 0).sum())} of {diff.size} values differ)")


def _rows(value: Any) -> int:
    while isinstance(value, (dict, tuple)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return len(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.astype(str).tolist() if value.dtype.kind == "S" else value.tolist()
    return value
