"""Recording into durable storage: a real S3-compatible server (SeaweedFS) on 127.0.0.1, real PPO runs, the run read
back from the store value by value, an outage of the store in the middle of a run, and every command on a URI."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from rllib_recorder import RecorderCallback, open_run
from rllib_recorder.format import segments
from tests.envs import logged_steps
from tests.helpers import own_cluster_env, rllib_counts_callback
from tests.integrity import check_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(output_dir, staging, run_name, **settings):
    from ray.rllib.algorithms.ppo import PPOConfig

    from tests.envs import CountingEnv

    return (
        PPOConfig().environment(CountingEnv, env_config={"obs_kind": "vector"}).env_runners(
            num_env_runners=1, rollout_fragment_length=100)
        .training(train_batch_size=200, minibatch_size=100, num_epochs=1)
        .callbacks(RecorderCallback.configured(output_dir=output_dir, staging_dir=str(staging), run_name=run_name,
                                               coalesce_s=0.1, **settings))
    )


def _sampled(result) -> int:
    return int(result["env_runners"]["num_env_steps_sampled_lifetime"])


@pytest.fixture(scope="module")
def s3_run(ray_session, s3, tmp_path_factory):
    """A PPO run recorded to s3://runs/exp/<run>, sealed every 0.3 s: several segments per runner."""
    staging = tmp_path_factory.mktemp("staging")
    algo = _config(s3.uri("runs/exp"), staging, "sealed", segment_s=0.3).build_algo()
    results = []
    for _ in range(5):  # each iteration a little over segment_s after the last, however fast the machine trains
        results.append(algo.train())
        time.sleep(0.4)
    algo.stop()
    return {"uri": s3.uri("runs/exp/sealed"), "staging": str(staging), "results": results,
            "sampled": _sampled(results[-1]), "cache": str(tmp_path_factory.mktemp("cache"))}


def test_a_run_recorded_to_s3_reads_back_from_the_store_whole(s3_run, s3):
    uri = s3_run["uri"]
    with open_run(uri, cache_dir=s3_run["cache"]) as run:
        assert run.manifest["status"] == "finished"
        assert run.num_env_steps == s3_run["sampled"]  # every sampled step, at the target
        (f,) = run.files
        names = [r["name"] for r in segments.segment_list(f.h5)]
        assert len(names) >= 3, names  # sealed as the run went, not once at the end
        # the index is one worker file: its rows are the segments' rows, in order, value by value
        for column in ("obs", "actions", "rewards", "t"):
            stitched = f.h5[f"agents/default_agent/steps/{column}"][:]
            pieces = []
            for name in names:
                with h5py.File(os.path.join(run.path, "segments", "worker-001", name), "r") as seg:  # plain h5py
                    pieces.append(seg[f"agents/default_agent/steps/{column}"][:])
            np.testing.assert_array_equal(stitched, np.concatenate(pieces))
        # an episode cut by a seal reads back as one
        frags = f.fragments("default_agent")
        assert len(set(frags["eps_id"].tolist())) < len(frags["eps_id"])
    facts = check_run(uri, sampled=s3_run["sampled"])  # every episode exact and complete, every step RLlib counted
    assert facts["agent_steps"] == s3_run["sampled"]
    # what reached the target left the node: staging keeps no segment, only its small records
    assert not glob.glob(os.path.join(s3_run["staging"], "**", "[0-9]*.h5"), recursive=True)
    last = s3_run["results"][-1]["recorder"]
    assert last["segments_uploaded"] >= 1 and last["upload_errors"] == 0


