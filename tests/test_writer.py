"""The plain writer class against real HDF5 files in a temp dir (no Ray)."""

import json

import h5py
import numpy as np
import pytest

from rllib_recorder.errors import RecorderError, SchemaError
from rllib_recorder.format import commits, datasets, decode, layout
from rllib_recorder.record.convert import episodes_to_chunk
from rllib_recorder.service.writer import RecordingWriter
from tests import helpers
from tests.helpers import image_episode, make_episode, stacked_frames


def _writer(tmp_path, run_id="run-1"):
    return RecordingWriter(str(tmp_path), run_id, datasets.StorageOptions())


def test_append_writes_rows_fragments_and_batch_index(tmp_path):
    writer = _writer(tmp_path)
    writer.set_learner_version(9, at_s=0.0)
    ack = writer.append(2, False, b"s" * 32, 0, episodes_to_chunk([make_episode(3, eps_id="a", version=7)]))
    writer.append(2, False, b"s" * 32, 1, episodes_to_chunk([make_episode(2, t_started=3, eps_id="a", version=8)]))
    stats = writer.close()
    assert ack == {"seq": 0, "duplicate": False, "rows": 3}
    assert stats["agent_steps"] == 5 and stats["chunks"] == 2
    assert stats["policy_lag_counts"] == {2: 3, 1: 2}
    with h5py.File(tmp_path / "worker-002.h5", "r") as h5:
        assert h5.attrs["schema_version"] == layout.SCHEMA_VERSION and h5.attrs["worker_index"] == 2
        steps = h5["agents/default_agent/steps"]
        np.testing.assert_array_equal(steps["obs"][:, 0], [0, 1, 2, 3, 4])
        np.testing.assert_array_equal(steps["t"][()], [0, 1, 2, 3, 4])
        frags = h5["agents/default_agent/fragments"]
        assert frags["first_row"][()].tolist() == [0, 3] and frags["batch"][()].tolist() == [0, 1]
        np.testing.assert_array_equal(frags["last_obs"][()], [[3, -3], [5, -5]])
        assert h5["batches/seq"][()].tolist() == [0, 1]
        assert h5["batches/learner_version"][()].tolist() == [9, 9]
        assert json.loads(h5.attrs["commit"]) == {"batches": 2, "agents": {"default_agent": [5, 2]}}


def test_resent_chunk_is_acknowledged_but_stored_once_even_after_reopen(tmp_path):
    chunk = episodes_to_chunk([make_episode(4)])
    writer = _writer(tmp_path)
    writer.append(0, False, b"x" * 32, 0, chunk)
    writer.close()
    again = _writer(tmp_path)  # a restarted writer actor
    assert again.append(0, False, b"x" * 32, 0, chunk)["duplicate"] is True
    assert again.append(0, False, b"y" * 32, 0, chunk)["duplicate"] is False  # new runner incarnation
    again.close()
    with h5py.File(tmp_path / "worker-000.h5", "r") as h5:
        assert h5["agents/default_agent/steps/rewards"].shape == (8,)


