"""Tune-style YAML experiments: load one, check it, attach the recorder, run it with Tune.

Nothing a YAML names is imported or run beyond what a Tune YAML may name. ``load_experiment`` reads the file
and checks its shape and the recorder settings, importing nothing. ``check_experiment`` then resolves, in this
process and before Ray starts or any file is written:

* ``register:`` the modules the file lists, imported (and handed to ``gymnasium.register_envs``);
* ``run:`` one of RLlib's registered algorithms (``ray.rllib.algorithms.registry.ALGORITHMS``), or a Tune
  trainable that a ``register:`` module registered;
* ``env:`` a Tune-registered env, a gymnasium id (``CartPole-v1``, ``ale_py:ALE/Breakout-v5``), the recorder's
  Atari wrapper name (``<id>-atari<dim>x<stack>``), or ``module:Class`` / ``module.Class`` naming an env class
  (a gymnasium.Env or RLlib env subclass) in a ``register:`` module, ``ale_py``, ``gymnasium`` or RLlib's
  env classes (``ray.rllib.env``, ``ray.rllib.examples.envs.classes``);
* ``config:`` RLlib's settings, every key known to the algorithm's config class; class paths that RLlib would
  import (``callbacks``, ``model.custom_model``, any ``type:``, ``input``, policy classes) only from a
  ``register:`` module or ``ray.rllib``.

Each problem is one ``ConfigError`` line: where, what is wrong, the fix.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import importlib
import logging
import math
import os
import re
import reprlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import yaml

from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import ConfigError

EXPERIMENT_KEYS = ("run", "env", "stop", "config", "recorder", "register", "atari_wrappers")
ATARI_NAME = re.compile(r"^(?P<id>.+)-atari(?P<dim>\d+)x(?P<stack>\d+)$")  # as replay.ATARI_NAME
ATARI_OPTIONS = ("dim", "framestack")
# Modules an `env:` may name without a `register:` entry: the recorder's Atari wrappers import ale_py (as RLlib
# does for 'ale_py:ALE/...' ids), and gymnasium's and RLlib's own env classes.
BUILTIN_ENV_MODULES = ("ale_py", "gymnasium", "ray.rllib.env", "ray.rllib.examples.envs.classes")
# Class paths in `config:` may come from RLlib itself (or a `register:` module).
BUILTIN_CLASS_MODULES = ("ray.rllib",)
MULTIAGENT_KEYS = ("policies", "policy_map_capacity", "policy_mapping_fn", "policies_to_train",
                   "policy_states_are_swappable", "count_steps_by")
# Keys whose string values RLlib imports as a class or function path, at any depth of `config:`.
CLASS_PATH_KEYS = frozenset({
    "callbacks", "callbacks_class", "custom_model", "custom_action_dist", "custom_preprocessor", "type",
    "sample_collector", "policy_class", "env_runner_cls", "learner_class", "custom_evaluation_function",
    "custom_eval_function", "offline_eval_runner_class", "input", "input_", "module_class", "catalog_class",
})
# Special keys RLlib's update_from_dict routes to a setter method rather than an attribute.
ROUTED_KEYS = frozenset({"multiagent", "model", "optimizer", "exploration_config", "replay_buffer_config",
                         "sample_collector", "callbacks_class"})
SCHEDULE_SUFFIXES = ("lr", "entropy_coeff", "epsilon")  # numbers that may also be a [[t, value], ...] schedule
MAX_NODES = 200_000
COUNT = re.compile(r"^(evaluation_)?num_(?!cpus|gpus)")  # num_env_runners, num_epochs, ...: whole numbers
MAX_COUNT = 1_000_000

_show = reprlib.Repr()
_show.maxstring = _show.maxother = 60
_show.maxlist = _show.maxdict = _show.maxtuple = _show.maxset = 4
_show.maxlevel = 2


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
    path: str = ""

    @property
    def where(self) -> str:
        return f"{self.path}: experiment {self.name!r}" if self.path else f"experiment {self.name!r}"


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

    import_env_package("ale_py")
    settings = {"frameskip": 1, "repeat_action_probability": 0.0, **dict(env_config)}
    skip = int(settings.pop("wrapper_frameskip", 4))
    return wrap_atari_for_new_api_stack(gym.make(env_id, **settings), dim=dim, frameskip=skip,
                                        framestack=framestack)


# ----------------------------------------------------------------------------------------------------- loading


def _one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every ConfigError leaves ``fn`` as one line (a name in the file may hold a line break)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            if len(str(e).splitlines()) <= 1:
                raise
            raise ConfigError(" ".join(str(e).split())) from None
    return wrapper


@_one_line_errors
def load_experiment(path: str, *, stop_iters: int | None = None, stop_timesteps: int | None = None,
                    output_dir: str | None = None) -> ExperimentSpec:
    """Reads the (single) experiment of a YAML file and applies command-line overrides.

    Checks the file's shape, the types of its settings and the recorder settings, importing nothing the file
    names (``check_experiment`` resolves those); raises ``ConfigError`` (one line) on the first problem.
    """
    document = _read_yaml(path)
    if not isinstance(document, dict) or len(document) != 1:
        raise ConfigError(f"{path}: the file must hold exactly one experiment, a mapping "
                          f"'name: {{run: PPO, env: CartPole-v1, stop: ..., config: ...}}'; it holds "
                          f"{_what(document)}" + (f" with {len(document)} keys" if isinstance(document, dict) else ""))
    (name, body), = document.items()
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or os.sep in name \
            or "\0" in name:
        raise ConfigError(f"{path}: the experiment name {_show.repr(name)} must be a plain name without '/' "
                          "(Tune names its directory after it), e.g. 'cartpole-ppo:'")
    at = f"{path}: experiment {name!r}"
    if not isinstance(body, dict):
        raise ConfigError(f"{at} must be a mapping with 'run:' (the algorithm, e.g. PPO), 'env:', 'stop:' and "
                          f"'config:'; it is {_what(body)}")
    for key in body:
        if key not in EXPERIMENT_KEYS:
            raise ConfigError(f"{at}: unknown setting {_show.repr(key)}{_did_you_mean(key, EXPERIMENT_KEYS)}; "
                              f"an experiment takes {', '.join(EXPERIMENT_KEYS)}")
    if "run" not in body:
        raise ConfigError(f"{at} has no 'run:' (the algorithm); add e.g. 'run: PPO'")
    run = body["run"]
    if not isinstance(run, str) or not run.strip():
        raise ConfigError(f"{at}: 'run:' must name an RLlib algorithm, e.g. 'run: PPO'; it is {_what(run)}")
    config = _mapping(body.get("config"), f"{at}: 'config:'", "RLlib's settings, e.g. 'config: {num_env_runners: 2}'")
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"{at}: 'config:' key {_show.repr(key)} is not a name; RLlib's settings are "
                              "named, e.g. 'num_env_runners: 2'")
    env = body.get("env")
    if "env" in config:  # a Tune YAML may give the env inside RLlib's config
        if env is not None:
            raise ConfigError(f"{at} names its env twice ('env:' and 'config: {{env: ...}}'); keep one 'env:'")
        config = dict(config)
        env = config.pop("env")
    if env is not None and (not isinstance(env, str) or not env.strip() or "\0" in env):
        raise ConfigError(f"{at}: 'env:' must be a gymnasium id or 'module:Class', e.g. 'env: CartPole-v1'; "
                          f"it is {_what(env)}")
    env_config = config.get("env_config")
    if env_config is not None:
        _mapping(env_config, f"{at}: 'config: env_config:'", "the env's settings, e.g. 'env_config: {num_agents: 2}'")
        bad = [k for k in env_config if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{at}: 'config: env_config:' key {_show.repr(bad[0])} is not a name; "
                              "an env's settings are named, e.g. 'num_agents: 2'")
    stop = dict(_mapping(body.get("stop"), f"{at}: 'stop:'", "e.g. 'stop: {training_iteration: 5}'"))
    if stop_iters is not None:
        stop["training_iteration"] = stop_iters
    if stop_timesteps is not None:
        stop["num_env_steps_sampled_lifetime"] = stop_timesteps
    for key, value in stop.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"{at}: 'stop:' key {_show.repr(key)} is not a result name; e.g. "
                              "'stop: {training_iteration: 5}'")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ConfigError(f"{at}: 'stop: {_key(key)}:' must be a number >= 0 (train until the result reaches it), "
                              f"e.g. '{_key(key)}: 5'; it is {_what(value)}")
    recorder = dict(_mapping(body.get("recorder"), f"{at}: 'recorder:'",
                             "the recorder's settings, e.g. 'recorder: {output_dir: recordings}'"))
    if output_dir is not None:
        recorder["output_dir"] = output_dir
    try:  # a relative output_dir is anchored where the program started (Tune runs trials in their own dirs)
        recorder_config = RecorderConfig.from_dict(recorder)
    except ConfigError as e:
        raise ConfigError(f"{at}: 'recorder:' {e}") from None
    register = _module_list(body.get("register"), at)
    atari = _atari_options(body.get("atari_wrappers"), at)
    named = ATARI_NAME.match(env) if isinstance(env, str) else None
    if named and atari is None:  # the recorder's own name for a wrapped ALE env: '<id>-atari<dim>x<stack>'
        env, atari = named["id"], {"dim": int(named["dim"]), "framestack": int(named["stack"])}
        atari = _atari_options(atari, at)
    if atari is not None and env is None:
        raise ConfigError(f"{at}: 'atari_wrappers:' needs an 'env:', an ALE id such as 'ale_py:ALE/Breakout-v5'")
    return ExperimentSpec(name=name, run=run, env=env, stop=stop, config=dict(config), recorder=recorder_config,
                          register=register, atari_wrappers=atari, path=str(path))


def _read_yaml(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path!r} ({getattr(e, 'strerror', None) or e}); give the path of a "
                          "YAML experiment file, e.g. configs/cartpole-ppo.yaml") from None
    try:
        return yaml.safe_load(data)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(f"{e.context or ''} {e.problem or ''}".split()) or "syntax error"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}; fix the file there") from None
    except yaml.YAMLError as e:  # e.g. bytes that are not UTF-8/UTF-16 text
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}; save it as UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; an experiment needs a few levels only") from None


def _what(value: Any) -> str:
    kind = ("null" if value is None else "a boolean" if isinstance(value, bool) else
            "a number" if isinstance(value, (int, float)) else "a string" if isinstance(value, str) else
            "a list" if isinstance(value, (list, tuple)) else "a mapping" if isinstance(value, dict) else
            f"a {type(value).__name__}")
    return f"{kind} ({_show.repr(value)})" if value is not None else kind


def _key(key: Any) -> str:
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 60 else _show.repr(key)


def _did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    if not isinstance(word, str):
        return ""
    candidates = list(candidates)
    folded = {c.lower(): c for c in candidates}
    close = ([folded[word.lower()]] if word.lower() in folded else
             difflib.get_close_matches(word, candidates, n=1, cutoff=0.6))
    return f" (did you mean {close[0]!r}?)" if close and close[0] != word else ""


def _mapping(value: Any, where: str, example: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping ({example}); it is {_what(value)}")
    return value


def _is_module_name(name: Any) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _module_list(value: Any, at: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{at}: 'register:' must be a list of module names to import, e.g. 'register: [ale_py]'; "
                          f"it is {_what(value)}")
    for module in value:
        if not _is_module_name(module):
            raise ConfigError(f"{at}: 'register:' entry {_show.repr(module)} is not a module name; list importable "
                              "modules, e.g. 'register: [ale_py, mypkg.envs]'")
    return list(value)


def _atari_options(value: Any, at: str) -> dict[str, Any] | None:
    if value is None:
        return None
    options = _mapping(value, f"{at}: 'atari_wrappers:'", "e.g. 'atari_wrappers: {dim: 84, framestack: 4}'")
    for key in options:
        if key not in ATARI_OPTIONS:
            raise ConfigError(f"{at}: unknown 'atari_wrappers:' setting {_show.repr(key)}"
                              f"{_did_you_mean(key, ATARI_OPTIONS)}; it takes 'dim' and 'framestack', e.g. "
                              "'atari_wrappers: {dim: 84, framestack: 4}'")
    dim, stack = options.get("dim", 84), options.get("framestack", 4)
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 4096:
        raise ConfigError(f"{at}: 'atari_wrappers: dim:' must be a frame size in pixels (1-4096), e.g. 'dim: 84'; "
                          f"it is {_what(dim)}")
    if stack is not None and (isinstance(stack, bool) or not isinstance(stack, int) or not 1 <= stack <= 64):
        raise ConfigError(f"{at}: 'atari_wrappers: framestack:' must be a number of frames (1-64) or null, e.g. "
                          f"'framestack: 4'; it is {_what(stack)}")
    return {"dim": dim, "framestack": stack}


# ----------------------------------------------------------------------------------------------------- checking


@_one_line_errors
def check_experiment(spec: ExperimentSpec) -> Any:
    """Resolves what the experiment names (see the module docstring for what may be imported) and checks its
    RLlib ``config:``; returns the AlgorithmConfig without the recorder. Starts no Ray and writes no file.
    Raises ``ConfigError`` (one line) on the first problem."""
    _import_registered(spec)
    algo_class, defaults = _algorithm(spec)
    env = _env(spec)
    settings = copy.deepcopy(spec.config)  # RLlib's update_from_dict changes the dicts it is given
    env_config = settings.pop("env_config", None) or {}
    _check_settings(settings, defaults, spec, "config:", top=True)
    _check_class_paths(settings, spec)
    multiagent = settings.get("multiagent")
    if multiagent is not None:
        settings["multiagent"] = _multiagent(multiagent, spec)
    with _quiet():  # RLlib's notes on the config (e.g. 'running PPO on the new API stack') come when it runs
        return _rllib_config(spec, algo_class, defaults, env, env_config, settings)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    logger = logging.getLogger("ray.rllib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _rllib_config(spec: ExperimentSpec, algo_class: type, defaults: Any, env: Any, env_config: dict,
                  settings: dict) -> Any:
    config = defaults
    try:
        if env is not None:
            config = config.environment(env, env_config=env_config)
        elif env_config:
            config = config.environment(env_config=env_config)
        config = config.update_from_dict(settings)
    except Exception as e:  # RLlib's own checks of the values it is given
        key = _culprit(algo_class, settings)
        raise ConfigError(f"{spec.where}: RLlib refuses 'config:{f' {_key(key)}:' if key else ''}' ({_one_line(e)}); "
                          "fix that setting") from None
    try:
        config.copy(copy_frozen=False).validate()
    except Exception as e:
        raise ConfigError(f"{spec.where}: RLlib refuses 'config:' for {spec.run} ({_one_line(e)}); "
                          "fix that setting") from None
    return config


def _culprit(algo_class: type, settings: dict) -> str | None:
    """The first setting RLlib refuses on its own (for the message; None if only a combination fails)."""
    for key, value in settings.items():
        try:
            algo_class.get_default_config().update_from_dict({key: copy.deepcopy(value)})
        except Exception:
            return key
    return None


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines)[:400] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _import_registered(spec: ExperimentSpec) -> None:
    for module in spec.register:  # e.g. ale_py: registers its envs with gymnasium
        try:
            import_env_package(module)
        except ImportError as e:
            raise ConfigError(f"{spec.where}: 'register:' cannot import {module!r} ({_one_line(e)}); install it "
                              "or fix the name") from None
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{spec.where}: 'register:' importing {module!r} failed ({_one_line(e)}); "
                              "fix that module") from None


def _algorithm(spec: ExperimentSpec) -> tuple[type, Any]:
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.registry import ALGORITHMS
    from ray.tune.registry import TRAINABLE_CLASS, _global_registry

    try:
        if spec.run in ALGORITHMS:
            algo_class = ALGORITHMS[spec.run]()[0]
        elif not spec.run.startswith("__") and _global_registry.contains(TRAINABLE_CLASS, spec.run):
            algo_class = _global_registry.get(TRAINABLE_CLASS, spec.run)  # registered by a `register:` module
            if not (isinstance(algo_class, type) and issubclass(algo_class, Algorithm)):
                raise ConfigError(f"{spec.where}: 'run: {_key(spec.run)}' is a Tune trainable, not an RLlib algorithm; "
                                  f"use one of {', '.join(ALGORITHMS)}")
        else:
            raise ConfigError(f"{spec.where}: unknown algorithm 'run: {_key(spec.run)}'"
                              f"{_did_you_mean(spec.run, ALGORITHMS)}; RLlib's algorithms are "
                              f"{', '.join(ALGORITHMS)} (or register your own with a 'register:' module)")
        return algo_class, algo_class.get_default_config()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{spec.where}: 'run: {_key(spec.run)}' cannot be loaded ({_one_line(e)}); install what it "
                          "needs or choose another algorithm") from None


def _env(spec: ExperimentSpec) -> Any:
    """What to hand RLlib's ``config.environment()``: a registered name, a gymnasium id or an env class."""
    if spec.atari_wrappers is not None:
        return _register_atari(spec)
    if spec.env is None:
        return None
    from ray.tune.registry import ENV_CREATOR, _global_registry

    env = spec.env
    if _global_registry.contains(ENV_CREATOR, env):
        return env
    if ":" in env:
        module, name = env.split(":", 1)
    elif "." in env and _is_module_name(env):  # RLlib's class path form, 'pkg.module.Class'
        module, name = env.rsplit(".", 1)
    else:
        return _gym_id(spec, env)
    if not _is_module_name(module):
        raise ConfigError(f"{spec.where}: 'env: {_key(env)}' is not a gymnasium id or 'module:Class' "
                          f"({module!r} is not a module name)")
    if not _allowed(module, spec.register, BUILTIN_ENV_MODULES):
        raise ConfigError(f"{spec.where}: 'env: {_key(env)}' would import module {module!r}, which the file "
                          f"does not list in 'register:'; add 'register: [{module}]' if you trust it, or give a "
                          "gymnasium id")
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{spec.where}: 'env: {_key(env)}' cannot be imported ({_one_line(e)}); "
                          "install the module or fix the name") from None
    except (Exception, SystemExit) as e:
        raise ConfigError(f"{spec.where}: 'env: {_key(env)}': importing {module!r} failed ({_one_line(e)})") from None
    if name.isidentifier() and hasattr(imported, name):
        env_class = getattr(imported, name)
        if not _is_env_class(env_class):
            raise ConfigError(f"{spec.where}: 'env: {_key(env)}' is not an env class (a gymnasium.Env or RLlib "
                              "MultiAgentEnv subclass); name one, or register an env creator with Tune's "
                              "register_env in a 'register:' module")
        return _register_class(env, name, env_class)
    import gymnasium as gym

    gym.register_envs(imported)
    return _gym_id(spec, env, name)


