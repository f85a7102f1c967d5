"""What an experiment imports: the modules its ``register:`` lists, the algorithm ``run:`` names, and the class
paths RLlib would import from ``config:`` (only from ``ray.rllib`` or a ``register:`` module)."""

from __future__ import annotations

from typing import Any

from rllib_recorder._rllib_compat import tune_registered
from rllib_recorder.commands.envs import import_env_package
from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.messages import allowed_module, did_you_mean, is_module_name, one_line, shown_key
from rllib_recorder.errors import ConfigError

# Class paths in `config:` may come from RLlib itself (or a `register:` module).
BUILTIN_CLASS_MODULES = ("ray.rllib",)

# Keys whose string values RLlib imports as a class or function path, at any depth of `config:`.
CLASS_PATH_KEYS = frozenset({
    "callbacks", "callbacks_class", "custom_model", "custom_action_dist", "custom_preprocessor", "type",
    "sample_collector", "policy_class", "env_runner_cls", "learner_class", "custom_evaluation_function",
    "custom_eval_function", "offline_eval_runner_class", "input", "input_", "module_class", "catalog_class",
})

MAX_NODES = 200_000

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


def import_registered(spec: ExperimentSpec) -> None:
    """Imports the modules ``register:`` lists (they register envs, trainables); ConfigError if one fails."""
    for module in spec.register:  # e.g. ale_py: registers its envs with gymnasium
        try:
            import_env_package(module)
        except ImportError as e:
            raise ConfigError(f"{spec.where}: 'register:' cannot import {module!r} ({one_line(e)}); install it "
                              "or fix the name") from None
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{spec.where}: 'register:' importing {module!r} failed ({one_line(e)}); "
                              "fix that module") from None


def resolve_algorithm(spec: ExperimentSpec) -> tuple[type, Any]:
    """(algorithm class, its default config) of ``run:``: one of RLlib's algorithms or a trainable a ``register:``
    module registered; ConfigError naming what to use instead otherwise."""
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


def check_class_paths(settings: dict, spec: ExperimentSpec) -> None:
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