def test_uncommitted_rows_of_a_crashed_append_are_removed_on_reopen(tmp_path):
    writer = _writer(tmp_path)
    writer.append(1, False, b"x" * 32, 0, episodes_to_chunk([make_episode(3)]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "a") as h5:  # a crash after writing rows, before commit
        rewards = h5["agents/default_agent/steps/rewards"]
        rewards.resize(10, axis=0)
    reopened = _writer(tmp_path)
    reopened.append(1, False, b"x" * 32, 1, episodes_to_chunk([make_episode(2, t_started=3)]))
    reopened.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        np.testing.assert_array_equal(h5["agents/default_agent/steps/rewards"][()], [0, 1, 2, 3, 4])


def test_evaluation_files_are_separate_and_marked(tmp_path):
    writer = _writer(tmp_path)
    writer.append(1, True, b"x" * 32, 0, episodes_to_chunk([make_episode(1)]))
    writer.close()
    with h5py.File(tmp_path / "eval-worker-001.h5", "r") as h5:
        assert bool(h5.attrs["is_evaluation"]) is True


def test_file_of_another_run_is_refused(tmp_path):
    writer = _writer(tmp_path, "run-1")
    writer.append(0, False, b"x" * 32, 0, episodes_to_chunk([make_episode(1)]))
    writer.close()
    with pytest.raises(RecorderError, match="belongs to run 'run-1'"):
        _writer(tmp_path, "run-2").append(0, False, b"x" * 32, 0, episodes_to_chunk([make_episode(1)]))


def test_future_major_version_is_refused_with_versions_named(tmp_path):
    writer = _writer(tmp_path)
    writer.append(0, False, b"x" * 32, 0, episodes_to_chunk([make_episode(1)]))
    writer.close()
    with h5py.File(tmp_path / "worker-000.h5", "a") as h5:
        h5.attrs["schema_version"] = "9.0"
    with pytest.raises(SchemaError, match=r"schema version 9\.0.*reads versions 1\.x and 2\.x and 3\.x; install"):
        _writer(tmp_path).append(0, False, b"x" * 32, 1, episodes_to_chunk([make_episode(1)]))


def test_changed_observation_shape_is_refused_and_file_stays_intact(tmp_path):
    writer = _writer(tmp_path)
    writer.append(0, False, b"x" * 32, 0, episodes_to_chunk([make_episode(2)]))
    bad = episodes_to_chunk([make_episode(2)])
    bad.streams["default_agent"].steps["obs"] = np.zeros((2, 5), np.float32)
    with pytest.raises(SchemaError, match="rows of shape"):
        writer.append(0, False, b"x" * 32, 1, bad)
    writer.append(0, False, b"x" * 32, 2, episodes_to_chunk([make_episode(1, obs_offset=50)]))
    writer.close()
    with h5py.File(tmp_path / "worker-000.h5", "r") as h5:
        np.testing.assert_array_equal(h5["agents/default_agent/steps/obs"][:, 0], [0, 1, 50])
        assert h5["batches/seq"][()].tolist() == [0, 2]


def test_values_a_column_can_not_hold_widen_it_instead_of_being_cast(tmp_path):
    """An env whose first rewards are all Python ints gets an int64 reward column; a later 0.5 turns the column
    into float64 (stored rows cast exactly), and a float32 column takes float64 values as float64."""
    first, second = make_episode(3), make_episode(2, eps_id="b")
    chunk = episodes_to_chunk([first])
    chunk.streams["default_agent"].steps["rewards"] = np.array([0, 1, 2], np.int64)  # an env's Python ints
    later = episodes_to_chunk([second])
    later.streams["default_agent"].steps["rewards"] = np.array([0.5, -1e-9])
    later.streams["default_agent"].steps["obs"] = np.array([[0.1, 0.0], [1e-40, -1.0]])  # float64 into float32
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, chunk)
    writer.append(1, False, b"s" * 32, 1, later)
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        steps = h5["agents/default_agent/steps"]
        assert steps["rewards"].dtype == np.float64 and steps["rewards"][()].tolist() == [0, 1, 2, 0.5, -1e-9]
        obs = steps["obs"]
        assert obs.dtype == np.float64 and helpers.plain_rows(obs).tolist() == [[0, 0], [1, -1], [2, -2], [0.1, 0], [1e-40, -1]]
        assert not [k for k in steps if k.endswith(layout.FLOAT_SUFFIX)]


def test_writer_refuses_pickling(tmp_path):
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(_writer(tmp_path))


def test_nested_dict_tuple_observations_read_back_as_nested(tmp_path):
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.read.run import open_run

    obs = [{"pos": np.full(2, t, np.float32), "inv": (np.int64(t), np.full(3, t, np.uint8))} for t in range(4)]
    episode = SingleAgentEpisode(id_="e", observations=obs, actions=[0, 1, 0], rewards=[1.0, 2.0, 3.0],
                                 terminated=True, len_lookback_buffer=0)
    episode.to_numpy()
    writer = _writer(tmp_path)
    writer.append(1, False, b"x" * 32, 0, episodes_to_chunk([episode]))
    writer.close()
    write_manifest(str(tmp_path), {"format": "rllib_recorder", "schema_version": layout.SCHEMA_VERSION})
    with open_run(str(tmp_path)) as run:
        stored = run.episode("e")
    assert isinstance(stored.obs, dict) and isinstance(stored.obs["inv"], tuple)
    np.testing.assert_array_equal(stored.obs["inv"][0], [0, 1, 2, 3])
    np.testing.assert_array_equal(stored.obs["inv"][1], np.repeat(np.arange(4, dtype=np.uint8), 3).reshape(4, 3))
    np.testing.assert_array_equal(stored.next_obs["pos"], [[1, 1], [2, 2], [3, 3]])


