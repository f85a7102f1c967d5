"""The envs an experiment or a replay may name: gymnasium ids, Tune-registered names, env classes, RLlib's Atari
wrappers.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import Any

from rllib_recorder._rllib_compat import tune_registered, tune_registered_names
from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.messages import allowed_module, did_you_mean, is_module_name, one_line, shown_key
from rllib_recorder.errors import ConfigError

# Modules an `env:` may name without a `register:` entry: the recorder's Atari wrappers import ale_py (as RLlib
# does for 'ale_py:ALE/...' ids), and gymnasium's and RLlib's own env classes.
BUILTIN_ENV_MODULES = ("ale_py", "gymnasium", "ray.rllib.env", "ray.rllib.examples.envs.classes")


def make_atari_env(env_id: str, dim: int, framestack: int | None, env_config: dict[str, Any]) -> Any:
    """An ALE env wrapped with RLlib's Atari wrappers (grayscale, dim x dim, frameskip, frame stack)."""
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack

    import_env_package("ale_py")
    settings = {"frameskip": 1, "repeat_action_probability": 0.0, **dict(env_config)}
    skip = int(settings.pop("wrapper_frameskip", 4))
    return wrap_atari_for_new_api_stack(gym.make(env_id, **settings), dim=dim, frameskip=skip,
                                        framestack=framestack)


def resolve_env(spec: ExperimentSpec) -> Any:
    """What to hand RLlib's ``config.environment()``: a registered name, a gymnasium id or an env class."""
    if spec.atari_wrappers is not None:
        return register_atari(spec)
    if spec.env is None:
        return None
    from ray.tune.registry import ENV_CREATOR

    env = spec.env
    if tune_registered(ENV_CREATOR, env) is not None:
        return env
    if ":" in env:
        module, name = env.split(":", 1)
    elif "." in env and is_module_name(env):  # RLlib's class path form, 'pkg.module.Class'
        module, name = env.rsplit(".", 1)
    elif ALE_LEGACY_ID.match(env):
        return _legacy_atari(spec, env)
    else:
        return _gym_id(spec, env)
    if not is_module_name(module):
        raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' is not a gymnasium id or 'module:Class' "
                          f"({module!r} is not a module name)")
    if not allowed_module(module, spec.register, BUILTIN_ENV_MODULES):
        raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' would import module {module!r}, which the file "
                          f"does not list in 'register:'; add 'register: [{module}]' if you trust it, or give a "
                          "gymnasium id")
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' cannot be imported ({one_line(e)}); "
                          "install the module or fix the name") from None
    except (Exception, SystemExit) as e:
        raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}': importing {module!r} failed ({one_line(e)})") from None
    if name.isidentifier() and hasattr(imported, name):
        env_class = getattr(imported, name)
        if not _is_env_class(env_class):
            raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' is not an env class (a gymnasium.Env or RLlib "
                              "MultiAgentEnv subclass); name one, or register an env creator with Tune's "
                              "register_env in a 'register:' module")
        return _register_class(env, name, env_class)
    import gymnasium as gym

    gym.register_envs(imported)
    return _gym_id(spec, env, name)


# The ALE ids of gym's day that RLlib's published Atari experiments name (PongNoFrameskip-v4, Breakout-v0,
# PongDeterministic-v4): ale_py registers them with gymnasium, and RLlib's deepmind preprocessing wrapped them.
ALE_LEGACY_ID = re.compile(r"^[A-Z][A-Za-z]+(NoFrameskip|Deterministic)?-v[04]$")

# RLlib's default conv nets fit these picture sizes (model: dim:); other sizes get 84.
ATARI_DIMS = (42, 64, 84)


def _legacy_atari(spec: ExperimentSpec, env: str) -> str:
    """An ALE id of gym's day: run with RLlib's Atari wrappers, as RLlib's deepmind preprocessing ran it."""
    import gymnasium as gym

    try:
        import_env_package("ale_py")
    except ImportError:
        return _gym_id(spec, env)
    if env not in gym.registry:
        return _gym_id(spec, env)
    model = spec.config.get("model") if isinstance(spec.config.get("model"), dict) else {}
    dim = model.get("dim") if model.get("dim") in ATARI_DIMS else 84
    spec.notes.append(f"{spec.where}: 'env: {shown_key(env)}' is an ALE id: it runs with RLlib's Atari wrappers "
                      f"(grayscale {dim}x{dim}, 4 frames skipped and 4 stacked), as RLlib's deepmind preprocessing "
                      f"ran it (write 'atari_wrappers: {{dim: {dim}, framestack: 4}}' to silence this)")
    return register_atari(dataclasses.replace(spec, atari_wrappers={"dim": dim, "framestack": 4}))


