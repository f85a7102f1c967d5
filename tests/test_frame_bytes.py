"""Atari's bytes on disk (schema 3.0): frames stored as XOR deltas and start states stored against an earlier one of
their batch, both lossless, checked bit for bit on real ALE frames and states and on a real recorded PPO run."""

from __future__ import annotations

import importlib.util
import os

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from rllib_recorder.cli import main
from rllib_recorder.errors import RecorderError, ReplayError
from rllib_recorder.format import datasets, frames, start_state
from rllib_recorder.format.manifest import write_manifest
from rllib_recorder.read.run import open_run
from rllib_recorder.read.worker_file import WorkerFile
from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk
from rllib_recorder.service.writer import RecordingWriter
from tests import helpers


def ale_episodes(lengths, seed=0):
    """Real Breakout frames through RLlib's Atari wrappers (84x84x4 float32 stacks), cut into fragments of
    ``lengths`` steps, under random actions."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rllib_recorder.commands.envs import make_atari_env

    env = make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {})
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out, t = [], 0
    for i, n in enumerate(lengths):
        observations, actions = [obs], []
        for _ in range(n):
            action = int(rng.integers(env.action_space.n))
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
            observations.append(obs)
            actions.append(action)
        episode = SingleAgentEpisode(id_=f"e{i}", observations=observations, actions=actions, rewards=[0.0] * n,
                                     len_lookback_buffer=0, t_started=0,
                                     extra_model_outputs={"weights_seq_no": [0] * n})
        episode.to_numpy()
        out.append(episode)
        t += n
    env.close()
    return out


@pytest.mark.parametrize("lengths", [[300], [5, 1, 129, 128, 130, 257]])
def test_frame_deltas_read_back_bit_for_bit_from_any_row_on_real_atari_frames(tmp_path, lengths):
    episodes = ale_episodes(lengths)
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions())
    for seq, episode in enumerate(episodes):  # one append each, and all of them in one: both cut fragments
        writer.append(1, False, b"s" * 32, seq, episodes_to_chunk([episode], ConvertOptions(encode_images=True)))
    writer.close()
    want = np.concatenate([e.get_observations()[:-1] for e in episodes])  # float32 stacks as RLlib held them
    path = str(tmp_path / "worker-001.h5")
    with h5py.File(path, "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert obs.attrs["delta"] == "xor_previous_row" and obs.attrs["delta_key_rows"] == 128
        stored = obs[()]
        plain = helpers.plain_rows(obs)  # docs/FORMAT.md's numpy, from plain h5py
        assert not np.array_equal(stored, plain)  # the rows on disk really are deltas
        # a life lost mid-fragment resets the stack, so these rows are stored as full stacks (stacking is tested
        # on the recorded run below): the codes of every frame of every stack
        assert "frame_stack" not in obs.attrs
        np.testing.assert_array_equal(plain, np.round((want + 1) * 128))
    f = WorkerFile(path)
    try:
        n = len(want)
        rng = np.random.default_rng(1)
        spans = [(0, n), (n - 1, n)] + [tuple(sorted(rng.integers(0, n + 1, 2))) for _ in range(40)]
        for a, b in spans:  # any rows, also from mid-fragment past a key row: as RLlib held them, bit for bit
            got = f.column("default_agent", "obs", slice(a, b))
            assert got.dtype == np.float32 and np.array_equal(got, want[a:b]), (a, b)
    finally:
        f.close()


def test_a_writer_continuing_a_2x_file_stores_frames_as_they_are(tmp_path):
    episodes = ale_episodes([20, 20])
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions())
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episodes[0]], ConvertOptions(encode_images=True)))
    writer.close()
    path = str(tmp_path / "worker-001.h5")
    with h5py.File(path, "a") as h5:  # as a 2.2 writer left it: frames as they are
        obs = h5["agents/default_agent/steps/obs"]
        rows = helpers.plain_rows(obs)
        h5.attrs["schema_version"] = "2.2"
        for name in ("delta", "delta_key_rows"):
            del obs.attrs[name]
        obs[...] = rows
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions())
    writer.append(1, False, b"s" * 32, 1, episodes_to_chunk([episodes[1]], ConvertOptions(encode_images=True)))
    writer.close()
    want = np.concatenate([e.get_observations()[:-1] for e in episodes])
    with h5py.File(path, "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert "delta" not in obs.attrs and h5.attrs["schema_version"] == "2.2"
        np.testing.assert_array_equal(obs[()], np.round((want + 1) * 128))


def ale_states(count):
    """Start-state blobs of real Breakout episodes as the recorder captures them (life losses start episodes
    mid-game, as RLlib's EpisodicLifeEnv does)."""
    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.record import envstate

    env = make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {})
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    blobs = []
    while len(blobs) < count:  # an episode starts (reset, or a life lost), is captured, and plays to its end
        blobs.append(envstate.capture(env)[1])
        while True:
            _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            if terminated or truncated:
                env.reset()
                break
    env.close()
    return blobs