def _gym_id(spec: ExperimentSpec, env: str, gym_id: str | None = None) -> str:
    import gymnasium as gym

    gym_id = gym_id or env
    if gym_id in gym.registry:
        if "." not in env:
            return env
        # RLlib takes a string with a '.' for a class path: hand it a registered name instead.
        from ray.tune.registry import register_env

        register_env(env, functools.partial(_make_gym_env, env))
        return env
    from ray.tune.registry import ENV_CREATOR, _global_registry

    names = list(gym.registry) + [key for category, key in getattr(_global_registry, "_to_flush", {})
                                  if category == ENV_CREATOR]
    hint = _did_you_mean(gym_id, names)
    if not hint and "/" in gym_id and ":" not in env:
        hint = f" (an ALE id? write 'ale_py:{_key(env)}')"
    raise ConfigError(f"{spec.where}: unknown env 'env: {_key(env)}'{hint}; give a registered gymnasium id "
                      "(e.g. CartPole-v1), 'module:Class' with the module in 'register:', or list the module that "
                      "registers it in 'register:'")


def _register_class(env: str, name: str, env_class: type) -> str:
    """Registers an env class with Tune under its name as the file gives it (``MultiAgentCartPole`` for
    ``ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole``), so that RLlib, Tune's trial names and
    the recording's manifest all say that name; the whole path when the short name is taken."""
    import gymnasium as gym
    from ray.tune.registry import ENV_CREATOR, _global_registry, register_env

    creator = functools.partial(_make_class_env, env_class)
    taken = name in gym.registry or _global_registry.contains(ENV_CREATOR, name) and not _same_creator(name, creator)
    registered = env if taken else name
    register_env(registered, creator)
    return registered


