"""Tune runs a trial more than once in the same trial dir: it restarts a failed trial (``FailureConfig``), PBT pauses
a trial and resumes it from another's checkpoint, ``Tuner.restore`` continues an interrupted experiment. Each time
the recording continues in the trial's run: one run, one entry per attempt, earlier attempts' rows intact, every
sampled step stored. A relative ``output_dir`` is relative to where the user started the program."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ray import tune
from ray.tune.registry import register_env
from ray.tune.schedulers import PopulationBasedTraining

from rllib_recorder import RecorderCallback
from rllib_recorder.commands.verify import verify_report
from rllib_recorder.read.accounting import accounts
from rllib_recorder.read.run import open_run
from tests.envs import FailOnceEnv
from tests.helpers import communicate_or_kill
from tests.helpers import rllib_sampled, trial_results
from tests.test_real_use import _stored_all, figure
from tests.test_recording import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
register_env("fail_once", lambda cfg: FailOnceEnv(cfg))


def _attempts(run_dir: str) -> list[dict]:
    """The run's attempts, after checking that each stored every step its senders sampled."""
    with open_run(run_dir) as run:
        by_sender = {a.sender: a for a in accounts(run.manifest, run.files)}
        attempts = run.manifest["attempts"]
        assert [a["attempt"] for a in attempts] == list(range(len(attempts)))
        seen: set[str] = set()
        for attempt in attempts:
            assert attempt["status"] in ("finished", "interrupted", "recovered"), attempt
            assert attempt["started_at"] and attempt["finished_at"], attempt
            assert attempt["senders"] and not seen & set(attempt["senders"]), attempt  # its own senders
            seen |= set(attempt["senders"])
            for sender in attempt["senders"]:
                account = by_sender.get(sender)  # absent: it sampled nothing (a runner whose first sample raised)
                assert account is None or (account.known and account.stored == account.sampled > 0), account
        assert seen >= set(by_sender) and set(by_sender) & set(attempts[-1]["senders"])
    return attempts


def test_a_trial_restarted_after_its_env_raised_records_on_into_its_run(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the user started: a relative output_dir lands here, not in Ray's temp dir
    config = ppo(env="fail_once", runners=0).environment(
        "fail_once", env_config={"obs_kind": "vector", "marker": str(tmp_path / "failed")})
    config = config.callbacks(RecorderCallback.configured(output_dir="rec"))
    tuner = tune.Tuner(config.algo_class, param_space=config, run_config=tune.RunConfig(
        name="restarted", stop={"training_iteration": 3}, storage_path=str(tmp_path / "tune"), verbose=0,
        failure_config=tune.FailureConfig(max_failures=1)))
    results = tuner.fit()
    assert not results.errors and (tmp_path / "failed").exists()  # the env did raise, and Tune restarted it
    (result,) = results
    run_dir = result.metrics["recorder"]["run_dir"]
    assert run_dir == str(tmp_path / "rec" / "restarted" / os.path.basename(result.path))
    attempts = _attempts(run_dir)
    assert len(attempts) == 2, attempts
    # the restarted trial began again (no checkpoint): RLlib's count is the second attempt's; the first attempt's
    # sample() raised before it returned anything, so it adds nothing (its accounts were checked above)
    rllib = rllib_sampled(trial_results(result))
    stored = _stored_all(run_dir, sampled=rllib)
    figure("Tune trial restarted by FailureConfig", rllib, stored,
           f" over {len(attempts)} attempts (RLlib's count: the last attempt's)")
    assert stored == rllib > 0
    # one run (no second one for the restart), the experiment's index and its lock
    assert sorted(os.listdir(tmp_path / "rec" / "restarted")) == sorted(
        [os.path.basename(run_dir), "recorder_index.json", ".recorder_index.lock"])


@pytest.mark.slow
def test_pbt_pauses_and_resumes_trials_into_their_own_runs(ray_session, tmp_path):
    config = ppo(runners=0).callbacks(RecorderCallback.configured(output_dir=str(tmp_path / "rec")))
    config = config.training(lr=tune.grid_search([1e-5, 1e-3]))
    pbt = PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=1, synch=True,
                                  hyperparam_mutations={"lr": [1e-5, 1e-4, 1e-3]}, quantile_fraction=0.5)
    tuner = tune.Tuner(config.algo_class, param_space=config, tune_config=tune.TuneConfig(
        scheduler=pbt, metric="env_runners/num_env_steps_sampled_lifetime", mode="max", max_concurrent_trials=2),
        run_config=tune.RunConfig(name="pbt", stop={"training_iteration": 2}, storage_path=str(tmp_path / "tune"),
                                  verbose=0, checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1)))
    results = tuner.fit()
    assert not results.errors
    run_dirs = sorted(r.metrics["recorder"]["run_dir"] for r in results)
    assert len(set(run_dirs)) == 2
    attempts = [_attempts(d) for d in run_dirs]
    assert max(len(a) for a in attempts) >= 2, attempts  # PBT did pause and resume a trial
    for result, run_dir in zip(sorted(results, key=lambda r: r.metrics["recorder"]["run_dir"]), run_dirs):
        # RLlib's count per attempt: every iteration each attempt trained, as Tune logged them (a resumed attempt
        # goes on from a checkpoint, its own or, exploited, another trial's, with that one's lifetime count)
        rllib = sum(int(row["env_runners"]["num_env_steps_sampled"]) for row in trial_results(result))
        figure("PBT trial", rllib, _stored_all(run_dir, sampled=rllib), f" over {len(_attempts(run_dir))} attempts")
    shown = json.loads(open(os.path.join(os.path.dirname(run_dirs[0]), "recorder_index.json")).read())
    assert sorted(shown["runs"]) == [os.path.basename(d) for d in run_dirs]


