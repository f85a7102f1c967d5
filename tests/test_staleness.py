"""Policy lag, rates and the experiment index: pure code, real files, no Ray."""

import json
import multiprocessing
import os

import numpy as np

from rllib_recorder.commands.info import stored_rates
from rllib_recorder.format import datasets
from rllib_recorder.format.index import INDEX_NAME, read_index, rebuild_index
from rllib_recorder.format.lag import chunk_learner_version, lag_summary, step_lags
from rllib_recorder.format.manifest import write_manifest
from rllib_recorder.read.worker_file import WorkerFile
from rllib_recorder.record.convert import episodes_to_chunk
from rllib_recorder.service.metrics import interval_rates
from rllib_recorder.service.writer import RecordingWriter
from tests.helpers import make_episode, update_index_many


def test_step_lags_mark_unknown_versions_with_minus_one():
    lags = step_lags(np.array([5, 5, -1, 7]), np.array([5, 3, 2, -1]))
    assert lags.tolist() == [0, 2, -1, -1]


def test_a_chunk_learner_version_is_never_below_its_behaviour_versions():
    assert chunk_learner_version(4, np.array([2, 3])) == 4
    assert chunk_learner_version(4, np.array([5, 6, -1])) == 6  # the learner's report came late
    assert chunk_learner_version(-1, np.array([5])) == -1  # unknown stays unknown
    assert chunk_learner_version(3, np.array([-1, -1])) == 3


def test_lag_summary_gives_percentiles_of_the_histogram():
    summary = lag_summary({0: 50, 1: 40, 3: 9, 7: 1, -1: 5})
    assert summary["hist"] == {"0": 50, "1": 40, "3": 9, "7": 1}
    assert (summary["p50"], summary["p90"], summary["p99"], summary["max"]) == (0, 1, 3, 7)
    assert summary["steps"] == 100 and summary["unknown"] == 5
    assert summary["mean"] == (40 + 27 + 7) / 100
    assert lag_summary({-1: 3}) == {"steps": 0, "unknown": 3, "hist": {}, "mean": None, "max": None,
                                    "p50": None, "p90": None, "p99": None}


def test_rates_from_the_batch_index_and_between_results():
    batches = {"seq": np.arange(3), "env_steps": np.array([100, 100, 100]),
               "sampled_at_s": np.array([10.0, 11.0, 12.0]), "written_at_s": np.array([10.5, 11.5, 13.0])}
    rates = stored_rates([batches])
    assert rates["produced_steps_per_s"] == 300 / 2.0 and rates["stored_steps_per_s"] == 300 / 3.0
    assert rates["write_delay_s_p50"] == 0.5 and rates["write_delay_s_max"] == 1.0
    assert stored_rates([batches], steps_sampled=400)["produced_steps_per_s"] == 200.0
    assert interval_rates((0.0, 0, 0, 0), (2.0, 100, 80, 60)) == {
        "produced_steps_per_s": 50.0, "stored_steps_per_s": 40.0, "consumed_steps_per_s": 30.0}
    assert interval_rates(None, (2.0, 100, 80, 60)) == {}


def test_writer_stores_the_learner_version_finished_before_the_sample(tmp_path):
    writer = RecordingWriter(str(tmp_path), "run-1", datasets.StorageOptions())
    writer.set_learner_version(0, at_s=100.0)
    writer.set_learner_version(1, at_s=200.0)
    writer.set_learner_version(1, at_s=250.0)  # a second learner reporting the same version
    writer.set_learner_version(0, at_s=300.0)  # older versions never go back in time
    assert [writer.learner_version_at(t) for t in (50.0, 100.0, 199.9, 200.0, 400.0)] == [-1, 0, 0, 1, 1]
    for seq, (version, at_s) in enumerate([(0, 150.0), (0, 210.0), (2, 220.0)]):
        chunk = episodes_to_chunk([make_episode(2, t_started=2 * seq, eps_id="e", version=version)], sampled_at_s=at_s)
        writer.append(1, False, b"s" * 32, seq, chunk)
    writer.close()
    f = WorkerFile(str(tmp_path / "worker-001.h5"))
    # sampled before version 1 was finished: lag 0; after: 1; acted with version 2 (report late): 0
    assert f.batches()["learner_version"].tolist() == [0, 1, 2]
    assert f.policy_lag("default_agent").tolist() == [0, 0, 1, 1, 0, 0]
    assert f.learner_versions("default_agent").tolist() == [0, 0, 1, 1, 2, 2]
    assert f.episode("e", "default_agent").policy_lag.tolist() == [0, 0, 1, 1, 0, 0]
    f.close()


def test_index_keeps_every_concurrent_update(tmp_path):
    names = [f"trial_{i}" for i in range(4)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(update_index_many, [(str(tmp_path), name, 25) for name in names])
    runs = read_index(str(tmp_path))["runs"]
    assert sorted(runs) == names
    assert all(runs[n] == {"run_dir": n, "status": "finished", "env_steps": 25} for n in names)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_index_is_rebuilt_from_the_manifests(tmp_path):
    for i, status in enumerate(["finished", "running"]):
        run_dir = tmp_path / f"trial_{i}"
        run_dir.mkdir()
        write_manifest(str(run_dir), {"format": "rllib_recorder", "status": status, "trial": f"trial_{i}",
                                      "trial_id": f"id{i}", "run_id": f"r{i}", "totals": {"env_steps_stored": 10 * i}})
    (tmp_path / "not-a-run").mkdir()
    index = rebuild_index(str(tmp_path))
    assert json.loads((tmp_path / INDEX_NAME).read_text())["runs"] == index["runs"]
    assert sorted(index["runs"]) == ["trial_0", "trial_1"]
    assert index["runs"]["trial_1"]["status"] == "running" and index["runs"]["trial_1"]["env_steps"] == 10
    assert index["runs"]["trial_0"]["trial_id"] == "id0"