def test_start_states_stored_against_an_earlier_one_of_their_batch_resolve_bit_for_bit():
    blobs = ale_states(12)
    encoded = start_state.encode_batch(blobs)
    assert start_state.ref_back(encoded[0]) == 0  # the first of a batch reads on its own
    assert sum(map(len, encoded)) < sum(map(len, blobs)) / 2
    for i, (blob, stored) in enumerate(zip(blobs, encoded)):
        back = start_state.ref_back(stored)
        assert 0 <= back <= i and start_state.ref_back(encoded[i - back]) == 0  # references are plain
        resolved = start_state.resolve(stored, encoded[i - back] if back else None)
        want, got = start_state.unpack(blob), start_state.unpack(resolved)
        assert want[1] == got[1] and want[0].keys() == got[0].keys()
        assert all(np.array_equal(want[0][k], got[0][k]) and want[0][k].dtype == got[0][k].dtype for k in want[0])
    xored = next(s for s in encoded if start_state.ref_back(s))
    with pytest.raises(ReplayError, match="stored against an earlier one"):
        start_state.unpack(xored)  # never read as if it were the state itself
    with pytest.raises(ReplayError, match="missing or not plain"):
        start_state.resolve(xored, None)


def test_a_hostile_reference_in_a_start_state_is_refused_not_followed():
    import json
    import struct
    import zlib

    blobs = ale_states(2)
    good = start_state.encode_batch(blobs)[1]
    assert start_state.ref_back(good) == 1
    flags, length = struct.unpack_from("<BI", good, 4)
    header = json.loads(good[9:9 + length])
    payload = good[9 + length:]

    def forged(**changes):
        head = json.dumps({**header, **changes}).encode()
        return start_state.MAGIC + struct.pack("<BI", flags, len(head)) + head + payload

    for bad in (forged(xor=["nope"]), forged(ref_back=-1), forged(ref_back="1"), forged(xor=[]),
                forged(xor="ale"), forged(ref_back=0)):
        with pytest.raises(ReplayError, match="unreadable"):
            start_state.resolve(bad, blobs[0])
    with pytest.raises(ReplayError, match="does not match"):  # a reference of another shape: refused, not read
        other = start_state.pack({name: np.zeros(3, np.uint8) for name in header["xor"]}, {})
        start_state.resolve(good, other)
    truncated = good[:9 + length] + zlib.compress(b"x" * 10)
    with pytest.raises(ReplayError):
        start_state.resolve(truncated, blobs[0])