def _same_creator(name: str, creator: functools.partial) -> bool:
    from ray.tune.registry import ENV_CREATOR, _global_registry

    try:
        known = _global_registry.get(ENV_CREATOR, name)
    except Exception:  # noqa: BLE001 - unreadable: taken by something else
        return False
    return isinstance(known, functools.partial) and known.func is creator.func and known.args == creator.args


def _make_class_env(env_class: type, env_config: Any) -> Any:
    return env_class(env_config)


def _make_gym_env(env_id: str, env_config: Any) -> Any:
    import gymnasium as gym

    return gym.make(env_id, **dict(env_config))


def _is_env_class(value: Any) -> bool:
    import gymnasium as gym
    from ray.rllib.env.base_env import BaseEnv
    from ray.rllib.env.external_env import ExternalEnv
    from ray.rllib.env.multi_agent_env import MultiAgentEnv
    from ray.rllib.env.vector_env import VectorEnv

    return isinstance(value, type) and issubclass(value, (gym.Env, MultiAgentEnv, BaseEnv, VectorEnv, ExternalEnv))


def _allowed(module: str, register: list[str], builtin: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in [*register, *builtin])


def _known_keys(defaults: Any) -> tuple[dict[str, Any], set[str], set[str]]:
    """(attributes with their defaults, settable properties, evaluation() arguments) of a config class."""
    import inspect

    from ray._common.deprecation import DEPRECATED_VALUE

    attributes = {k: v for k, v in vars(defaults).items() if not (type(v) is int and v == DEPRECATED_VALUE)}
    properties = {k for k, v in inspect.getmembers(type(defaults)) if isinstance(v, property) and v.fset}
    evaluation = set(inspect.signature(type(defaults).evaluation).parameters) - {"self"}
    return attributes, properties, evaluation


