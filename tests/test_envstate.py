"""Start states without Ray: capture, restore into a fresh env, and the same future step by step."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from rllib_recorder import envstate
from rllib_recorder.errors import ReplayError
from rllib_recorder.experiment import make_atari_env
from tests.envs import CountingEnv


def rollout(env, actions):
    out = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((np.array(obs), float(reward), terminated, truncated))
        if terminated or truncated:
            break
    return out


@pytest.mark.parametrize("make", [lambda: gym.make("CartPole-v1"),
                                  lambda: make_atari_env("ALE/Breakout-v5", 84, 4, {})], ids=["cartpole", "breakout"])
def test_restored_env_repeats_the_captured_future_exactly(make):
    env = make()
    env.reset(seed=3)
    for action in [0, 1, 1, 0, 1]:
        env.step(action)
    kind, state = envstate.capture(env)
    actions = [int(a) for a in np.random.default_rng(0).integers(0, env.action_space.n, 40)]
    expected = rollout(env, actions)
    fresh = make()
    fresh.reset(seed=12345)  # a different start: only the restored state may make it match
    envstate.restore(fresh, kind, state)
    got = rollout(fresh, actions)
    assert kind == (envstate.KIND_ALE if "Breakout" in str(env.spec) else envstate.KIND_CLASSIC)
    assert len(got) == len(expected) > 1
    for (obs_e, *rest_e), (obs_g, *rest_g) in zip(expected, got):
        np.testing.assert_array_equal(obs_g, obs_e)
        assert rest_g == rest_e


def test_unsupported_env_has_no_state_and_a_reason():
    env = CountingEnv({})
    env.reset()
    assert envstate.capture(env) is None
    assert "neither an ALE emulator nor a classic-control 'state'" in envstate.unsupported_reason(env)


def test_restore_refuses_a_state_of_another_kind():
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    kind, state = envstate.capture(env)
    with pytest.raises(ReplayError, match="pass the env the run was recorded with"):
        envstate.restore(make_atari_env("ALE/Breakout-v5", 84, 4, {}), kind, state)
