"""RLlib's settings in an experiment's ``config:``: old names taken as RLlib's new ones or refused with the new
name, every key known to the algorithm's config class, each value of the kind its default has."""

from __future__ import annotations

import re
from typing import Any

from rllib_recorder._rllib_compat import deprecated_value, translate_config_key
from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.messages import SHOW, describe_value, did_you_mean, one_line, shown_key
from rllib_recorder.errors import ConfigError

# Special keys RLlib's update_from_dict routes to a setter method rather than an attribute.
ROUTED_KEYS = frozenset({"multiagent", "model", "optimizer", "exploration_config", "replay_buffer_config",
                         "sample_collector", "callbacks_class"})

SCHEDULE_SUFFIXES = ("lr", "entropy_coeff", "epsilon")  # numbers that may also be a [[t, value], ...] schedule

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

IGNORED = frozenset({"sgd_minibatch_size", "sample_batch_size", "synchronize_filters"})


def is_grid(value: Any) -> bool:
    """Tune's ``{grid_search: [v1, v2, ...]}``."""
    return isinstance(value, dict) and set(value) == {"grid_search"} and isinstance(value["grid_search"], list) \
        and bool(value["grid_search"])


def renamed_settings(settings: dict, spec: ExperimentSpec, where: str, problems: list[str]) -> dict:
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


def check_settings(settings: dict, defaults: Any, spec: ExperimentSpec, where: str, top: bool,
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
            inner = renamed_settings(value, spec, f"{where} evaluation_config:", problems)
            value.clear()
            value.update(inner)
            check_settings(value, defaults, spec, f"{where} evaluation_config:", top=False, problems=problems)
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


def _known_keys(defaults: Any) -> tuple[dict[str, Any], set[str], set[str]]:
    """(attributes with their defaults, settable properties, evaluation() arguments) of a config class."""
    import inspect

    attributes = {k: v for k, v in vars(defaults).items() if not (type(v) is int and v == deprecated_value())}
    properties = {k for k, v in inspect.getmembers(type(defaults)) if isinstance(v, property) and v.fset}
    evaluation = set(inspect.signature(type(defaults).evaluation).parameters) - {"self"}
    return attributes, properties, evaluation
