"""Runs end the way users' runs end: the user's script as a child process (no ``algo.stop()``, an exception,
``ray.shutdown()`` first, Ctrl-C, SIGTERM, SIGKILL of the driver) and env runners SIGKILLed while they sample,
with the default settings, at random moments. Every case checks that each step an env runner's ``sample()``
returned is stored: the accounting's ``all N sampled env steps stored`` against RLlib's own count."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from rllib_recorder import RecorderCallback
from rllib_recorder.cli import main
from rllib_recorder.commands.verify import verify_report
from rllib_recorder.format import liveness
from rllib_recorder.format.manifest import read_manifest
from tests.helpers import communicate_or_kill
from tests.integrity import check_run
from tests.test_recording import ppo
from tests.test_reliability import _session_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_STORED = re.compile(r"all (\d+) sampled env steps stored")


def _start(mode: str, out: str, *more: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return subprocess.Popen([sys.executable, "-m", "tests.user_program", mode, out, *more], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _progress(proc: subprocess.Popen, lines: int | None = None) -> list[dict]:
    """The child's progress lines: the first ``lines`` of them, or all until it exits."""
    out = []
    while lines is None or len(out) < lines:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def figure(case: str, sampled: int, stored: int, extra: str = "") -> None:
    """One measured figure for docs/RELIABILITY.md's table (``pytest -s -n 0`` shows them)."""
    print(f"\nfigure: {case}: RLlib sampled {sampled}, stored {stored}{extra}")


# Env steps of one train() of tests/user_program.py (train_batch_size): what a run killed inside a train() may
# hold beyond RLlib's count of the train() calls that returned.
ITERATION_STEPS = 400


def _stored_all(run_dir: str, sampled: int | tuple[int, int]) -> int:
    """Verify the run as a user would, and check every row against the env's code and the count against RLlib's
    (``sampled``: exact, or a (low, high) range); returns N of 'all N sampled env steps stored'."""
    result = CliRunner().invoke(main, ["verify", run_dir])
    assert result.exit_code == 0, result.output
    found = ALL_STORED.search(result.output)
    assert found, result.output
    check_run(run_dir, statuses=("finished", "interrupted", "recovered"), sampled=sampled)
    return int(found.group(1))


def _wait(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = communicate_or_kill(proc, timeout, "the user's program")
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("mode, status, ended_by", [
    ("end", "finished", "the program ended without algo.stop()"),
    ("raise", "interrupted", "uncaught RuntimeError: a bug in the user's loop"),
    ("shutdown", "finished", "ray.shutdown() before algo.stop()"),
])
def test_a_script_that_never_stops_its_algorithm_stores_every_sampled_step(tmp_path, mode, status, ended_by):
    proc = _start(mode, str(tmp_path / "rec"))
    progress = _progress(proc)
    code, err = _wait(proc)
    assert (code != 0) == (mode == "raise"), err[-2000:]
    run_dir = progress[-1]["run_dir"]
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["ended_by"]) == (status, ended_by)
    # nothing sampled after the last train(): stored is exactly what RLlib sampled and trained on
    stored = _stored_all(run_dir, sampled=progress[-1]["sampled"])
    figure(f"script {mode}", progress[-1]["sampled"], stored)
    assert stored == progress[-1]["sampled"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, ended_by", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_or_sigterm_at_a_random_moment_stores_every_sampled_step(tmp_path, signum, ended_by):
    proc = _start("loop", str(tmp_path / "rec"))
    try:
        progress = _progress(proc, 2)
        assert len(progress) == 2, proc.stderr.read()[-2000:]
        time.sleep(random.uniform(0.0, 1.0))  # inside train(): runners sampling, writers committing
    finally:
        proc.send_signal(signum)
    progress += _progress(proc)
    _wait(proc)
    run_dir = progress[-1]["run_dir"]
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["ended_by"]) == ("interrupted", ended_by)
    rllib = progress[-1]["sampled"]  # the train() the signal interrupted: stored, never counted by RLlib
    stored = _stored_all(run_dir, sampled=(rllib, rllib + ITERATION_STEPS))
    figure(ended_by, progress[-1]["sampled"], stored, " (RLlib's count is of the last finished train())")
    assert stored >= progress[-1]["sampled"]