def _gym_id(spec: ExperimentSpec, env: str, gym_id: str | None = None) -> str:
    import gymnasium as gym

    gym_id = gym_id or env
    if gym_id in gym.registry:
        _check_env_package(spec, env, gym.registry[gym_id].entry_point)
        if "." not in env:
            return env
        # RLlib takes a string with a '.' for a class path: hand it a registered name instead.
        from ray.tune.registry import register_env

        register_env(env, functools.partial(_make_gym_env, env))
        return env
    from ray.tune.registry import ENV_CREATOR

    names = list(gym.registry) + tune_registered_names(ENV_CREATOR)
    hint = did_you_mean(gym_id, names)
    if not hint and "/" in gym_id and ":" not in env:
        hint = f" (an ALE id? write 'ale_py:{shown_key(env)}')"
    raise ConfigError(f"{spec.where}: unknown env 'env: {shown_key(env)}'{hint}; give a registered gymnasium id "
                      "(e.g. CartPole-v1), 'module:Class' with the module in 'register:', or list the module that "
                      "registers it in 'register:'")


# gymnasium's env families that need a package of their own, and how to install it.
ENV_PACKAGES = {
    "gymnasium.envs.mujoco": ("mujoco", "pip install 'gymnasium[mujoco]'"),
    "gymnasium.envs.box2d": ("Box2D", "pip install 'gymnasium[box2d]' (it builds with swig)"),
}


def _check_env_package(spec: ExperimentSpec, env: str, entry_point: Any) -> None:
    """A registered gymnasium id whose env needs a package that is not installed (MuJoCo, Box2D): one line."""
    import importlib.util

    if callable(entry_point):  # gymnasium's stand-in for ids whose env it dropped (the mujoco-py -v2/-v3 ones)
        raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' needs mujoco-py, which gymnasium no longer runs; "
                          "use the -v5 id of the same env (e.g. HalfCheetah-v5) with pip install 'gymnasium[mujoco]'")
    module = str(entry_point).split(":", 1)[0]
    for family, (package, install) in ENV_PACKAGES.items():
        if module.startswith(family) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' needs the {package} package, which is not "
                              f"installed; {install}")


def _register_class(env: str, name: str, env_class: type) -> str:
    """Registers an env class with Tune under its name as the file gives it (``MultiAgentCartPole`` for
    ``ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole``), so that RLlib, Tune's trial names and
    the recording's manifest all say that name; the whole path when the short name is taken."""
    import gymnasium as gym
    from ray.tune.registry import ENV_CREATOR, register_env

    creator = functools.partial(_make_class_env, env_class)
    taken = name in gym.registry or tune_registered(ENV_CREATOR, name) is not None and not _same_creator(name, creator)
    registered = env if taken else name
    register_env(registered, creator)
    return registered


def _same_creator(name: str, creator: functools.partial) -> bool:
    from ray.tune.registry import ENV_CREATOR

    try:
        known = tune_registered(ENV_CREATOR, name)
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


def register_atari(spec: ExperimentSpec) -> str:
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
        if not is_module_name(module) or not allowed_module(module, spec.register, BUILTIN_ENV_MODULES):
            raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' would import module {module!r}, which the file "
                              f"does not list in 'register:'; add 'register: [{module}]' if you trust it")
        try:
            import_env_package(module)
        except (Exception, SystemExit) as e:
            raise ConfigError(f"{spec.where}: 'env: {shown_key(env)}' cannot be imported ({one_line(e)})") from None
    import gymnasium as gym

    if gym_id not in gym.registry:
        names = [n for n in gym.registry if n.startswith("ALE/")]
        raise ConfigError(f"{spec.where}: unknown ALE env 'env: {shown_key(env)}'{did_you_mean(gym_id, names)}; "
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
        if not any(name.startswith("ALE/") for name in gym.registry):
            register_ale_envs(imported)


def register_ale_envs(ale_py: Any) -> None:
    """Registers ALE's ids where importing ale_py did not: ale-py 0.12 registers them only once its vector env
    imports, which needs gymnasium 1.1 (Ray before 2.49 pins gymnasium 1.0.0, where the import fails quietly)."""
    from ale_py.registration import register_v0_v4_envs, register_v5_envs

    register_v0_v4_envs()
    register_v5_envs()
