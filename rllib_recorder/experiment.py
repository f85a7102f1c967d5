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
    atari_wrappers: dict[str, Any] | None = None


class AgentToPolicy:
    """A picklable ``policy_mapping_fn`` from a YAML dict ``{agent_id: policy_id}``."""

    def __init__(self, mapping: dict[Any, str]):
        self.mapping = {str(k): str(v) for k, v in mapping.items()}

    def __call__(self, agent_id: Any, episode: Any = None, **kwargs: Any) -> str:
        try:
            return self.mapping[str(agent_id)]
        except KeyError:
            raise ConfigError(f"multiagent.policy_mapping_fn has no policy for agent {agent_id!r}; "
                              f"add '{agent_id}: <policy id>' to the YAML") from None


def make_atari_env(env_id: str, dim: int, framestack: int | None, env_config: dict[str, Any]) -> Any:
    """An ALE env wrapped with RLlib's Atari wrappers (grayscale, dim x dim, frameskip, frame stack)."""
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack

    _register_envs("ale_py")
    settings = {"frameskip": 1, "repeat_action_probability": 0.0, **dict(env_config)}
    skip = int(settings.pop("wrapper_frameskip", 4))
    return wrap_atari_for_new_api_stack(gym.make(env_id, **settings), dim=dim, frameskip=skip,
                                        framestack=framestack)


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
        register=list(body.get("register") or []), atari_wrappers=body.get("atari_wrappers"),
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
    if spec.atari_wrappers is not None:
        config = config.environment(_register_atari(spec), env_config=env_config or {})
    elif spec.env:
        config = config.environment(_resolve_env(spec.env), env_config=env_config or {})
    multiagent = settings.get("multiagent")
    if isinstance(multiagent, dict) and isinstance(multiagent.get("policy_mapping_fn"), dict):
        settings["multiagent"] = {**multiagent, "policy_mapping_fn": AgentToPolicy(multiagent["policy_mapping_fn"])}
        settings["multiagent"]["policies"] = set(multiagent.get("policies") or
                                                 multiagent["policy_mapping_fn"].values())
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


def _resolve_env(env: str) -> Any:
    """``module:Class`` names an env class; anything else (``CartPole-v1``, ``ale_py:ALE/Breakout-v5``)
    is a gymnasium id that RLlib looks up itself."""
    import importlib

    module, _, attr = env.partition(":")
    if attr.isidentifier():
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"env {env!r} cannot be imported ({e}); give a gymnasium id or 'module:Class'") from None
    return env


def _register_atari(spec: ExperimentSpec) -> str:
    """Registers the wrapped ALE env with Tune (visible to every env runner) and returns its name."""
    import functools

    from ray.tune.registry import register_env

    options = dict(spec.atari_wrappers or {})
    unknown = set(options) - {"dim", "framestack"}
    if unknown or not spec.env:
        raise ConfigError(f"atari_wrappers takes 'dim' and 'framestack' and needs an 'env:' "
                          f"(got {sorted(unknown)}); e.g. atari_wrappers: {{dim: 84, framestack: 4}}")
    dim, framestack = int(options.get("dim", 84)), options.get("framestack", 4)
    name = f"{spec.env}-atari{dim}x{framestack or 1}"
    creator = functools.partial(make_atari_env, spec.env, dim, framestack)
    register_env(name, lambda env_config: creator(dict(env_config)))
    return name


def _register_envs(module: str) -> None:
    import importlib

    import gymnasium as gym

    gym.register_envs(importlib.import_module(module))
