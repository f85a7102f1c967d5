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

Each problem is one ``ConfigError`` line: where, what is wrong, the fix. The checks by kind: ``experiment_imports``
(``register:``, ``run:``, class paths), ``envs`` (``env:``), ``experiment_settings`` (the keys and values of
``config:``), ``experiment_multiagent`` (``multiagent:``); this module runs them all, then asks RLlib's own checks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from typing import Any, Iterator

from rllib_recorder._rllib_compat import translate_config_key
from rllib_recorder.commands.envs import resolve_env
from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.experiment_imports import check_class_paths, import_registered, resolve_algorithm
from rllib_recorder.commands.experiment_multiagent import multiagent_settings
from rllib_recorder.commands.experiment_settings import check_settings, is_grid, renamed_settings
from rllib_recorder.commands.messages import one_line, one_line_errors, shown_key
from rllib_recorder.errors import ConfigError, ConfigProblems


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

    attempt(import_registered, spec)
    found = attempt(resolve_algorithm, spec)
    env = attempt(resolve_env, spec)
    envs = [env] + [attempt(resolve_env, dataclasses.replace(spec, env=other, env_grid=None))
                    for other in (spec.env_grid or [])[1:]]
    settings = copy.deepcopy(spec.config)  # RLlib's update_from_dict changes the dicts it is given
    env_config = settings.pop("env_config", None) or {}
    if found is not None:
        algo_class, defaults = found
        settings = renamed_settings(settings, spec, "config:", problems)
        check_settings(settings, defaults, spec, "config:", top=True, problems=problems)
    attempt(check_class_paths, settings, spec)
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