def _check_settings(settings: dict, defaults: Any, spec: ExperimentSpec, where: str, top: bool) -> None:
    attributes, properties, evaluation = _known_keys(defaults)
    names = sorted(set(attributes) | evaluation | ROUTED_KEYS | {"env_config", "callbacks", "lambda", "framework",
                                                                  "input", "num_workers"})
    cls = type(defaults)
    for key, value in settings.items():
        if not isinstance(key, str):
            raise ConfigError(f"{spec.where}: '{where}' key {_show.repr(key)} is not a name; RLlib's settings are "
                              "named, e.g. 'num_env_runners: 2'")
        at = f"{spec.where}: '{where} {_key(key)}:'"
        try:
            name = cls._translate_special_keys(key, warn_deprecated=True)
        except Exception as e:
            raise ConfigError(f"{at} is an old RLlib setting ({_one_line(e)}); rename it") from None
        if key in ("env", "env_config", "multiagent") and not top:
            raise ConfigError(f"{at} is not supported inside evaluation_config here; evaluation uses the "
                              "experiment's env and policies")
        if name in ("policy_mapping_fn", "observation_fn"):
            raise ConfigError(f"{at} cannot be set from a YAML; give 'multiagent: {{policy_mapping_fn: "
                              "{agent id: policy id}}}' instead")
        if name.startswith("evaluation_"):
            if name not in evaluation:
                raise ConfigError(f"{at} is not an RLlib evaluation setting of {spec.run}"
                                  f"{_did_you_mean(name, evaluation)}; see AlgorithmConfig.evaluation()")
            if name == "evaluation_config" and value is not None:
                if not top:
                    raise ConfigError(f"{at} cannot be nested inside evaluation_config; give it once")
                if not isinstance(value, dict):
                    raise ConfigError(f"{at} must be a mapping of settings for evaluation, e.g. "
                                      f"'evaluation_config: {{explore: false}}'; it is {_what(value)}")
                _check_settings(value, defaults, spec, f"{where} evaluation_config:", top=False)
            continue
        if name in ROUTED_KEYS or name == "env_config":
            if name in ("model", "optimizer", "exploration_config", "replay_buffer_config", "multiagent") \
                    and not isinstance(value, dict):
                raise ConfigError(f"{at} must be a mapping; it is {_what(value)}")
            continue
        if name in attributes:
            _check_value(at, name, value, attributes[name])
        elif name in properties:
            try:  # a renamed setting: RLlib's setter says what it is called now
                setattr(defaults.copy(copy_frozen=False), name, value)
            except Exception as e:
                raise ConfigError(f"{at} is an old RLlib setting ({_one_line(e)}); rename it") from None
        else:
            raise ConfigError(f"{at} is not an RLlib setting of {spec.run}{_did_you_mean(name, names)}; "
                              f"see {cls.__name__} in RLlib's docs for the settings it takes")