def test_exact_float_frames_are_stored_as_uint8_and_read_back_bit_for_bit(tmp_path):
    from rllib_recorder.read.run import open_run

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(6, 8, 8, 4)).astype(np.uint8)
    episode, frames = image_episode(codes, "img")
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert obs.dtype == np.uint8 and obs.attrs["encoding"] == "affine_uint8"
        stored = helpers.plain_rows(obs, h5["agents/default_agent/fragments"])  # frame deltas undone
        np.testing.assert_array_equal(stored, codes[:-1])
        # the FORMAT.md recipe: value = code * scale + offset, as float32
        decoded = stored.astype(np.float32) * np.float32(obs.attrs["scale"]) + np.float32(obs.attrs["offset"])
        assert np.array_equal(decoded, frames[:-1])
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "rllib_recorder", "schema_version": layout.SCHEMA_VERSION}))
    with open_run(str(tmp_path)) as run:
        stored = run.episode("img")
        assert stored.obs.dtype == np.float32 and np.array_equal(stored.obs, frames)  # incl. last_obs


def test_a_frame_that_is_not_exact_turns_the_column_back_into_float32_losslessly(tmp_path):
    rng = np.random.default_rng(1)
    first, frames1 = image_episode(rng.integers(0, 256, size=(4, 8, 8, 1)), "a")
    second, frames2 = image_episode(rng.integers(0, 256, size=(3, 8, 8, 1)), "b")
    second_obs = second.get_observations()
    second_obs[1, 0, 0, 0] += np.float32(1e-3)  # no longer code / 128 - 1
    frames2[1, 0, 0, 0] += np.float32(1e-3)
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([first]))
    writer.append(1, False, b"s" * 32, 1, episodes_to_chunk([second]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert obs.dtype == np.float32 and "encoding" not in obs.attrs
        assert np.array_equal(helpers.plain_rows(obs), np.concatenate([frames1[:-1], frames2[:-1]]))
        assert not [k for k in h5["agents/default_agent/steps"] if k.endswith(layout.FLOAT_SUFFIX)]


@pytest.mark.parametrize("sent", [("codes", "codes"), ("codes", "inexact", "codes"), ("inexact", "codes"),
                                  ("codes", "floats")])
@pytest.mark.parametrize("writer_encodes", [True, False])
def test_frames_the_runner_sends_as_uint8_codes_are_stored_losslessly_whatever_came_before(tmp_path, sent,
                                                                                             writer_encodes):
    from rllib_recorder.format.chunks import uint8_chunk

    rng = np.random.default_rng(2)
    chunks, expected = [], []
    for i, how in enumerate(sent):
        episode, frames = image_episode(rng.integers(0, 256, size=(5, 8, 8, 2)), f"e{i}")
        if how == "inexact":
            episode.get_observations()[2, 1, 1, 1] += np.float32(1e-3)  # no longer code / 128 - 1
            frames[2, 1, 1, 1] += np.float32(1e-3)
        chunk = episodes_to_chunk([episode])
        if how != "floats":
            encoded = uint8_chunk(chunk)
            stream = encoded.streams["default_agent"]
            assert encoded.nbytes == chunk.nbytes  # counted as the float32 frames they stand for
            if how == "codes":
                assert stream.steps["obs"].dtype == np.uint8 and stream.fragments["last_obs"].dtype == np.uint8
                assert set(stream.encoded) == {"steps/obs", "fragments/last_obs"}
            else:
                assert stream.steps["obs"].dtype == np.float32 and set(stream.encoded) == {"fragments/last_obs"}
            chunk = encoded
        chunks.append(chunk)
        expected.append(frames)
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions(encode_uint8=writer_encodes))
    for seq, chunk in enumerate(chunks):
        writer.append(1, False, b"s" * 32, seq, chunk)
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        steps, fragments = h5["agents/default_agent/steps"], h5["agents/default_agent/fragments"]
        stays_uint8 = writer_encodes and "inexact" not in sent
        assert steps["obs"].dtype == (np.uint8 if stays_uint8 else np.float32)
        for column, want in ((steps["obs"], np.concatenate([f[:-1] for f in expected])),
                             (fragments["last_obs"], np.stack([f[-1] for f in expected]))):
            got = decode.decode_uint8(column, helpers.plain_rows(column))
            assert got.dtype == np.float32 and np.array_equal(got, want)  # bit for bit


def test_reopen_finishes_a_float_rewrite_cut_short_by_a_crash(tmp_path):
    rng = np.random.default_rng(2)
    episode, frames = image_episode(rng.integers(0, 256, size=(4, 8, 8, 1)), "a")
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode]))
    writer.close()
    path = tmp_path / "worker-001.h5"
    with h5py.File(path, "a") as h5:  # crash between deleting the uint8 column and renaming its float copy
        steps = h5["agents/default_agent/steps"]
        steps.create_dataset("obs" + layout.FLOAT_SUFFIX, data=frames[:-1], maxshape=(None, 8, 8, 1))
        del steps["obs"]
    again = _writer(tmp_path)
    again.append(1, False, b"s" * 32, 1, episodes_to_chunk([image_episode(np.zeros((2, 8, 8, 1)), "b")[0]]))
    again.close()
    with h5py.File(path, "r") as h5:
        obs = helpers.plain_rows(h5["agents/default_agent/steps/obs"])
        assert obs.dtype == np.float32 and np.array_equal(obs[:3], frames[:-1]) and len(obs) == 4