def test_each_segment_at_the_store_is_checked_and_plain_hdf5(s3_run, s3):
    fs = s3.filesystem()
    with open_run(s3_run["uri"], cache_dir=s3_run["cache"]) as run:
        records = segments.segment_list(run.files[0].h5)
    import hashlib

    for record in records:
        with fs.open_input_stream(f"runs/exp/sealed/segments/worker-001/{record['name']}") as src:
            data = src.read()
        assert len(data) == record["size"] and hashlib.sha256(data).hexdigest() == record["sha256"]
    # a damaged cached segment is fetched again, and checked
    cached = os.path.join(s3_run["cache"], "segments", "worker-001", records[0]["name"])
    with open(cached, "r+b") as f:
        f.truncate(100)
    with open_run(s3_run["uri"], cache_dir=s3_run["cache"]) as run:
        assert run.num_env_steps == s3_run["sampled"]
    assert os.path.getsize(cached) == records[0]["size"]


def test_every_command_reads_a_run_at_its_uri(s3_run, tmp_path):
    env = {**os.environ, "RLLIB_RECORDER_CACHE": str(tmp_path / "cache")}
    uri = s3_run["uri"]

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "rllib_recorder.cli", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    shown = cli("info", uri)
    assert f"{s3_run['sampled']:,}" in shown and "Run s3://runs/exp/sealed" in shown and "secret" not in shown
    assert "is sound" in cli("verify", uri)
    cli("export", uri, "--to", "rllib", "-o", str(tmp_path / "bc-data"))
    assert glob.glob(str(tmp_path / "bc-data" / "**" / "*.parquet"), recursive=True)
    with open_run(uri, cache_dir=s3_run["cache"]) as run:
        batches = run.counts()["batches"]
    replayed = [json.loads(line) for line in cli("replay", uri).splitlines()]
    assert len(replayed) == batches  # one JSON line per stored chunk, read from the segments
    secret = "rr_test_secret"
    with open(os.path.join(cli_cache(tmp_path), "manifest.json")) as f:
        assert secret not in f.read()  # the manifest names the target without its credentials


def cli_cache(tmp_path):
    (run,) = glob.glob(str(tmp_path / "cache" / "sealed-*"))
    return run


def test_the_offline_input_and_ray_data_read_a_run_at_its_uri(s3_run, ray_session):
    with open_run(s3_run["uri"], cache_dir=s3_run["cache"]) as run:
        ds = run.to_ray_dataset(rows_per_task=150)
        rows = ds.take_all()
        assert len(rows) == s3_run["sampled"]
        expected = np.concatenate([b["obs"] for b in run.iter_batches(256, columns=["obs"])])
    np.testing.assert_array_equal(np.sort(np.stack([r["obs"] for r in rows]), axis=0), np.sort(expected, axis=0))


