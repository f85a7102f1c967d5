"""The YAML experiments in configs/: each loads and builds; the multi-agent one records a real run."""

from __future__ import annotations

import glob
import os

import pytest

from rllib_recorder.commands.experiment import load_experiment
from rllib_recorder.commands.train import build_config
from rllib_recorder.commands.verify import verify_run
from rllib_recorder.read.run import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_the_issue_lists_every_config():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"cartpole-ppo.yaml", "cartpole-ppo-old-stack.yaml", "multiagent-cartpole-ppo.yaml",
            "breakout-ppo.yaml", "cartpole-appo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_builds_with_the_recorder_attached(ray_session, tmp_path, path):
    spec = load_experiment(path, output_dir=str(tmp_path))
    config = build_config(spec)
    callbacks = config.callbacks_class if isinstance(config.callbacks_class, list) else [config.callbacks_class]
    assert any(c.__name__.startswith("RecorderCallback") for c in callbacks)
    assert spec.recorder.output_dir == str(tmp_path)
    assert spec.stop  # every experiment stops by itself


def test_breakout_config_uses_rllibs_atari_wrappers(ray_session, tmp_path):
    spec = load_experiment(os.path.join(ROOT, "configs", "breakout-ppo.yaml"), output_dir=str(tmp_path))
    assert spec.atari_wrappers == {"dim": 84, "framestack": 4}
    from rllib_recorder.commands.envs import make_atari_env

    env = make_atari_env(spec.env, 84, 4, spec.config["env_config"])
    obs, _ = env.reset(seed=0)
    assert obs.shape == (84, 84, 4) and obs.dtype.name == "float32"
    env.close()


def test_multiagent_config_records_each_agent(ray_session, tmp_path):
    spec = load_experiment(os.path.join(ROOT, "configs", "multiagent-cartpole-ppo.yaml"), output_dir=str(tmp_path))
    config = build_config(spec).env_runners(num_env_runners=1).training(
        train_batch_size=400, minibatch_size=200, num_epochs=1)
    algo = config.build_algo()
    result = algo.train()
    algo.stop()
    run_dir = result["recorder"]["run_dir"]
    assert verify_run(run_dir) == []
    with open_run(run_dir) as run:
        assert {a for f in run.files for a in f.agents} == {"0", "1"}
        episode = next(run.episodes())
        assert episode.module_id in ("p0", "p1") and episode.obs.shape[1] == 4
        assert run.num_env_steps == result["env_runners"]["num_env_steps_sampled_lifetime"]
        # the env's name as the file gives it, not RLlib's class repr ('<class ...MultiEnv>')
        assert run.manifest["env"] == "MultiAgentCartPole"
        assert os.path.basename(run_dir).startswith("PPO_MultiAgentCartPole_")  # outside Tune: <algo>_<env>_<time>_<id>
    from click.testing import CliRunner

    from rllib_recorder.cli import main

    result = CliRunner().invoke(main, ["replay", run_dir, "--check"])  # says why, before looking for the env
    assert result.exit_code == 2 and result.output.startswith(
        "error: this run can't be re-simulated: it is multi-agent (worker-001.h5 holds agent '0')"), result.output


def test_an_env_class_is_named_as_replay_takes_it():
    from rllib_recorder.service.run_dir import env_name
    from tests.envs import CountingEnv

    assert env_name(CountingEnv) == "tests.envs:CountingEnv"  # what 'replay --env module:Class' takes
    assert env_name("CartPole-v1") == "CartPole-v1" and env_name(None) == "None"
