"""The reader API on a real recorded run: counts, episodes, batches, start states and every conversion,
checked value by value against the HDF5 file read with plain h5py."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from rllib_recorder.format import start_state
from rllib_recorder.read.run import open_run
from rllib_recorder.record import envstate


@pytest.fixture(scope="module")
def plain(recorded_cartpole):
    """The worker file's committed columns, read with plain h5py."""
    with h5py.File(os.path.join(recorded_cartpole, "worker-001.h5"), "r") as f:
        rows, frags = json.loads(f.attrs["commit"])["agents"]["default_agent"]
        steps, fr = f["agents/default_agent/steps"], f["agents/default_agent/fragments"]
        return {
            "rows": rows, "batches": json.loads(f.attrs["commit"])["batches"],
            "steps": {k: steps[k][:rows] for k in ("obs", "actions", "rewards", "terminateds", "truncateds",
                                                   "eps_id", "t", "weights_seq_no")},
            "extras": {k: v[:rows] for k, v in steps["extra_model_outputs"].items()},
            "frags": {k: fr[k][:frags] for k in ("eps_id", "first_row", "num_rows", "t_start", "last_obs",
                                                 "has_last_obs", "batch", "start_state_kind")},
            "start_state": [bytes(s) for s in fr["start_state"][:frags]],
            "seq": f["batches/seq"][:],
        }


def expected_episode(plain, eps_id: bytes):
    frags = plain["frags"]
    mine = np.flatnonzero(frags["eps_id"] == eps_id)
    mine = mine[np.argsort(frags["t_start"][mine])]
    rows = np.concatenate([np.arange(frags["first_row"][i], frags["first_row"][i] + frags["num_rows"][i])
                           for i in mine])
    obs = np.concatenate([plain["steps"]["obs"][rows], frags["last_obs"][mine[-1]][None]])
    return rows, obs, mine


def test_opening_reads_nothing_and_counts_come_from_the_indexes(recorded_cartpole, plain):
    with open_run(recorded_cartpole) as run:
        assert all(f._h5 is None for f in run.files)  # no file opened, no column read
        assert run.workers == [(1, False)]
        counts = run.counts()
    assert counts["agent_steps"] == counts["env_steps"] == plain["rows"] == 400
    assert counts["batches"] == plain["batches"]
    assert counts["fragments"] == len(plain["frags"]["eps_id"])
    assert counts["episodes"] == len(set(plain["frags"]["eps_id"].tolist()))


@pytest.mark.compat
def test_every_episode_is_stitched_and_matches_the_file(recorded_cartpole, plain):
    with open_run(recorded_cartpole) as run:
        episodes = list(run.episodes())
        assert [e.eps_id.encode() for e in episodes] == list(dict.fromkeys(plain["frags"]["eps_id"].tolist()))
        assert any(len(plain["frags"]["eps_id"][plain["frags"]["eps_id"] == e.eps_id.encode()]) > 1
                   for e in episodes), "no episode spans two fragments: stitching untested"
        for episode in episodes:
            rows, obs, _ = expected_episode(plain, episode.eps_id.encode())
            np.testing.assert_array_equal(episode.obs, obs)
            np.testing.assert_array_equal(episode.next_obs, obs[1:])
            for name in ("actions", "rewards", "terminateds", "truncateds", "t", "weights_seq_no"):
                np.testing.assert_array_equal(getattr(episode, name), plain["steps"][name][rows])
            for name, column in plain["extras"].items():
                np.testing.assert_array_equal(episode.extra_model_outputs[name], column[rows])
        by_id = run.episode(episodes[3].eps_id)
        np.testing.assert_array_equal(by_id.obs, episodes[3].obs)
        with pytest.raises(KeyError, match="is not in run"):
            run.episode("no-such-episode")


@pytest.mark.compat
def test_batches_come_back_in_stored_order_with_all_their_rows(recorded_cartpole, plain):
    with open_run(recorded_cartpole) as run:
        batches = list(run.batches())
    assert [b.info["seq"] for b in batches] == plain["seq"].tolist()
    assert [b.row for b in batches] == list(range(plain["batches"]))
    for name in ("rewards", "actions", "t"):
        stitched = np.concatenate([b.steps["default_agent"][name] for b in batches])
        np.testing.assert_array_equal(stitched, plain["steps"][name])
    np.testing.assert_array_equal(np.concatenate([b.steps["default_agent"]["obs"] for b in batches]),
                                  plain["steps"]["obs"])


