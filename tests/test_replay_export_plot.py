"""`replay`, `export` and `plot` on real recorded runs (CartPole and Breakout), and their bad-input errors."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from rllib_recorder.cli import main
from rllib_recorder.read.run import open_run
from tests import helpers


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def alter_one_action(run_dir, copy_dir, episode_number, step, new_action):
    """Copies a run and changes the stored action of one step; returns (eps_id, old action)."""
    shutil.copytree(run_dir, copy_dir)
    with h5py.File(os.path.join(copy_dir, "worker-001.h5"), "a") as f:
        frags, steps = f["agents/default_agent/fragments"], f["agents/default_agent/steps"]
        first = np.flatnonzero(frags["t_start"][:] == 0)[episode_number]
        assert frags["num_rows"][first] > step + 1
        row = int(frags["first_row"][first]) + step
        old = int(steps["actions"][row])
        steps["actions"][row] = new_action(old)
        return frags["eps_id"][first].decode(), old


def test_replay_streams_batches_as_json_lines_in_stored_order(recorded_cartpole):
    result = invoke("replay", recorded_cartpole)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    with open_run(recorded_cartpole) as run:
        f = run.files[0]
        assert [r["seq"] for r in records] == f.batches()["seq"].tolist()
        rewards = np.concatenate([r["steps"]["default_agent"]["rewards"] for r in records])
        obs = np.concatenate([r["steps"]["default_agent"]["obs"] for r in records])
        np.testing.assert_array_equal(rewards, f.column("default_agent", "rewards"))
        np.testing.assert_array_equal(obs.astype(np.float32), f.column("default_agent", "obs"))


def test_replay_streams_episodes_into_a_callable(recorded_cartpole):
    helpers.SINK.clear()
    result = invoke("replay", recorded_cartpole, "--episodes", "--to", "tests.helpers:collect")
    assert result.exit_code == 0 and result.output == "", result.output
    with open_run(recorded_cartpole) as run:
        expected = list(run.episodes())
    assert [e.eps_id for e in helpers.SINK] == [e.eps_id for e in expected]
    for got, want in zip(helpers.SINK, expected):
        np.testing.assert_array_equal(got.actions, want.actions)
    result = invoke("replay", recorded_cartpole, "--episodes")
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["eps_id"] for line in lines] == [e.eps_id for e in expected]
    assert [line["len"] for line in lines] == [len(e) for e in expected]


@pytest.mark.parametrize("fixture", [pytest.param("recorded_cartpole", marks=pytest.mark.compat), "recorded_breakout"])
def test_replay_check_re_simulates_every_episode(fixture, request):
    run_dir = request.getfixturevalue(fixture)
    result = invoke("replay", run_dir, "--check")
    assert result.exit_code == 0, result.output
    with open_run(run_dir) as run:
        counts = run.counts()
    assert f"ok: {counts['episodes']} episodes, {counts['agent_steps']} steps re-simulated" in result.output


@pytest.mark.parametrize("fixture, new_action", [
    ("recorded_cartpole", lambda a: 1 - a),
    ("recorded_breakout", lambda a: 3 if a in (0, 1, 2) else 2),  # LEFT (or RIGHT): the paddle moves
])
def test_replay_check_reports_one_altered_action_precisely(fixture, new_action, request, tmp_path):
    # CartPole shows an altered action at once. On Breakout a changed paddle move can be invisible (the paddle
    # at a wall), so try the same one-action change in up to 4 episodes; the first that changes the game must
    # be reported at (or after) the altered step, and never before it.
    for episode_number in range(1 if fixture == "recorded_cartpole" else 4):
        copy = tmp_path / f"altered-{episode_number}"
        try:
            eps_id, old = alter_one_action(request.getfixturevalue(fixture), copy, episode_number=episode_number,
                                           step=2, new_action=new_action)
        except (IndexError, AssertionError):  # fewer or shorter episodes than candidates
            break
        result = invoke("replay", copy, "--check")
        if result.exit_code == 0 and fixture == "recorded_breakout":
            continue
        assert result.exit_code == 1, result.output
        mismatches = [line for line in result.output.splitlines() if line.startswith("mismatch:")]
        assert len(mismatches) == 1, result.output
        step = int(re.search(rf"mismatch: worker 1 episode {eps_id} step (\d+): obs differs: expected ", mismatches[0])[1])
        assert step == 2 if fixture == "recorded_cartpole" else step >= 2, mismatches[0]
        assert ", got " in mismatches[0] and "FAILED: 1 of" in result.output
        return
    pytest.fail("no altered action changed a re-simulated Breakout episode")


def test_replay_check_says_when_an_env_cannot_be_re_simulated(recorded_cartpole, tmp_path):
    result = invoke("replay", recorded_cartpole, "--check", "--env", "tests.envs:OpaqueCartPole")
    assert result.exit_code == 2
    assert result.output.strip() == ("error: env tests.envs:OpaqueCartPole can't be re-simulated (OpaqueCartPole has "
                                     "neither an ALE emulator nor a classic-control 'state' array; only such envs "
                                     "can be restored)")
    copy = tmp_path / "stateless"
    shutil.copytree(recorded_cartpole, copy)
    with h5py.File(copy / "worker-001.h5", "a") as f:
        kinds = f["agents/default_agent/fragments/start_state_kind"]
        kinds[...] = [b""] * len(kinds)
    result = invoke("replay", copy, "--check")
    assert result.exit_code == 2 and "error: env CartPole-v1 can't be re-simulated (episode " in result.output
    assert "has no recorded start state" in result.output


@pytest.mark.compat
def test_export_rllib_trains_a_real_bc(recorded_cartpole, tmp_path):
    import gymnasium as gym
    from ray.rllib.algorithms.bc import BCConfig

    out = tmp_path / "bc-data"
    result = invoke("export", recorded_cartpole, "--to", "rllib", "-o", out)
    assert result.exit_code == 0, result.output
    import pyarrow.parquet as pq

    table = pq.read_table(out / "part-00000.parquet")
    with open_run(recorded_cartpole) as run:
        episodes = [e for e in run.episodes()]
    assert table.num_rows == sum(len(e) for e in episodes)
    np.testing.assert_array_equal(np.stack(table["new_obs"].to_pylist()).astype(np.float32),
                                  np.concatenate([e.obs[1:] for e in episodes]))
    np.testing.assert_array_equal(table["actions"].to_numpy(), np.concatenate([e.actions for e in episodes]))
    cartpole = gym.make("CartPole-v1")
    config = (
        BCConfig().environment(observation_space=cartpole.observation_space, action_space=cartpole.action_space)
        .offline_data(input_=[str(out)], input_read_method_kwargs={"override_num_blocks": 2},
                      map_batches_kwargs={"concurrency": 1, "num_cpus": 1},
                      iter_batches_kwargs={"prefetch_batches": 1, "local_shuffle_buffer_size": None},
                      dataset_num_iters_per_learner=1)
        .training(train_batch_size_per_learner=100)
    )
    algo = config.build_algo()
    try:
        learner = algo.train()["learners"]["default_policy"]
    finally:
        algo.stop()
        # Finalize BC's Ray Data iterator now: finalized later by the garbage collector in the middle of an
        # import, it breaks CPython 3.11's AST compiler ("AST constructor recursion depth mismatch").
        gc.collect()
    assert learner["num_module_steps_trained"] == 100
    assert np.isfinite(learner["policy_loss"]) and learner["policy_loss"] > 0


def test_export_minari_loads_in_minari(recorded_cartpole, tmp_path, monkeypatch):
    import minari

    out = tmp_path / "minari"
    result = invoke("export", recorded_cartpole, "--to", "minari", "-o", out, "--dataset-id", "rr/cartpole-v0")
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(out))
    dataset = minari.load_dataset("rr/cartpole-v0")
    with open_run(recorded_cartpole) as run:
        episodes = list(run.episodes())
    assert dataset.total_episodes == len(episodes)
    assert dataset.total_steps == sum(len(e) for e in episodes)
    assert dataset.spec.observation_space == gym_cartpole_spaces()[0]
    env = dataset.recover_environment()  # the run's gymnasium id travels with the dataset as its EnvSpec
    try:
        assert env.spec.id == "CartPole-v1" and env.observation_space == gym_cartpole_spaces()[0]
    finally:
        env.close()
    for got, want in zip(dataset.iterate_episodes(), episodes):
        np.testing.assert_array_equal(got.observations, want.obs)
        np.testing.assert_array_equal(got.actions, want.actions)
        np.testing.assert_array_equal(got.rewards, want.rewards)
        np.testing.assert_array_equal(got.terminations, want.terminateds)


def gym_cartpole_spaces():
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    return env.observation_space, env.action_space


def test_plot_writes_returns_and_policy_lag(recorded_cartpole, tmp_path):
    import matplotlib.image

    out = tmp_path / "run.png"
    result = invoke("plot", recorded_cartpole, "-o", out)
    assert result.exit_code == 0, result.output
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 800 and image.std() > 0
    with open_run(recorded_cartpole) as run:
        frags = run.files[0].fragments("default_agent")
    finished = int((frags["terminated"] | frags["truncated"]).sum())
    assert f"finished episodes worker 1: {finished};" in result.output
    assert "policy lags {" in result.output


@pytest.fixture(scope="module")
def bad_runs(recorded_cartpole, tmp_path_factory):
    """Each kind of bad input: (name, path, message the error must hold)."""
    base = tmp_path_factory.mktemp("bad")
    (base / "empty").mkdir()
    random_h5 = base / "random"
    shutil.copytree(recorded_cartpole, random_h5)
    (random_h5 / "worker-001.h5").write_bytes(os.urandom(4096))
    truncated = base / "truncated"
    shutil.copytree(recorded_cartpole, truncated)
    data = (truncated / "worker-001.h5").read_bytes()
    (truncated / "worker-001.h5").write_bytes(data[: len(data) // 2])
    future = base / "future"
    shutil.copytree(recorded_cartpole, future)
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps({**manifest, "schema_version": "9.0"}))
    return [
        ("missing", base / "missing", "is not a directory"),
        ("not a run", base / "empty", "is not an rllib_recorder run"),
        ("random .h5", random_h5, "worker-001.h5 is not a readable HDF5 file"),
        ("truncated", truncated, "which recover cannot mend: copy it again, or move it out of the run directory"),
        ("future schema", future, "has schema version 9.0, but rllib_recorder"),
    ]


@pytest.mark.parametrize("command", [["replay"], ["replay", "--episodes"], ["replay", "--check"],
                                     ["export", "--to", "rllib", "-o", "OUT"],
                                     ["export", "--to", "minari", "-o", "OUT"], ["plot", "-o", "OUT.png"]])
def test_bad_input_gives_one_line_and_exit_2(command, bad_runs, tmp_path):
    for name, path, message in bad_runs:
        args = [tmp_path / a if a.startswith("OUT") else a for a in command]
        result = invoke(args[0], path, *args[1:])
        assert result.exit_code == 2, (name, result.output)
        assert message in result.output, (name, result.output)
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, (name, result.output)


def test_replay_check_refuses_an_env_whose_spaces_do_not_match(recorded_cartpole, recorded_breakout):
    result = invoke("replay", recorded_cartpole, "--check", "--env", "ale_py:ALE/Breakout-v5-atari84x4")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: env ale_py:ALE/Breakout-v5-atari84x4 does not match the recorded spaces: "
                                    "it observes float32[84, 84, 4], the run stored float32[4]")
    result = invoke("replay", recorded_breakout, "--check", "--env", "no-such-env-v0")
    assert result.exit_code == 2 and "error: env 'no-such-env-v0' cannot be made" in result.output


def test_replay_check_refuses_old_api_stack_runs(recorded_cartpole, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(recorded_cartpole, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "api_stack": "old"}))
    result = invoke("replay", copy, "--check")
    assert result.exit_code == 2
    assert result.output.strip() == ("error: this run can't be re-simulated: it was recorded on RLlib's old API "
                                     "stack, which records no start states")
