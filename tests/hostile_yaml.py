"""Hostile YAML experiment files, and a harness that loads and checks each in this process.

Shared by tests/test_yaml_inputs.py (hypothesis feeds ``document`` a seeded random) and scripts/fuzz_yaml.py.
``Harness.examine`` answers 'accepted', 'error' (one ConfigError line) or 'violation' (any other exception, a
message that is not one line, a file written, the sentinel module imported, or a process-spawning function called).
"""

from __future__ import annotations

import copy
import math
import os
import random
import subprocess
import sys
from typing import Any

import yaml

SENTINEL = "rr_sentinel_mod"  # an importable module a YAML names in env:/config: but never lists in register:
SENTINEL_MARK = "SENTINEL_IMPORTED"
SENTINEL_SOURCE = f'''"""Writes {SENTINEL_MARK} next to itself when imported: it must never be."""
import os

open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{SENTINEL_MARK}"), "w").close()

import gymnasium as gym


class Env(gym.Env):
    pass


class Callbacks:
    pass
'''

# What a YAML names where something gets resolved: real names, typos, and names that must never run.
RUNS = ["PPO", "APPO", "DQN", "SAC", "IMPALA", "BC", "PPOO", "ppo", "script", "__fake", "os.system", "PG", ""]
ENVS = ["CartPole-v1", "CartPol-v1", "Pendulum-v1", "os:system", "subprocess:Popen", "os.system", "builtins:eval",
        "subprocess.Popen", f"{SENTINEL}:Env", f"{SENTINEL}.Env", f"{SENTINEL}:Env-v0", "ale_py:ALE/Breakout-v5",
        "ALE/Pong-v5", "ale_py:ALE/Breakout-v5-atari84x4", "CartPole-v1-atari84x4",
        "gymnasium.envs.classic_control.cartpole:CartPoleEnv", "json:loads", "os:getcwd",
        "ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole", "ray.rllib.examples.envs.classes:os",
        "nosuch_module_xyz:Env", ":", "a:b:c", "   "]
REGISTERS = ["os", "subprocess", "json", "gymnasium", "nosuch_module_xyz", "", "a b", "..x", "os;id", "os.path"]
CLASS_PATHS = ["os.system", "subprocess.Popen", f"{SENTINEL}.Callbacks", "builtins.eval",
               "ray.rllib.callbacks.callbacks.RLlibCallback", "StochasticSampling", "nosuch.Thing"]
CONFIG_KEYS = ["num_env_runners", "num_env_runner", "num_workers", "lr", "lambda", "gamma", "train_batch_size",
               "minibatch_size", "num_epochs", "explore", "env_config", "multiagent", "model", "callbacks",
               "callbacks_class", "evaluation_interval", "evaluation_config", "evaluation_intervall",
               "exploration_config", "replay_buffer_config", "input", "sgd_minibatch_size", "num_rollout_workers",
               "min_iter_time_s", "policy_mapping_fn", "rollout_fragment_length", "framework", "seed", "env",
               "enable_rl_module_and_learner", "enable_env_runner_and_connector_v2", "_is_frozen", "policies"]
RECORDER_KEYS = ["output_dir", "run_name", "num_writers", "num_writer", "backpressure", "coalesce_s",
                 "compression", "compression_level", "fsync", "drain_timeout_s", "stack_frames"]
STOP_KEYS = ["training_iteration", "num_env_steps_sampled_lifetime", "env_runners/episode_return_mean", ""]
MULTIAGENT_KEYS = ["policies", "policy_mapping_fn", "policies_to_train", "count_steps_by", "policy_map_capacity",
                   "observation_fn", "policy"]