def test_a_recorded_breakout_run_stores_deltas_and_replays_exactly(recorded_breakout):
    path = os.path.join(recorded_breakout, "worker-001.h5")
    with h5py.File(path, "r") as h5:
        assert h5.attrs["schema_version"].startswith("3.")
        obs, frags = h5["agents/default_agent/steps/obs"], h5["agents/default_agent/fragments"]
        assert obs.attrs["delta"] == "xor_previous_row"
        states = [bytes(s) for s in frags["start_state"][()] if len(s)]
        assert len(states) >= 2 and any(start_state.ref_back(s) for s in states)
        plain = helpers.plain_rows(obs)
    with open_run(recorded_breakout) as run:
        f = next(f for f in run.files if f.path == path)
        np.testing.assert_array_equal(f.column("default_agent", "obs", slice(None), decode=False)[..., -1],
                                      plain[..., 0])
    result = CliRunner().invoke(main, ["replay", recorded_breakout, "--check"])  # every frame against ALE's
    assert result.exit_code == 0 and "all match" in result.output, result.output


def test_frame_delta_off_stores_frames_as_they_are(tmp_path):
    episodes = ale_episodes([30])
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions(frame_delta=False))
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk(episodes, ConvertOptions(encode_images=True)))
    writer.close()
    write_manifest(str(tmp_path), {"format": "rllib_recorder", "schema_version": "3.0"})
    with h5py.File(tmp_path / "worker-001.h5", "r") as h5:
        obs = h5["agents/default_agent/steps/obs"]
        assert "delta" not in obs.attrs
        want = episodes[0].get_observations()[:-1]
        np.testing.assert_array_equal(obs[()], np.round((want + 1) * 128))
    assert frames.DELTA_KEY_ROWS == 128


def _recompress_with_unknown_filter(path: str, column: str, filter_id: int) -> None:
    """Rewrites ``column`` of a worker file as a user's ``h5repack -f`` with a plugin codec would (the filter named
    in the dataset's pipeline, its chunks written through as the plugin would have left them)."""
    with h5py.File(path, "r+") as h5:
        old = h5[column]
        values, attrs, chunks = old[()], dict(old.attrs), old.chunks
        del h5[column]
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(chunks)
        dcpl.set_filter(filter_id, h5py.h5z.FLAG_OPTIONAL, (3,))  # HDF5 keeps a filter it cannot load as optional
        space = h5py.h5s.create_simple(values.shape, (h5py.h5s.UNLIMITED,) + values.shape[1:])
        new = h5py.Dataset(h5py.h5d.create(h5.id, column.encode(), h5py.h5t.py_create(values.dtype), space,
                                           dcpl=dcpl))
        for start in range(0, len(values), chunks[0]):
            block = np.zeros(chunks, values.dtype)
            block[:len(values[start:start + chunks[0]])] = values[start:start + chunks[0]]
            new.id.write_direct_chunk((start,) + (0,) * (values.ndim - 1), block.tobytes(), filter_mask=0)
        new.attrs.update(attrs)


@pytest.mark.skipif(h5py.h5z.filter_avail(32015) or importlib.util.find_spec("hdf5plugin") is not None,
                    reason="this HDF5 has a zstd filter, or hdf5plugin would give it one")
def test_a_column_compressed_with_a_plugin_this_h5py_lacks_gets_one_line_naming_filter_and_fix(recorded_breakout,
                                                                                              tmp_path):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(recorded_breakout, run)
    path = os.path.join(run, "worker-001.h5")
    _recompress_with_unknown_filter(path, "agents/default_agent/steps/obs", 32015)
    with h5py.File(path, "r") as h5, pytest.raises(OSError, match="plugin"):  # plain h5py: a plugin directory
        h5["agents/default_agent/steps/obs"][:1]
    with pytest.raises(RecorderError) as caught, open_run(run) as opened:
        next(opened.iter_batches(64, columns=["obs"]))
    message = str(caught.value)
    assert "\n" not in message and "32015 (zstd)" in message and "pip install hdf5plugin" in message, message
    assert "agents/default_agent/steps/obs" in message and path in message
    for argv in (["verify", run], ["info", run], ["replay", run, "--check"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2 and "32015 (zstd)" in result.output and "Traceback" not in result.output, \
            (argv, result.output)
