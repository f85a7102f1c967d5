"""docs/FORMAT.md's code, run as written (plain h5py and numpy) against real recordings and compared value by value
with what ``open_run`` reads: Pong with an episode across two fragments of one chunk, each longer than
``delta_key_rows``; Breakout with start states stored against an earlier one; CartPole with several episodes a
chunk; a multi-agent run (tests/conftest.py's turn-based one). The blocks are taken from the markdown itself, so
the doc and this test cannot drift."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import zlib

import h5py
import numpy as np
import pytest

from rllib_recorder.format import layout
from rllib_recorder.format import start_state as state_codec
from rllib_recorder.read.run import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "FORMAT.md")
RUNS = ["pong", "breakout", "cartpole", "multi_agent"]
# Every section of FORMAT.md with a python block, and the tests here that run it.
EXERCISED = {
    "Policy lag": ("test_policy_lag_block_gives_the_readers_lag_of_every_row",),
    "Image columns stored as uint8": ("test_fragment_blocks_give_every_step_column_as_the_reader_does",),
    "Frame deltas (schema 3.0)": ("test_fragment_blocks_give_every_step_column_as_the_reader_does",),
    "Frame stacks stored as their newest frames (schema 2.0)":
        ("test_fragment_blocks_give_every_step_column_as_the_reader_does",),
    "/agents/&lt;agent&gt;/fragments: the episode index, one row per episode fragment":
        ("test_infos_block_gives_the_readers_infos_of_every_episode", "test_the_infos_block_reads_both_stored_forms"),
    "Start states (schema 1.1; blob form of 1.2)":
        ("test_start_state_block_gives_the_readers_start_states",
         "test_the_start_state_block_xors_any_array_and_reads_the_npz_form",
         "test_the_restore_block_puts_an_env_in_the_recorded_start_state"),
    "Reading one episode with plain h5py": ("test_reading_one_episode_gives_the_readers_episode",),
}


def blocks() -> list[tuple[str, str]]:
    """(heading of the section, code) of every python block of FORMAT.md, in the doc's order; the headings of
    blocks that sit under the same heading are repeated."""
    doc, out, heading = open(DOC).read(), [], ""
    for part in re.split(r"^(#+ [^\n]*|```python\n.*?^```)$", doc, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            out.append((heading, part[len("```python\n"):-3]))
    return out


def is_script(code: str) -> bool:
    return "h5py.File(" in code


def definitions() -> dict:
    """A fresh namespace with what every block that only defines (imports, functions) defines, in the doc's order."""
    scope: dict = {}
    for _, code in blocks():
        if not is_script(code):
            exec(compile(code, DOC, "exec"), scope)
    return scope


def script(heading: str, path: str, agent: str, episode: int = 0) -> dict:
    """Runs the script block under ``heading`` on file ``path`` and ``agent`` (its ``episode``-th distinct
    episode where it reads one); returns its variables."""
    (code,) = [c for h, c in blocks() if h == heading and is_script(c)]
    for old, new in (('"recordings/<run>/worker-001.h5"', repr(path)), ('agent = "default_agent"', f"agent = {agent!r}"),
                     ('eps_id = frags["eps_id"][0]', f'eps_id = np.unique(frags["eps_id"][:n_frags])[{episode}]')):
        assert code.count(old) <= 1
        code = code.replace(old, new)
    scope = definitions()
    exec(compile(code, DOC, "exec"), scope)
    return scope


def streams(run_dir: str):
    """(worker file as open_run reads it, h5py file, agent) of every file and agent of a run."""
    with open_run(run_dir) as run:
        for f in run.files:
            with h5py.File(f.path, "r") as h5:
                for agent in f.agents:
                    yield f, h5, agent


def fragments_of(h5: h5py.File, agent: str) -> tuple[h5py.Group, h5py.Group, int]:
    n_frags = json.loads(h5.attrs["commit"])["agents"][agent][1]
    return h5[f"agents/{agent}/fragments"], h5[f"agents/{agent}/steps"], n_frags


