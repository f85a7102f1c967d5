"""Conversion of hand-built episodes and batches to chunks: exact arrays, no Ray."""

import json

import numpy as np
import pytest
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from rllib_recorder.errors import ConversionError
from rllib_recorder.format.chunks import merge_chunks, uint8_chunk
from rllib_recorder.record.batches import batch_to_chunk
from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk, flatten_value
from tests.helpers import image_episode, make_episode, stacked_frames


def test_single_agent_fragment_columns_exact():
    chunk = episodes_to_chunk([make_episode(3, t_started=5, terminated=True, eps_id="e1", version=7)])
    stream = chunk.streams["default_agent"]
    assert chunk.env_steps == 3 and stream.num_rows == 3
    np.testing.assert_array_equal(stream.steps["obs"], [[5, -5], [6, -6], [7, -7]])
    np.testing.assert_array_equal(stream.steps["actions"], [0, 1, 0])
    np.testing.assert_array_equal(stream.steps["rewards"], [5.0, 6.0, 7.0])
    np.testing.assert_array_equal(stream.steps["t"], [5, 6, 7])
    np.testing.assert_array_equal(stream.steps["terminateds"], [False, False, True])
    np.testing.assert_array_equal(stream.steps["truncateds"], [False, False, False])
    np.testing.assert_array_equal(stream.steps["weights_seq_no"], [7, 7, 7])
    np.testing.assert_array_equal(stream.steps["extra_model_outputs/action_logp"], [-0.5] * 3)
    assert stream.steps["eps_id"].tolist() == [b"e1"] * 3
    frag = stream.fragments
    assert frag["eps_id"].tolist() == [b"e1"] and frag["t_start"].tolist() == [5]
    assert frag["return"].tolist() == [18.0] and frag["terminated"].tolist() == [True]
    np.testing.assert_array_equal(frag["last_obs"], [[8, -8]])
    assert json.loads(frag["infos"][0]) == [{"t": 5}, {"t": 6}, {"t": 7}, {"t": 8}]


def test_a_sample_of_many_episodes_stores_each_as_it_would_alone():
    # One sample's episodes are converted together (columns built once); every row and fragment must be what the
    # episode gives on its own: lengths, continuing fragments (t_started > 0), last obs, versions, returns.
    episodes = [
        make_episode(3, t_started=5, terminated=True, eps_id="a", version=1),
        make_episode(1, eps_id="b", version=2),
        make_episode(4, t_started=2, obs_offset=100, eps_id="c", version=3),
        make_episode(1, t_started=9, terminated=True, eps_id="d", version=3),
    ]
    together = episodes_to_chunk(episodes)
    alone = [episodes_to_chunk([e]).streams["default_agent"] for e in episodes]
    stream = together.streams["default_agent"]
    assert together.env_steps == 9 and stream.num_rows == 9
    for table in ("steps", "fragments"):
        columns = getattr(stream, table)
        assert set(columns) == set(getattr(alone[0], table))
        for path, values in columns.items():
            expected = np.concatenate([getattr(s, table)[path] for s in alone])
            assert values.dtype == expected.dtype, path
            if values.dtype == object:  # strings, or byte arrays (start states)
                assert [bytes(v) if isinstance(v, np.ndarray) else v for v in values] == \
                    [bytes(v) if isinstance(v, np.ndarray) else v for v in expected], path
            else:
                np.testing.assert_array_equal(values, expected, err_msg=path)
    np.testing.assert_array_equal(stream.steps["t"], [5, 6, 7, 0, 2, 3, 4, 5, 9])
    np.testing.assert_array_equal(stream.steps["terminateds"], [0, 0, 1, 0, 0, 0, 0, 0, 1])
    assert stream.steps["eps_id"].tolist() == [b"a"] * 3 + [b"b"] + [b"c"] * 4 + [b"d"]
    np.testing.assert_array_equal(stream.fragments["last_obs"], [[8, -8], [1, -1], [106, -6], [10, -10]])
    assert stream.fragments["return"].tolist() == [18.0, 0.0, 14.0, 9.0]


def test_episodes_of_one_sample_with_different_columns_are_refused_with_the_column():
    plain = make_episode(2, eps_id="a")
    other = make_episode(2, eps_id="b")
    other.extra_model_outputs.pop("action_logp")
    with pytest.raises(ConversionError, match="columns differ .*extra_model_outputs/action_logp"):
        episodes_to_chunk([plain, other])