@pytest.mark.parametrize("sent", [("stacked", "stacked"), ("full", "full"), ("stacked", "broken", "stacked"),
                                  ("broken", "stacked")])
@pytest.mark.parametrize("writer_stacks", [True, False])
def test_frame_stacks_are_stored_as_newest_frames_and_read_back_bit_for_bit_whatever_came_before(
        tmp_path, sent, writer_stacks):
    """Chunks of one episode continued across samples (truncate_episodes) and of new ones: sent stacked by the env
    runner, sent in full (the writer stacks them), or with a row that does not repeat the frames before it (the
    column turns into full stacks, once). Every row reads back bit for bit through the reader, whatever the rows
    asked for; plain h5py sees one frame per row and the frame_stack attribute."""
    from rllib_recorder.read.worker_file import WorkerFile
    from rllib_recorder.record.convert import ConvertOptions

    rng = np.random.default_rng(3)
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions(stack_frames=writer_stacks))
    expected, last, episodes = [], None, {}
    for seq, how in enumerate(sent):
        codes = stacked_frames(rng, 4 + seq, first=last)  # continues the episode of the chunk before
        last = codes[-1]
        if how == "broken":
            codes[2, 0, 0, 1] ^= 1
        continued, _ = image_episode(codes, "long", t_started=sum(len(e) - 1 for e in expected))
        new, new_codes = image_episode(stacked_frames(rng, 3), f"new{seq}")
        episodes.setdefault("long", []).append(codes)
        episodes[f"new{seq}"] = [np.round((new_codes + 1) * 128)]
        expected.extend([codes, np.round((new_codes + 1) * 128)])
        chunk = episodes_to_chunk([continued, new], ConvertOptions(encode_images=True, stack_frames=how == "stacked"))
        assert chunk.streams["default_agent"].stacked == ({"obs": 4} if how == "stacked" else {})
        writer.append(1, False, b"s" * 32, seq, chunk)
    writer.close()
    path = str(tmp_path / "worker-001.h5")
    all_rows = np.concatenate([e[:-1] for e in expected]).astype(np.float32) / 128 - 1
    stays_stacked = writer_stacks and "broken" not in sent
    with h5py.File(path, "r") as h5:  # plain h5py
        obs, fragments = h5["agents/default_agent/steps/obs"], h5["agents/default_agent/fragments"]
        assert obs.shape == (len(all_rows), 6, 6, 1 if stays_stacked else 4) and obs.dtype == np.uint8
        assert obs.attrs.get("frame_stack") == (4 if stays_stacked else None)
        assert ("head_obs" in fragments) == stays_stacked
        if stays_stacked:
            np.testing.assert_array_equal(helpers.plain_rows(obs)[:, ..., 0], np.round((all_rows[..., -1] + 1) * 128))
            assert fragments["head_obs"].shape == (2 * len(sent), 6, 6, 3)
            assert decode.row_shape(obs) == (6, 6, 4)
    f = WorkerFile(path)
    try:
        n = len(all_rows)
        for start in range(n + 1):
            for stop in range(start, n + 1, 3):
                got = f.column("default_agent", "obs", slice(start, stop))
                assert got.dtype == np.float32 and np.array_equal(got, all_rows[start:stop]), (start, stop)
        for eps_id, parts in episodes.items():
            want = np.concatenate([p[:-1] for p in parts] + [parts[-1][-1:]]).astype(np.float32) / 128 - 1
            assert np.array_equal(f.episode(eps_id, "default_agent").obs, want), eps_id
        batches = list(f.batches_in_order())
        assert np.array_equal(np.concatenate([b.steps["default_agent"]["obs"] for b in batches]), all_rows)
    finally:
        f.close()


