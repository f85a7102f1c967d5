"""A multi-agent run reads back as RLlib MultiAgentEpisodes equal, env step by env step, to what the env produced:
a turn-based env with an agent that joins late and leaves early, recorded by real PPO on real Ray, with fragments
short enough that most episodes are cut across samples."""

from __future__ import annotations

import numpy as np
import pytest

from rllib_recorder import open_run
from rllib_recorder.errors import ConversionError


def expected_env_ts(agent: str, length: int, turns: tuple[str, ...]) -> list[int]:
    """The env steps at which ``agent`` observes, in an episode of ``length`` env steps (TurnBasedEnv's rules)."""
    if agent == "c":
        return list(range(2, 7))
    return [t for t in range(length) if t % len(turns) == turns.index(agent)] + [length]


# Two agents taking turns, and three: an agent then waits two env steps between its observations, across cuts.
@pytest.fixture(scope="module", params=[("a", "b"), ("a", "b", "d")], ids=["2-turns", "3-turns"])
def turn_based_run(turn_based_recorder, request):
    turns = tuple(request.param)
    if turns == ("a", "b", "d"):  # the session's run (tests/conftest.py), which other modules read too
        return request.getfixturevalue("recorded_turn_based"), turns
    return turn_based_recorder(turns), turns


def test_multi_agent_episodes_equal_the_env_step_by_step(turn_based_run):
    run_dir, turns = turn_based_run
    agents = turns + ("c",)
    seen, done = set(), 0
    with open_run(run_dir) as run:
        episodes = list(run.multi_agent_episodes())
        stored_rows = sum(f.num_rows(a) for f in run.files for a in f.agents)
        older = sum(int((f.column(a, "env_t") < 0).sum()) for f in run.files for a in f.agents)
    # RLlib's cut keeps each waiting agent's last observation in the continuing chunk's env_t map: every env step
    # is known when stored (the reader still takes one from the previous fragment if a map ever lacks it)
    assert older == 0
    assert sum(sum(len(sa) for sa in e.agent_episodes.values()) for e in episodes) == stored_rows
    for episode in episodes:
        first = episode.get_observations(indices=0, env_steps=True)
        assert list(first) == ["a"]
        worker, number = int(first["a"][0]), int(first["a"][1])
        assert (worker, number) not in seen  # each episode once, all its chunks in one
        seen.add((worker, number))
        length = 9 + number % 7
        if episode.is_done:
            done += 1
            assert episode.is_terminated and episode.env_t == length
        assert {a: sa.module_id for a, sa in episode.agent_episodes.items()} == {
            a: "pc" if a == "c" else "pab" for a in episode.agent_episodes}
        # Every env step: exactly the agents the env let observe, with the observation it gave them.
        for t in range(episode.env_t + 1):
            observed = episode.get_observations(indices=t, env_steps=True)
            want = {a for a in agents if t in expected_env_ts(a, length, turns)}
            assert set(observed) == want, (number, t)
            for agent, obs in observed.items():
                assert obs[:4].tolist() == [worker, number, t, agents.index(agent)]
        for agent, sa in episode.agent_episodes.items():
            obs, actions, rewards = sa.get_observations(), sa.get_actions(), sa.get_rewards()
            assert [int(o[2]) for o in obs] == expected_env_ts(agent, length, turns)[:len(obs)]
            # the env echoes each action and the rewards piled up while the agent waited in its next observation
            np.testing.assert_array_equal(actions, obs[1:, 4].astype(np.int64))
            np.testing.assert_array_equal(rewards, obs[1:, 5])
            assert sa.is_terminated == (agent == "c" and len(obs) == 5 or episode.is_terminated)
            assert sa.get_extra_model_outputs("action_logp").shape == (len(actions),)
    assert done >= 5
    # every episode the env started, numbers 0..n without a gap
    assert sorted(n for _, n in seen) == list(range(len(seen)))


def test_single_agent_run_refuses_multi_agent_episodes_in_one_line(recorded_cartpole):
    with open_run(recorded_cartpole) as run:
        with pytest.raises(ConversionError, match="env_t"):
            next(run.multi_agent_episodes())


def test_an_unknown_env_step_is_taken_from_the_previous_fragment(turn_based_run, tmp_path):
    """A continuing fragment whose first row's env step was not in the sampled map (stored -1) reads the same: that
    observation is the previous fragment's last one, whose env step the previous fragment has."""
    import shutil

    import h5py

    run_dir, _ = turn_based_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    with open_run(str(copy)) as run:
        f = run.files[0]
        frags = f.fragments("a")
        continuing = [i for i in range(len(frags["eps_id"])) if frags["t_start"][i] > 0]
        want = {i: f.episode(frags["eps_id"][i].decode(), "a").env_t for i in continuing}
        path = f.path
    with h5py.File(path, "r+") as h5:
        env_t = h5["agents/a/steps/env_t"]
        for i in continuing:
            env_t[int(frags["first_row"][i])] = -1
    with open_run(str(copy)) as run:
        for i in continuing:
            got = run.files[0].episode(frags["eps_id"][i].decode(), "a").env_t
            np.testing.assert_array_equal(got, want[i])
        assert sum(len(e.agent_episodes) for e in run.multi_agent_episodes()) > 0
    assert continuing