def same(a, b) -> bool:
    """Equal values, dtypes and shapes (bit for bit for floats)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# --- the recordings ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pong(ray_session, tmp_path_factory):
    """PPO on Pong through configs/breakout-ppo.yaml's wrappers: one iteration of two 140-step samples coalesced
    into one chunk, so Pong's first (long) episode lies in two fragments of one chunk, each longer than the 128
    rows between key rows of the frame deltas, the second starting at row 140."""
    from rllib_recorder.commands.experiment import load_experiment
    from rllib_recorder.commands.train import build_config

    spec = load_experiment(os.path.join(ROOT, "configs", "breakout-ppo.yaml"),
                           output_dir=str(tmp_path_factory.mktemp("pong")))
    spec.env = "ale_py:ALE/Pong-v5"
    spec.config.update(rollout_fragment_length=140, train_batch_size=280, minibatch_size=140)
    spec.recorder = dataclasses.replace(spec.recorder, coalesce_rows=280, coalesce_s=600.0)
    algo = build_config(spec).build_algo()
    run_dir = algo.train()["recorder"]["run_dir"]
    algo.stop()
    return run_dir


@pytest.fixture(params=RUNS)
def run_dir(request):
    fixtures = {"pong": "pong", "breakout": "recorded_breakout", "cartpole": "recorded_cartpole",
                "multi_agent": "recorded_turn_based"}
    return request.getfixturevalue(fixtures[request.param])


def test_the_recordings_hold_what_the_doc_must_be_read_right_on(pong, recorded_breakout, recorded_turn_based):
    with h5py.File(os.path.join(pong, "worker-001.h5"), "r") as h5:
        frags, steps, _ = fragments_of(h5, "default_agent")
        every = int(steps["obs"].attrs["delta_key_rows"])
        assert h5.attrs["schema_version"] == layout.SCHEMA_VERSION and steps["obs"].attrs["frame_stack"] == 4
        assert frags["eps_id"][0] == frags["eps_id"][1] and frags["t_start"][1] > 0  # one episode, two fragments
        assert frags["batch"][0] == frags["batch"][1]                                 # of one chunk
        assert min(frags["num_rows"][:2]) > every and frags["first_row"][1] % every    # keys not on a 128 grid
        assert steps["obs"].compression == "gzip" and not steps["obs"].shuffle          # what the doc says
    with h5py.File(os.path.join(recorded_breakout, "worker-001.h5"), "r") as h5:
        states = h5["agents/default_agent/fragments/start_state"]
        flags = {states[i].tobytes()[4] for i in range(len(states)) if len(states[i])}
        assert flags == {1, 3}  # plain and compressed; stored against an earlier one and compressed
    with open_run(recorded_turn_based) as run:
        assert len(run.files[0].agents) == 4 and np.bincount(run.files[0].fragments("a")["batch"]).max() > 1


# --- the doc's blocks --------------------------------------------------------------------------------------------


def test_every_python_block_of_the_doc_is_run_here():
    headings = {h for h, _ in blocks()}
    assert headings == set(EXERCISED), f"python blocks of FORMAT.md no test here runs: {headings - set(EXERCISED)}"
    assert all(name in globals() for names in EXERCISED.values() for name in names)
    assert all("rllib_recorder" not in code for _, code in blocks())  # plain h5py and numpy


def test_the_title_names_the_schema_version_written():
    title = open(DOC).readline()
    assert title.strip() == f"# The rllib_recorder file format (schema version {layout.SCHEMA_VERSION})"


def test_policy_lag_block_gives_the_readers_lag_of_every_row(run_dir):
    for f, _, agent in streams(run_dir):
        got = script("Policy lag", f.path, agent)
        assert same(got["lag"], f.policy_lag(agent)) and same(got["learner_of_rows"], f.learner_versions(agent))
        assert len(got["lag"]) == f.num_rows(agent)


def test_fragment_blocks_give_every_step_column_as_the_reader_does(run_dir):
    scope = definitions()
    checked = 0
    for f, h5, agent in streams(run_dir):
        frags, steps, n_frags = fragments_of(h5, agent)
        for i in range(n_frags):
            first, n = int(frags["first_row"][i]), int(frags["num_rows"][i])
            rows = slice(first, first + n)
            for path in f.column_paths(agent):
                want = f.column(agent, path, rows)
                if "frame_stack" in steps[path].attrs:
                    got = scope["fragment_obs"](steps, frags, i, path)
                    assert want.dtype == np.float32 and want.shape[-1] == steps[path].attrs["frame_stack"]
                else:
                    got = scope["fragment_rows"](steps[path], first, n)
                assert same(got, want), (agent, i, path)
                checked += 1
    assert checked


def test_infos_block_gives_the_readers_infos_of_every_episode(run_dir):
    scope = definitions()
    for f, h5, agent in streams(run_dir):
        frags, _, n_frags = fragments_of(h5, agent)
        for i in range(n_frags):
            entries = scope["fragment_infos"](frags, i)
            assert len(entries) == frags["num_rows"][i] + frags["has_last_obs"][i]
        for eps_id in f.episode_ids(agent):
            mine = np.flatnonzero(frags["eps_id"][:n_frags] == eps_id.encode())
            mine = mine[np.argsort(frags["t_start"][mine], kind="stable")]
            episode = f.episode(eps_id, agent)
            assert scope["episode_infos"](frags, mine) == list(episode.infos)
            assert len(episode.infos) == len(episode.obs)


def test_start_state_block_gives_the_readers_start_states(run_dir):
    scope = definitions()
    found = stored = 0
    for f, h5, agent in streams(run_dir):
        frags, _, n_frags = fragments_of(h5, agent)
        stored += sum(1 for i in range(n_frags) if len(frags["start_state"][i]))
        for i in range(n_frags):
            episode = f.episode(frags["eps_id"][i].decode(), agent)
            got = scope["start_state"](frags, i)
            if frags["t_start"][i] or not episode.start_state:
                assert got is None
                continue
            arrays, meta = state_codec.unpack(episode.start_state)
            assert got[1] == meta and got[0].keys() == arrays.keys()
            assert all(same(got[0][name], arrays[name]) for name in arrays)
            found += 1
    assert found == stored  # none in the multi-agent run


def blob(arrays: dict, meta: dict, flags: int = 1, **header) -> bytes:
    """A start-state blob made from FORMAT.md's table alone (header shapes as the arrays have them, 0-d too)."""
    table, offset = [], 0
    for name, value in arrays.items():
        table.append([name, value.dtype.str, list(value.shape), offset])
        offset += value.nbytes
    payload = b"".join(np.ascontiguousarray(v).tobytes() for v in arrays.values())
    head = json.dumps({"meta": meta, "arrays": table, **header}).encode()
    return b"RRS2" + bytes([flags]) + len(head).to_bytes(4, "little") + head + zlib.compress(payload)