def test_frame_stacks_inside_a_dict_space_and_from_the_old_stack_are_stacked_by_the_writer_and_read_back(tmp_path):
    """A Dict observation whose image is a frame stack (the writer stacks ``obs/pixels``, its head frames under
    ``fragments/head_obs/pixels``), and an old-stack SampleBatch of two episodes' frame stacks (sent in full, split
    into fragments by episode, stacked by the writer). Every row reads back as recorded."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.policy.sample_batch import SampleBatch

    from rllib_recorder.read.worker_file import WorkerFile
    from rllib_recorder.record.batches import batch_to_chunk

    rng = np.random.default_rng(7)
    codes = stacked_frames(rng, 5)
    obs = [{"pixels": c, "vec": np.full(2, t, np.float32)} for t, c in enumerate(codes)]
    episode = SingleAgentEpisode(id_="d", observations=obs, actions=[0] * 5, rewards=[0.0] * 5, len_lookback_buffer=0)
    episode.to_numpy()
    old = [stacked_frames(rng, n) for n in (3, 4)]
    rows = np.concatenate([o[:-1] for o in old])
    batch = SampleBatch({
        "obs": rows, "new_obs": np.concatenate([o[1:] for o in old]), "actions": np.zeros(7, np.int64),
        "rewards": np.ones(7, np.float32), "terminateds": np.zeros(7, bool), "truncateds": np.zeros(7, bool),
        "eps_id": np.array([1] * 3 + [2] * 4), "t": np.array([0, 1, 2, 0, 1, 2, 3]),
    })
    for worker, chunk in ((1, episodes_to_chunk([episode])), (2, batch_to_chunk(batch))):
        writer = _writer(tmp_path)
        writer.append(worker, False, b"s" * 32, 0, chunk)
        writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        assert h5["agents/default_agent/steps/obs/pixels"].attrs["frame_stack"] == 4
        assert h5["agents/default_agent/fragments/head_obs/pixels"].shape == (1, 6, 6, 3)
    with h5py.File(tmp_path / "worker-002.h5", "r") as h5:
        assert h5["agents/default_agent/steps/obs"].shape == (7, 6, 6, 1)
        assert h5["agents/default_agent/fragments/head_obs"].shape == (2, 6, 6, 3)
    first, second = WorkerFile(str(tmp_path / "worker-001.h5")), WorkerFile(str(tmp_path / "worker-002.h5"))
    try:
        stored = first.episode("d", "default_agent").obs
        assert np.array_equal(stored["pixels"], codes) and np.array_equal(stored["vec"][:, 0], np.arange(6))
        assert np.array_equal(second.column("default_agent", "obs"), rows)
        assert np.array_equal(second.column("default_agent", "obs", slice(2, 5)), rows[2:5])
    finally:
        first.close()
        second.close()


def test_a_frame_stacked_column_without_its_head_frames_is_reported_in_one_line(tmp_path):
    from rllib_recorder.read.worker_file import WorkerFile
    from rllib_recorder.record.convert import ConvertOptions

    episode, _ = image_episode(stacked_frames(np.random.default_rng(8), 4), "a")
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode], ConvertOptions(encode_images=True)))
    writer.close()
    from rllib_recorder.commands.verify import verify_run
    from rllib_recorder.format.manifest import write_manifest

    write_manifest(str(tmp_path), {"format": "rllib_recorder", "schema_version": layout.SCHEMA_VERSION,
                                   "status": "finished"})
    assert verify_run(str(tmp_path)) == []
    with h5py.File(tmp_path / "worker-001.h5", "a") as h5:
        del h5["agents/default_agent/fragments/head_obs"]
    f = WorkerFile(str(tmp_path / "worker-001.h5"))
    try:
        with pytest.raises(SchemaError, match=r"head_obs or .*first_row is missing, so its stacks can't be rebuilt; "
                                              r"the file is damaged: move it out of the run directory to read the "
                                              r"rest of the run$"):
            f.column("default_agent", "obs")
    finally:
        f.close()
    assert verify_run(str(tmp_path)) == [
        "worker-001.h5: default_agent: steps/obs stores frame stacks as newest frames, but fragments/head_obs is "
        "missing or short, so its stacks can't be rebuilt"]


def test_head_frames_that_are_not_exact_codes_are_kept_as_float32_and_a_later_rewrite_to_full_stacks_is_exact(
        tmp_path):
    """Float32 frames sent in full (no encoding in the runner): the writer stacks and encodes them. A first row
    whose older frames are off the uint8 grid leaves its newest frames exact: the head column turns float32, the
    step column stays uint8 codes. A chunk that does not repeat its frames then rewrites the column as full
    stacks from both, as float32."""
    rng = np.random.default_rng(6)
    episodes = [image_episode(stacked_frames(rng, 4), f"e{i}") for i in range(3)]
    episodes[1][0].get_observations()[0, 2, 2, 0] += np.float32(1e-3)  # frame 0 of row 0: a head frame only
    episodes[1][1][0, 2, 2, 0] += np.float32(1e-3)
    episodes[2][0].get_observations()[2, 1, 1, 1] += np.float32(0.5)  # row 2 no longer repeats row 1
    episodes[2][1][2, 1, 1, 1] += np.float32(0.5)
    writer = _writer(tmp_path)
    path = tmp_path / "worker-001.h5"
    for seq, (episode, _) in enumerate(episodes):
        writer.append(1, False, b"s" * 32, seq, episodes_to_chunk([episode]))
        if seq == 1:
            writer.close()
            with h5py.File(path, "r") as h5:
                obs, heads = h5["agents/default_agent/steps/obs"], h5["agents/default_agent/fragments/head_obs"]
                assert obs.dtype == np.uint8 and obs.attrs["frame_stack"] == 4 and heads.dtype == np.float32
            writer = _writer(tmp_path)
    writer.close()
    with h5py.File(path, "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert obs.dtype == np.float32 and "frame_stack" not in obs.attrs and "encoding" not in obs.attrs
        assert "head_obs" not in h5["agents/default_agent/fragments"]
        assert np.array_equal(helpers.plain_rows(obs), np.concatenate([frames[:-1] for _, frames in episodes]))


def test_reopen_drops_the_head_frames_of_a_column_a_crash_left_as_full_stacks(tmp_path):
    from rllib_recorder.record.convert import ConvertOptions

    rng = np.random.default_rng(4)
    episode, frames = image_episode(stacked_frames(rng, 5), "a")
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode], ConvertOptions(encode_images=True)))
    writer.close()
    path = tmp_path / "worker-001.h5"
    with h5py.File(path, "a") as h5:  # crash after the full-stack copy replaced the column, before its heads went
        steps = h5["agents/default_agent/steps"]
        full = decode.read_rows(steps["obs"], slice(None), decode=False)
        attrs = {k: v for k, v in steps["obs"].attrs.items() if k not in ("frame_stack", "delta", "delta_key_rows")}
        del steps["obs"]
        steps.create_dataset("obs", data=full, maxshape=(None, 6, 6, 4)).attrs.update(attrs)
        assert "head_obs" in h5["agents/default_agent/fragments"]
    again = _writer(tmp_path)
    more, more_frames = image_episode(stacked_frames(rng, 3), "b")
    again.append(1, False, b"s" * 32, 1, episodes_to_chunk([more], ConvertOptions(encode_images=True)))
    again.close()
    with h5py.File(path, "r") as h5:
        assert "head_obs" not in h5["agents/default_agent/fragments"]
        assert np.array_equal(helpers.plain_rows(h5["agents/default_agent/steps/obs"]),
                              np.round((np.concatenate([frames[:-1], more_frames[:-1]]) + 1) * 128))


def _noisy_chunk(first, n, width=64):
    """n rows of obs made from the row index, compressed (so a tail chunk grows each time it is rewritten)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    rows = np.arange(first, first + n + 1, dtype=np.uint64)[:, None]
    obs = ((rows * np.uint64(2654435761) + np.arange(width, dtype=np.uint64)) % np.uint64(1 << 20)).astype(np.float32)
    obs[:, 0] = rows[:, 0]
    episode = SingleAgentEpisode(
        observations=list(obs), actions=[0] * n, rewards=[1.0] * n, len_lookback_buffer=0,
        extra_model_outputs={"weights_seq_no": [0] * n},
    )
    episode.to_numpy()
    return episodes_to_chunk([episode])