def test_options_drop_infos_and_extras():
    options = ConvertOptions(record_infos=False, record_extra_model_outputs=False)
    stream = episodes_to_chunk([make_episode(2)], options).streams["default_agent"]
    assert "infos" not in stream.fragments
    assert not [k for k in stream.steps if k.startswith("extra_model_outputs")]
    assert stream.steps["weights_seq_no"].tolist() == [3, 3]  # versions are never dropped


def test_buffers_are_read_as_the_episode_getters_return_them():
    # convert reads an episode's buffers directly (_all_items); it must match RLlib's getters, numpy'd or not, with
    # a lookback (a cut episode's continuation) and without, for arrays and for dict observations.
    from rllib_recorder.record.convert import _all_items

    def check(episode):
        pairs = [(episode.observations, episode.get_observations()), (episode.actions, episode.get_actions()),
                 (episode.rewards, episode.get_rewards()), (episode.infos, episode.get_infos())]
        pairs += [(episode.extra_model_outputs[k], episode.get_extra_model_outputs(k))
                  for k in episode.extra_model_outputs]
        for buffer, expected in pairs:
            got = _all_items(buffer)
            assert type(got) is type(expected)
            if isinstance(expected, dict):
                for key in expected:
                    np.testing.assert_array_equal(got[key], expected[key])
            else:
                np.testing.assert_array_equal(np.asarray(got, dtype=object), np.asarray(expected, dtype=object))

    for obs in ([np.full(2, t, np.float32) for t in range(6)], [{"p": np.full(2, t, np.float32)} for t in range(6)]):
        episode = SingleAgentEpisode(
            observations=obs, actions=[0, 1, 0, 1, 1], rewards=[1.0, 2.0, 3.0, 4.0, 5.0],
            infos=[{"t": t} for t in range(6)],
            extra_model_outputs={"logp": [-0.1, -0.2, -0.3, -0.4, -0.5]}, len_lookback_buffer=2,
        )
        check(episode)
        episode.to_numpy()
        check(episode)
        assert len(_all_items(episode.actions)) == 3  # after the lookback of 2


def test_nested_dict_tuple_observations_flatten_with_containers():
    obs = [{"pos": np.full(2, t, np.float32), "inv": (np.int64(t), np.full(3, t, np.uint8))} for t in range(3)]
    episode = SingleAgentEpisode(observations=obs, actions=[0, 1], rewards=[1.0, 2.0], len_lookback_buffer=0)
    episode.to_numpy()
    stream = episodes_to_chunk([episode]).streams["default_agent"]
    assert stream.containers["obs"] == "dict" and stream.containers["obs/inv"] == "tuple"
    assert stream.containers["last_obs"] == "dict"
    np.testing.assert_array_equal(stream.steps["obs/inv/0"], [0, 1])
    np.testing.assert_array_equal(stream.steps["obs/inv/1"], [[0] * 3, [1] * 3])
    assert stream.steps["obs/inv/1"].dtype == np.uint8
    np.testing.assert_array_equal(stream.fragments["last_obs/pos"], [[2, 2]])


def test_multi_agent_episode_one_stream_per_agent_shared_episode_id():
    episode = MultiAgentEpisode(
        observations=[{"a": 0, "b": 10}, {"a": 1, "b": 11}, {"a": 2}],
        actions=[{"a": 0, "b": 1}, {"a": 1}], rewards=[{"a": 1.0, "b": 2.0}, {"a": 3.0}],
        terminateds={"__all__": True, "a": True, "b": True}, len_lookback_buffer=0,
        agent_module_ids={"a": "pa", "b": "pb"},
    )
    episode.to_numpy()
    chunk = episodes_to_chunk([episode])
    assert set(chunk.streams) == {"a", "b"}
    a, b = chunk.streams["a"], chunk.streams["b"]
    np.testing.assert_array_equal(a.steps["obs"], [0, 1])
    np.testing.assert_array_equal(a.fragments["last_obs"], [2])
    assert a.fragments["module_id"].tolist() == ["pa"] and b.fragments["module_id"].tolist() == ["pb"]
    assert a.steps["eps_id"][0] == b.steps["eps_id"][0] == episode.id_.encode()
    assert a.fragments["return"].tolist() == [4.0] and b.fragments["return"].tolist() == [2.0]


def _sample_batch(eps_ids, ts, agent_index=0):
    n = len(eps_ids)
    obs = np.array([[e, t] for e, t in zip(eps_ids, ts)], np.float32)
    return SampleBatch({
        "obs": obs, "new_obs": obs + [0, 1], "actions": np.arange(n) % 2,
        "rewards": np.ones(n, np.float32), "terminateds": np.array(ts) == 99,
        "truncateds": np.zeros(n, bool), "infos": np.array([{"i": i} for i in range(n)]),
        "eps_id": np.array(eps_ids, np.int64), "t": np.array(ts, np.int64),
        "agent_index": np.full(n, agent_index), "unroll_id": np.zeros(n, np.int64),
        "vf_preds": np.arange(n, dtype=np.float32),
    })


