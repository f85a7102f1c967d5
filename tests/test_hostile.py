"""A recording is data, never code: hostile run directories get one line and do nothing else.

The issue's own cases first (each exactly as found), then a few hundred generated hostile manifests and index files
through every reading command (tests/hostile.py; scripts/fuzz_hostile.py runs thousands), then the reader API,
durability of names with ``fsync=True``, the umask, and ``omit_env_config_keys``.
"""

import json
import os
import random
import shutil
import stat

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllib_recorder import RecorderConfig
from rllib_recorder.cli import main as cli
from rllib_recorder.errors import RecorderError
from tests import hostile


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    return hostile.install(str(tmp_path_factory.mktemp("sentinel")))


def _copy_with_manifest(run_dir, dest, change):
    shutil.copytree(run_dir, dest)
    path = os.path.join(dest, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return str(dest)


def _run(argv):
    return hostile.armed(lambda: CliRunner().invoke(cli, [str(a) for a in argv]))


@pytest.mark.parametrize("env", ["subprocess:Popen", "rr_sentinel:make", "rr_sentinel:Env-v0",
                                 "rr_sentinel:Env-v0-atari84x4", "os:system"])
@pytest.mark.parametrize("command", ["replay --check", "export minari"])
def test_a_manifest_naming_code_as_its_env_runs_nothing_and_says_pass_env(recorded_cartpole, tmp_path, sentinel,
                                                                           env, command):
    shell = {"sh": 0, "-c": 0, f"echo ran >> {sentinel}": 0}  # Popen(env_config) would run `sh -c 'echo ...'`
    run = _copy_with_manifest(recorded_cartpole, tmp_path / "run", lambda m: m.update(env=env, env_config=shell))
    argv = ["replay", run, "--check"] if command == "replay --check" else [
        "export", run, "--to", "minari", "-o", tmp_path / "out"]
    result = _run(argv)
    assert not os.path.exists(sentinel), open(sentinel).read()
    assert hostile.EVENTS.spawned == [] and hostile.EVENTS.imported == []
    assert hostile.check_result(result) == []
    if command == "replay --check":
        assert result.exit_code == 2 and "pass --env" in result.stderr, result.output
    else:  # export makes no env it cannot trust: the spaces come from the data
        assert result.exit_code == 0, result.output


def test_the_user_may_still_name_code_on_the_command_line(recorded_cartpole, tmp_path, sentinel):
    run = _copy_with_manifest(recorded_cartpole, tmp_path / "run", lambda m: m.update(env="tests.envs:no_such"))
    result = _run(["replay", run, "--check", "--env", "CartPole-v1"])
    assert result.exit_code == 0, result.output
    result = _run(["replay", run, "--check", "--env", "rr_sentinel:make"])  # typed by the user: imported
    assert hostile.EVENTS.imported == ["rr_sentinel"] and os.path.exists(sentinel)
    os.remove(sentinel)


@pytest.mark.parametrize("name", ["../payload.txt", "/tmp/payload-abs.h5", "worker-001.h5/../../payload.h5",
                                  "sub/worker-001.h5", ".."])
def test_gather_refuses_file_names_that_leave_the_run_before_reading_or_writing(recorded_cartpole, tmp_path,
                                                                                name, sentinel):
    def change(m):
        m["files"][name] = {}
    run = _copy_with_manifest(recorded_cartpole, tmp_path / "exp" / "run", change)
    target = tmp_path / "exp" / "target"
    before = hostile.snapshot(str(tmp_path), [])
    result = _run(["gather", run, "--to", target])
    assert result.exit_code == 2 and "not a worker file name" in result.stderr, result.output
    assert hostile.check_result(result) == []
    assert hostile.snapshot(str(tmp_path), []) == before  # not even the target was made
    assert not os.path.exists("/tmp/payload-abs.h5")


@pytest.mark.parametrize("node_id", ["../..", 7, "nodeX"])
def test_a_node_id_that_is_not_a_ray_node_id_is_refused(recorded_cartpole, tmp_path, node_id):
    def change(m):
        next(iter(m["files"].values()))["node_id"] = node_id
    run = _copy_with_manifest(recorded_cartpole, tmp_path / "run", change)
    result = _run(["gather", run, "--to", tmp_path / "target"])
    assert result.exit_code == 2 and "not a Ray node id" in result.stderr, result.output


@pytest.mark.parametrize("totals", [None, [], "x", {"senders": []}, {"senders": {"a": 5}},
                                    {"env_steps_stored": "many"}, {"env_steps_stored": 10 ** 40}])
def test_info_and_verify_on_odd_totals_answer_in_one_line(recorded_cartpole, tmp_path, totals):
    run = _copy_with_manifest(recorded_cartpole, tmp_path / "run", lambda m: m.update(totals=totals))
    for argv in (["info", run], ["info", "--json", run], ["verify", run]):
        result = _run(argv)
        assert hostile.check_result(result) == [], (argv, result.output)
        assert result.exit_code in (0, 1) if totals is None else result.exit_code == 2, (argv, result.output)


@pytest.mark.parametrize("output, message", [("missing-dir/run.png", "does not exist"),
                                             ("run.gif", "name a .png")])
def test_plot_to_a_path_it_cannot_write_names_the_path_not_the_run(recorded_cartpole, tmp_path, output, message):
    result = _run(["plot", recorded_cartpole, "-o", tmp_path / output])
    assert result.exit_code == 2 and message in result.stderr and "recover" not in result.stderr, result.output


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_hostile_manifests_and_indexes_get_one_line_run_nothing_and_write_nothing_outside(
        recorded_cartpole, tmp_path_factory, sentinel, seed):
    root = str(tmp_path_factory.mktemp("hostile"))
    outcome = hostile.run_one(random.Random(seed), recorded_cartpole, root, sentinel, 0)
    assert outcome.violations == [], (outcome.command, outcome.how, outcome.violations)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_the_reader_api_raises_only_recorder_errors_on_hostile_manifests(recorded_cartpole, tmp_path_factory,
                                                                          sentinel, seed):
    from rllib_recorder.read.run import open_run

    rng = random.Random(seed)
    run = os.path.join(str(tmp_path_factory.mktemp("reader")), "run")
    shutil.copytree(recorded_cartpole, run)
    with open(os.path.join(run, "manifest.json")) as f:
        raw, how = hostile.mutate(json.load(f), rng, sentinel)
    with open(os.path.join(run, "manifest.json"), "wb") as f:
        f.write(raw)
    try:
        with open_run(run) as r:
            r.counts()
            sum(len(e) for e in r.episodes())
            r.num_env_steps
    except RecorderError:
        pass
    assert not os.path.exists(sentinel), how


def test_with_fsync_new_files_and_renames_are_followed_by_a_directory_fsync(tmp_path, monkeypatch):
    from rllib_recorder.format import commits, datasets, durable, manifest
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.service.writer import RecordingWriter
    from tests.helpers import make_episode

    synced = []
    real = durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_dir", lambda path: (synced.append(os.path.abspath(path)), real(path)))
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    writer = RecordingWriter(run_dir, "run-1", datasets.StorageOptions(fsync=True))
    writer.append(1, False, b"s" * 16, 0, episodes_to_chunk([make_episode(5)], sampled_at_s=0.0))
    assert synced == [run_dir]  # the new worker-001.h5's name
    writer.close()
    synced.clear()
    commits.rewrite_committed(os.path.join(run_dir, "worker-001.h5"))
    manifest.write_manifest(run_dir, {"format": "rllib_recorder"})
    assert synced == [run_dir, run_dir]  # the rewrite's rename and the manifest's


def test_files_are_created_with_the_users_umask_never_wider(tmp_path):
    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.format.spool_files import SegmentWriter
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.record.outbox import Outbox
    from rllib_recorder.service.writer import RecordingWriter
    from tests.helpers import make_episode

    old = os.umask(0o077)
    try:
        run_dir = str(tmp_path / "run")
        os.makedirs(run_dir)
        writer = RecordingWriter(run_dir, "run-1", StorageOptions())
        writer.append(1, False, b"s" * 16, 0, episodes_to_chunk([make_episode(5)], sampled_at_s=0.0))
        writer.close()
        out = Outbox(SegmentWriter(os.path.join(run_dir, ".spool", "worker-001", "ab" * 16)))
        out.add(episodes_to_chunk([make_episode(5)], sampled_at_s=0.0))
        write_manifest(run_dir, {"format": "rllib_recorder"})
    finally:
        os.umask(old)
    for base, dirs, names in os.walk(run_dir):
        for name in dirs + names:
            mode = stat.S_IMODE(os.stat(os.path.join(base, name)).st_mode)
            assert mode & 0o077 == 0, (name, oct(mode))


def test_omit_env_config_keys_leaves_secrets_out_of_the_manifest(ray_session, tmp_path):
    from ray import tune
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback
    from tests.envs import CountingEnv

    tune.register_env("counting", lambda cfg: CountingEnv(cfg))
    config = (PPOConfig().environment("counting", env_config={"api_token": "s3cret", "level": 3})
              .env_runners(num_env_runners=0).training(train_batch_size=64, minibatch_size=32, num_epochs=1)
              .callbacks(RecorderCallback.configured(output_dir=str(tmp_path), omit_env_config_keys=["api_token"])))
    algo = config.build_algo()
    try:
        run_dir = algo.train()["recorder"]["run_dir"]
    finally:
        algo.stop()
    text = open(os.path.join(run_dir, "manifest.json")).read()
    manifest = json.loads(text)
    assert "s3cret" not in text
    assert manifest["env_config"] == {"level": 3} and manifest["env_config_omitted"] == ["api_token"]
    with pytest.raises(RecorderError, match="omit_env_config_keys"):
        RecorderConfig(omit_env_config_keys="api_token")