def test_freed_space_is_never_reused_and_dead_space_is_compacted_away_without_losing_a_row(tmp_path):
    writer = _writer(tmp_path)
    slack = writer.compact_slack_bytes = 256 << 10
    path = tmp_path / "worker-001.h5"
    peak, first = 0, 0
    for seq in range(120):
        writer.append(1, False, b"s" * 32, seq, _noisy_chunk(first, 20))
        first += 20
        peak = max(peak, path.stat().st_size)
    mid_run = writer.stats()["compactions"]
    stats = writer.close()
    with h5py.File(path, "r") as h5:
        assert h5.id.get_create_plist().get_file_space_strategy()[0] == h5py.h5f.FSPACE_STRATEGY_NONE
        obs = helpers.plain_rows(h5["agents/default_agent/steps/obs"])
        assert obs.shape == (first, 64) and json.loads(h5.attrs["commit"])["agents"]["default_agent"][0] == first
        np.testing.assert_array_equal(obs[:, 0], np.arange(first))
        data = commits.datasets_bytes(h5)
    assert mid_run >= 1 and stats["compacted_bytes"] > 0
    # Bounded while running (dead space <= data + slack, plus one append), small at the end.
    assert peak < 2 * data + slack + 2 * (64 << 10) * 12
    assert path.stat().st_size < 1.5 * data + slack
    assert stats["disk_bytes"] == path.stat().st_size