def test_sample_batch_splits_fragments_by_episode_and_keeps_extras():
    batch = _sample_batch([4, 4, 4, 9, 9], [7, 8, 9, 0, 1])
    stream = batch_to_chunk(batch, policy_version=2).streams["default_agent"]
    frag = stream.fragments
    assert frag["eps_id"].tolist() == [b"4", b"9"]
    assert frag["num_rows"].tolist() == [3, 2] and frag["t_start"].tolist() == [7, 0]
    np.testing.assert_array_equal(frag["last_obs"], [[4, 10], [9, 2]])
    np.testing.assert_array_equal(stream.steps["extra_model_outputs/vf_preds"], np.arange(5))
    assert stream.steps["weights_seq_no"].tolist() == [2] * 5
    assert json.loads(frag["infos"][1]) == [None, {"i": 3}, {"i": 4}]


def test_an_old_stack_evaluation_batch_without_actions_is_stored_without_them():
    # RLlib 2.60's old-stack evaluation runners (explore=False) return batches with no "actions" column
    batch = _sample_batch([4, 4], [0, 1])
    del batch["actions"]
    stream = batch_to_chunk(MultiAgentBatch({"default_policy": batch}, 2)).streams["default_agent"]
    assert "actions" not in stream.steps and stream.steps["rewards"].tolist() == [1.0, 1.0]


def test_multi_agent_batch_one_stream_per_policy():
    batch = MultiAgentBatch({"p0": _sample_batch([1, 1], [0, 1]), "p1": _sample_batch([1], [0], agent_index=1)}, 2)
    chunk = batch_to_chunk(batch)
    assert set(chunk.streams) == {"p0", "p1"} and chunk.env_steps == 2
    assert chunk.streams["p1"].steps["agent_index"].tolist() == [1]


def test_merge_chunks_concatenates_in_order():
    merged = merge_chunks([episodes_to_chunk([make_episode(2, obs_offset=0)]),
                           episodes_to_chunk([make_episode(3, obs_offset=100)])])
    stream = merged.streams["default_agent"]
    assert merged.num_samples == 2 and merged.env_steps == 5
    np.testing.assert_array_equal(stream.steps["obs"][:, 0], [0, 1, 100, 101, 102])
    assert stream.fragments["num_rows"].tolist() == [2, 3]


def test_frames_are_encoded_per_episode_before_concatenation_as_a_whole_chunk_would_be():
    rng = np.random.default_rng(5)
    episodes = [image_episode(rng.integers(0, 256, size=(n, 6, 6, 2)), f"e{n}")[0] for n in (3, 5, 2)]
    per_episode = episodes_to_chunk(episodes, ConvertOptions(encode_images=True)).streams["default_agent"]
    whole = uint8_chunk(episodes_to_chunk(episodes)).streams["default_agent"]
    assert per_episode.encoded == whole.encoded == {"steps/obs": (1 / 128, -1.0), "fragments/last_obs": (1 / 128, -1.0)}
    for table in ("steps", "fragments"):
        for path, values in getattr(whole, table).items():
            got = getattr(per_episode, table)[path]
            assert got.dtype == values.dtype and got.shape == values.shape, path
            if values.dtype != object:
                np.testing.assert_array_equal(got, values)


def test_merging_encoded_and_float_samples_decodes_only_the_columns_they_disagree_on():
    rng = np.random.default_rng(6)
    (a, frames_a), (b, frames_b) = (image_episode(rng.integers(0, 256, size=(4, 5, 5, 1)), e) for e in "ab")
    b.get_observations()[1, 2, 2, 0] += np.float32(1e-3)  # one value off the grid: b's steps stay float32
    frames_b[1, 2, 2, 0] += np.float32(1e-3)
    options = ConvertOptions(encode_images=True)
    merged = merge_chunks([episodes_to_chunk([a], options), episodes_to_chunk([b], options)])
    stream = merged.streams["default_agent"]
    assert stream.encoded == {"fragments/last_obs": (1 / 128, -1.0)}  # both sent their last frame as codes
    assert stream.steps["obs"].dtype == np.float32
    assert np.array_equal(stream.steps["obs"], np.concatenate([frames_a[:-1], frames_b[:-1]]))  # bit for bit
    assert np.array_equal(stream.fragments["last_obs"].astype(np.float32) / 128 - 1, [frames_a[-1], frames_b[-1]])
    again = uint8_chunk(merged).streams["default_agent"]  # the outbox's check at send time finds it inexact
    assert again.steps["obs"].dtype == np.float32 and "steps/obs" not in again.encoded