def _check_value(at: str, key: str, value: Any, default: Any) -> None:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{at} must be true or false; it is {_what(value)}")
    elif isinstance(default, (int, float)):
        if COUNT.match(key) and type(default) is int:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise ConfigError(f"{at} must be a whole number from 0 to {MAX_COUNT}; it is {_what(value)}")
            return
        if value is None or value == "auto" or isinstance(value, list) and key.endswith(SCHEDULE_SUFFIXES):
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str):
                try:
                    hint = f" (YAML reads {value} as text: write {float(value)!r})"
                except ValueError:
                    pass
            raise ConfigError(f"{at} must be a number{hint}; it is {_what(value)}")
        if key.startswith(("num_cpus", "num_gpus")) and not 0 <= value <= MAX_COUNT:
            raise ConfigError(f"{at} must be a number from 0 to {MAX_COUNT}; it is {_what(value)}")
    elif isinstance(default, dict) and key != "policies":
        if not isinstance(value, dict):
            raise ConfigError(f"{at} must be a mapping; it is {_what(value)}")
    elif isinstance(default, list):
        if value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{at} must be a list; it is {_what(value)}")


def _check_class_paths(settings: dict, spec: ExperimentSpec) -> None:
    """Refuses class paths RLlib would import from `config:` unless from ray.rllib or a `register:` module."""
    stack: list[tuple[Any, str, bool]] = [(settings, "config:", False)]
    seen: set[int] = set()
    while stack:
        value, where, is_path = stack.pop()
        if id(value) in seen and not isinstance(value, str):
            continue
        seen.add(id(value))
        if len(seen) > MAX_NODES:
            raise ConfigError(f"{spec.where}: 'config:' holds more than {MAX_NODES} values; an RLlib config "
                              "needs far fewer")
        if isinstance(value, str):
            if is_path and "." in value and _is_module_name(value):
                module = value.rsplit(".", 1)[0]
                if not _allowed(module, spec.register, BUILTIN_CLASS_MODULES):
                    raise ConfigError(f"{spec.where}: '{where}' {value!r} would be imported by RLlib from module "
                                      f"{module!r}, which the file does not list in 'register:'; add "
                                      f"'register: [{module}]' if you trust it")
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{where} {_key(key)}:"
                if key == "policies" and isinstance(item, dict):  # {policy id: [policy class, ...]}
                    stack.extend((spec_item, inner, True) for spec_item in item.values())
                else:  # a list of policy ids holds no class paths
                    stack.append((item, inner, is_path or key in CLASS_PATH_KEYS))
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                stack.append((item, where, is_path))


