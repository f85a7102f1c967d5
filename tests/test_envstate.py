"""Start states without Ray: capture, restore into a fresh env, and the same future step by step."""

from __future__ import annotations

import gc
import weakref

import gymnasium as gym
import numpy as np
import pytest

from rllib_recorder.commands.envs import make_atari_env
from rllib_recorder.errors import ReplayError
from rllib_recorder.format import start_state
from rllib_recorder.record import envstate
from tests.envs import CountingEnv


def rollout(env, actions):
    out = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((np.array(obs), float(reward), terminated, truncated))
        if terminated or truncated:
            break
    return out


@pytest.mark.parametrize("make", [
    lambda: gym.make("CartPole-v1"),
    lambda: make_atari_env("ALE/Breakout-v5", 84, 4, {}),  # no sticky actions: ALE's generator left out
    lambda: make_atari_env("ALE/Breakout-v5", 84, 4, {"repeat_action_probability": 0.25}),  # kept: it decides
], ids=["cartpole", "breakout", "breakout-sticky"])
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
    assert kind == (start_state.KIND_ALE if "Breakout" in str(env.spec) else start_state.KIND_CLASSIC)
    if kind == start_state.KIND_ALE:  # the generator's 7 kB are in the state only where sticky actions need them
        sticky = env.unwrapped.ale.getFloat("repeat_action_probability") > 0
        assert (len(start_state.unpack(state)[0]["ale"]) > 12_000) == sticky
    assert len(got) == len(expected) > 1
    for (obs_e, *rest_e), (obs_g, *rest_g) in zip(expected, got):
        np.testing.assert_array_equal(obs_g, obs_e)
        assert rest_g == rest_e


def test_a_frame_stack_just_after_a_reset_is_stored_as_one_frame_and_restored_as_the_full_stack():
    env = make_atari_env("ALE/Breakout-v5", 84, 4, {})
    env.reset(seed=5)
    captured = envstate.capture_state(env)
    (name, attrs), = [layer for layer in captured.meta["layers"] if "frames" in layer[1]]
    assert name == "FrameStack" and attrs["frames"]["repeat"] == 4
    assert captured.arrays[attrs["frames"]["deque"]].shape == (1, 84, 84, 1)
    actions = [int(a) for a in np.random.default_rng(2).integers(0, env.action_space.n, 30)]
    expected = rollout(env, actions)
    fresh = make_atari_env("ALE/Breakout-v5", 84, 4, {})
    fresh.reset(seed=77)
    envstate.restore(fresh, start_state.KIND_ALE, captured.pack())
    frames = [layer for layer in envstate._layers(fresh) if type(layer).__name__ == "FrameStack"][0].frames
    assert len(frames) == 4 and frames.maxlen == 4
    got = rollout(fresh, actions)
    assert len(got) == len(expected) > 1
    for (obs_e, *rest_e), (obs_g, *rest_g) in zip(expected, got):
        np.testing.assert_array_equal(obs_g, obs_e)
        assert rest_g == rest_e
    env.step(1)  # frames differ now: stored in full
    stepped = envstate.capture_state(env)
    (_, attrs), = [layer for layer in stepped.meta["layers"] if "frames" in layer[1]]
    assert "repeat" not in attrs["frames"] and stepped.arrays[attrs["frames"]["deque"]].shape == (4, 84, 84, 1)


def test_capture_plans_neither_keep_envs_alive_nor_remember_an_env_before_its_first_reset():
    env = gym.make("CartPole-v1")
    assert envstate.capture_state(env) is None  # no state before the first reset
    env.reset(seed=1)
    first = envstate.capture_state(env)
    env.step(0)
    second = envstate.capture_state(env)  # from the plan made by the first capture
    assert first.kind == second.kind == start_state.KIND_CLASSIC
    assert not np.array_equal(first.arrays["state"], second.arrays["state"])
    assert first.meta["layers"] == [["TimeLimit", {"_elapsed_steps": 0}]]
    assert second.meta["layers"] == [["TimeLimit", {"_elapsed_steps": 1}]]
    gone, key = weakref.ref(env.unwrapped), id(env)
    assert key in envstate._PLANS
    del env
    gc.collect()
    assert gone() is None
    assert key not in envstate._PLANS  # the plan went with its env


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