# Text that is not a plain document: tags that would run code under yaml.load, deep nesting, aliases, bytes.
RAW = [
    b"x: !!python/object/apply:os.system ['touch PWNED']\n",
    b"x:\n  run: !!python/name:os.system\n",
    b"x: &a\n  run: PPO\n  env: CartPole-v1\n  config: {evaluation_config: *a}\n",
    b"x:\n  run: PPO\n  env: CartPole-v1\n  config: &c {env_config: *c}\n",
    b"a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b]\n",
    b"x:\n  run: PPO\n  stop: " + b"[" * 3000 + b"]" * 3000 + b"\n",
    b"\xff\xfe\x00x\x00:\x00 \x00",
    b"x:\n  run: P\xc3\x28O\n",
    b"\xef\xbb\xbfx:\n  run: PPO\n  env: CartPole-v1\n",
    b"---\nx: 1\n---\ny: 2\n",
    b"x:\n\trun: PPO\n",
    b"x: {run: PPO, env: CartPole-v1, config: {env_config: hello}}\n",
    b"? [1, 2]\n: 3\n",
    b"x:\n  run: PPO\n  env: CartPole-v1\n  config: {1: 2}\n",
    b"",
    b"\x00\x01\x02",
]


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random YAML value: nested mappings and lists of strings, numbers, booleans, nulls."""
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 3, 84, 10 ** 30, -10 ** 20, rng.randint(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, 0.5, -2.5, 1e-3, 1e300, math.inf, -math.inf, math.nan])
    if kind in (4, 5):
        return rng.choice(["", " ", "auto", "1e-3", "recordings", "a/b", "..", "\x00", "\n", "é", "x" * 300,
                           "PPO", "CartPole-v1", "os.system", "torch", "env_steps", "p0", "${HOME}", "~"])
    if kind == 6:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 7:
        return rng.choice(CLASS_PATHS)
    if kind in (8, 9):
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice([rng.choice(CONFIG_KEYS), rng.choice(RECORDER_KEYS), "type", "custom_model", 0, None,
                        True, 1.5, "k" + str(rng.randrange(99))]): junk(rng, depth + 1) for _ in range(rng.randrange(4))}


VALID_CONFIG = {
    "num_env_runners": [0, 1, 2], "num_workers": [1], "lr": [0.001, [[0, 0.01], [100, 0.001]]], "lambda": [0.9],
    "train_batch_size": [200, 400], "minibatch_size": [100], "num_epochs": [1], "explore": [True, False],
    "gamma": [0.99], "seed": [None, 3], "rollout_fragment_length": ["auto", 50], "env_config": [{}],
    "evaluation_interval": [None, 2], "evaluation_config": [{"explore": False}], "model": [{"fcnet_hiddens": [16]}],
    "callbacks": ["ray.rllib.callbacks.callbacks.RLlibCallback"], "framework": ["torch"],
    "enable_rl_module_and_learner": [True], "enable_env_runner_and_connector_v2": [True],
}


def valid_experiment(rng: random.Random) -> dict[str, Any]:
    """An experiment check_experiment accepts (before any mutation)."""
    run = rng.choice(["PPO", "APPO", "PPO", "IMPALA"])
    env = rng.choice(["CartPole-v1", "gymnasium.envs.classic_control.cartpole:CartPoleEnv", "ale_py:ALE/Pong-v5",
                      "ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole", "ale_py:ALE/Breakout-v5"])
    config = {k: rng.choice(v) for k, v in rng.sample(sorted(VALID_CONFIG.items()), rng.randrange(6))}
    if "minibatch_size" in config:
        config["train_batch_size"] = 400
    body: dict[str, Any] = {"run": run, "env": env, "stop": {"training_iteration": rng.choice([1, 5])},
                            "config": config, "recorder": {"output_dir": "recordings", "num_writers": 1}}
    if "multi_agent" in env:
        config["env_config"] = {"num_agents": 2}
        config["multiagent"] = {"policies": ["p0", "p1"], "policy_mapping_fn": {0: "p0", 1: "p1"}}
    if env.startswith("ale_py") and rng.random() < 0.7:
        body["atari_wrappers"] = {"dim": 84, "framestack": 4}
    if rng.random() < 0.3:
        body["register"] = rng.sample(["os", "json", "gymnasium", "subprocess"], rng.randrange(1, 3))
    return {"exp": body}


def _containers(value: Any, out: list[Any]) -> list[Any]:
    if isinstance(value, (dict, list)):
        out.append(value)
        for item in (value.values() if isinstance(value, dict) else value):
            _containers(item, out)
    return out


def _hostile_value(rng: random.Random) -> Any:
    return rng.choice([lambda: junk(rng), lambda: rng.choice(ENVS), lambda: rng.choice(RUNS),
                       lambda: rng.choice(CLASS_PATHS), lambda: {"type": rng.choice(CLASS_PATHS)},
                       lambda: rng.sample(REGISTERS, 2),
                       lambda: _mapping(rng, MULTIAGENT_KEYS, lambda r: r.choice([["p0"], {0: "p9"}, "p0",
                                                                                  junk(r, 2)]))])()


def _hostile_key(rng: random.Random) -> Any:
    return rng.choice([lambda: rng.choice(CONFIG_KEYS), lambda: rng.choice(RECORDER_KEYS),
                       lambda: rng.choice(["num_samples", "Run", "envs", "type", "custom_model", "policies"]),
                       lambda: junk(rng, 3), lambda: rng.choice(MULTIAGENT_KEYS), lambda: rng.choice(STOP_KEYS)])()


def _mapping(rng: random.Random, keys: list[str], value) -> Any:
    return {rng.choice(keys) if rng.random() < 0.85 else junk(rng, 3): value(rng) for _ in range(rng.randrange(4))}


def experiment(rng: random.Random) -> Any:
    """A valid experiment with 0-3 hostile changes anywhere in it: a value replaced (by random nesting of
    mappings, lists, strings, numbers, nulls, or a name that must not run), a key added, renamed or dropped."""
    document: Any = copy.deepcopy(valid_experiment(rng))  # VALID_CONFIG's values are shared
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        target = rng.choice(_containers(document, []))
        if isinstance(target, list):
            if target:
                target[rng.randrange(len(target))] = _hostile_value(rng)
            continue
        action = rng.randrange(4) if target else 1
        if action == 0:
            target[rng.choice(list(target))] = _hostile_value(rng)
        elif action == 1:
            target[_hostile_key(rng)] = _hostile_value(rng)
        elif action == 2:
            target.pop(rng.choice(list(target)))
        else:
            key = rng.choice(list(target))
            if isinstance(key, str) and key:
                at = rng.randrange(len(key))
                target[key[:at] + key[at + 1:]] = target.pop(key)
    for body in document.values():  # a module the file lists in register: may be imported: not the sentinel
        if isinstance(body, dict) and isinstance(body.get("register"), list):
            body["register"] = [m for m in body["register"] if not (isinstance(m, str) and SENTINEL in m)]
    if rng.random() < 0.04:
        body = next(iter(document.values()), {})
        document = rng.choice([[document], junk(rng), {"a": body, "b": body},
                               {rng.choice(["a/b", "..", "", 3, None, True]): body}])
    return document


def document(rng: random.Random) -> bytes:
    """One hostile YAML file's bytes."""
    roll = rng.random()
    if roll < 0.08:
        return rng.choice(RAW)
    if roll < 0.12:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    try:
        text = yaml.safe_dump(experiment(rng), default_flow_style=rng.choice([None, True, False]), sort_keys=False,
                              allow_unicode=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    except (yaml.YAMLError, TypeError):
        text = b"x: 1\n"
    if roll < 0.2 and text:  # damage the text: cut it, or drop in a stray character
        at = rng.randrange(len(text))
        text = text[:at] if rng.random() < 0.5 else text[:at] + rng.choice([b":", b"[", b"{", b"\t", b"&", b"*a",
                                                                             b"!!", b"\xff", b"'", b"\n  - "]) + text[at:]
    return text


def _listing(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root)
                  for f in files + dirs)