def _multiagent(value: Any, spec: ExperimentSpec) -> dict[str, Any]:
    at = f"{spec.where}: 'config: multiagent:'"
    multiagent = dict(_mapping(value, at, "e.g. 'multiagent: {policies: [p0, p1], policy_mapping_fn: {0: p0, 1: p1}}'"))
    for key in multiagent:
        if key not in MULTIAGENT_KEYS:
            raise ConfigError(f"{at} unknown setting {_show.repr(key)}{_did_you_mean(key, MULTIAGENT_KEYS)}; it "
                              f"takes {', '.join(MULTIAGENT_KEYS)}")
    policies = multiagent.get("policies")
    if policies is not None:
        if isinstance(policies, list):
            if not policies or not all(isinstance(p, str) and p for p in policies):
                raise ConfigError(f"{at} 'policies:' must list policy ids, e.g. 'policies: [p0, p1]'; it is "
                                  f"{_what(policies)}")
            multiagent["policies"] = set(policies)
        elif not isinstance(policies, dict) or not policies or not all(isinstance(p, str) for p in policies):
            raise ConfigError(f"{at} 'policies:' must list policy ids, e.g. 'policies: [p0, p1]'; it is "
                              f"{_what(policies)}")
    mapping = multiagent.get("policy_mapping_fn")
    if mapping is not None:
        if not isinstance(mapping, dict) or not mapping or \
                not all(isinstance(p, str) and p for p in mapping.values()):
            raise ConfigError(f"{at} 'policy_mapping_fn:' must map agent ids to policy ids, e.g. "
                              f"'policy_mapping_fn: {{0: p0, 1: p1}}'; it is {_what(mapping)}")
        known = set(multiagent.get("policies") or mapping.values())
        missing = sorted(set(mapping.values()) - known)
        if missing:
            raise ConfigError(f"{at} 'policy_mapping_fn:' maps to policy {missing[0]!r}, which 'policies:' does not "
                              "list; add it there")
        multiagent["policy_mapping_fn"] = AgentToPolicy(mapping)
        multiagent["policies"] = set(multiagent.get("policies") or mapping.values())
    to_train = multiagent.get("policies_to_train")
    if to_train is not None and (not isinstance(to_train, list) or not all(isinstance(p, str) for p in to_train)):
        raise ConfigError(f"{at} 'policies_to_train:' must list policy ids; it is {_what(to_train)}")
    capacity = multiagent.get("policy_map_capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ConfigError(f"{at} 'policy_map_capacity:' must be a number >= 1; it is {_what(capacity)}")
    if multiagent.get("count_steps_by", "env_steps") not in ("env_steps", "agent_steps"):
        raise ConfigError(f"{at} 'count_steps_by:' must be env_steps or agent_steps; it is "
                          f"{_what(multiagent['count_steps_by'])}")
    swappable = multiagent.get("policy_states_are_swappable", False)
    if not isinstance(swappable, bool):
        raise ConfigError(f"{at} 'policy_states_are_swappable:' must be true or false; it is {_what(swappable)}")
    return multiagent


# ----------------------------------------------------------------------------------------------------- running


def build_config(spec: ExperimentSpec) -> Any:
    """The AlgorithmConfig of an experiment (checked by ``check_experiment``), with the recorder callback added."""
    from rllib_recorder.callback import RecorderCallback

    config = check_experiment(spec)
    callback = RecorderCallback.configured(spec.recorder)  # creates the output dir: only once all is checked
    callbacks = config.callbacks_class
    existing = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
                if c.__name__ not in ("RLlibCallback", "DefaultCallbacks")]
    return config.callbacks(existing + [callback] if existing else callback)