def test_a_stale_end_of_allocation_left_by_a_kill_is_repaired_before_reopening_not_cut_off(tmp_path):
    """A writer killed after HDF5 wrote a chunk and its index but before the superblock's EOA: the chunk's
    bytes are in the file, past the EOA the superblock records. Opening for append must not cut them off."""
    from rllib_recorder.format import repair as h5repair

    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, _noisy_chunk(0, 30))
    path = tmp_path / "worker-001.h5"
    writer._files[(1, False)].flush()
    stale_eoa = path.stat().st_size
    writer.append(1, False, b"s" * 32, 1, _noisy_chunk(30, 30))
    writer._files.pop((1, False)).close()  # flushed, then gone: no close-time compaction, like a killed writer
    # The superblock says the file ends where it ended before the second append (version 2: checksummed).
    head = bytearray(path.read_bytes()[:48])
    assert head[8] in (2, 3)  # superblock versions 2-3 share this layout
    head[28:36] = stale_eoa.to_bytes(8, "little")
    head[44:48] = h5repair.lookup3(bytes(head[:44])).to_bytes(4, "little")
    with open(path, "r+b") as f:
        f.write(head)
    with pytest.raises(Exception, match="addr overflow|truncated|eoa"):
        with h5py.File(path, "r") as h5:
            helpers.plain_rows(h5["agents/default_agent/steps/obs"])
    size = path.stat().st_size
    again = _writer(tmp_path)  # a restarted writer reopens the file
    again.append(1, False, b"t" * 32, 0, _noisy_chunk(60, 10))
    again.close()
    assert size > stale_eoa
    with h5py.File(path, "r") as h5:
        obs = helpers.plain_rows(h5["agents/default_agent/steps/obs"])
        np.testing.assert_array_equal(obs[:, 0], np.arange(70))
        assert json.loads(h5.attrs["commit"])["batches"] == 3


def test_commits_overwrite_the_record_in_place_so_the_root_header_never_grows(tmp_path):
    # Rewritten as a variable-length string, the record now and then gave the root header a new chunk at the
    # end of the file (in the kill loop's workload at its 339th append), and a kill between the flushes of the
    # header and of that chunk (HDF5 flushes metadata in address order) left a file no HDF5 could open.
    # Overwritten in place as a fixed-size string, a commit allocates nothing.
    writer = _writer(tmp_path)
    sizes, counts = set(), []
    for seq in range(24):  # row counts pass 10, 100, 1,000 and 10,000: the JSON grows by a digit each time
        writer.append(1, False, b"s" * 32, seq, episodes_to_chunk([make_episode(10 + 40 * seq, eps_id=f"e{seq}")]))
        h5 = writer._files[(1, False)]
        sizes.add(h5py.h5o.get_info(h5.id).hdr.space.total)
        counts.append(commits.read_commit(h5)["agents"]["default_agent"][0])
    writer.close()
    assert counts[-1] > 10_000 and len(sizes) == 1
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        assert h5.attrs.get_id("commit").dtype == np.dtype(f"S{commits.COMMIT_BYTES}")
        assert json.loads(h5.attrs["commit"]) == {"batches": 24, "agents": {"default_agent": [counts[-1], 24]}}