def test_the_start_state_block_xors_any_array_and_reads_the_npz_form():
    """Beside the recordings: states stored against an earlier one as the writer does, arrays of every width; one
    whose arrays are 0-d (numpy refuses a byte view of those); and schema 1.1's npz blob."""
    scope = definitions()
    noise = np.random.default_rng(0).random(600)  # a blob of more than 1 KiB, as an ALE state's
    states = [{"big": noise + k, "t": np.float64(k * 1.5), "n": np.int32(7 + k)} for k in range(3)]
    stored = state_codec.encode_batch([state_codec.pack(s, {"k": i}) for i, s in enumerate(states)])
    assert [b[4] for b in stored] == [1, 3, 3]
    frags = {"start_state": [np.frombuffer(b, np.uint8) for b in stored]}
    for i, b in enumerate(stored):
        arrays, meta = state_codec.unpack(state_codec.resolve(b, stored[0]))
        got = scope["start_state"](frags, i)
        assert got[1] == meta == {"k": i} and all(same(got[0][k], arrays[k]) for k in arrays)
    zero_d = {"t": np.asarray(2.5), "n": np.asarray(9, np.int32)}
    reference = {"t": np.asarray(1.5), "n": np.asarray(7, np.int32)}
    xored = {k: np.frombuffer(bytes(x ^ y for x, y in zip(v.tobytes(), reference[k].tobytes())), v.dtype).reshape(())
             for k, v in zero_d.items()}
    frags = {"start_state": [np.frombuffer(b, np.uint8) for b in
                             (blob(reference, {}), blob(xored, {}, 3, xor=["t", "n"], ref_back=1))]}
    arrays, _ = scope["start_state"](frags, 1)
    assert all(same(arrays[k], v) for k, v in zero_d.items())
    buffer = io.BytesIO()
    np.savez(buffer, state=np.arange(4.0), meta=np.frombuffer(json.dumps({"rng": None}).encode(), np.uint8))
    arrays, header = scope["state_arrays"](buffer.getvalue())
    assert header["meta"] == state_codec.unpack(buffer.getvalue())[1] == {"rng": None}
    assert same(arrays["state"], np.arange(4.0))