@pytest.mark.slow
def test_a_sigkilled_driver_loses_nothing_its_runners_handed_over_once_recovered(tmp_path):
    proc = _start("loop", str(tmp_path / "rec"))
    try:
        progress = _progress(proc, 2)
        assert len(progress) == 2, proc.stderr.read()[-2000:]
        time.sleep(random.uniform(0.0, 1.0))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray cluster it started
        out, _ = proc.communicate()
        progress += [json.loads(line) for line in out.splitlines() if line.startswith("{")]  # printed, not read yet
        deadline = time.time() + 30
        while _session_pids(proc.pid) and time.time() < deadline:  # Ray's processes follow within seconds
            time.sleep(0.5)
    run_dir = progress[-1]["run_dir"]
    assert read_manifest(run_dir)["status"] == "running"
    result = CliRunner().invoke(main, ["recover", run_dir])
    assert result.exit_code == 0, result.output
    rllib = progress[-1]["sampled"]
    stored = _stored_all(run_dir, sampled=(rllib, rllib + ITERATION_STEPS))
    recovery = read_manifest(run_dir)["recovery"]
    figure("driver SIGKILL + recover", progress[-1]["sampled"], stored,
           f", of them {recovery.get('spool_env_steps_committed', 0)} committed from the spool by recover")
    assert stored >= progress[-1]["sampled"]


@pytest.mark.slow
def test_a_live_run_reads_as_recording_and_recover_refuses_it_untouched(ray_session, tmp_path):
    algo = ppo(runners=1).callbacks(RecorderCallback.configured(output_dir=str(tmp_path))).build_algo()
    try:
        run_dir = [algo.train() for _ in range(2)][-1]["recorder"]["run_dir"]
        before = sorted(os.listdir(run_dir))  # the writer itself may still commit: names, not times
        runner = CliRunner()
        result = runner.invoke(main, ["recover", run_dir])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "is recording (its driver (pid" in result.output and "let it finish" in result.output
        assert sorted(os.listdir(run_dir)) == before and read_manifest(run_dir)["status"] == "running"
        result = runner.invoke(main, ["verify", run_dir])
        assert result.exit_code == 0 and "recording now" in result.output, result.output
        result = runner.invoke(main, ["info", run_dir])
        assert result.exit_code == 0 and "recording (its driver" in result.output, result.output
    finally:
        algo.stop()
    assert "all " in verify_report(run_dir)["summary"]


def _command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``rllib-recorder ARGS`` as a real process (this tree first on PYTHONPATH, as conftest set it)."""
    return subprocess.run([shutil.which("rllib-recorder") or "rllib-recorder", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_recover_run_at_once_after_the_driver_alone_is_sigkilled_waits_for_ray_then_stores_every_step(tmp_path):
    """The notebook kernel's death: only the driver is SIGKILLed; Ray ends its writers and runners by itself a few
    seconds later. ``recover`` run at once says so in one line, waits for them and recovers; while the driver
    ran, the same command refused with today's advice."""
    proc = _start("loop", str(tmp_path / "rec"))
    try:
        progress = _progress(proc, 1)
        assert len(progress) == 1, proc.stderr.read()[-2000:]
        run_dir = progress[-1]["run_dir"]
        live = _command("recover", run_dir)
        assert live.returncode == 2 and live.stderr.count("\n") == 1, live.stderr
        assert "is recording (its driver (pid" in live.stderr and "let it finish, or stop it first" in live.stderr
        assert read_manifest(run_dir)["status"] == "running"
        progress += _progress(proc, 1)
        time.sleep(random.uniform(0.0, 1.5))  # between train() calls or inside one
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone: Ray's own processes are left to end themselves
        proc.wait()
        killed_at = time.monotonic()
        running = liveness.run_processes(run_dir)
        recovered = _command("recover", run_dir)
        recover_s = time.monotonic() - killed_at
    finally:
        for pid in [proc.pid] * (proc.poll() is None) + _session_pids(proc.pid):  # the rest of its Ray cluster
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        progress += _progress(proc)  # what it printed before the kill
    assert running, "the premise: the driver's writers still ran when recover started"
    assert recovered.returncode == 0, recovered.stderr
    waited = [line for line in recovered.stderr.splitlines() if "has died; waiting up to 30 s for Ray to end" in line]
    assert len(waited) == 1 and recovered.stderr.strip() == waited[0], recovered.stderr
    verified = _command("verify", run_dir)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    stored = int(ALL_STORED.search(verified.stdout).group(1))
    sampled = progress[-1]["sampled"]  # RLlib's count after the last train() that returned
    check_run(run_dir, statuses=("recovered",), sampled=(sampled, sampled + ITERATION_STEPS))  # every row too
    figure("driver alone SIGKILLed, recover at once", sampled, stored,
           f" ({waited[0].split('; ')[1]}; recover ended {recover_s:.1f} s after the kill)")
    # more only by the train() the kill interrupted (train_batch_size 400), which RLlib never counted
    assert sampled <= stored <= sampled + 400