def test_bc_trains_on_every_row_of_a_run_at_its_uri(s3_run, ray_session):
    """offline_input takes the run's URI: RLlib's BC reads every recorded transition from the store's segments."""
    from ray.rllib.algorithms.bc import BCConfig

    from rllib_recorder import offline_input
    from tests.envs import CountingEnv
    from tests.test_offline import _train_once

    env = CountingEnv({"obs_kind": "vector"})
    rows = s3_run["sampled"]
    config = (BCConfig().environment(observation_space=env.observation_space, action_space=env.action_space)
              .offline_data(**offline_input(s3_run["uri"], batches_per_iteration=4))
              .training(train_batch_size_per_learner=rows // 4))
    learner, count, table = _train_once(config, rows)
    assert count == rows and learner["num_module_steps_trained"] == rows
    with open_run(s3_run["uri"], cache_dir=s3_run["cache"]) as run:
        want = np.concatenate([b["obs"] for b in run.iter_batches(10_000, columns=["obs"])])
    np.testing.assert_array_equal(table["obs"][np.lexsort(table["obs"].T)], want[np.lexsort(want.T)])


def test_the_store_down_for_a_while_loses_nothing_and_is_reported(ray_session, s3, tmp_path):
    """The store goes away mid-run (killed) and comes back (same data): uploads fail and are retried with backoff,
    sampling goes on, the backlog shows in result['recorder'], and at the end every step is at the target. The
    target is a path in the user's own ``storage_filesystem`` (as Tune's), one that gives up fast."""
    staging = tmp_path / "staging"
    fs = s3.filesystem(fail_fast=True)
    algo = _config("runs/exp", staging, "outage", segment_s=0.3, storage_filesystem=fs).build_algo()
    try:
        first = algo.train()
        s3.stop()
        during = [algo.train()]
        while during[-1]["recorder"]["upload_errors"] < 2 and len(during) < 60:
            during.append(algo.train())
        assert during[-1]["recorder"]["upload_errors"] >= 2  # retried, with backoff
        assert during[-1]["recorder"]["upload_backlog_bytes"] > 0  # sealed segments wait on the node
        assert "last_upload_error" in during[-1]["recorder"] and during[-1]["recorder"]["last_upload_error"]
        assert _sampled(during[-1]) > _sampled(first)  # sampling never waited for the store
        s3.start()
        last = algo.train()
    finally:
        if s3.proc is None:
            s3.start()
        algo.stop()
    with open_run("runs/exp/outage", filesystem=fs, cache_dir=str(tmp_path / "cache")) as run:
        assert run.manifest["status"] == "finished"
        assert run.manifest["recorder"]["storage_filesystem"] == "S3FileSystem"  # by type: no credentials
        assert run.num_env_steps == _sampled(last)
        assert run.manifest["totals"]["upload_backlog_bytes"] == 0
    check_run(str(tmp_path / "cache"), sampled=_sampled(last))


def test_past_the_upload_backlog_the_configured_backpressure_applies_and_verify_names_it(ray_session, s3, tmp_path):
    """The store down, and the upload backlog past max_upload_backlog_bytes (0 here: one waiting segment): the writer
    takes no more chunks, the runner's spool fills, and backpressure='drop' drops and counts; once the store is
    back, the backlog goes up and recording resumes. verify names every dropped step; no step is unexplained."""

    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder.commands.verify import verify_report
    from tests.envs import CountingEnv

    fs = s3.filesystem(fail_fast=True)
    config = (PPOConfig().environment(CountingEnv, env_config={"obs_kind": "image"})
              .env_runners(num_env_runners=1, rollout_fragment_length=100)
              .training(train_batch_size=200, minibatch_size=100, num_epochs=1,
                        model={"conv_filters": [[4, [3, 3], 2], [8, [5, 5], 1]]})
              .callbacks(RecorderCallback.configured(
                  output_dir="runs/exp", storage_filesystem=fs, staging_dir=str(tmp_path / "staging"),
                  run_name="backlog", segment_s=0.3, coalesce_s=0.1, max_upload_backlog_bytes=0,
                  backpressure="drop", max_backlog_bytes=1 << 20)))
    algo = config.build_algo()
    try:
        algo.train()
        s3.stop()
        during = [algo.train()]
        spool = str(tmp_path / "staging" / "backlog" / ".spool")

        def spooled() -> int:
            return sum(os.path.getsize(p) for p in glob.glob(os.path.join(spool, "**", "*"), recursive=True)
                       if os.path.isfile(p))

        while (spooled() < 1 << 20 or not during[-1]["recorder"]["upload_errors"]) and len(during) < 200:
            during.append(algo.train())  # the writer holds back: the runner's spool fills
        during += [algo.train() for _ in range(3)]  # past the bound: these samples are dropped
        recorder = during[-1]["recorder"]
        assert recorder["upload_backpressure_s"] > 0 and recorder["upload_backlog_segments"] >= 1, recorder
        assert recorder["upload_errors"] >= 1 and recorder["env_steps_stored"] < _sampled(during[-1])
        s3.start()
        after = [algo.train()]
        deadline = time.monotonic() + 90  # the publisher retries at its next backoff step (1 s doubling to 60 s)
        while (after[-1]["recorder"]["upload_backlog_segments"] or not after[-1]["recorder"]["env_steps_dropped"]) \
                and time.monotonic() < deadline:
            after.append(algo.train())
        last = after[-1]
        # the runner's counters travel with its spool: once the writer reads on, the drops show
        assert last["recorder"]["env_steps_dropped"] > 0 and last["recorder"]["upload_backlog_segments"] == 0
    finally:
        if s3.proc is None:
            s3.start()
        algo.stop()
    cache = str(tmp_path / "cache")
    with open_run("runs/exp/backlog", filesystem=fs, cache_dir=cache) as run:
        stored = run.num_env_steps
    report = verify_report(cache)
    assert not report["problems"], report["problems"]
    assert any("dropped by back-pressure" in n for n in report["notes"]), report["notes"]
    dropped = sum(int(n.split(": ")[1].split(" of ")[0]) for n in report["notes"] if "back-pressure" in n)
    assert stored + dropped == _sampled(last)  # every sampled step is stored or counted as dropped
    assert stored > recorder["env_steps_stored"]  # recording resumed once the backlog went up
    check_run(cache, kind="image", allow_gaps=True, sampled=_sampled(last), not_stored=dropped)


def test_a_target_the_recorder_cannot_write_is_one_line_before_training(ray_session, s3, tmp_path):
    from rllib_recorder.errors import OutputDirError

    wrong = s3.uri("runs/x").replace("rr_test_secret", "not-the-secret")
    with pytest.raises(OutputDirError) as info:
        _config(wrong, tmp_path / "staging", "refused").build_algo()
    text = str(info.value)
    assert "not writable" in text and "credentials" in text and "not-the-secret" not in text
    assert "\n" not in text


def test_a_run_recorded_again_at_the_same_uri_reads_as_the_new_run_not_the_old_cached_segments(s3_run, s3, tmp_path):
    """The cache keeps a segment by its name: a run recorded again at a URI (or the same path on another store), whose
    segment of the same name and size holds other rows, reads as the new run; the old copy is fetched again, because
    its index names another SHA-256. (Seen in a suite run: the same node-loss run path on each session's own store
    read another session's cached segment, every size equal, and its episodes mixed.)"""
    import pyarrow.fs as pafs

    from rllib_recorder.format import store

    COLUMN = "agents/default_agent/fragments/return"
    fs, cache = s3.filesystem(), str(tmp_path / "cache")
    pafs.copy_files("runs/exp/sealed", "runs/again/sealed", source_filesystem=fs, destination_filesystem=fs)
    uri = s3.uri("runs/again/sealed")
    with open_run(uri, cache_dir=cache) as run:  # the first run, cached
        (f,) = run.files
        first = segments.segment_list(f.h5)[0]
        before = f.h5[COLUMN][:]
    # the run recorded again: its first segment holds another return for its first fragment, in a file of the same
    # size (the value's bytes changed where HDF5 keeps them: the column is not compressed), named in its index
    target, rel = store.resolve(uri), segments.target_segment("worker-001", first["name"])
    local, index = tmp_path / "again.h5", tmp_path / "index.h5"
    data = bytearray(target.get_bytes(rel))
    local.write_bytes(data)
    with h5py.File(local, "r") as seg:
        column = seg[COLUMN]
        at, value, compression = column.id.get_chunk_info(0).byte_offset, column[0], column.compression
    assert compression is None and data[at:at + 8] == np.float64(value).tobytes()
    data[at:at + 8] = np.float64(value + 1000.0).tobytes()
    local.write_bytes(data)
    assert len(data) == first["size"]
    put = target.put(str(local), rel, replace=True)
    target.get("worker-001.h5", str(index))
    with h5py.File(index, "r+") as h5:
        listed = json.loads(h5.attrs["segments"])
        listed["segments"][0]["sha256"] = put["sha256"]
        h5.attrs["segments"] = json.dumps(listed)
    target.put(str(index), "worker-001.h5", replace=True)
    with open_run(uri, cache_dir=cache) as run:
        (f,) = run.files
        after = f.h5[COLUMN][:]
    assert after[0] == before[0] + 1000.0 and np.array_equal(after[1:], before[1:])


def test_an_index_whose_segment_is_gone_is_one_line_not_zeros(ray_session, tmp_path):
    """HDF5 reads a virtual dataset's missing source as fill values: the reader refuses instead, naming the file."""
    import shutil

    from rllib_recorder.errors import SchemaError

    algo = _config(str(tmp_path / "shared"), tmp_path / "staging", "gone", segment_s=0.3).build_algo()
    [algo.train() for _ in range(2)]
    algo.stop()
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "shared" / "gone", copy)
    (first,) = sorted(glob.glob(str(copy / "segments" / "worker-001" / "*.h5")))[:1]
    os.remove(first)
    with open_run(str(copy)) as run, pytest.raises(SchemaError) as info:
        run.num_env_steps
    assert "000000.h5 is missing" in str(info.value) and "\n" not in str(info.value)

    # a hostile index: a segment named to leave the run, and virtual datasets reading a file it does not name
    for change, said in (({"name": "../../evil.h5"}, "not a list of segment records"),
                         (None, "not one of its own segments")):
        hostile = tmp_path / f"hostile-{bool(change)}"
        shutil.copytree(tmp_path / "shared" / "gone", hostile)
        with h5py.File(hostile / "worker-001.h5", "r+") as h5:
            listed = json.loads(h5.attrs["segments"])
            if change:
                listed["segments"][0].update(change)
            else:
                del listed["segments"][0]
            h5.attrs["segments"] = json.dumps(listed)
        with open_run(str(hostile)) as run, pytest.raises(SchemaError) as info:
            run.num_env_steps
        assert said in str(info.value) and "\n" not in str(info.value), info.value


@pytest.mark.multinode
def test_a_node_removed_mid_run_loses_at_most_what_it_had_not_uploaded_and_verify_names_it(s3, tmp_path):
    """A node of a real ray.cluster_utils.Cluster leaves mid-run (as the autoscaler removes one) and its staging
    directory is deleted: every segment it had uploaded is at the target and verifies; the steps it held unsealed,
    or sealed but not yet uploaded, are named as lost with that node, and no more; the other runner, and the runner
    recreated on a new node, lose nothing."""
    with own_cluster_env() as env:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "node_loss_script.py"),
                               s3.uri("runs/cluster"), str(tmp_path / "staging")],
                              capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["restarts"] >= 1 and facts["sealed_before_loss"], facts
    with open_run(facts["uri"], cache_dir=str(tmp_path / "cache")) as run:
        assert run.manifest["lost_nodes"] == [facts["lost_node"]], (  # said whole: seen once with a second node
            run.manifest["lost_nodes"], facts, run.manifest.get("writer_nodes"), run.manifest.get("totals"),
            proc.stderr[-3000:])
        lost = next(f for f in run.files if os.path.basename(f.path) == facts["lost_stem"] + ".h5")
        names = [s["name"] for s in segments.segment_list(lost.h5)]
        assert names[:len(facts["sealed_before_loss"])] == facts["sealed_before_loss"]  # sealed before: all there
        others = [f for f in run.files if f is not lost]
        assert {f.worker_index for f in others} == {1, 2}  # runner 2, and runner 1 recreated on the new node
    from rllib_recorder.commands.verify import verify_report

    report = verify_report(str(tmp_path / "cache"))
    assert not report["problems"], report["problems"]
    named = [n for n in report["notes"] if "lost with its node" in n]
    assert len(named) == 1 and named[0].startswith(facts["lost_stem"] + "/"), report["notes"]
    lost_steps = int(named[0].split(": ")[1].split(" of ")[0])
    # the bound: at most what the lost node had not uploaded (its runner's steps by the env's own log, less the
    # steps at the target): its rows since its last seal, any sealed segment still waiting for its upload, and
    # what its spool held
    assert 0 < lost_steps <= facts["not_uploaded"], (lost_steps, facts)
    print(f"\nfigure: node loss: {lost_steps} steps lost with the node, of {facts['not_uploaded']} not uploaded "
          f"({facts['tail_steps']} unsealed, {facts['pending_steps']} sealed and waiting for their upload)")
    # the env's own log, per runner: runner 2 stored exactly; runner 1 (both incarnations) stored all but what
    # was lost with its node; and all of it RLlib's count
    logged = logged_steps(facts["step_log"])
    by_worker = {w: sum(n for (w2, _), n in logged.items() if w2 == w) for w in (1, 2)}
    with open_run(facts["uri"], cache_dir=str(tmp_path / "cache")) as run:
        stored = {w: sum(f.num_rows("default_agent") for f in run.files if f.worker_index == w) for w in (1, 2)}
    assert stored[2] == by_worker[2] and stored[1] + lost_steps == by_worker[1], (stored, by_worker, lost_steps)
    check_run(facts["uri"], allow_gaps=True, sampled=facts["sampled"], not_stored=lost_steps)