def test_state_blob_round_trips_arrays_and_meta_and_compresses_only_big_payloads():
    frames = np.arange(4 * 84 * 84, dtype=np.float32).reshape(4, 84, 84) % 7
    blob = start_state.pack({"frames": frames, "state": np.array([1.5, -2.0])}, {"rng": {"s": 3}, "layers": []})
    arrays, meta = start_state.unpack(blob)
    assert blob[:4] == start_state.MAGIC and blob[4] == 1 and len(blob) < frames.nbytes // 10
    np.testing.assert_array_equal(arrays["frames"], frames)
    assert arrays["frames"].dtype == np.float32 and meta == {"rng": {"s": 3}, "layers": []}
    small = start_state.pack({"state": np.array([1.0, 2.0, 3.0, 4.0])}, {})
    assert small[4] == 0 and start_state.unpack(small)[0]["state"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_schema_1_1_npz_start_states_still_restore():
    import io
    import json

    env = gym.make("CartPole-v1")
    env.reset(seed=3)
    kind, blob = envstate.capture(env)
    arrays, meta = start_state.unpack(blob)
    old = io.BytesIO()
    np.savez_compressed(old, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    fresh = gym.make("CartPole-v1")
    fresh.reset(seed=99)
    envstate.restore(fresh, kind, old.getvalue())
    np.testing.assert_array_equal(fresh.unwrapped.state, env.unwrapped.state)


def test_garbage_start_state_is_a_one_line_replay_error():
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    with pytest.raises(ReplayError, match="start state is unreadable"):
        envstate.restore(env, start_state.KIND_CLASSIC, b"RRS2\x00garbage")


def test_start_state_is_not_captured_on_a_runner_that_does_not_record():
    from types import SimpleNamespace

    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rllib_recorder.config import RecorderConfig
    from rllib_recorder.record.binding import Binding
    from rllib_recorder.record.runner import StartStates, recorder_for

    class Runner:  # what the recorder reads of an EnvRunner (weak-referenceable, like one)
        def __init__(self, worker_index, in_evaluation):
            self.worker_index, self.config = worker_index, SimpleNamespace(in_evaluation=in_evaluation)

    vector_env = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    vector_env.reset(seed=0)
    evaluation = Runner(1, True)
    recorder_for(evaluation).bind(Binding("r", "/nonexistent", "ns", 1, RecorderConfig(record_evaluation=False)))
    episode = SingleAgentEpisode()
    keeper = StartStates()  # one per callback object: it remembers the runner's recorder and the sub-envs
    keeper.keep(episode, vector_env, 0, evaluation)
    assert not episode.custom_data
    unbound = Runner(2, False)
    keeper.keep(episode, vector_env, 0, unbound)  # not bound yet: captured (held until bound)
    assert set(episode.custom_data) == {"rllib_recorder.start_state"}
    first = episode.custom_data["rllib_recorder.start_state"].arrays["state"]
    np.testing.assert_array_equal(first, vector_env.envs[0].unwrapped.state)
    recreated = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])  # RLlib recreated the env
    recreated.reset(seed=1)
    keeper.keep(episode, recreated, 0, unbound)
    np.testing.assert_array_equal(episode.custom_data["rllib_recorder.start_state"].arrays["state"],
                                  recreated.envs[0].unwrapped.state)
    assert not np.array_equal(first, recreated.envs[0].unwrapped.state)
    keeper.keep(SingleAgentEpisode(), recreated, 3, unbound)  # no such sub-env: nothing, no error


def test_a_captured_state_pickles_as_its_blob_and_keeps_none_of_the_env():
    import gc
    import pickle
    import weakref

    env = gym.make("CartPole-v1")
    env.reset(seed=3)
    at_reset = env.unwrapped.state.copy()
    captured = envstate.capture_state(env)
    env.step(0)  # the capture copied the state: stepping does not change it (its blob is built only now)
    np.testing.assert_array_equal(captured.arrays["state"], at_reset)
    blob = captured.pack()
    assert pickle.loads(pickle.dumps(captured)).pack() == blob
    after_step = env.unwrapped.state.copy()
    unbuilt = envstate.capture_state(env)
    assert pickle.loads(pickle.dumps(envstate.capture_state(env))).pack() != blob
    gone = weakref.ref(env.unwrapped)
    del env
    gc.collect()
    assert gone() is None  # neither capture, built or not, keeps the env alive
    assert captured.pack() == blob
    np.testing.assert_array_equal(start_state.unpack(unbuilt.pack())[0]["state"], after_step)


def _stored_layer_attrs(blob: bytes) -> set[str]:
    return {attr for _, attrs in start_state.unpack(blob)[1]["layers"] for attr in attrs}


def test_frames_max_pooled_by_every_full_step_are_left_out_unless_the_first_step_ended_the_episode():
    import copy

    from rllib_recorder.record.convert import START_STATE_KEY, episodes_to_chunk
    from tests.helpers import make_episode

    env = make_atari_env("ALE/Breakout-v5", 84, 4, {})
    env.reset(seed=4)
    env.step(1)
    captured = envstate.capture_state(env)
    assert copy.deepcopy(captured) is captured  # RLlib deep-copies custom_data on every cut: no copy of the frames
    actions = [int(a) for a in np.random.default_rng(1).integers(0, env.action_space.n, 40)]
    expected = rollout(env, actions)
    short = captured.pack(first_step_ended=False)
    assert "_obs_buffer" not in _stored_layer_attrs(short) and "_obs_buffer" in _stored_layer_attrs(captured.pack())
    assert len(short) < len(captured.pack()) and "frames" in _stored_layer_attrs(short)
    fresh = make_atari_env("ALE/Breakout-v5", 84, 4, {})
    fresh.reset(seed=999)
    envstate.restore(fresh, start_state.KIND_ALE, short)
    got = rollout(fresh, actions)
    assert len(got) == len(expected) > 1
    for (obs_e, *rest_e), (obs_g, *rest_g) in zip(expected, got):  # the first step is a full one: same future
        np.testing.assert_array_equal(obs_g, obs_e)
        assert rest_g == rest_e
    # Conversion packs it: the whole state only for an episode whose first step was its last.
    for n, terminated, with_buffer in ((3, False, False), (1, False, False), (1, True, True)):
        episode = make_episode(n, terminated=terminated)
        episode.custom_data[START_STATE_KEY] = captured
        stream = episodes_to_chunk([episode]).streams["default_agent"]
        assert stream.fragments["start_state_kind"][0] == start_state.KIND_ALE
        assert ("_obs_buffer" in _stored_layer_attrs(stream.fragments["start_state"][0].tobytes())) == with_buffer
