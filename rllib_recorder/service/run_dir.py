"""A new run's directory and first manifest: its name, the algorithm, env and spaces, the settings."""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from typing import Any

from rllib_recorder.config import RecorderConfig
from rllib_recorder.format.layout import SCHEMA_VERSION
from rllib_recorder.format.liveness import process_start
from rllib_recorder.format.manifest import now_iso, versions
from rllib_recorder.service.attempts import tune_names, tune_trial


def resolve_run_dir(output_dir: str, config: RecorderConfig, algorithm: Any) -> str:
    """The run directory.

    Outside Tune: ``output_dir/run_name`` (or ``ALGO_ENV_time_id``). Under Tune, named like Tune's own
    folders: ``output_dir/<experiment>/<trial dir>`` (``run_name`` replaces the experiment name), so the trials
    of a grid search sit side by side under one experiment directory.
    """
    experiment, trial = tune_names(algorithm)
    if trial:
        return os.path.join(output_dir, config.run_name or experiment or "experiment", trial)
    if config.run_name:
        return os.path.join(output_dir, config.run_name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name(algorithm.config.env).rpartition(":")[2])[:40] or "env"
    return os.path.join(output_dir, f"{type(algorithm).__name__}_{env}_{stamp}_{uuid.uuid4().hex[:6]}")


def initial_manifest(algorithm: Any, run_id: str, config: RecorderConfig) -> dict[str, Any]:
    """The manifest of a run as it starts (status ``running``)."""
    algo_config = algorithm.config
    experiment, trial = tune_names(algorithm)
    trial_name, trial_id = tune_trial(trial)
    return {
        "format": "rllib_recorder", "schema_version": SCHEMA_VERSION, "run_id": run_id,
        "status": "running", "started_at": now_iso(), "finished_at": None,
        "versions": versions(), "algorithm": type(algorithm).__name__,
        "env": env_name(algo_config.env), **env_config_fields(algo_config.env_config, config),
        "api_stack": "new" if config_is_new_stack(algorithm) else "old",
        "batch_mode": algo_config.batch_mode, "num_env_runners": algo_config.num_env_runners,
        "trial": trial, "trial_name": trial_name, "trial_id": trial_id, "experiment": experiment,
        "spaces": _spaces(algorithm), "recorder": config.to_dict(),
        **driver_identity(),
    }


def driver_identity() -> dict[str, Any]:
    """Who the driver is, for ``recover`` to tell whether it still runs: its host, pid and start time (checked on
    its host), and its Ray node, job, actor (a Tune trial's) and cluster's GCS address (checked elsewhere)."""
    import ray

    identity = {"driver_host": socket.gethostname(), "driver_pid": os.getpid(), "driver_started": process_start()}
    try:
        context = ray.get_runtime_context()
        identity.update(driver_node_id=context.get_node_id(), driver_job_id=context.get_job_id(),
                        driver_actor_id=context.get_actor_id(), ray_gcs_address=context.gcs_address)
    except Exception:  # noqa: BLE001 - Ray not initialised here: the pid check alone tells
        pass
    return identity


def env_config_fields(env_config: Any, config: RecorderConfig) -> dict[str, Any]:
    """The manifest's ``env_config`` (verbatim, as JSON) without the keys ``omit_env_config_keys`` names."""
    env_config = dict(env_config or {})
    omitted = sorted(str(k) for k in env_config if k in config.omit_env_config_keys)
    kept = {k: v for k, v in env_config.items() if k not in config.omit_env_config_keys}
    return {"env_config": _jsonable(kept), **({"env_config_omitted": omitted} if omitted else {})}


def env_name(env: Any) -> str:
    """The env as the user named it: a registered name or gymnasium id as given, an env class as
    ``module:Class`` (what ``replay --env`` takes), anything else by its type."""
    if isinstance(env, str):
        return env
    if isinstance(env, type):
        return f"{env.__module__}:{env.__qualname__}"
    return "None" if env is None else f"{type(env).__module__}:{type(env).__qualname__}"


def config_is_new_stack(algorithm: Any) -> bool:
    return bool(algorithm.config.enable_env_runner_and_connector_v2)


def _spaces(algorithm: Any) -> dict[str, Any]:
    try:
        spaces = algorithm.env_runner_group.get_spaces()
        return {str(k): {"observation": repr(v[0]), "action": repr(v[1])} for k, v in spaces.items()}
    except Exception as e:  # spaces are informative; their absence must not stop a run
        return {"error": f"{type(e).__name__}: {e}"}


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)
