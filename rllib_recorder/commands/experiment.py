"""A Tune-style YAML experiment: what a file holds, read and checked for its shape and types, importing nothing it
names.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from rllib_recorder.commands.messages import (
    SHOW,
    as_mapping,
    describe_value,
    did_you_mean,
    is_module_name,
    one_line_errors,
    shown_key,
)
from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import ConfigError

# The name the recorder gives an ALE env with RLlib's Atari wrappers: '<id>-atari<dim>x<stack>'.
ATARI_NAME = re.compile(r"^(?P<id>.+)-atari(?P<dim>\d+)x(?P<stack>\d+)$")

EXPERIMENT_KEYS = ("run", "env", "stop", "config", "recorder", "register", "atari_wrappers")

ATARI_OPTIONS = ("dim", "framestack")


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
    notes: list[str] = field(default_factory=list)  # what was translated or looks wrong, shown at start
    rename_old_keys: bool = False  # take RLlib's old key names as their new ones, also those RLlib 2.60 refuses
    env_grid: list[str] | None = None  # 'env: {grid_search: [...]}': Tune runs a trial per env (``env`` is the first)

    @property
    def where(self) -> str:
        return f"{self.path}: experiment {self.name!r}" if self.path else f"experiment {self.name!r}"


@one_line_errors
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
                          f"{describe_value(document)}" + (f" with {len(document)} keys" if isinstance(document, dict) else ""))
    (name, body), = document.items()
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or os.sep in name \
            or "\0" in name:
        raise ConfigError(f"{path}: the experiment name {SHOW.repr(name)} must be a plain name without '/' "
                          "(Tune names its directory after it), e.g. 'cartpole-ppo:'")
    at = f"{path}: experiment {name!r}"
    if not isinstance(body, dict):
        raise ConfigError(f"{at} must be a mapping with 'run:' (the algorithm, e.g. PPO), 'env:', 'stop:' and "
                          f"'config:'; it is {describe_value(body)}")
    for key in body:
        if key not in EXPERIMENT_KEYS:
            raise ConfigError(f"{at}: unknown setting {SHOW.repr(key)}{did_you_mean(key, EXPERIMENT_KEYS)}; "
                              f"an experiment takes {', '.join(EXPERIMENT_KEYS)}")
    if "run" not in body:
        raise ConfigError(f"{at} has no 'run:' (the algorithm); add e.g. 'run: PPO'")
    run = body["run"]
    if not isinstance(run, str) or not run.strip():
        raise ConfigError(f"{at}: 'run:' must name an RLlib algorithm, e.g. 'run: PPO'; it is {describe_value(run)}")
    config = as_mapping(body.get("config"), f"{at}: 'config:'", "RLlib's settings, e.g. 'config: {num_env_runners: 2}'")
    for key in config:
        if not isinstance(key, str):
            raise ConfigError(f"{at}: 'config:' key {SHOW.repr(key)} is not a name; RLlib's settings are "
                              "named, e.g. 'num_env_runners: 2'")
    env = body.get("env")
    if "env" in config:  # a Tune YAML may give the env inside RLlib's config
        if env is not None:
            raise ConfigError(f"{at} names its env twice ('env:' and 'config: {{env: ...}}'); keep one 'env:'")
        config = dict(config)
        env = config.pop("env")
    env_grid = None
    if isinstance(env, dict) and set(env) == {"grid_search"} and isinstance(env["grid_search"], list) \
            and env["grid_search"] and all(_env_name(e) for e in env["grid_search"]):
        env_grid = list(dict.fromkeys(env["grid_search"]))  # Tune's grid over envs: a trial each
        env = env_grid[0]
    if env is not None and not _env_name(env):
        raise ConfigError(f"{at}: 'env:' must be a gymnasium id or 'module:Class' (or Tune's "
                          f"'{{grid_search: [id, ...]}}'), e.g. 'env: CartPole-v1'; it is {describe_value(env)}")
    env_config = config.get("env_config")
    if env_config is not None:
        as_mapping(env_config, f"{at}: 'config: env_config:'", "the env's settings, e.g. 'env_config: {num_agents: 2}'")
        bad = [k for k in env_config if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{at}: 'config: env_config:' key {SHOW.repr(bad[0])} is not a name; "
                              "an env's settings are named, e.g. 'num_agents: 2'")
    stop = dict(as_mapping(body.get("stop"), f"{at}: 'stop:'", "e.g. 'stop: {training_iteration: 5}'"))
    if stop_iters is not None:
        stop["training_iteration"] = stop_iters
    if stop_timesteps is not None:
        stop["num_env_steps_sampled_lifetime"] = stop_timesteps
    stop, notes = _stop_conditions(stop, at)
    recorder = dict(as_mapping(body.get("recorder"), f"{at}: 'recorder:'",
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
    if env_grid is not None and (atari is not None or any(ATARI_NAME.match(e) for e in env_grid)):
        raise ConfigError(f"{at}: a grid over envs takes ids without 'atari_wrappers:' (ALE ids such as "
                          "BreakoutNoFrameskip-v4 get RLlib's Atari wrappers by themselves); give one experiment "
                          "per wrapped env instead")
    return ExperimentSpec(name=name, run=run, env=env, stop=stop, config=dict(config), recorder=recorder_config,
                          register=register, atari_wrappers=atari, path=str(path), notes=notes, env_grid=env_grid)


def _env_name(env: Any) -> bool:
    return isinstance(env, str) and bool(env.strip()) and "\0" not in env


def _nearest(key: str, names: Any) -> list[str]:
    """Up to three result names like ``key``: by the whole name, else by its last part."""
    import difflib

    names = sorted(names)
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    if not close:
        by_last = {}
        for n in names:
            by_last.setdefault(n.rsplit("/", 1)[-1], n)
        close = [by_last[k] for k in difflib.get_close_matches(key.rsplit("/", 1)[-1], list(by_last), n=3, cutoff=0.6)]
    return close


def _stop_conditions(stop: dict[str, Any], at: str) -> tuple[dict[str, Any], list[str]]:
    """``stop:`` as Tune takes it (train until the result reaches each value; any number, negative included), old
    result names mapped to RLlib 2.60's with a note, and a note for a name no RLlib result holds (a callback may add
    it, so it is not refused)."""
    from rllib_recorder.commands.result_names import OLD_RESULT_NAMES, RESULT_NAMES

    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in stop.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"{at}: 'stop:' key {SHOW.repr(key)} is not a result name; e.g. "
                              "'stop: {training_iteration: 5}'")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConfigError(f"{at}: 'stop: {shown_key(key)}:' must be a number (train until the result reaches it), "
                              f"e.g. '{shown_key(key)}: 5'; it is {describe_value(value)}")
        name = key
        if key in OLD_RESULT_NAMES:
            name = OLD_RESULT_NAMES[key]
            notes.append(f"{at}: 'stop: {key}:' is the result name of RLlib before 2.x, which RLlib 2.60 results do "
                         f"not hold; stopping on '{name}' instead (write that name to silence this)")
        elif name not in RESULT_NAMES and not name.startswith("recorder/"):
            near = _nearest(key, RESULT_NAMES)
            notes.append(f"{at}: 'stop: {shown_key(key)}:' is not a name RLlib 2.60's results hold"
                         + (f" (nearest: {', '.join(near)})" if near else "")
                         + "; it only stops the run if a callback of yours adds it")
        out[name] = value
    return out, notes


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


def _module_list(value: Any, at: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{at}: 'register:' must be a list of module names to import, e.g. 'register: [ale_py]'; "
                          f"it is {describe_value(value)}")
    for module in value:
        if not is_module_name(module):
            raise ConfigError(f"{at}: 'register:' entry {SHOW.repr(module)} is not a module name; list importable "
                              "modules, e.g. 'register: [ale_py, mypkg.envs]'")
    return list(value)


def _atari_options(value: Any, at: str) -> dict[str, Any] | None:
    if value is None:
        return None
    options = as_mapping(value, f"{at}: 'atari_wrappers:'", "e.g. 'atari_wrappers: {dim: 84, framestack: 4}'")
    for key in options:
        if key not in ATARI_OPTIONS:
            raise ConfigError(f"{at}: unknown 'atari_wrappers:' setting {SHOW.repr(key)}"
                              f"{did_you_mean(key, ATARI_OPTIONS)}; it takes 'dim' and 'framestack', e.g. "
                              "'atari_wrappers: {dim: 84, framestack: 4}'")
    dim, stack = options.get("dim", 84), options.get("framestack", 4)
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 4096:
        raise ConfigError(f"{at}: 'atari_wrappers: dim:' must be a frame size in pixels (1-4096), e.g. 'dim: 84'; "
                          f"it is {describe_value(dim)}")
    if stack is not None and (isinstance(stack, bool) or not isinstance(stack, int) or not 1 <= stack <= 64):
        raise ConfigError(f"{at}: 'atari_wrappers: framestack:' must be a number of frames (1-64) or null, e.g. "
                          f"'framestack: 4'; it is {describe_value(stack)}")
    return {"dim": dim, "framestack": stack}
