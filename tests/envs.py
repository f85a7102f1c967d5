"""Deterministic test envs whose every observation encodes (env runner, episode number, step)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from ray.rllib.env.multi_agent_env import MultiAgentEnv


def episode_length(episode: int) -> int:
    """Episodes last 5 to 11 steps, so fragments often cut them."""
    return 5 + episode % 7


class CountingEnv(gym.Env):
    """obs = (worker_index, episode number, t); reward = t + 1; terminates per ``episode_length``.

    ``obs_kind`` switches the observation space: ``vector`` (Box float32), ``image``
    (Box float32 10x10x3, channels worker/episode/t; ``image_u8``: uint8) or ``dict`` (Dict with a nested Tuple).
    """

    def __init__(self, config: dict | None = None):
        config = config or {}
        self.worker_index = int(getattr(config, "worker_index", 0))
        self.kind = config.get("obs_kind", "vector")
        self.observation_space = {
            "vector": gym.spaces.Box(-1e6, 1e6, (3,), np.float32),
            "image": gym.spaces.Box(0, 255, (10, 10, 3), np.float32),  # as RLlib's Atari wrappers give
            "image_u8": gym.spaces.Box(0, 255, (10, 10, 3), np.uint8),
            "dict": gym.spaces.Dict({
                "ids": gym.spaces.Box(-1e6, 1e6, (2,), np.float32),
                "clock": gym.spaces.Tuple((gym.spaces.Discrete(1000), gym.spaces.Box(0, 1, (1,), np.float32))),
            }),
        }[self.kind]
        self.action_space = gym.spaces.Discrete(2)
        self.episode = -1
        self.t = 0
        self.step_log = StepLog(config.get("step_log"), self.worker_index)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {"episode": self.episode}

    def step(self, action):
        self.step_log.write(self.episode, self.t)
        self.t += 1
        terminated = self.t >= episode_length(self.episode)
        return self._obs(), float(self.t), terminated, False, {"t": self.t, "action": int(action)}

    def _obs(self):
        if self.kind.startswith("image"):
            image = np.zeros((10, 10, 3), self.observation_space.dtype)
            image[..., 0], image[..., 1], image[..., 2] = self.worker_index, self.episode % 256, self.t
            image[0, 1, 1] = self.episode // 256 % 256  # so that episode 256 is not read as episode 0
            return image
        if self.kind == "dict":
            return {"ids": np.array([self.worker_index, self.episode], np.float32),
                    "clock": (self.t, np.array([0.5], np.float32))}
        return np.array([self.worker_index, self.episode, self.t], np.float32)


class StepLog:
    """The env's own log of the steps it took: with ``env_config["step_log"]`` a directory, one line "episode t" per
    step into ``w<worker>-p<pid>-<n>.log`` there, flushed at once (a SIGKILLed process's lines stay). The truth a
    test checks the recorder against where RLlib keeps no count of its own (per env runner, per incarnation)."""

    _opened = 0

    def __init__(self, directory: str | None, worker_index: int) -> None:
        self.directory, self.worker_index, self._file = directory, worker_index, None

    def write(self, episode: int, t: int) -> None:
        if self.directory is None:
            return
        if self._file is None:
            import os

            StepLog._opened += 1
            name = f"w{self.worker_index}-p{os.getpid()}-{StepLog._opened}.log"
            self._file = open(os.path.join(self.directory, name), "a", buffering=1)
        self._file.write(f"{episode} {t}\n")


def logged_steps(directory: str) -> dict[tuple[int, int], int]:
    """Steps the envs logged in ``directory`` (``StepLog``), per (worker index, process id)."""
    import os

    counts: dict[tuple[int, int], int] = {}
    for name in os.listdir(directory):
        worker, pid, _ = name[1:-4].split("-")
        key = (int(worker), int(pid[1:]))
        with open(os.path.join(directory, name)) as f:
            counts[key] = counts.get(key, 0) + sum(1 for _ in f)
    return counts


def decode(obs, kind: str) -> np.ndarray:
    """(worker, episode, t) rows of a stored observation column of any kind."""
    if kind.startswith("image"):
        ids = obs[:, 0, 0, :].astype(np.int64)
        ids[:, 1] += 256 * obs[:, 0, 1, 1].astype(np.int64)
        return ids
    if kind == "dict" and isinstance(obs, dict):
        return np.column_stack([obs["ids"][:, 0], obs["ids"][:, 1], obs["clock"][0]]).astype(np.int64)
    if kind == "dict":  # flattened by RLlib's FlattenObservations: one-hot(1000) t, Box(1), ids(2)
        return np.column_stack([obs[:, -2], obs[:, -1], obs[:, :1000].argmax(axis=1)]).astype(np.int64)
    return obs.astype(np.int64)


class TwoAgentCountingEnv(MultiAgentEnv):
    """Two agents; agent 'b' stops two steps before 'a'. obs = (worker, episode, t, agent)."""

    def __init__(self, config: dict | None = None):
        super().__init__()
        self.worker_index = int(getattr(config or {}, "worker_index", 0))
        space = gym.spaces.Box(-1e6, 1e6, (4,), np.float32)
        self.agents = self.possible_agents = ["a", "b"]
        self.observation_spaces = {"a": space, "b": space}
        self.action_spaces = {"a": gym.spaces.Discrete(2), "b": gym.spaces.Discrete(2)}
        self.episode = -1
        self.t = 0

    def _obs(self, agent):
        return np.array([self.worker_index, self.episode, self.t, 0 if agent == "a" else 1], np.float32)

    def reset(self, *, seed=None, options=None):
        self.episode += 1
        self.t = 0
        return {a: self._obs(a) for a in ("a", "b")}, {}

    def step(self, actions):
        self.t += 1
        length = episode_length(self.episode) + 2
        acting = [a for a in actions]
        done_b = self.t >= length - 2
        obs = {a: self._obs(a) for a in acting}
        rewards = {a: float(self.t) for a in acting}
        terminateds = {"a": self.t >= length, "__all__": self.t >= length}
        if "b" in acting:
            terminateds["b"] = done_b
        return obs, rewards, terminateds, {"__all__": False}, {}


class OpaqueCartPole(gym.Env):
    """CartPole behind a plain Env that exposes no state: replay --check must say it can't restore it."""

    def __init__(self, config: dict | None = None):
        self._inner = gym.make("CartPole-v1")
        self.observation_space, self.action_space = self._inner.observation_space, self._inner.action_space

    def reset(self, *, seed=None, options=None):
        return self._inner.reset(seed=seed, options=options)

    def step(self, action):
        return self._inner.step(action)


class StateRaisesEnv(CountingEnv):
    """CountingEnv whose ``state`` raises: capturing the start state fails inside the env runner."""

    @property
    def state(self):
        raise RuntimeError("state is unavailable")


class FailOnceEnv(CountingEnv):
    """CountingEnv that raises once, in its fourth episode (``env_config["fail_at_episode"]``), in the first process to
    get there: the marker file
    ``env_config["marker"]`` says it has (a Tune trial restarted after it records on)."""

    def step(self, action):
        import os

        marker = self.config_marker
        if self.episode == self.fail_at_episode and self.t == 2 and marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                raise RuntimeError("the env fails once")
        return super().step(action)

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self.config_marker = (config or {}).get("marker")
        self.fail_at_episode = int((config or {}).get("fail_at_episode", 3))


class TurnBasedEnv(MultiAgentEnv):
    """Turn-based with an agent that joins late and leaves early: the turn agents (``config["turns"]``, default
    'a' and 'b') take turns, agent i of n observing at the env steps t with t % n == i, and all of them at the end;
    'c' acts at every env step from env_t 2 and terminates at env_t 6 (episodes of 9 to 15 env steps). Turn agent i
    gets t / (i + 1) at every step once it has observed, so the ones waiting pile up rewards RLlib hands them with
    their next observation.

    obs = (worker, episode, env_t, agent, its previous action (-1: none), the reward it piled up since its previous
    observation): a stored row can be checked against the env alone.
    """

    def __init__(self, config: dict | None = None):
        super().__init__()
        self.worker_index = int(getattr(config or {}, "worker_index", 0))
        self.turns = tuple((config or {}).get("turns", ("a", "b")))
        self.AGENTS = self.turns + ("c",)
        space = gym.spaces.Box(-1e6, 1e6, (6,), np.float32)
        self.agents = self.possible_agents = list(self.AGENTS)
        self.observation_spaces = {a: space for a in self.AGENTS}
        self.action_spaces = {a: gym.spaces.Discrete(3) for a in self.AGENTS}
        self.episode = -1
        self.t = 0

    def _obs(self, agent):
        return np.array([self.worker_index, self.episode, self.t, self.AGENTS.index(agent), self.last_action[agent],
                         self.piled[agent]], np.float32)

    def _observe(self, agents):
        obs = {a: self._obs(a) for a in agents}
        for a in agents:
            self.piled[a] = 0.0
            self.seen.add(a)
        return obs

    def reset(self, *, seed=None, options=None):
        self.episode += 1
        self.t = 0
        self.length = 9 + self.episode % 7
        self.last_action = {a: -1 for a in self.AGENTS}
        self.piled = {a: 0.0 for a in self.AGENTS}
        self.seen = set()
        return self._observe(["a"]), {}

    def step(self, actions):
        for agent, action in actions.items():
            self.last_action[agent] = int(action)
        self.t += 1
        rewards = [(agent, self.t / (i + 1)) for i, agent in enumerate(self.turns)]
        for agent, reward in rewards + [("c", 0.25 if self.t <= 6 else 0.0)]:
            if agent in self.seen:  # RLlib drops a reward that comes before an agent's first observation
                self.piled[agent] += reward
        done = self.t >= self.length
        observing = list(self.turns) if done else [self.turns[self.t % len(self.turns)]]
        if 2 <= self.t <= 6:
            observing.append("c")
        terminateds = {"__all__": done, **{a: True for a in observing if done}}
        if self.t == 6:
            terminateds["c"] = True
        obs = self._observe(observing)
        return obs, {a: obs[a][5] for a in observing}, terminateds, {"__all__": False}, {}