def _tune_program(mode: str, cwd: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return subprocess.Popen([sys.executable, "-m", "tests.tune_program", mode, os.path.join(cwd, "tune")],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _results(proc: subprocess.Popen, timeout: float) -> tuple[list[dict], str]:
    out, err = communicate_or_kill(proc, timeout, "the Tune program")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.slow
def test_tuner_restore_of_an_interrupted_experiment_continues_its_runs(tmp_path):
    from tests.tune_program import ITERATIONS

    proc = _tune_program("fit", str(tmp_path))
    first = []
    while len(first) < 2:  # Ctrl-C once the trial has trained (and checkpointed) twice
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        if line.startswith("{"):
            first.append(json.loads(line))
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    rest, err = _results(proc, 180)
    interrupted = [r["iteration"] for r in first + rest if "iteration" in r]
    assert max(interrupted) < ITERATIONS, err[-3000:]
    run_dir = first[0]["run_dir"]
    assert run_dir == str(tmp_path / "rec" / "restorable" / os.path.basename(run_dir))

    restored, err = _results(_tune_program("restore", str(tmp_path)), 300)
    assert restored[-1] == {"errors": [], "iterations": [ITERATIONS]}, err[-3000:]
    assert {r["run_dir"] for r in restored if "run_dir" in r} == {run_dir}
    assert restored[0]["iteration"] <= max(interrupted) + 1  # it continued from a checkpoint, not from scratch
    attempts = _attempts(run_dir)
    assert len(attempts) == 2, attempts
    # RLlib's count per attempt: every iteration either attempt reported (the first attempt's iterations after its
    # last checkpoint were sampled and stored, then trained again by the second), plus at most the iteration
    # Ctrl-C interrupted, which RLlib never reported (train_batch_size 200)
    rllib = sum(int(r["sampled_this_iteration"]) for r in first + rest + restored if "sampled_this_iteration" in r)
    stored = _stored_all(run_dir, sampled=(rllib, rllib + 200))
    figure("Tuner.restore after Ctrl-C", rllib, stored, f" over {len(attempts)} attempts")
    assert stored >= restored[-2]["sampled"] > 0
    assert verify_report(run_dir)["problems"] == []
