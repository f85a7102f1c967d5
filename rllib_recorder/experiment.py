"""Tune-style YAML experiments: load one, attach the recorder, run it with Tune."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import ConfigError


@dataclass
class ExperimentSpec:
    """One experiment of a YAML file: algorithm, env, stop conditions, RLlib config, recorder settings."""

    name: str
    run: str
    env: str | None
    stop: dict[str, Any]
    config: dict[str, Any]
    recorder: RecorderConfig
    register: list[str] = field(default_factory=list)


def load_experiment(path: str, *, stop_iters: int | None = None, stop_timesteps: int | None = None,
                    output_dir: str | None = None) -> ExperimentSpec:
    """Reads the (single) experiment of a YAML file and applies command-line overrides."""
    with open(path) as f:
        document = yaml.safe_load(f)
    if not isinstance(document, dict) or len(document) != 1:
        raise ConfigError(f"{path} must hold exactly one experiment: 'name: {{run: PPO, env: ..., config: ...}}'")
    (name, body), = document.items()
    if not isinstance(body, dict) or "run" not in body:
        raise ConfigError(f"experiment {name!r} in {path} has no 'run:' (the algorithm, e.g. PPO)")
    recorder = dict(body.get("recorder") or {})
    if output_dir is not None:
        recorder["output_dir"] = output_dir
    # Tune runs trials in their own working dirs: anchor a relative output_dir here.
    recorder["output_dir"] = os.path.abspath(recorder.get("output_dir", "recordings"))
    stop = dict(body.get("stop") or {})
    if stop_iters is not None:
        stop["training_iteration"] = stop_iters
    if stop_timesteps is not None:
        stop["num_env_steps_sampled_lifetime"] = stop_timesteps
    return ExperimentSpec(
        name=str(name), run=str(body["run"]), env=body.get("env"), stop=stop,
        config=dict(body.get("config") or {}), recorder=RecorderConfig.from_dict(recorder),
        register=list(body.get("register") or []),
    )


def build_config(spec: ExperimentSpec) -> Any:
    """The AlgorithmConfig of an experiment, with the recorder callback added."""
    from ray.tune.registry import get_trainable_cls

    from rllib_recorder.callback import RecorderCallback

    for module in spec.register:  # e.g. ale_py: registers its envs with gymnasium
        _register_envs(module)
    config = get_trainable_cls(spec.run).get_default_config()
    settings = dict(spec.config)
    env_config = settings.pop("env_config", None)
    if spec.env:
        config = config.environment(spec.env, env_config=env_config or {})
    config = config.update_from_dict(settings)
    callback = RecorderCallback.configured(spec.recorder)
    callbacks = config.callbacks_class
    existing = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
                if c.__name__ not in ("RLlibCallback", "DefaultCallbacks")]
    return config.callbacks(existing + [callback] if existing else callback)


def run_experiment(spec: ExperimentSpec, *, num_cpus: int | None = None,
                   echo: Callable[[str], None] = print) -> list[str]:
    """Runs the experiment with Tune; returns the recorded run directories."""
    import ray
    from ray import tune

    config = build_config(spec)
    if not ray.is_initialized():
        # A trial needs a CPU for its algorithm plus one per env runner; on a small machine
        # ask Ray for that many logical CPUs rather than leave the trial pending forever.
        needed = 1 + int(config.num_env_runners or 0)
        ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, needed), include_dashboard=False)
    echo(f"training {spec.run} on {spec.env} until {spec.stop}; recording into {spec.recorder.output_dir}")
    tuner = tune.Tuner(
        spec.run, param_space=config,
        run_config=tune.RunConfig(
            name=spec.name, stop=spec.stop, verbose=1,
            storage_path=os.path.abspath(os.path.join(spec.recorder.output_dir, "_tune")),
        ),
    )
    results = tuner.fit()
    if results.errors:
        raise ConfigError(f"experiment {spec.name!r} failed: {results.errors[0]}")
    return sorted({r.metrics["recorder"]["run_dir"] for r in results if r.metrics and "recorder" in r.metrics})


def _register_envs(module: str) -> None:
    import importlib

    import gymnasium as gym

    gym.register_envs(importlib.import_module(module))
