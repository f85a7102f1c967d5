"""run.iter_batches on real recorded runs: every stored row once, the derived columns right, memory bounded."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from rllib_recorder import open_run
from tests.envs import decode
from tests.test_recording import ppo, record


@pytest.mark.compat
def test_batches_in_order_hold_every_stored_row_value_by_value(recorded_cartpole):
    with open_run(recorded_cartpole) as run:
        batches = list(run.iter_batches(300, columns=["obs", "actions", "rewards", "eps_id", "policy_lag",
                                                      "worker_index", "agent_id"]))
        assert [len(b["obs"]) for b in batches[:-1]] == [300] * (len(batches) - 1)
        assert 0 < len(batches[-1]["obs"]) <= 300
        got = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        want = {k: [] for k in ("obs", "actions", "rewards", "eps_id", "policy_lag", "worker_index")}
        for f in run.files_of(False):
            for agent in f.agents:
                rows = slice(0, f.num_rows(agent))
                for k in ("obs", "actions", "rewards", "eps_id"):
                    want[k].append(f.column(agent, k, rows))
                want["policy_lag"].append(f.policy_lag(agent))
                want["worker_index"].append(np.full(f.num_rows(agent), f.worker_index))
        for k, parts in want.items():
            np.testing.assert_array_equal(got[k], np.concatenate(parts), err_msg=k)
        assert set(got["agent_id"].tolist()) == {"default_agent"} and len(got["obs"]) == run.num_env_steps
        with pytest.raises(Exception, match="has no step column 'nope'"):
            next(run.iter_batches(10, columns=["nope"]))


def test_next_obs_is_the_stored_observation_after_each_step(recorded_cartpole, recorded_breakout):
    for run_dir in (recorded_cartpole, recorded_breakout):  # Breakout: frame stacks rebuilt across fragments
        with open_run(run_dir) as run:
            after = {}
            for episode in run.episodes():
                for i, t in enumerate(episode.t.tolist()):
                    after[episode.eps_id, t] = episode.obs[i + 1] if len(episode.obs) > i + 1 else None
            seen = 0
            for b in run.iter_batches(128, columns=["next_obs", "has_next_obs", "eps_id", "t"], shuffle=True, seed=3):
                for i in range(len(b["t"])):
                    want = after[b["eps_id"][i].decode(), int(b["t"][i])]
                    assert b["has_next_obs"][i] == (want is not None)
                    if want is not None:
                        np.testing.assert_array_equal(b["next_obs"][i], want)
                    seen += 1
            assert seen == len(after) == run.num_env_steps


@pytest.mark.parametrize("obs_kind, multi_agent", [("vector", True), ("dict", False)], ids=["multi-agent", "dict-obs"])
def test_next_obs_of_every_agent_and_nested_space_follows_its_step(ray_session, tmp_path, obs_kind, multi_agent):
    env = "counting_ma" if multi_agent else "counting"
    run_dir, _, _ = record(ppo(env, obs_kind, runners=1, multi_agent=multi_agent), tmp_path, iterations=1)
    with open_run(run_dir) as run:
        obs_paths = [p for p in run.files[0].column_paths(run.files[0].agents[0]) if p.split("/")[0] == "obs"]
        columns = ["t", "agent_id", "has_next_obs", *obs_paths, *("next_" + p for p in obs_paths)]
        rows = 0
        for b in run.iter_batches(50, columns=columns):
            if "obs/ids" in b:  # stored as the Dict space (else flattened by RLlib's connector: one column)
                obs = {"ids": b["obs/ids"], "clock": (b["obs/clock/0"], b["obs/clock/1"])}
                nxt = {"ids": b["next_obs/ids"], "clock": (b["next_obs/clock/0"], b["next_obs/clock/1"])}
            else:
                obs, nxt = b["obs"], b["next_obs"]
            now, then = decode(obs, obs_kind), decode(nxt, obs_kind)  # (worker, episode, t) of each
            assert b["has_next_obs"].all()
            np.testing.assert_array_equal(then[:, :2], now[:, :2])  # the same runner and episode
            np.testing.assert_array_equal(then[:, 2], now[:, 2] + 1)  # one step later
            rows += len(b["t"])
        assert rows == run.counts()["agent_steps"]
        if multi_agent:
            assert {a for f in run.files for a in f.agents} == {"a", "b"}


@pytest.mark.compat
def test_shuffled_batches_hold_every_row_once_in_a_repeatable_order(recorded_cartpole):
    with open_run(recorded_cartpole) as run:
        def rows(**kwargs):
            return [(bytes(b["eps_id"][i]), int(b["t"][i])) for b in run.iter_batches(64, columns=["eps_id", "t"],
                                                                                         **kwargs)
                    for i in range(len(b["t"]))]

        ordered = rows()
        shuffled = rows(shuffle=True, buffer_rows=100, seed=7)  # a buffer far smaller than the run
        assert sorted(shuffled) == sorted(ordered) and len(set(ordered)) == len(ordered) == run.num_env_steps
        assert shuffled != ordered and shuffled == rows(shuffle=True, buffer_rows=100, seed=7)
        assert len(rows(shuffle=True, seed=7, drop_last=True)) == len(ordered) // 64 * 64


def test_memory_stays_bounded_by_the_batch_and_the_buffer_not_the_run(recorded_breakout, tmp_path):
    import shutil

    def peak_of(copies: int) -> tuple[int, int]:
        """Peak traced bytes while iterating a run of ``copies`` copies of the Breakout file, and its steps."""
        run_dir = tmp_path / f"x{copies}"
        run_dir.mkdir()
        shutil.copy(f"{recorded_breakout}/manifest.json", run_dir)
        for i in range(copies):
            shutil.copy(f"{recorded_breakout}/worker-001.h5", run_dir / f"worker-{i + 1:03d}.h5")
        with open_run(str(run_dir)) as run:
            steps = run.num_env_steps
            tracemalloc.start()
            try:
                n = sum(len(b["obs"]) for b in run.iter_batches(16, columns=["obs", "next_obs", "actions"],
                                                               shuffle=True, buffer_bytes=2 << 20,
                                                               block_bytes=2 << 20, seed=0))
                return tracemalloc.get_traced_memory()[1], n if n == steps else -1
            finally:
                tracemalloc.stop()

    small, steps_small = peak_of(1)
    large, steps_large = peak_of(6)
    raw_large = steps_large * 84 * 84 * 4 * 4  # float32 frame stacks as the reader gives them
    print(f"1 copy: peak {small / 1e6:.1f} MB; 6 copies: {raw_large / 1e6:.0f} MB of raw obs, "
          f"peak {large / 1e6:.1f} MB")
    assert steps_large == 6 * steps_small > 0
    assert large < 1.25 * small and large < raw_large / 5  # a block, the buffer, a batch: not the run


def test_torch_data_loader_workers_read_every_row_once_between_them(recorded_cartpole):
    from torch.utils.data import DataLoader

    with open_run(recorded_cartpole) as run:
        want = np.concatenate([b["obs"] for b in run.iter_batches(1000, columns=["obs"])])
        dataset = run.torch_dataset(64, columns=["obs", "actions", "next_obs", "agent_id"], shuffle=True, seed=1)
    for workers in (0, 2):
        batches = list(DataLoader(dataset, batch_size=None, num_workers=workers))
        got = np.concatenate([b["obs"].numpy() for b in batches])
        assert all(b["obs"].dtype.is_floating_point and b["actions"].shape == (len(b["obs"]),) for b in batches)
        assert all(set(b["agent_id"]) == {"default_agent"} for b in batches)  # strings stay numpy
        np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])


def test_undecoded_frames_are_the_stored_codes_of_the_same_stacks(recorded_breakout):
    """decode=False gives Atari frame stacks as uint8 codes (a quarter of the bytes), equal after decoding."""
    with open_run(recorded_breakout) as run:
        scale, offset = run.files[0].encoding("default_agent", "obs")
        cols = ["obs", "next_obs", "rewards"]
        for raw, full in zip(run.iter_batches(100, columns=cols, decode=False), run.iter_batches(100, columns=cols)):
            assert raw["obs"].dtype == np.uint8 and raw["obs"].shape == full["obs"].shape
            for key in ("obs", "next_obs"):
                np.testing.assert_array_equal(raw[key].astype(np.float32) * np.float32(scale) + np.float32(offset),
                                              full[key])
        episodes = 0
        for raw, full in zip(run.episodes(decode=False), run.episodes()):
            assert raw.eps_id == full.eps_id and raw.obs.dtype == np.uint8
            np.testing.assert_array_equal(raw.obs.astype(np.float32) * np.float32(scale) + np.float32(offset), full.obs)
            episodes += 1
        assert episodes == len(list(run.episodes()))
        assert run.files[0].encoding("default_agent", "rewards") is None