def test_a_sigkilled_driver_recording_to_s3_is_published_by_recover(s3, tmp_path, monkeypatch):
    """A user's script recording into s3:// with default settings is SIGKILLed with its local Ray at a random
    moment; 'rllib-recorder recover' on the node's staging directory commits the spools, seals and uploads
    everything, and the run at its URI holds every step the runners handed over, value by value."""
    import random
    import signal

    from click.testing import CliRunner

    from rllib_recorder.cli import main
    from tests.s3server import ACCESS_KEY, SECRET_KEY
    from tests.test_real_use import _progress, _start
    from tests.test_reliability import _session_pids

    proc = _start("loop", s3.uri("runs/killed"), str(tmp_path / "staging"))
    try:
        progress = _progress(proc, 2)
        assert len(progress) == 2, proc.stderr.read()[-2000:]
        time.sleep(random.uniform(0.0, 1.0))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        progress += [json.loads(line) for line in out.splitlines() if line.startswith("{")]  # printed, not read yet
        deadline = time.time() + 30
        while _session_pids(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
    staged = progress[-1]["run_dir"]
    assert staged.startswith(str(tmp_path / "staging"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)  # the manifest names the target without credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    result = CliRunner().invoke(main, ["recover", staged])  # a URI read from a recording alone sends nothing
    assert result.exit_code == 0 and "add --publish" in result.output, result.output
    assert glob.glob(os.path.join(staged, "*.h5")) or glob.glob(os.path.join(staged, ".segments", "*", "[0-9]*.h5"))
    result = CliRunner().invoke(main, ["recover", staged, "--publish"])
    assert result.exit_code == 0 and "published:" in result.output, result.output
    uri = s3.uri(f"runs/killed/{os.path.basename(staged)}")
    with open_run(uri, cache_dir=str(tmp_path / "cache")) as run:
        assert run.manifest["status"] == "recovered"
        assert run.num_env_steps >= progress[-1]["sampled"]
    rllib = progress[-1]["sampled"]  # and at most the train() the kill interrupted (400 steps)
    check_run(uri, statuses=("recovered",), sampled=(rllib, rllib + 400))
    assert not glob.glob(os.path.join(staged, ".segments", "*", "[0-9]*.h5"))  # all of it left the node


def test_a_writer_sigkilled_at_random_moments_while_it_seals_and_uploads_loses_and_repeats_nothing(ray_session, tmp_path):
    """Recording into a shared-file-system target (a local output_dir with staging_dir), sealing every 0.2 s, the writer actor is SIGKILLed three times at random moments of train(): mid-append,
    mid-seal, mid-upload or mid-index. Ray restarts it; it goes on from its staging directory (the live file, the
    sealed segments not yet published, the published records). At the target: every sampled step once, in order."""
    import random
    import signal
    import threading

    from rllib_recorder.commands.verify import verify_run
    from tests.test_recording import ppo
    from tests.test_reliability import _pid_of, _writer_actor

    config = ppo(runners=2).callbacks(RecorderCallback.configured(
        output_dir=str(tmp_path / "shared"), staging_dir=str(tmp_path / "staging"), run_name="killed-writer",
        segment_s=0.2, coalesce_s=0.05))
    algo = config.build_algo()
    results = [algo.train()]
    writer = _writer_actor(results[0]["recorder"]["run_dir"])
    rng, pids = random.Random(), []
    for _ in range(3):
        pid = _pid_of(writer)
        pids.append(pid)
        timer = threading.Timer(rng.uniform(0.05, 0.5), os.kill, (pid, signal.SIGKILL))
        timer.start()  # fires while train() below samples, appends, seals and uploads
        results.append(algo.train())
        timer.join()
        results.append(algo.train())
    algo.stop()
    assert len(set(pids)) == 3  # three incarnations were killed
    run_dir = str(tmp_path / "shared" / "killed-writer")
    sampled = _sampled(results[-1])
    counts = check_run(run_dir, sampled=sampled)  # every row, value by value: no gap, no duplicate, across segments
    with open_run(run_dir) as run:
        assert run.num_env_steps == sampled == counts["agent_steps"]
        assert sum(len(segments.segment_list(f.h5)) for f in run.files) >= 4
    assert verify_run(run_dir) == []


def test_a_tune_trial_retried_on_another_node_records_on_into_its_run_at_the_target(ray_session, tmp_path):
    """A Tune trial recording into durable storage fails (its env raises) and Tune retries it on a node that never
    staged the run (here: its staging directory deleted before the retry). The retry fetches the run's manifest and
    each runner's index from the target and records on: one run, two attempts, the stream's segments numbered on,
    nothing overwritten; every step of both attempts stored, but for the failed attempt's unsealed tail (if any),
    which verify names as an unexplained gap by RLlib's count of each attempt."""
    import shutil

    from ray import tune

    from rllib_recorder.read.accounting import accounts, check, unexplained_steps
    from tests.test_recording import ppo
    from tests.test_tune_attempts import FailOnceEnv  # noqa: F401 - registers the env "fail_once"

    staging = tmp_path / "staging"

    class NodeGone(tune.Callback):
        def on_trial_recover(self, iteration, trials, trial, **info):
            shutil.rmtree(staging, ignore_errors=True)

    config = ppo(env="fail_once", runners=0).environment("fail_once", env_config={
        "obs_kind": "vector", "marker": str(tmp_path / "failed"), "fail_at_episode": 60})  # in its 6th iteration
    config = config.callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "shared"),
                                                          staging_dir=str(staging), segment_s=0.2))
    results = tune.Tuner(config.algo_class, param_space=config, run_config=tune.RunConfig(
        name="retried", stop={"training_iteration": 8}, storage_path=str(tmp_path / "tune"), verbose=0,
        failure_config=tune.FailureConfig(max_failures=1), callbacks=[NodeGone(), counted := rllib_counts_callback()])
    ).fit()
    assert not results.errors and (tmp_path / "failed").exists()  # the env did raise, and Tune retried the trial
    (result,) = results
    run_dir = result.metrics["recorder"]["target"]
    assert run_dir.startswith(str(tmp_path / "shared" / "retried"))
    with open_run(run_dir) as run:
        attempts = run.manifest["attempts"]
        # Tune killed the failed attempt's process: its sealed segments were at the target, its tail went with the
        # deleted staging directory (as with a lost node); the retry recorded on from segment to segment
        assert [a["attempt"] for a in attempts] == [0, 1] and attempts[1]["status"] == "finished", attempts
        # the tail: the recorder's own accounts see it where counters of the failed attempt's sender reached the
        # target after those rows (a problem named for that sender), not where they went with the tail; RLlib's
        # count of each attempt always does: an unexplained gap of exactly RLlib's count less what is stored
        problems, _ = check(accounts(run.manifest, run.files), run.num_env_steps)
        retry = set(attempts[1]["senders"])  # the killed attempt never closed: its senders are the others
        assert all(p.split(":")[0] not in retry and "neither stored nor counted" in p for p in problems), problems
        gap = unexplained_steps(run.manifest, accounts(run.manifest, run.files))
        (f,) = run.files
        names = [s["name"] for s in segments.segment_list(f.h5)]
        assert names == [f"{i:06d}.h5" for i in range(len(names))] and len(names) >= 4  # numbered on, no gap
        assert len(set(f.batches()["sender_id"].tolist())) == 2  # both attempts' rows, in one stream
        # the retry began again (no checkpoint): RLlib's count is its own; the first attempt's sealed steps add to it
        assert run.num_env_steps > result.metrics["env_runners"]["num_env_steps_sampled_lifetime"] > 0
        lost = sum(sum(a.lost.values()) for a in accounts(run.manifest, run.files))
    # RLlib's count of both attempts, every iteration Tune got from either: stored, or named as not stored; and up
    # to one fragment (40 steps) more: the failed iteration's first sample, which reached the callback (and, sealed
    # in time, the target) before the env raised in its second, so that RLlib never counted it
    rllib = counted.sampled[result.metrics["trial_id"]]
    assert run.manifest["rllib_counts"]["env_steps_sampled"] == rllib  # both attempts' counts, at the target
    check_run(run_dir, sampled=(rllib, rllib + 40), not_stored=lost + gap, allow_gaps=True)
    if gap:  # a tail the failed attempt had not sealed (none, when its last seal came after its last sample)
        from rllib_recorder.commands.verify import verify_report

        assert any(f"unexplained gap: {gap} env steps" in p for p in verify_report(run_dir)["problems"])


