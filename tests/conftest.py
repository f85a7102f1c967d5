"""One Ray instance per test session (2 CPUs, like the machine), and a recorded-run helper."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ray workers inherit this environment: they must import tests.envs and friends too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


# The suite runs on two pytest-xdist workers, a test file to a worker (pyproject's addopts: ``-n 2 --dist loadfile
# --no-loadscope-reorder``): a worker takes the next file when it is done with its last, in this order. The files
# that take longest come first, the longest first, so that none of them starts when the other worker is nearly
# done (ranked by their times in one process on 7 Dec 2026, 200 s down to 23 s); the others follow in their usual
# order. Tests within a file keep their order (test_readme.py's help test runs after its snippets test).
LONGEST_FIRST = ("test_readme.py", "test_durable.py", "test_real_use.py", "test_tune_attempts.py", "test_chaos.py",
                 "test_recording.py", "test_rllib_yamls.py", "test_offline.py", "test_errors_and_tune.py",
                 "test_reliability.py", "test_multinode.py", "test_yaml_inputs.py", "test_follow.py",
                 "test_format_doc.py", "test_hostile.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest as collected


@pytest.fixture(scope="session", autouse=True)
def sound_records(tmp_path_factory):
    """The records of files known sound (format/sound_files.py) and the copies of runs read at a URI
    (read/remote.py) go to the session's own directories, not the user's cache; set before Ray starts, so that
    writer actors and child processes use them too."""
    os.environ["RLLIB_RECORDER_SOUND_DIR"] = str(tmp_path_factory.mktemp("sound-records"))
    os.environ["RLLIB_RECORDER_CACHE"] = str(tmp_path_factory.mktemp("run-cache"))
    return os.environ["RLLIB_RECORDER_SOUND_DIR"]


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    import gc

    gc.collect()  # a Ray Data iterator a test left unfinished is closed while Ray is up (after: a logged traceback)
    ray.shutdown()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 for the session's tests (tests/s3server.py); each test
    writes under prefixes of its own."""
    from tests.s3server import S3Server

    server = S3Server(str(tmp_path_factory.mktemp("s3")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def recorded_cartpole(ray_session, tmp_path_factory):
    """One small real recorded PPO CartPole run (1 env runner), shared by the read-side tests."""
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback

    out = tmp_path_factory.mktemp("cartpole")
    config = (
        PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, rollout_fragment_length=25)
        .training(train_batch_size=200, minibatch_size=100, num_epochs=1)
        # every sample its own chunk: episodes span fragments and batches (stitching is tested)
        .callbacks(RecorderCallback.configured(output_dir=str(out), coalesce_rows=0))
    )
    algo = config.build_algo()
    for _ in range(2):
        run_dir = algo.train()["recorder"]["run_dir"]
    algo.stop()
    return run_dir


@pytest.fixture(scope="session")
def recorded_breakout(ray_session, tmp_path_factory):
    """One tiny real recorded PPO Breakout run from configs/breakout-ppo.yaml (RLlib's Atari wrappers, 1 iteration)."""
    from rllib_recorder.commands.experiment import load_experiment
    from rllib_recorder.commands.train import build_config

    spec = load_experiment(os.path.join(ROOT, "configs", "breakout-ppo.yaml"),
                           output_dir=str(tmp_path_factory.mktemp("breakout")))
    spec.config.update(train_batch_size=200, minibatch_size=100)
    algo = build_config(spec).build_algo()
    run_dir = algo.train()["recorder"]["run_dir"]
    algo.stop()
    return run_dir


@pytest.fixture(scope="session")
def turn_based_recorder(ray_session, tmp_path_factory):
    """Records PPO on tests.envs.TurnBasedEnv with the given turn agents (and 'c', who joins late and leaves early),
    fragments of 7 env steps, two iterations; returns the run directory."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.tune.registry import register_env

    from rllib_recorder import RecorderCallback
    from tests.envs import TurnBasedEnv

    register_env("turn_based", lambda cfg: TurnBasedEnv(cfg))

    def record(turns: tuple[str, ...]) -> str:
        config = (
            PPOConfig().environment("turn_based", env_config={"turns": turns}, disable_env_checking=True)
            .env_runners(num_env_runners=1, rollout_fragment_length=7)
            .multi_agent(policies={"pab", "pc"}, policy_mapping_fn=lambda aid, *a, **k: "pc" if aid == "c" else "pab")
            .training(train_batch_size=60, minibatch_size=30, num_epochs=1)
            .callbacks(RecorderCallback.configured(output_dir=str(tmp_path_factory.mktemp("ma") / "rec")))
        )
        algo = config.build_algo()
        results = [algo.train() for _ in range(2)]
        algo.stop()
        return results[-1]["recorder"]["run_dir"]

    return record


@pytest.fixture(scope="session")
def recorded_turn_based(turn_based_recorder):
    """One real recorded multi-agent run (three turn agents and 'c'), shared by the multi-agent tests and
    FORMAT.md's."""
    return turn_based_recorder(("a", "b", "d"))