def test_a_commit_record_that_outgrows_its_attribute_is_recreated_larger_and_later_commits_fit_in_place(tmp_path):
    # The writer keeps the record and its attribute open between appends; one that outgrows the attribute (here
    # 60 agents' counts) is re-created at twice its size, and the next commits write the new one in place.
    from rllib_recorder.format.chunks import Chunk

    def chunk(agents, seq):
        stream = episodes_to_chunk([make_episode(3, eps_id=f"e{seq}")]).streams["default_agent"]
        return Chunk(streams={f"agent_{i:02d}": stream for i in range(agents)}, env_steps=3, num_samples=1,
                     sampled_at_s=0.0)

    writer = _writer(tmp_path)
    for seq, agents in enumerate((5, 60, 60)):
        writer.append(1, False, b"s" * 32, seq, chunk(agents, seq))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        commit = json.loads(h5.attrs["commit"])
        capacity = h5.attrs.get_id("commit").dtype.itemsize
        assert capacity > commits.COMMIT_BYTES and len(json.dumps(commit)) < capacity
        assert commit["batches"] == 3
        assert commit["agents"] == {f"agent_{i:02d}": [9, 3] if i < 5 else [6, 2] for i in range(60)}
        for i in (0, 4, 5, 59):
            rows = commit["agents"][f"agent_{i:02d}"][0]
            np.testing.assert_array_equal(h5[f"agents/agent_{i:02d}/steps/t"][()], np.tile(np.arange(3), rows // 3))


def test_an_older_files_variable_length_commit_is_read_and_replaced_on_the_next_append(tmp_path):
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([make_episode(3, eps_id="a")]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "a") as h5:  # as schema 1.2 wrote it
        del h5.attrs["commit"]
        h5.attrs["commit"] = json.dumps({"batches": 1, "agents": {"default_agent": [3, 1]}})
        assert h5.attrs.get_id("commit").dtype.kind == "O"
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 1, episodes_to_chunk([make_episode(2, eps_id="b", obs_offset=10)]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        assert h5.attrs.get_id("commit").dtype.kind == "S"
        assert json.loads(h5.attrs["commit"]) == {"batches": 2, "agents": {"default_agent": [5, 2]}}
        np.testing.assert_array_equal(h5["agents/default_agent/steps/obs"][:, 0], [0, 1, 2, 10, 11])


def test_columns_are_compressed_where_it_pays_and_read_back_value_by_value(tmp_path):
    """Index tables' small columns are unfiltered (256-row chunks); a step column is gzip unless its first rows
    compress less than 1.25x (noise-like float32 observations); images and scalars with structure are gzip."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    rng = np.random.default_rng(0)
    n = 600
    obs = rng.standard_normal((n + 1, 4)).astype(np.float32)  # incompressible: 1.1x, as CartPole's
    episode = SingleAgentEpisode(
        id_="noise", observations=list(obs), actions=[t % 2 for t in range(n)], rewards=[1.0] * n,
        extra_model_outputs={"weights_seq_no": [0] * n}, len_lookback_buffer=0,
    )
    episode.to_numpy()
    codes = rng.integers(0, 4, size=(3, 21, 21, 4)).astype(np.uint8).repeat(4, axis=1).repeat(4, axis=2)[:, :84, :84]
    frames, values = image_episode(codes, "frames")
    writer = _writer(tmp_path)
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode]))
    writer.append(2, False, b"s" * 32, 0, episodes_to_chunk([frames]))
    writer.close()
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        steps, frags = h5["agents/default_agent/steps"], h5["agents/default_agent/fragments"]
        assert steps["obs"].compression is None and steps["t"].compression == "gzip"
        assert steps["rewards"].compression == "gzip"
        for table in (h5["batches"], frags):
            for name, column in table.items():
                if column.dtype.itemsize < datasets.INDEX_PLAIN_ROW_BYTES and column.ndim == 1:
                    assert column.compression is None and column.chunks[0] <= datasets.INDEX_CHUNK_ROWS, name
        np.testing.assert_array_equal(helpers.plain_rows(steps["obs"]), obs[:-1])
        np.testing.assert_array_equal(frags["last_obs"][0], obs[-1])
        np.testing.assert_array_equal(steps["t"][()], np.arange(n))
    with h5py.File(tmp_path / "worker-002.h5", "r") as h5:
        column = h5["agents/default_agent/steps/obs"]
        assert column.compression == "gzip" and column.dtype == np.uint8
        np.testing.assert_array_equal(decode.decode_uint8(column, helpers.plain_rows(column)), values[:-1])
        last = h5["agents/default_agent/fragments/last_obs"]
        assert last.compression == "gzip"  # a row of 84x84x4 bytes: compressed like a step column