def test_a_black_first_frame_does_not_hide_the_grid_the_rest_of_the_frames_lie_on():
    from rllib_recorder.format.frames import image_grid

    codes = np.random.default_rng(7).integers(0, 256, size=(4, 5, 5, 1))
    codes[0] = 0  # black in u8 * (1/255) is 0.0, which is also code 128 of u8 / 128 - 1
    episode, frames = image_episode(codes, "black", scale=255.0, offset=0.0)
    # the grid is code * float32(1/255); float32 division by 255 rounds 126 of the 256 values differently
    frames[:] = codes.astype(np.float32) * np.float32(1 / 255)
    episode.get_observations()[:] = frames
    stream = episodes_to_chunk([episode], ConvertOptions(encode_images=True)).streams["default_agent"]
    assert stream.encoded["steps/obs"] == (np.float32(1 / 255), 0.0)
    assert np.array_equal(stream.steps["obs"], codes[:-1]) and stream.steps["obs"].dtype == np.uint8
    assert image_grid(frames[:1]) == (np.float32(1 / 128), np.float32(-1.0))  # alone, the zeros fit the first grid


def test_frame_stacks_are_sent_as_their_newest_frames_and_rebuilt_bit_for_bit():
    from rllib_recorder.format.chunks import full_stacks

    rng = np.random.default_rng(8)
    episodes = [image_episode(stacked_frames(rng, n), f"e{n}")[0] for n in (3, 1, 6)]
    full = episodes_to_chunk(episodes, ConvertOptions(encode_images=True))
    stacked = episodes_to_chunk(episodes, ConvertOptions(encode_images=True, stack_frames=True))
    f, s = full.streams["default_agent"], stacked.streams["default_agent"]
    assert f.stacked == {} and f.steps["obs"].shape == (10, 6, 6, 4)
    assert s.stacked == {"obs": 4} and s.steps["obs"].shape == (10, 6, 6, 1) and s.steps["obs"].dtype == np.uint8
    np.testing.assert_array_equal(s.steps["obs"][..., 0], f.steps["obs"][..., -1])  # each row's newest frame
    np.testing.assert_array_equal(s.fragments["head_obs"], f.steps["obs"][[0, 3, 4], ..., :-1])
    assert s.encoded["fragments/head_obs"] == s.encoded["steps/obs"] == (1 / 128, -1.0)
    assert stacked.nbytes == full.nbytes  # counted as the float32 stacks they stand for
    np.testing.assert_array_equal(s.fragments["last_obs"], f.fragments["last_obs"])  # a fragment's last: in full
    back = full_stacks(s, ["obs"])
    assert back.stacked == {} and "head_obs" not in back.fragments and "fragments/head_obs" not in back.encoded
    for table in ("steps", "fragments"):
        assert getattr(back, table).keys() == getattr(f, table).keys()
        for path, values in getattr(f, table).items():
            if values.dtype != object:
                np.testing.assert_array_equal(getattr(back, table)[path], values, err_msg=path)


def test_one_fragment_whose_rows_do_not_repeat_their_frames_keeps_the_whole_chunk_in_full_stacks():
    rng = np.random.default_rng(9)
    (good, good_frames), (bad, bad_frames) = (image_episode(stacked_frames(rng, 5), e) for e in "gb")
    bad.get_observations()[3, 1, 1, 0] = bad_frames[3, 1, 1, 0] = np.float32(0.5)  # still a code, not the frame before
    stream = episodes_to_chunk([good, bad], ConvertOptions(encode_images=True, stack_frames=True)).streams["default_agent"]
    assert stream.stacked == {} and "head_obs" not in stream.fragments and stream.steps["obs"].dtype == np.uint8
    np.testing.assert_array_equal(stream.steps["obs"].astype(np.float32) / 128 - 1,
                                  np.concatenate([good_frames[:-1], bad_frames[:-1]]))


def test_text_observations_become_utf8_bytes():
    episode = SingleAgentEpisode(observations=["a", "bé"], actions=[0], rewards=[0.0], len_lookback_buffer=0)
    stream = episodes_to_chunk([episode]).streams["default_agent"]
    assert stream.steps["obs"].tolist() == [b"a"]
    assert stream.fragments["last_obs"].tolist() == ["bé".encode()]


def test_object_columns_are_rejected_with_fix():
    with pytest.raises(ConversionError, match="extra_model_outputs/odd.*numeric dtype"):
        flatten_value("extra_model_outputs/odd", np.array([object(), object()]), {})