@pytest.mark.compat
def test_first_fragments_carry_a_restorable_start_state(recorded_cartpole, plain):
    frags = plain["frags"]
    first = frags["t_start"] == 0
    assert first.any() and (~first).any()
    assert set(frags["start_state_kind"][first].tolist()) == {start_state.KIND_CLASSIC.encode()}
    assert set(frags["start_state_kind"][~first].tolist()) == {b""}
    assert all(len(s) > 0 for s, f in zip(plain["start_state"], first) if f)
    assert all(len(s) == 0 for s, f in zip(plain["start_state"], first) if not f)
    with open_run(recorded_cartpole) as run:
        episode = next(run.episodes())
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    envstate.restore(env, episode.start_state_kind, episode.start_state)
    np.testing.assert_array_equal(np.asarray(env.unwrapped.state, np.float32), episode.obs[0])


@pytest.mark.compat
def test_single_agent_episode_and_sample_batch(recorded_cartpole):
    with open_run(recorded_cartpole) as run:
        episode = next(e for e in run.episodes() if e.is_done)
    rllib_episode = episode.to_single_agent_episode()
    assert len(rllib_episode) == len(episode) and rllib_episode.is_terminated == bool(episode.terminateds[-1])
    assert rllib_episode.id_ == episode.eps_id and rllib_episode.t_started == 0
    np.testing.assert_array_equal(rllib_episode.get_observations(), episode.obs)
    np.testing.assert_array_equal(rllib_episode.get_actions(), episode.actions)
    np.testing.assert_array_equal(rllib_episode.get_rewards(), episode.rewards)
    np.testing.assert_array_equal(rllib_episode.get_extra_model_outputs("action_logp"),
                                  episode.extra_model_outputs["action_logp"])
    batch = episode.to_sample_batch()
    assert len(batch) == len(episode)
    np.testing.assert_array_equal(batch["obs"], episode.obs[:-1])
    np.testing.assert_array_equal(batch["new_obs"], episode.obs[1:])
    np.testing.assert_array_equal(batch["rewards"], episode.rewards)
    assert set(batch["eps_id"].tolist()) == {episode.eps_id}


def test_dataframe_of_scalar_columns(recorded_cartpole, plain):
    with open_run(recorded_cartpole) as run:
        df = run.to_dataframe()
    assert len(df) == plain["rows"]
    assert {"worker_index", "agent_id", "eps_id", "t", "rewards", "actions", "weights_seq_no"} <= set(df.columns)
    assert "obs" not in df.columns
    np.testing.assert_array_equal(df["rewards"].to_numpy(), plain["steps"]["rewards"])
    np.testing.assert_array_equal(df["actions"].to_numpy(), plain["steps"]["actions"])
    assert df["eps_id"].tolist() == plain["steps"]["eps_id"].astype(str).tolist()


@pytest.mark.compat
def test_ray_dataset_reads_row_ranges_in_parallel_tasks(recorded_cartpole, plain):
    from rllib_recorder.read.datasource import RecordedStepsDatasource

    with open_run(recorded_cartpole) as run:
        tasks = RecordedStepsDatasource(run, 150, False).get_read_tasks(4)
        assert [t.metadata.num_rows for t in tasks] == [150, 150, 100]
        ds = run.to_ray_dataset(rows_per_task=150)
        rows = ds.take_all()
    assert len(rows) == plain["rows"]
    got = {(r["eps_id"], r["t"]): r for r in rows}
    for i in range(plain["rows"]):
        row = got[plain["steps"]["eps_id"][i].decode(), int(plain["steps"]["t"][i])]
        np.testing.assert_array_equal(row["obs"], plain["steps"]["obs"][i])
        assert row["rewards"] == plain["steps"]["rewards"][i] and row["actions"] == plain["steps"]["actions"][i]
        assert row["worker_index"] == 1 and row["agent_id"] == "default_agent"


def test_failing_start_state_capture_is_counted_and_never_stops_sampling(ray_session, tmp_path):
    from ray.tune.registry import register_env

    from tests.envs import StateRaisesEnv
    from tests.helpers import rllib_sampled
    from tests.integrity import check_run
    from tests.test_recording import ppo, record

    register_env("state_raises", lambda cfg: StateRaisesEnv(cfg))
    run_dir, results, _ = record(ppo(env="state_raises", runners=1), tmp_path, iterations=2)
    assert results[-1]["recorder"]["errors"] >= 1
    counts = check_run(run_dir, sampled=rllib_sampled(results))  # every step RLlib sampled stored all the same
    assert counts["agent_steps"] == rllib_sampled(results)
    with h5py.File(os.path.join(run_dir, "worker-001.h5"), "r") as f:
        assert set(f["agents/default_agent/fragments/start_state_kind"][:].tolist()) == {b""}
