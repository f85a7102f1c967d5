"""RLlib's offline algorithms train straight from a real recording (offline_input), every row read once per pass."""

from __future__ import annotations

import gc

import gymnasium as gym
import numpy as np
import pytest

from rllib_recorder import ConfigError, RecorderCallback, offline_input, open_run
from rllib_recorder._rllib_compat import ray_release
from tests.test_recording import ppo, record


def _train_once(config, rows: int) -> tuple[dict, int, dict]:
    """One train() of an offline algorithm; its learner results, the dataset's row count, and the dataset's rows."""
    algo = config.build_algo()
    try:
        data = algo.offline_data.data
        table = {k: np.stack(v.tolist()) if v.dtype == object else v.to_numpy()
                 for k, v in data.to_pandas().items()}
        result = algo.train()["learners"]["default_policy"]
        return result, data.count(), table
    finally:
        algo.stop()
        del algo
        gc.collect()  # Ray Data's iterator finalized while Ray is up (see the README's BC example)


@pytest.mark.compat
def test_bc_and_marwil_train_on_every_row_of_a_cartpole_recording(recorded_cartpole):
    from ray.rllib.algorithms.bc import BCConfig
    from ray.rllib.algorithms.marwil import MARWILConfig

    cartpole = gym.make("CartPole-v1")
    with open_run(recorded_cartpole) as run:
        rows = run.num_env_steps
        want = {k: np.concatenate([b[k] for b in run.iter_batches(10_000, columns=["obs", "next_obs", "actions"])])
                for k in ("obs", "next_obs", "actions")}
    for config_class in (BCConfig, MARWILConfig):
        config = (config_class().environment(observation_space=cartpole.observation_space,
                                             action_space=cartpole.action_space)
                  .offline_data(**offline_input(recorded_cartpole, batches_per_iteration=4))
                  .training(train_batch_size_per_learner=rows // 4))
        learner, count, table = _train_once(config, rows)
        assert count == rows  # the dataset is the run's every step
        if ray_release() >= (2, 44):  # one iteration: 4 batches of a quarter, every row once (before 2.44 a local
            assert learner["num_module_steps_trained"] == rows  # learner took one batch, MARWIL's counted twice)
        assert np.isfinite(learner["policy_loss"])
        order = np.lexsort(table["obs"].T)  # the rows, as RLlib reads them, are the recorded transitions
        mine = np.lexsort(want["obs"].T)
        np.testing.assert_array_equal(table["obs"][order], want["obs"][mine])
        np.testing.assert_array_equal(table["new_obs"][order], want["next_obs"][mine])
        np.testing.assert_array_equal(table["actions"][order], want["actions"][mine])


def test_bc_trains_on_every_breakout_frame_stack_as_the_env_runner_saw_it(recorded_breakout):
    """RLlib's Atari wrappers stack frames in the env: BC reads the recorded stacks (stored as newest uint8 frames,
    rebuilt float32 84x84x4) exactly as PPO's env runner observed them, and trains its CNN on every row."""
    import hashlib

    from ray.rllib.algorithms.bc import BCConfig

    from rllib_recorder.commands.envs import make_atari_env

    env = make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {})
    with open_run(recorded_breakout) as run:
        rows = run.num_env_steps
        want = sorted(hashlib.sha1(o.tobytes() + n.tobytes()).hexdigest() for b in run.iter_batches(64, columns=[
            "obs", "next_obs"]) for o, n in zip(b["obs"], b["next_obs"]))
    config = (BCConfig().environment(observation_space=env.observation_space, action_space=env.action_space)
              .offline_data(**offline_input(recorded_breakout, batches_per_iteration=1))
              .training(train_batch_size_per_learner=rows))
    learner, count, table = _train_once(config, rows)
    assert count == rows and learner["num_module_steps_trained"] == rows
    assert np.isfinite(learner["policy_loss"])
    assert table["obs"].shape == (rows, 84, 84, 4) and table["obs"].dtype == np.float32
    got = sorted(hashlib.sha1(o.tobytes() + n.tobytes()).hexdigest() for o, n in zip(table["obs"], table["new_obs"]))
    assert got == want


def test_bc_with_an_evaluation_runner_on_every_cpu_trains_and_evaluates(recorded_cartpole):
    """RLlib's actors may hold every CPU (here the pre-learner and an evaluation env runner: the session's 2): the
    reading must not wait for one. It did, forever, before read tasks stopped reserving a CPU."""
    import signal

    from ray.rllib.algorithms.bc import BCConfig

    cartpole = gym.make("CartPole-v1")
    config = (BCConfig().environment("CartPole-v1", observation_space=cartpole.observation_space,
                                     action_space=cartpole.action_space)
              .offline_data(**offline_input(recorded_cartpole, batches_per_iteration=2))
              .training(train_batch_size_per_learner=100)
              .evaluation(evaluation_interval=2, evaluation_duration=2, evaluation_duration_unit="episodes",
                          evaluation_num_env_runners=1))

    def hung(*_):
        raise TimeoutError("BC with an evaluation runner hung: a read task waits for a CPU RLlib's actors hold")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    algo = config.build_algo()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        algo.stop()
        del algo
        gc.collect()
    assert all(r["learners"]["default_policy"]["num_module_steps_trained"] == 200 for r in results)
    assert results[-1]["evaluation"]["env_runners"]["num_episodes"] >= 2


def test_cql_trains_on_every_row_of_a_pendulum_recording(ray_session, tmp_path):
    from ray.rllib.algorithms.cql import CQLConfig
    from ray.rllib.algorithms.ppo import PPOConfig

    recording = (PPOConfig().environment("Pendulum-v1").env_runners(num_env_runners=1, rollout_fragment_length=100)
                 .training(train_batch_size=400, minibatch_size=200, num_epochs=1)
                 .callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "rec"))))
    algo = recording.build_algo()
    run_dir = algo.train()["recorder"]["run_dir"]
    algo.stop()
    with open_run(run_dir) as run:
        rows = run.num_env_steps
    config = (CQLConfig().environment("Pendulum-v1")  # CQL (SAC) needs continuous actions
              .offline_data(**offline_input(run_dir, batches_per_iteration=4))
              .training(train_batch_size_per_learner=rows // 4, num_steps_sampled_before_learning_starts=0, lr=None))
    learner, count, _ = _train_once(config, rows)
    assert count == rows and learner["num_module_steps_trained"] == rows
    assert np.isfinite(learner["cql_loss"]) and np.isfinite(learner["qf_loss"])


def test_a_multi_agent_run_trains_one_module_at_a_time(ray_session, tmp_path):
    from ray.rllib.algorithms.bc import BCConfig

    run_dir, _, _ = record(ppo("counting_ma", runners=1, multi_agent=True), tmp_path, iterations=1)
    with pytest.raises(ConfigError, match="multi-agent run .*pass module_id=, one of pa, pb"):
        offline_input(run_dir)
    with pytest.raises(ConfigError, match="has no module 'pz'"):
        offline_input(run_dir, module_id="pz")
    with open_run(run_dir) as run:
        rows = sum(f.num_rows("a") for f in run.files)  # agent a acts with module pa (ppo's mapping)
        space = gym.spaces.Box(-1e6, 1e6, (4,), np.float32)  # (worker, episode, t, agent)
    config = (BCConfig().environment(observation_space=space, action_space=gym.spaces.Discrete(2))
              .offline_data(**offline_input(run_dir, module_id="pa", batches_per_iteration=1))
              .training(train_batch_size_per_learner=rows))
    learner, count, table = _train_once(config, rows)
    assert count == rows and learner["num_module_steps_trained"] == rows
    assert (table["obs"][:, 2] + 1 == table["new_obs"][:, 2]).all()  # the counting env's step clock
    assert (table["obs"][:, 3] == 0).all()  # agent a's rows only