@pytest.mark.parametrize("fixture", ["recorded_breakout", "recorded_cartpole"])
def test_the_restore_block_puts_an_env_in_the_recorded_start_state(fixture, request):
    """The meta layout is enough to restore a state: the env then steps through the episode's recorded
    observations, rewards and ends exactly."""
    import gymnasium as gym

    from rllib_recorder.commands.envs import make_atari_env

    scope = definitions()
    with open_run(request.getfixturevalue(fixture)) as run:
        episodes = [e for e in run.episodes() if e.start_state_kind][:3]
        env_config = run.manifest.get("env_config") or {}
    assert episodes
    for episode in episodes:
        if episode.start_state_kind == "ale/1":
            env = make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, env_config)
        else:
            env = gym.make("CartPole-v1")
        env.reset(seed=0)
        scope["restore"](env, *state_codec.unpack(episode.start_state))
        for i in range(len(episode)):
            obs, reward, terminated, _, _ = env.step(int(episode.actions[i]))
            if i + 1 < len(episode.obs):
                assert same(obs, episode.obs[i + 1]), (episode.eps_id, i)
            assert np.float32(reward) == np.float32(episode.rewards[i]) and terminated == episode.terminateds[i]
        env.close()


def test_reading_one_episode_gives_the_readers_episode(run_dir):
    for f, h5, agent in streams(run_dir):
        ids = np.unique(fragments_of(h5, agent)[0]["eps_id"][:fragments_of(h5, agent)[2]])
        for k in range(min(len(ids), 12)):
            got = script("Reading one episode with plain h5py", f.path, agent, k)
            want = f.episode(got["eps_id"].decode(), agent)
            assert same(got["obs"], want.obs) and same(got["actions"], want.actions)
            assert same(got["rewards"], want.rewards) and got["infos"] == list(want.infos)
            if want.start_state:
                arrays, meta = state_codec.unpack(want.start_state)
                assert got["state"][1] == meta and all(same(got["state"][0][n], arrays[n]) for n in arrays)
            else:
                assert got["state"] is None


@pytest.mark.parametrize("schema", ["2.2", layout.SCHEMA_VERSION])
def test_the_infos_block_reads_both_stored_forms(tmp_path, schema):
    """Infos as a 3.0 file stores them (zlib JSON in a uint8 array) and as a 2.x file does (a UTF-8 string), which a
    3.0 writer continuing it keeps; one episode across two appends."""
    from rllib_recorder.format import datasets
    from rllib_recorder.format.append import open_for_append
    from rllib_recorder.read.worker_file import WorkerFile
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.service.writer import RecordingWriter
    from tests.helpers import make_episode

    path = str(tmp_path / "worker-001.h5")
    h5 = open_for_append(path, {"run_id": "run-1", "worker_index": 1, "is_evaluation": False})
    h5.attrs["schema_version"] = schema  # as a writer of that version created it
    h5.close()
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions())
    parts = [[make_episode(3, eps_id="a")], [make_episode(2, t_started=3, eps_id="a"), make_episode(2, eps_id="b")],
             [make_episode(4, eps_id="c")]]
    for seq, part in enumerate(parts):
        writer.append(1, False, b"s" * 32, seq, episodes_to_chunk(part))
    writer.close()
    scope, reader = definitions(), WorkerFile(path)
    try:
        with h5py.File(path, "r") as h5:
            frags = h5["agents/default_agent/fragments"]
            zlib_json = frags["infos"].attrs.get("encoding") == "zlib_json"
            assert zlib_json == (schema == layout.SCHEMA_VERSION)
            assert (h5py.check_vlen_dtype(frags["infos"].dtype) == np.uint8) == zlib_json
            assert (h5py.check_string_dtype(frags["infos"].dtype) is not None) != zlib_json
            assert [len(scope["fragment_infos"](frags, i)) for i in range(4)] == [4, 3, 3, 5]  # rows + 1: with last_obs
            for eps_id, mine in (("a", [0, 1]), ("b", [2]), ("c", [3])):
                infos = scope["episode_infos"](frags, np.array(mine))
                assert infos == list(reader.episode(eps_id, "default_agent").infos)
            assert scope["episode_infos"](frags, np.array([0, 1])) == [{"t": t} for t in range(6)]
    finally:
        reader.close()
