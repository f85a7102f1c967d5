"""Checking an experiment before Ray starts: what it may import, which env and algorithm it names, RLlib's settings.

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
import dataclasses
import logging
import re
import warnings
from typing import Any, Iterator

from rllib_recorder._rllib_compat import deprecated_value, translate_config_key, tune_registered
from rllib_recorder.commands.envs import import_env_package, resolve_env
from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.experiment_multiagent import multiagent_settings
from rllib_recorder.commands.messages import (
    SHOW,
    allowed_module,
    describe_value,
    did_you_mean,
    is_module_name,
    one_line,
    one_line_errors,
    shown_key,
)
from rllib_recorder.errors import ConfigError, ConfigProblems

# Class paths in `config:` may come from RLlib itself (or a `register:` module).
BUILTIN_CLASS_MODULES = ("ray.rllib",)

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

# RLlib's renamed settings, from RLlib 2.60's own deprecation paths (``deprecation_warning(old=..., new=...)`` in
# AlgorithmConfig and the algorithms' configs): old key -> (new key, whether RLlib maps the old key itself when a
# config dict gives it, with a warning). Those it does not map it refuses (``error=True``), or ignores (IGNORED:
# the attribute is kept as DEPRECATED_VALUE, or a dict key is set and never read).
RENAMED: dict[str, tuple[str, bool]] = {
    "num_workers": ("num_env_runners", True),
    "num_cpus_for_driver": ("num_cpus_for_main_process", True),
    "create_env_on_driver": ("create_env_on_local_worker", True),
    "custom_eval_function": ("custom_evaluation_function", True),
    "evaluation_num_workers": ("evaluation_num_env_runners", True),
    "num_sgd_iter": ("num_epochs", True),  # .training(num_sgd_iter=) maps it
    "num_cpus_per_worker": ("num_cpus_per_env_runner", True),
    "num_gpus_per_worker": ("num_gpus_per_env_runner", True),
    "custom_resources_per_worker": ("custom_resources_per_env_runner", True),
    "num_learner_workers": ("num_learners", True),
    "num_cpus_per_learner_worker": ("num_cpus_per_learner", True),
    "num_gpus_per_learner_worker": ("num_gpus_per_learner", True),
    "num_cpus_for_local_worker": ("num_cpus_for_main_process", True),
    "max_requests_in_flight_per_sampler_worker": ("max_requests_in_flight_per_env_runner", True),
    "model_config_dict": ("model_config", True),
    "sgd_minibatch_size": ("minibatch_size", False),
    "num_rollout_workers": ("num_env_runners", False),
    "num_envs_per_worker": ("num_envs_per_env_runner", False),
    "validate_workers_after_construction": ("validate_env_runners_after_construction", False),
    "synchronize_filters": ("update_worker_filter_stats", False),
    "recreate_failed_workers": ("restart_failed_env_runners", False),
    "recreate_failed_env_runners": ("restart_failed_env_runners", False),
    "ignore_worker_failures": ("ignore_env_runner_failures", False),
    "max_num_worker_restarts": ("max_num_env_runner_restarts", False),
    "delay_between_worker_restarts_s": ("delay_between_env_runner_restarts_s", False),
    "num_consecutive_worker_failures_tolerance": ("num_consecutive_env_runner_failures_tolerance", False),
    "worker_health_probe_timeout_s": ("env_runner_health_probe_timeout_s", False),
    "worker_restore_timeout_s": ("env_runner_restore_timeout_s", False),
    "metrics_smoothing_episodes": ("metrics_num_episodes_for_smoothing", False),
    "min_iter_time_s": ("min_time_s_per_iteration", False),
    "min_time_s_per_reporting": ("min_time_s_per_iteration", False),
    "min_sample_timesteps_per_reporting": ("min_sample_timesteps_per_iteration", False),
    "min_train_timesteps_per_reporting": ("min_train_timesteps_per_iteration", False),
    "timesteps_per_iteration": ("min_sample_timesteps_per_iteration", False),
    "collect_metrics_timeout": ("metrics_episode_collection_timeout_s", False),
    "evaluation_num_episodes": ("evaluation_duration", False),
    "target_update_frequency": ("target_network_update_freq", False),
    "sample_batch_size": ("rollout_fragment_length", False),
}
# Algorithms of earlier RLlib releases that 2.60 no longer ships, with the nearest one it has.
_ON_POLICY = "use PPO (or APPO for asynchronous sampling) and adapt 'config:'"
REMOVED_ALGORITHMS: dict[str, str] = {
    **{name: _ON_POLICY for name in ("A2C", "A3C", "PG", "ES", "ARS", "DDPPO", "MAML", "MBMPO", "AlphaStar",
                                     "ALPHASTAR")},
    **{name: "use SAC (continuous actions) and adapt 'config:'" for name in ("DDPG", "TD3", "APEX_DDPG",
                                                                            "ApexDDPG")},
    **{name: "use DQN and adapt 'config:'" for name in ("APEX", "ApexDQN", "APEX_DQN", "R2D2", "SimpleQ",
                                                        "SIMPLEQ", "QMIX", "SlateQ", "SLATEQ")},
    **{name: "use BC, MARWIL, CQL or IQL (offline) and adapt 'config:'" for name in ("CRR", "DT")},
    **{name: "use DreamerV3" for name in ("Dreamer", "DREAMER")},
    **{name: "RLlib 2.60 has no counterpart; rllib_contrib kept the old code" for name in (
        "AlphaZero", "ALPHAZERO", "LeelaChessZero", "MADDPG", "BanditLinUCB", "BanditLinTS", "LinUCB", "LinTS",
        "Random", "RandomAgent")},
}

IGNORED = frozenset({"sgd_minibatch_size", "sample_batch_size", "synchronize_filters"})


def check_experiment(spec: ExperimentSpec) -> Any:
    """Resolves what the experiment names (see the module docstring for what may be imported) and checks its
    RLlib ``config:``; returns the AlgorithmConfig without the recorder. Starts no Ray and writes no file.
    Raises ``ConfigError``: one line for one problem, ``ConfigProblems`` listing every problem found (each with its
    fix) when there are more, so that the file is fixed once. Notes on keys it translated (RLlib's renames) go to
    ``spec.notes``."""
    problems: list[str] = []

    def attempt(check: Any, *args: Any) -> Any:
        try:
            return one_line_errors(check)(*args)
        except ConfigError as e:
            problems.append(str(e))
            return None

    attempt(_import_registered, spec)
    found = attempt(_algorithm, spec)
    env = attempt(resolve_env, spec)
    envs = [env] + [attempt(resolve_env, dataclasses.replace(spec, env=other, env_grid=None))
                    for other in (spec.env_grid or [])[1:]]
    settings = copy.deepcopy(spec.config)  # RLlib's update_from_dict changes the dicts it is given
    env_config = settings.pop("env_config", None) or {}
    if found is not None:
        algo_class, defaults = found
        settings = _renamed(settings, spec, "config:", problems)
        _check_settings(settings, defaults, spec, "config:", top=True, problems=problems)
    attempt(_check_class_paths, settings, spec)
    multiagent = settings.get("multiagent")
    if multiagent is not None:
        checked = attempt(multiagent_settings, multiagent, spec)
        if checked is not None:
            settings["multiagent"] = checked
    if problems:
        raise_problems(spec, problems)
    with _quiet():  # RLlib's notes on the config (e.g. 'running PPO on the new API stack') come when it runs
        config = one_line_errors(_rllib_config)(spec, algo_class, defaults, env, env_config, settings)
    if spec.env_grid:  # RLlib checked the first env's config; Tune makes a trial per env
        config.env = {"grid_search": envs}
    return config


def raise_problems(spec: ExperimentSpec, problems: list[str]) -> None:
    """One ConfigError for one problem; ``ConfigProblems`` for more (every one, each with its fix)."""
    problems = [" ".join(p.split()) for p in problems]  # a name in the file may hold a line break
    if len(problems) == 1:
        raise ConfigError(problems[0])
    prefix = " ".join(f"{spec.where}: ".split()) + " "
    raise ConfigProblems(" ".join(f"{spec.where}: {len(problems)} problems".split()), [
        p[len(prefix):] if p.startswith(prefix) else p for p in problems])


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
    grids = {k: v for k, v in settings.items() if is_grid(v)}
    if grids:  # each grid value is checked; RLlib validates the first combination, Tune expands the rest
        first = {**settings, **{k: v["grid_search"][0] for k, v in grids.items()}}
        config = _rllib_config(spec, algo_class, defaults.copy(copy_frozen=False), env, env_config, first)
        for key, grid in grids.items():
            setattr(config, translate_config_key(type(config), key), grid)
        return config
    config = defaults
    try:
        if env is not None:
            config = config.environment(env, env_config=env_config)
        elif env_config:
            config = config.environment(env_config=env_config)
        config = config.update_from_dict(settings)
    except Exception as e:  # RLlib's own checks of the values it is given
        key = _culprit(algo_class, settings)
        raise ConfigError(f"{spec.where}: RLlib refuses 'config:{f' {shown_key(key)}:' if key else ''}' ({one_line(e)}); "
                          "fix that setting") from None
    try:
        config.copy(copy_frozen=False).validate()
    except Exception as e:
        raise ConfigError(f"{spec.where}: RLlib refuses 'config:' for {spec.run} ({one_line(e)}); "
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


def _import_registered(spec: ExperimentSpec) -> None:
    for module in spec.register:  # e.g. ale_py: registers its envs with gymnasium
        try:
            import_env_package(module)
        except ImportError as e:
            raise ConfigError(f"{spec.where}: 'register:' cannot import {module!r} ({one_line(e)}); install it "
                              "or fix the name") from None
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{spec.where}: 'register:' importing {module!r} failed ({one_line(e)}); "
                              "fix that module") from None


def _algorithm(spec: ExperimentSpec) -> tuple[type, Any]:
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.registry import ALGORITHMS
    from ray.tune.registry import TRAINABLE_CLASS

    try:
        if spec.run in ALGORITHMS:
            algo_class = ALGORITHMS[spec.run]()[0]
        elif not spec.run.startswith("__") and tune_registered(TRAINABLE_CLASS, spec.run) is not None:
            algo_class = tune_registered(TRAINABLE_CLASS, spec.run)  # registered by a `register:` module
            if not (isinstance(algo_class, type) and issubclass(algo_class, Algorithm)):
                raise ConfigError(f"{spec.where}: 'run: {shown_key(spec.run)}' is a Tune trainable, not an RLlib algorithm; "
                                  f"use one of {', '.join(ALGORITHMS)}")
        elif spec.run in REMOVED_ALGORITHMS or spec.run.upper() in REMOVED_ALGORITHMS:
            instead = REMOVED_ALGORITHMS.get(spec.run) or REMOVED_ALGORITHMS[spec.run.upper()]
            raise ConfigError(f"{spec.where}: 'run: {shown_key(spec.run)}' is an algorithm RLlib 2.60 no longer has "
                              f"(moved to rllib_contrib or removed); {instead}")
        else:
            raise ConfigError(f"{spec.where}: unknown algorithm 'run: {shown_key(spec.run)}'"
                              f"{did_you_mean(spec.run, ALGORITHMS)}; RLlib's algorithms are "
                              f"{', '.join(ALGORITHMS)} (or register your own with a 'register:' module)")
        return algo_class, algo_class.get_default_config()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{spec.where}: 'run: {shown_key(spec.run)}' cannot be loaded ({one_line(e)}); install what it "
                          "needs or choose another algorithm") from None


def _known_keys(defaults: Any) -> tuple[dict[str, Any], set[str], set[str]]:
    """(attributes with their defaults, settable properties, evaluation() arguments) of a config class."""
    import inspect

    attributes = {k: v for k, v in vars(defaults).items() if not (type(v) is int and v == deprecated_value())}
    properties = {k for k, v in inspect.getmembers(type(defaults)) if isinstance(v, property) and v.fset}
    evaluation = set(inspect.signature(type(defaults).evaluation).parameters) - {"self"}
    return attributes, properties, evaluation


def is_grid(value: Any) -> bool:
    """Tune's ``{grid_search: [v1, v2, ...]}``."""
    return isinstance(value, dict) and set(value) == {"grid_search"} and isinstance(value["grid_search"], list) \
        and bool(value["grid_search"])


def _renamed(settings: dict, spec: ExperimentSpec, where: str, problems: list[str]) -> dict:
    """RLlib's renamed settings (its own deprecation paths): a key RLlib maps itself is translated, with a note
    naming the new key; one it ignores or refuses is a problem naming the new key."""
    out = {}
    for key, value in settings.items():
        rename = RENAMED.get(key) if isinstance(key, str) else None
        if rename is None:
            out[key] = value
            continue
        new, mapped = rename
        at = f"{spec.where}: '{where} {key}:'"
        if not mapped and not spec.rename_old_keys:
            problems.append(f"{at} is RLlib's old name of '{new}', which RLlib 2.60 "
                            f"{'ignores' if key in IGNORED else 'refuses'}; rename it '{new}' (or run with "
                            "--rename-old-keys)")
            continue
        if new in settings:
            problems.append(f"{at} is RLlib's old name of '{new}', which the file sets too; keep one '{new}:'")
            continue
        spec.notes.append(f"{at} is RLlib's old name of '{new}'{'' if mapped else ' (--rename-old-keys)'}; taken as "
                          f"'{new}: {SHOW.repr(value)}' (rename it to silence this)")
        out[new] = value
    return out


def _check_settings(settings: dict, defaults: Any, spec: ExperimentSpec, where: str, top: bool,
                    problems: list[str]) -> None:
    """Checks every setting, adding each problem (one line with its fix) to ``problems``."""
    attributes, properties, evaluation = _known_keys(defaults)
    names = sorted(set(attributes) | evaluation | ROUTED_KEYS | {"env_config", "callbacks", "lambda", "framework",
                                                                  "input", "num_workers"})
    for key, value in settings.items():
        try:
            if is_grid(value):
                for item in value["grid_search"]:
                    _check_setting(key, item, defaults, spec, where, top, attributes, properties, evaluation,
                                   names, problems)
            else:
                _check_setting(key, value, defaults, spec, where, top, attributes, properties, evaluation, names,
                               problems)
        except ConfigError as e:
            if str(e) not in problems:
                problems.append(str(e))


def _check_setting(key: Any, value: Any, defaults: Any, spec: ExperimentSpec, where: str, top: bool,
                   attributes: dict, properties: set, evaluation: set, names: list, problems: list[str]) -> None:
    cls = type(defaults)
    if not isinstance(key, str):
        raise ConfigError(f"{spec.where}: '{where}' key {SHOW.repr(key)} is not a name; RLlib's settings are "
                          "named, e.g. 'num_env_runners: 2'")
    at = f"{spec.where}: '{where} {shown_key(key)}:'"
    try:
        name = translate_config_key(cls, key)
    except Exception as e:
        raise ConfigError(f"{at} is an old RLlib setting ({one_line(e)}); rename it") from None
    if name == "framework_str" and value in ("tf", "tf2", "tfe"):
        raise ConfigError(f"{at} {value} needs TensorFlow, which this install does not run (RLlib 2.60's new API "
                          "stack is torch only); write 'framework: torch'")
    if key in ("env", "env_config", "multiagent") and not top:
        raise ConfigError(f"{at} is not supported inside evaluation_config here; evaluation uses the "
                          "experiment's env and policies")
    if name in ("policy_mapping_fn", "observation_fn"):
        raise ConfigError(f"{at} cannot be set from a YAML; give 'multiagent: {{policy_mapping_fn: "
                          "{agent id: policy id}}}' instead")
    if name.startswith("evaluation_"):
        if name not in evaluation:
            raise ConfigError(f"{at} is not an RLlib evaluation setting of {spec.run}"
                              f"{did_you_mean(name, evaluation)}; see AlgorithmConfig.evaluation()")
        if name == "evaluation_config" and value is not None:
            if not top:
                raise ConfigError(f"{at} cannot be nested inside evaluation_config; give it once")
            if not isinstance(value, dict):
                raise ConfigError(f"{at} must be a mapping of settings for evaluation, e.g. "
                                  f"'evaluation_config: {{explore: false}}'; it is {describe_value(value)}")
            inner = _renamed(value, spec, f"{where} evaluation_config:", problems)
            value.clear()
            value.update(inner)
            _check_settings(value, defaults, spec, f"{where} evaluation_config:", top=False, problems=problems)
        return
    if name in ROUTED_KEYS or name == "env_config":
        if name in ("model", "optimizer", "exploration_config", "replay_buffer_config", "multiagent") \
                and not isinstance(value, dict):
            raise ConfigError(f"{at} must be a mapping; it is {describe_value(value)}")
        return
    if name in attributes:
        _check_value(at, name, value, attributes[name])
    elif name in properties:
        try:  # a renamed setting: RLlib's setter says what it is called now
            setattr(defaults.copy(copy_frozen=False), name, value)
        except Exception as e:
            raise ConfigError(f"{at} is an old RLlib setting ({one_line(e)}); rename it") from None
    else:
        raise ConfigError(f"{at} is not an RLlib setting of {spec.run}{did_you_mean(name, names)}; "
                          f"see {cls.__name__} in RLlib's docs for the settings it takes")


def _check_value(at: str, key: str, value: Any, default: Any) -> None:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{at} must be true or false; it is {describe_value(value)}")
    elif isinstance(default, (int, float)):
        if COUNT.match(key) and type(default) is int:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise ConfigError(f"{at} must be a whole number from 0 to {MAX_COUNT}; it is {describe_value(value)}")
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
            raise ConfigError(f"{at} must be a number{hint}; it is {describe_value(value)}")
        if key.startswith(("num_cpus", "num_gpus")) and not 0 <= value <= MAX_COUNT:
            raise ConfigError(f"{at} must be a number from 0 to {MAX_COUNT}; it is {describe_value(value)}")
    elif isinstance(default, dict) and key != "policies":
        if not isinstance(value, dict):
            raise ConfigError(f"{at} must be a mapping; it is {describe_value(value)}")
    elif isinstance(default, list):
        if value is not None and not isinstance(value, (list, tuple)):
            raise ConfigError(f"{at} must be a list; it is {describe_value(value)}")


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
            if is_path and "." in value and is_module_name(value):
                module = value.rsplit(".", 1)[0]
                if not allowed_module(module, spec.register, BUILTIN_CLASS_MODULES):
                    raise ConfigError(f"{spec.where}: '{where}' {value!r} would be imported by RLlib from module "
                                      f"{module!r}, which the file does not list in 'register:'; add "
                                      f"'register: [{module}]' if you trust it")
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{where} {shown_key(key)}:"
                if key == "policies" and isinstance(item, dict):  # {policy id: [policy class, ...]}
                    stack.extend((spec_item, inner, True) for spec_item in item.values())
                else:  # a list of policy ids holds no class paths
                    stack.append((item, inner, is_path or key in CLASS_PATH_KEYS))
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                stack.append((item, where, is_path))