def describe(spec: ExperimentSpec) -> str:
    """One line: what the experiment trains, until when, and where it records."""
    stop = ", ".join(f"{k} {v}" for k, v in spec.stop.items()) or "Tune stops it"
    into = os.path.join(spec.recorder.output_dir, spec.recorder.run_name or spec.name)
    relative = os.path.relpath(into)
    return (f"training {spec.run} on {spec.env} until {stop}; recording into "
            f"{into if relative.startswith('..') else relative}")


def run_experiment(spec: ExperimentSpec, *, num_cpus: int | None = None,
                   echo: Callable[[str], None] | None = print, verbose: bool = True,
                   callbacks: list[Any] | None = None, config: Any = None) -> list[str]:
    """Runs the experiment with Tune; returns the recorded run directories.

    ``verbose=False`` keeps Ray, RLlib and Tune quiet in this process (``callbacks``, e.g. ``TrainProgress``,
    show progress instead): no worker logs forwarded, Tune's tables off, Ray's log level ERROR, warnings off.
    A trial that fails raises ``ConfigError`` naming its error and where Tune keeps the whole of it.
    ``config`` is ``build_config(spec)`` when the caller has built it already.
    """
    config = config if config is not None else build_config(spec)  # every check first: before Ray starts
    with _quiet_ray(verbose):
        import ray
        from ray import tune

        if not ray.is_initialized():
            # A trial needs a CPU for its algorithm plus one per env runner; on a small machine
            # ask Ray for that many logical CPUs rather than leave the trial pending forever.
            needed = 1 + int(config.num_env_runners or 0)
            ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, needed), include_dashboard=False,
                     log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
        if echo is not None:
            echo(describe(spec))
        tuner = tune.Tuner(
            spec.run, param_space=config,
            run_config=tune.RunConfig(
                name=spec.name, stop=spec.stop, verbose=1 if verbose else 0, callbacks=callbacks,
                storage_path=os.path.abspath(os.path.join(spec.recorder.output_dir, "_tune")),
            ),
        )
        results = tuner.fit()
    if results.errors:
        failed = next((r for r in results if r.error is not None), None)
        lines = [line.strip() for line in str(results.errors[0]).splitlines() if line.strip()]
        where = os.path.join(failed.path, "error.txt") if failed is not None and failed.path else None
        raise ConfigError(f"experiment {spec.name!r} failed: {lines[-1] if lines else results.errors[0]!r}"
                          + (f" (the whole error: {where})" if where and os.path.isfile(where) else ""))
    return sorted({r.metrics["recorder"]["run_dir"] for r in results if r.metrics and "recorder" in r.metrics})