class Harness:
    """Loads and checks documents in this process with ``cwd`` an empty dir and tripwires on process spawning.

    ``root`` gets ``work/`` (the cwd, must stay empty), ``modules/`` (the sentinel module, on sys.path; it must
    stay alone there) and ``exp.yaml``. Use as a context manager; ``examine(data)`` per document.
    """

    TRIPWIRES = {os: ("system", "popen", "execv", "execve", "execvp", "fork", "spawnv"),
                 subprocess: ("Popen", "run", "call", "check_call", "check_output", "getoutput")}

    def __init__(self, root: str) -> None:
        self.root = root
        self.work = os.path.join(root, "work")
        self.modules = os.path.join(root, "modules")
        self.path = os.path.join(root, "exp.yaml")
        os.makedirs(self.work, exist_ok=True)
        os.makedirs(self.modules, exist_ok=True)
        with open(os.path.join(self.modules, f"{SENTINEL}.py"), "w") as f:
            f.write(SENTINEL_SOURCE)
        self.called: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "Harness":
        from rllib_recorder.commands.experiment import load_experiment
        from rllib_recorder.commands.experiment_check import check_experiment

        self.load, self.check = load_experiment, check_experiment
        self._cwd = os.getcwd()
        os.chdir(self.work)
        sys.path.insert(0, self.modules)
        sys.dont_write_bytecode = True
        # Warm up (RLlib, gymnasium, ale_py imported) before the tripwires go in.
        with open(self.path, "w") as f:
            f.write("warm-up:\n  run: PPO\n  env: ale_py:ALE/Breakout-v5\n  atari_wrappers: {dim: 84}\n")
        self.check(self.load(self.path))
        for module, names in self.TRIPWIRES.items():
            for name in names:
                if hasattr(module, name):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._tripwire(f"{module.__name__}.{name}"))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)
        sys.path.remove(self.modules)
        sys.dont_write_bytecode = False
        os.chdir(self._cwd)

    def _tripwire(self, name: str) -> Any:
        def tripwire(*args: Any, **kwargs: Any) -> Any:
            self.called.append(name)
            raise RuntimeError(f"tripwire: {name} called")
        return tripwire

    def examine(self, data: bytes) -> tuple[str, str]:
        """('accepted' | 'error' | 'violation', detail) for one document."""
        from rllib_recorder.errors import ConfigError, ConfigProblems

        with open(self.path, "wb") as f:
            f.write(data)
        outcome, detail = "accepted", ""
        try:
            self.check(self.load(self.path))
        except ConfigProblems as e:  # several problems: each one line, listed under one headline
            lines = [e.headline, *e.problems]
            outcome, detail = ("error", str(e)) if len(e.problems) > 1 and all(
                len(x.splitlines()) == 1 for x in lines) else ("violation", f"ConfigProblems not one line each: {e!r}")
        except ConfigError as e:
            message = str(e)
            outcome, detail = ("error", message) if len(message.splitlines()) == 1 \
                else ("violation", f"ConfigError not one line: {message!r}")
        except Exception as e:  # noqa: BLE001 - anything else is what this looks for
            outcome, detail = "violation", f"{type(e).__name__}: {e}"
        problems = []
        if _listing(self.work):
            problems.append(f"files written: {_listing(self.work)[:5]}")
        if _listing(self.modules) != [f"{SENTINEL}.py"] or SENTINEL in sys.modules:
            problems.append(f"sentinel imported: {_listing(self.modules)}")
        if self.called:
            problems.append(f"called {self.called}")
        if problems:
            outcome, detail = "violation", "; ".join(problems) + (f" ({detail})" if detail else "")
        return outcome, detail

    def reset(self) -> None:
        """Clears what a violation left, so the next example starts clean."""
        import shutil

        for name in os.listdir(self.work):
            path = os.path.join(self.work, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        for name in os.listdir(self.modules):
            if name != f"{SENTINEL}.py":
                path = os.path.join(self.modules, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        sys.modules.pop(SENTINEL, None)
        self.called.clear()