def test_the_store_down_at_stop_ends_within_its_bound_in_one_line_and_recover_publish_completes_the_run(
        ray_session, s3, tmp_path, caplog, monkeypatch):
    """The store goes down before algo.stop(), with the store client's default retries: stop returns within
    ``stop_upload_timeout_s`` (plus the client's own timeouts on a request in flight), says once which command
    completes the run, and the manifest says so; once the store is back, that command completes it."""
    import logging
    import shlex

    from click.testing import CliRunner

    from rllib_recorder.cli import main
    from rllib_recorder.format.manifest import read_manifest

    algo = _config(s3.uri("runs/exp"), tmp_path / "staging", "down-at-stop", segment_s=0.3,
                   stop_upload_timeout_s=3.0).build_algo()
    try:
        algo.train()
        s3.stop()
        last = algo.train()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rllib_recorder"):
            algo.stop()
        took = time.monotonic() - started
    finally:
        if s3.proc is None:
            s3.start()
    staged = last["recorder"]["run_dir"]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("rllib_recorder") and r.levelno >= logging.WARNING]
    pending = read_manifest(staged)["publish_pending"]
    # stop gave up at its bound (stop_upload_timeout_s), not at the store's return: said once, and kept for recover;
    # how long it took is a figure for docs/RELIABILITY.md, not a threshold (a loaded machine stretches it)
    assert pending["waited_s"] == 3.0
    print(f"\nfigure: store down at stop: algo.stop() returned after {took:.1f} s (stop_upload_timeout_s=3)")
    assert len(said) == 1 and pending["command"] in said[0] and staged in said[0], said
    assert pending["segments"] >= 1 and pending["staging_dir"] == staged
    from tests.s3server import ACCESS_KEY, SECRET_KEY

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)  # the manifest names the target without credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    result = CliRunner().invoke(main, shlex.split(pending["command"])[1:])
    assert result.exit_code == 0 and "published:" in result.output, result.output
    uri = s3.uri(f"runs/exp/{os.path.basename(staged)}")
    with open_run(uri, cache_dir=str(tmp_path / "cache")) as run:
        assert run.manifest["status"] == "finished" and "publish_pending" not in run.manifest
        assert run.num_env_steps == _sampled(last)
    check_run(uri, sampled=_sampled(last))
    assert not glob.glob(os.path.join(staged, ".segments", "*", "[0-9]*.h5"))  # all of it left the node