@contextlib.contextmanager
def _quiet_ray(verbose: bool) -> Iterator[None]:
    """Tune's legacy reporter at verbosity 0 prints nothing (the new one still prints its tables); warnings off."""
    if verbose:
        yield
        return
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def _register_atari(spec: ExperimentSpec) -> str:
    """Registers the wrapped ALE env with Tune (visible to every env runner) and returns its name."""
    from ray.tune.registry import register_env

    options = dict(spec.atari_wrappers or {})
    env = str(spec.env)
    module, _, gym_id = env.rpartition(":")
    try:
        import_env_package("ale_py")
    except ImportError:
        raise ConfigError(f"{spec.where}: 'atari_wrappers:' needs ale-py; pip install 'rllib-recorder[atari]'") \
            from None
    if module and module != "ale_py":
        if not _is_module_name(module) or not _allowed(module, spec.register, BUILTIN_ENV_MODULES):
            raise ConfigError(f"{spec.where}: 'env: {_key(env)}' would import module {module!r}, which the file "
                              f"does not list in 'register:'; add 'register: [{module}]' if you trust it")
        try:
            import_env_package(module)
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{spec.where}: 'env: {_key(env)}' cannot be imported ({_one_line(e)})") from None
    import gymnasium as gym

    if gym_id not in gym.registry:
        names = [n for n in gym.registry if n.startswith("ALE/")]
        raise ConfigError(f"{spec.where}: unknown ALE env 'env: {_key(env)}'{_did_you_mean(gym_id, names)}; "
                          "'atari_wrappers:' takes an ALE id, e.g. 'env: ale_py:ALE/Breakout-v5'")
    dim, framestack = options["dim"], options["framestack"]
    name = f"{spec.env}-atari{dim}x{framestack or 1}"
    creator = functools.partial(make_atari_env, spec.env, dim, framestack)
    register_env(name, lambda env_config: creator(dict(env_config)))
    return name


def import_env_package(module: str) -> None:
    """Imports an env package and registers its gymnasium ids (ALE's start-up banner silenced)."""
    import gymnasium as gym

    imported = importlib.import_module(module)
    gym.register_envs(imported)
    if module == "ale_py" and hasattr(imported, "ALEInterface") and hasattr(imported, "LoggerMode"):
        imported.ALEInterface.setLoggerMode(imported.LoggerMode.Error)
