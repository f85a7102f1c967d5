"""Tune-style YAMLs as RLlib's tuned examples are written (old key names, grid searches, old result names in
``stop:``, negative thresholds): every problem listed at once with its fix, RLlib's renames translated with a note,
clear one-line limits, and a grid search that trains and records. The files are written here in the shape of Ray's
published ones (``rllib/tuned_examples/``), not copied from them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rllib_recorder.cli import main

PENDULUM = """\
pendulum-ppo:
    env: Pendulum-v1
    run: PPO
    stop:
        episode_reward_mean: -400
        timesteps_total: 400000
    config:
        framework: tf2
        train_batch_size: 512
        vf_clip_param: 10.0
        num_workers: 1
        num_envs_per_worker: 2
        lambda: 0.1
        gamma: 0.95
        lr: 0.0003
        sgd_minibatch_size: 64
        num_sgd_iter: 6
        model:
            fcnet_activation: relu
"""

GRID = """\
cartpole-ppo:
    env: CartPole-v1
    run: PPO
    stop:
        env_runners/episode_return_mean: 200
        time_total_s: 180
    config:
        framework: torch
        num_env_runners: 2
        num_sgd_iter:
            grid_search: [1, 2]
        minibatch_size: 64
        train_batch_size: 128
        rollout_fragment_length: 64
"""


def _check(tmp_path, text: str, *args: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["train", str(path), "--check", *args])
    return result.exit_code, result.stdout, result.stderr


def test_every_problem_of_a_published_style_file_is_listed_at_once_with_its_fix(tmp_path):
    code, out, err = _check(tmp_path, PENDULUM)
    assert code == 2 and not out, (out, err)
    lines = err.strip().splitlines()
    assert lines[-4].startswith("error: ") and lines[-4].endswith("3 problems:"), err
    problems = lines[-3:]
    assert any("'config: framework:' tf2 needs TensorFlow" in p and "write 'framework: torch'" in p for p in problems)
    assert any("'config: num_envs_per_worker:' is RLlib's old name of 'num_envs_per_env_runner', which RLlib 2.60 "
               "refuses; rename it 'num_envs_per_env_runner'" in p for p in problems)
    assert any("'config: sgd_minibatch_size:' is RLlib's old name of 'minibatch_size', which RLlib 2.60 ignores; "
               "rename it 'minibatch_size'" in p for p in problems)
    notes = [line for line in lines if line.startswith("note: ")]  # RLlib maps these itself: translated, noted
    assert any("'config: num_sgd_iter:' is RLlib's old name of 'num_epochs'; taken as 'num_epochs: 6'" in n
               for n in notes)
    assert any("'config: num_workers:' is RLlib's old name of 'num_env_runners'" in n for n in notes)
    assert any("'stop: episode_reward_mean:'" in n and "stopping on 'env_runners/episode_return_mean'" in n
               for n in notes)
    assert any("'stop: timesteps_total:'" in n and "'num_env_steps_sampled_lifetime'" in n for n in notes)
    fixed = (PENDULUM.replace("tf2", "torch").replace("num_envs_per_worker", "num_envs_per_env_runner")
             .replace("sgd_minibatch_size", "minibatch_size"))
    code, out, err = _check(tmp_path, fixed)  # fixed once, it passes
    assert code == 0 and out.startswith("ok: ") and "env_runners/episode_return_mean -400" in out, (out, err)


def test_stop_takes_negative_numbers_and_warns_of_a_name_no_result_holds(tmp_path):
    text = PENDULUM.replace("framework: tf2", "framework: torch").replace("num_envs_per_worker", "num_envs_per_env_runner") \
        .replace("sgd_minibatch_size", "minibatch_size").replace(
            "        timesteps_total: 400000\n", "        env_runners/episode_retrun_mean: -1000\n")
    code, out, err = _check(tmp_path, text)
    assert code == 0, (out, err)
    assert "'stop: env_runners/episode_retrun_mean:' is not a name RLlib 2.60's results hold (nearest: " \
           "env_runners/episode_return_mean" in err
    code, out, err = _check(tmp_path, text.replace("-1000", "nan"))
    assert code == 2 and "must be a number" in err


@pytest.mark.parametrize("run, env, fix", [
    ("DDPG", "Pendulum-v1", "use SAC"),
    ("A2C", "CartPole-v1", "use PPO"),
    ("SAC", "HalfCheetah-v2", "needs mujoco-py"),
    ("SAC", "BipedalWalker-v3", "needs the Box2D package"),
])
def test_clear_limits_are_one_line_each(tmp_path, run, env, fix):
    import importlib.util

    if env.startswith("Bipedal") and importlib.util.find_spec("Box2D") is not None:
        pytest.skip("Box2D is installed here")
    code, out, err = _check(tmp_path, f"x:\n  run: {run}\n  env: {env}\n  stop: {{training_iteration: 1}}\n")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], err


@pytest.mark.slow
def test_a_grid_search_in_the_published_shape_trains_records_and_verifies_every_trial(ray_session, tmp_path,
                                                                                      monkeypatch):
    path = tmp_path / "grid.yaml"
    path.write_text(GRID)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", str(path), "--stop-iters", "1", "--num-env-runners", "1",
                                       "--output-dir", str(tmp_path / "rec")])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "trained and recorded 2 run(s)" in result.stdout
    assert result.stdout.count("verify: sound: all ") == 2, result.stdout
    assert "num_epochs=1" in result.stdout and "num_epochs=2" in result.stdout
