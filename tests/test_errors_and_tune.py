"""Failure paths at the RLlib boundary, an asynchronous algorithm, and Tune trials: real runs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from ray import tune
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.callbacks.callbacks import RLlibCallback

from rllib_recorder import ConfigError, OutputDirError, RecorderCallback, RecorderConfig, RecorderError
from rllib_recorder.cli import main
from rllib_recorder.commands.verify import verify_report
from rllib_recorder.read.run import open_run
from tests.helpers import rllib_sampled, trial_results, with_callbacks
from tests.integrity import check_run
from tests.test_recording import ppo, record


class MangleEpisodeIds(RLlibCallback):
    """A user callback (runs before ours) that gives finished episodes ids the recorder cannot store."""

    def on_sample_end(self, *, samples, **kwargs):
        for episode in samples:
            if episode.is_done:
                episode.id_ = "x" * 50


def _manifest_totals(run_dir):
    with open(os.path.join(run_dir, "manifest.json")) as f:
        return json.load(f)["totals"]


def test_recorder_error_is_counted_and_never_kills_the_env_runner(ray_session, tmp_path):
    config = with_callbacks(ppo(runners=1), [MangleEpisodeIds, RecorderCallback.configured(output_dir=str(tmp_path))])
    algo = config.build_algo()
    results = [algo.train() for _ in range(2)]
    totals = algo.stop() or _manifest_totals(results[-1]["recorder"]["run_dir"])
    # the runner can't convert a sample holding such an id: counted as an error and as unconvertible steps
    assert totals["errors"] >= 1, totals
    assert results[-1]["env_runners"]["num_env_steps_sampled_lifetime"] >= 160  # the runner kept sampling
    faults = results[-1]["fault_tolerance"]
    assert faults["num_remote_worker_restarts"] == 0 and faults["num_healthy_workers"] == 1
    # every sampled step is counted as not stored, by cause (each sample had a mangled episode): no
    # unexplained gap, but a run with nothing stored is not sound
    report = verify_report(results[-1]["recorder"]["run_dir"])
    assert report["problems"] == ["no env steps are stored in this run"], report
    assert report["notes"] and all("could not be converted" in n for n in report["notes"]), report
    sender, = totals["senders"].values() if len(totals["senders"]) == 1 else [
        s for s in totals["senders"].values() if s["env_steps_sampled"]]
    assert sender["env_steps_unconvertible"] == sender["env_steps_sampled"] >= 160


def test_fail_on_error_stops_training_with_a_recorder_error(ray_session, tmp_path):
    recorder = RecorderCallback.configured(output_dir=str(tmp_path), fail_on_error=True, coalesce_rows=0)
    algo = with_callbacks(ppo(runners=1), [MangleEpisodeIds, recorder]).build_algo()
    with pytest.raises(RecorderError, match="fail_on_error=True"):
        for _ in range(3):
            algo.train()
    algo.stop()


@pytest.mark.parametrize("settings, message", [
    ({"num_writers": 0}, "num_writers=0: use at least one writer actor"),
    ({"backpressure": "wait"}, "backpressure='wait': choose one of block, drop"),
    ({"max_backlog_bytes": "4"}, "max_backlog_bytes='4': expected a value of type int"),
    ({"compression_level": 12}, "compression_level=12: gzip levels are 0-9"),
])
def test_invalid_settings_fail_at_config_time_naming_field_and_fix(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RecorderCallback.configured(output_dir=str(tmp_path), **settings)


def test_unknown_yaml_setting_names_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown recorder setting 'num_writer'; valid settings are: .*num_writers"):
        RecorderConfig.from_dict({"num_writer": 2})


def test_unwritable_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputDirError, match="is not writable.*output_dir="):
        RecorderCallback.configured(output_dir=str(blocker / "runs"))


def test_second_run_never_overwrites_the_first(ray_session, tmp_path):
    run_dir, results, _ = record(ppo(runners=1), tmp_path, iterations=1, run_name="fixed", coalesce_rows=0)
    before = {p: os.path.getmtime(os.path.join(run_dir, p)) for p in os.listdir(run_dir)}
    config = ppo(runners=1).callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "rec"), run_name="fixed"))
    with pytest.raises(OutputDirError, match="already holds a run; choose another run_name"):
        config.build_algo()
    assert {p: os.path.getmtime(os.path.join(run_dir, p)) for p in os.listdir(run_dir)} == before
    check_run(run_dir, sampled=rllib_sampled(results))


def test_asynchronous_appo_run_is_recorded_exactly_with_its_policy_lag(ray_session, tmp_path):
    config = (
        APPOConfig().environment("counting", env_config={"obs_kind": "vector"})
        .env_runners(num_env_runners=1, rollout_fragment_length=20)  # 2 CPUs: 1 env runner, the learner here
        .learners(num_learners=0)
        # weights reach the env runner every 3rd training step: the learner runs ahead meanwhile
        .training(train_batch_size_per_learner=40, broadcast_interval=3)
        .reporting(min_time_s_per_iteration=1)
        .callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "rec")))
    )
    algo = config.build_algo()
    results = []
    for _ in range(40):  # APPO's first samples take a few seconds to arrive on 2 CPUs
        result = algo.train()
        results.append(result)
        rates = [result["recorder"][f"{k}_steps_per_s"] for k in ("produced", "stored", "consumed")]
        if result["recorder"]["policy_lag_max"] > 0 and all(rate > 0 for rate in rates):
            break  # (an iteration of 1 s may see no chunk stored: the outbox coalesces up to 2 s)
    algo.stop()
    run_dir = result["recorder"]["run_dir"]
    assert result["recorder"]["learners_reporting"] == 1
    assert {k for k, v in result["recorder"].items() if k.endswith("_steps_per_s") and v > 0} == {
        "produced_steps_per_s", "stored_steps_per_s", "consumed_steps_per_s"}
    # RLlib's count, and at most the one sample in flight (max_requests_in_flight_per_env_runner=1, 20 steps) that
    # the runner returned before algo.stop() and RLlib never fetched: the recorder keeps what sample() returned
    sampled = rllib_sampled(results)
    counts = check_run(run_dir, sampled=(sampled, sampled + 20))
    with open_run(run_dir) as run:
        assert run.num_env_steps == run.manifest["totals"]["env_steps_stored"] == counts["agent_steps"] > 0
        assert run.manifest["totals"]["unacked_at_stop"] == 0 and run.manifest["totals"]["errors"] == 0
        f = run.files[0]
        lags = f.policy_lag("default_agent")
        learner = f.learner_versions("default_agent")
        acted = f.column("default_agent", "weights_seq_no", slice(0, len(lags)))
        np.testing.assert_array_equal(lags, learner - acted)
        assert lags.min() >= 0 and lags.max() > 0  # none negative, none unknown, some stale
        hist = {str(k): int((lags == k).sum()) for k in np.unique(lags)}
        assert run.manifest["totals"]["policy_lag_hist"] == hist

    runner = CliRunner()
    shown = runner.invoke(main, ["info", run_dir])
    assert shown.exit_code == 0, shown.output
    histogram = ", ".join(f"{k}: {v:,}" for k, v in hist.items())
    assert f"  histogram    {histogram}" in shown.output.splitlines(), shown.output
    rates = {line.split()[0]: line for line in shown.output.split("Rates (")[1].splitlines()[1:]}
    assert all("steps/s" in rates[k] for k in ("produced", "stored", "consumed")), shown.output
    summary = json.loads(runner.invoke(main, ["info", run_dir, "--json"]).output)
    assert summary["policy_lag"]["hist"] == hist and summary["policy_lag"]["unknown"] == 0
    assert summary["policy_lag"]["max"] == int(lags.max())
    for p in (50, 90, 99):
        assert summary["policy_lag"][f"p{p}"] == int(np.percentile(lags, p, method="inverted_cdf"))
    assert all(summary["rates"][k] > 0 for k in ("produced_steps_per_s", "stored_steps_per_s", "consumed_steps_per_s"))
    plotted = runner.invoke(main, ["plot", run_dir, "-o", str(tmp_path / "lag.png")])
    assert plotted.exit_code == 0, plotted.output
    assert f"policy lags { {int(k): v for k, v in hist.items()} }" in plotted.output
    assert (tmp_path / "lag.png").stat().st_size > 10_000


def test_two_tune_trials_get_separate_complete_runs(ray_session, tmp_path):
    config = ppo(runners=0).callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "rec"), coalesce_rows=0))
    config = config.training(lr=tune.grid_search([1e-4, 1e-3]))
    tuner = tune.Tuner(
        config.algo_class, param_space=config,
        run_config=tune.RunConfig(stop={"training_iteration": 2}, storage_path=str(tmp_path / "tune"), verbose=0),
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
    )
    results = tuner.fit()
    assert not results.errors
    run_dirs = sorted({r.metrics["recorder"]["run_dir"] for r in results})
    assert len(run_dirs) == 2
    # named like Tune's own folders: <output_dir>/<experiment>/<trial dir>
    trial_dirs = sorted(os.path.basename(r.path) for r in results)
    assert [os.path.basename(d) for d in run_dirs] == trial_dirs
    assert {os.path.dirname(d) for d in run_dirs} == {str(tmp_path / "rec" / os.path.basename(results.experiment_path))}
    experiment_dir = os.path.dirname(run_dirs[0])
    index = json.loads(open(os.path.join(experiment_dir, "recorder_index.json")).read())
    assert sorted(index["runs"]) == [os.path.basename(d) for d in run_dirs]
    trial_ids = sorted(r.metrics["trial_id"] for r in results)
    assert sorted(e["trial_id"] for e in index["runs"].values()) == trial_ids
    sampled_by_run = {r.metrics["recorder"]["run_dir"]: rllib_sampled(trial_results(r)) for r in results}
    for run_dir in run_dirs:
        counts = check_run(run_dir, sampled=sampled_by_run[run_dir])  # RLlib's count of the trial
        with open_run(run_dir) as run:
            assert [f.worker_index for f in run.files] == [0]  # the local env runner samples
            entry = index["runs"][os.path.basename(run_dir)]
            assert entry["status"] == "finished"
            assert entry["env_steps"] == run.num_env_steps == counts["agent_steps"] > 0
            assert entry["trial"] == os.path.basename(run_dir) and entry["trial_name"] in run_dir

    for folder in (experiment_dir, str(tmp_path / "rec")):  # the experiment, and the output dir above it
        shown = CliRunner().invoke(main, ["info", folder])
        assert shown.exit_code == 0, shown.output
        lines = shown.output.splitlines()
        total = 0
        for run_dir in run_dirs:
            with open_run(run_dir) as run:
                row = next(line for line in lines if os.path.basename(run_dir) in line).split()
                row = row[row.index(os.path.basename(run_dir)) + 1:]
                steps = run.num_env_steps
                assert row[:2] == ["finished", f"{steps:,}"], shown.output
                assert row[6] == "0/0/0", shown.output  # after the size (2 tokens): PPO lag p50/p99/max
                total += steps
        assert lines[0].startswith(f"{folder}/: 2 runs, {total:,} env steps, "), shown.output
        assert lines[0].endswith("(2 finished)")
    assert f"{os.path.basename(experiment_dir)}/  (Tune experiment, 2 runs, {total:,} env steps" in shown.output
    summary = json.loads(CliRunner().invoke(main, ["info", experiment_dir, "--json"]).output)
    assert summary["totals"]["runs"] == 2 and summary["totals"]["env_steps"] == total
