"""A recorded multi-agent episode as RLlib's ``MultiAgentEpisode``, rebuilt env step by env step.

Each agent's rows are stored apart (``agents/<agent>/``); the ``env_t`` of each observation (schema 2.2, new API
stack) says where it sat among the env's steps, so the episode is replayed into RLlib's own class with
``add_env_reset``/``add_env_step``, as the env runner built it: agents that join late or leave early, turn-based
envs (an agent acts only at the env steps it observed), and rewards that piled up while an agent waited (stored
with the agent's next observation, where RLlib put them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator, Sequence

import numpy as np

from rllib_recorder.errors import ConversionError
from rllib_recorder.read.records import Episode, FileOfSteps, unbatch


def iter_multi_agent_episodes(f: FileOfSteps) -> Iterator[Any]:
    """Every episode of a file as RLlib's ``MultiAgentEpisode``, as soon as all its agents' episodes are read: each
    agent's episodes stream (``WorkerFile.iter_episodes``) side by side, one at a time from each, so memory holds
    the agents' blocks and the episodes some agent has not finished yet."""
    agents = f.agents
    members: dict[str, int] = defaultdict(int)  # episode id -> agents it has
    for agent in agents:
        for eps_id in np.unique(f.fragments(agent)["eps_id"]).tolist():
            members[eps_id.decode()] += 1
    streams = {agent: f.iter_episodes(agent) for agent in agents}
    held: dict[str, dict[str, Episode]] = defaultdict(dict)
    while streams:
        for agent in list(streams):
            episode = next(streams[agent], None)
            if episode is None:
                del streams[agent]
                continue
            parts = held[episode.eps_id]
            parts[agent] = episode
            if len(parts) == members[episode.eps_id]:
                del held[episode.eps_id]
                yield to_multi_agent_episode(episode.eps_id, [parts[a] for a in sorted(parts)])


def to_multi_agent_episode(eps_id: str, agents: Sequence[Episode]) -> Any:
    """RLlib's ``MultiAgentEpisode`` (numpy) of one episode from each of its agents' stitched ``Episode``."""
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

    for agent in agents:
        if len(agent.env_t) != _num_obs(agent):
            raise ConversionError(
                f"episode {eps_id} of agent {agent.agent_id!r} has no env steps (env_t); it was recorded before "
                "schema 2.2 or on the old API stack: read its agents one by one with run.episodes()")
    observations: dict[int, dict[str, Any]] = defaultdict(dict)
    infos: dict[int, dict[str, Any]] = defaultdict(dict)
    actions: dict[int, dict[str, Any]] = defaultdict(dict)  # env step the action was taken in (obs env_t + 1)
    outputs: dict[int, dict[str, Any]] = defaultdict(dict)
    rewards: dict[int, dict[str, float]] = defaultdict(dict)
    terminateds: dict[int, dict[str, bool]] = defaultdict(dict)
    truncateds: dict[int, dict[str, bool]] = defaultdict(dict)
    for agent in agents:
        aid, env_t = agent.agent_id, agent.env_t.tolist()
        for k, e in enumerate(env_t):
            observations[e][aid] = unbatch(agent.obs, k)
            if agent.infos is not None and k < len(agent.infos) and isinstance(agent.infos[k], dict):
                infos[e][aid] = agent.infos[k]
        for k in range(len(agent)):
            step = env_t[k] + 1
            actions[step][aid] = unbatch(agent.actions, k)
            outputs[step][aid] = {key: unbatch(value, k) for key, value in agent.extra_model_outputs.items()}
            # RLlib hands an agent the rewards it piled up while waiting with its next observation
            rewards[env_t[k + 1] if k + 1 < len(env_t) else step][aid] = float(agent.rewards[k])
        if len(agent) and agent.terminateds[-1]:
            terminateds[env_t[-1]][aid] = True
        if len(agent) and agent.truncateds[-1]:
            truncateds[env_t[-1]][aid] = True
    last = max(max(observations, default=0), max(rewards, default=0))
    done = all(a.is_done for a in agents if len(a))
    episode = MultiAgentEpisode(
        id_=eps_id, agent_module_ids={a.agent_id: a.module_id or None for a in agents},
        agent_episode_ids=None, len_lookback_buffer=0,
    )
    episode.add_env_reset(observations=observations.get(0, {}), infos=infos.get(0, {}))
    for step in range(1, last + 1):
        ended_all = done and step == last
        terminated = dict(terminateds.get(step, {}))
        truncated = dict(truncateds.get(step, {}))
        terminated["__all__"] = ended_all and bool(terminated or not truncated)
        truncated["__all__"] = ended_all and not terminated["__all__"]
        episode.add_env_step(
            observations=observations.get(step, {}), actions=actions.get(step, {}),
            rewards=rewards.get(step, {}), infos=infos.get(step, {}), terminateds=terminated, truncateds=truncated,
            extra_model_outputs=outputs.get(step, {}),
        )
    episode.to_numpy()
    return episode


def _num_obs(agent: Episode) -> int:
    value = agent.obs
    while isinstance(value, (dict, tuple)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return len(value)

