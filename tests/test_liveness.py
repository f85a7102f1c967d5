"""Whether a run still records, and recover's wait for a dead driver's processes: real processes of this machine
(a child that ended, a child that runs), an injected clock and Ray job state; no Ray cluster, no sleeping."""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys

import pytest

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import liveness
from rllib_recorder.format.liveness import HEARTBEAT_NAME, OWNER_NAME, process_start
from rllib_recorder.service.recover import wait_for_the_dead


class Clock:
    def __init__(self, on_sleep=lambda: None) -> None:
        self.now, self.slept, self.on_sleep = 0.0, 0, on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1
        self.on_sleep()


@pytest.fixture
def child():
    """A running child process (a stand-in for a writer or an env runner), killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _identity(pid: int, host: str | None = None) -> dict:
    return {"host": host or os.uname().nodename, "pid": pid, "started": process_start(pid)}


def _ended_process() -> dict:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = _identity(proc.pid)
    proc.communicate(b"")
    return identity


def _run(tmp_path, driver: dict, writer: dict | None = None, runner: dict | None = None, **fields) -> tuple[str, dict]:
    run_dir = str(tmp_path / "run")
    stem = os.path.join(run_dir, ".spool", "worker-001")
    os.makedirs(os.path.join(stem, "ab" * 8))
    if writer is not None:
        with open(os.path.join(stem, HEARTBEAT_NAME), "w") as f:
            json.dump(writer, f)
    if runner is not None:
        with open(os.path.join(stem, "ab" * 8, OWNER_NAME), "w") as f:
            json.dump(runner, f)
    manifest = {"format": "rllib_recorder", "status": "running", "driver_host": driver["host"],
                "driver_pid": driver["pid"], "driver_started": driver["started"], **fields}
    return run_dir, manifest


def test_a_dead_drivers_live_writer_is_waited_for_in_one_line_then_recover_goes_on(tmp_path, child):
    run_dir, manifest = _run(tmp_path, _ended_process(), writer=_identity(child.pid))
    assert "its driver has died" in liveness.recording_now(run_dir, manifest)
    said = []
    clock = Clock(on_sleep=lambda: clock.slept == 3 and (child.kill(), child.wait()))  # Ray ends it
    assert wait_for_the_dead(run_dir, manifest, said.append, clock=clock, sleep=clock.sleep)
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"its driver (pid {manifest['driver_pid']} on" in said[0] and "has died; waiting up to 30 s" in said[0]
    assert f"writer pid {child.pid}" in said[0]
    assert clock.slept == 3 and liveness.recording_now(run_dir, manifest) is None


def test_a_dead_drivers_env_runner_is_waited_for_too(tmp_path, child):
    run_dir, manifest = _run(tmp_path, _ended_process(), runner=_identity(child.pid))
    said = []
    clock = Clock(on_sleep=lambda: (child.kill(), child.wait()))
    wait_for_the_dead(run_dir, manifest, said.append, clock=clock, sleep=clock.sleep)
    assert f"env runner pid {child.pid}" in said[0] and clock.slept == 1


def test_processes_that_outlive_the_bound_are_named_with_the_fix_and_nothing_is_touched(tmp_path, child):
    run_dir, manifest = _run(tmp_path, _ended_process(), writer=_identity(child.pid))
    clock = Clock()
    with pytest.raises(SchemaError, match=rf"its driver has died, but its writer pid {child.pid} still ran 30 s "
                                          rf"later; end them \(kill {child.pid}, or 'ray stop'"):
        wait_for_the_dead(run_dir, manifest, lambda line: None, clock=clock, sleep=clock.sleep)
    assert 30 <= clock.now < 31


def test_a_live_driver_is_refused_with_the_advice_of_today(tmp_path):
    run_dir, manifest = _run(tmp_path, _identity(os.getpid()))
    with pytest.raises(SchemaError, match=r"is recording \(its driver \(pid \d+ on .*\) is running\); recover only "
                                          "a run whose driver has died: let it finish, or stop it first"):
        wait_for_the_dead(run_dir, manifest, pytest.fail)


def test_a_reused_pid_is_not_the_driver(tmp_path):
    me = _identity(os.getpid())
    run_dir, manifest = _run(tmp_path, {**me, "started": me["started"] + "1"})  # another process had this pid
    assert liveness.driver_alive(manifest) is False
    assert not wait_for_the_dead(run_dir, manifest, pytest.fail)  # nothing runs: nothing to wait for


def test_off_the_drivers_host_its_ray_job_decides_else_the_heartbeat_refuses(tmp_path, child):
    elsewhere = {"host": "another-host", "pid": 4242, "started": "boot:1"}
    run_dir, manifest = _run(tmp_path, elsewhere, writer=_identity(child.pid))
    with pytest.raises(SchemaError, match=r"is recording \(a writer of it was alive \d+ s ago\); recover only"):
        wait_for_the_dead(run_dir, manifest, pytest.fail, ask_ray=lambda m: None)  # Ray can't tell
    with pytest.raises(SchemaError, match=r"is recording \(its driver \(pid 4242 on another-host\) is running\)"):
        wait_for_the_dead(run_dir, manifest, pytest.fail, ask_ray=lambda m: True)  # its job runs
    said = []
    clock = Clock(on_sleep=lambda: (child.kill(), child.wait()))
    wait_for_the_dead(run_dir, manifest, said.append, clock=clock, sleep=clock.sleep, ask_ray=lambda m: False)
    assert "pid 4242 on another-host) has died" in said[0]


def test_ray_is_asked_only_about_the_cluster_this_environment_names(monkeypatch):
    asked = []
    monkeypatch.setattr("rllib_recorder._rllib_compat.ray_job_dead", lambda gcs, job: asked.append((gcs, job)) or True)
    manifest = {"driver_host": "another-host", "driver_job_id": "01000000", "ray_gcs_address": "10.0.0.1:6379"}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert liveness.driver_alive(manifest) is None and asked == []  # another cluster: never contacted
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert liveness.driver_alive(manifest) is False and asked == [("10.0.0.1:6379", "01000000")]
    assert liveness.driver_alive({**manifest, "driver_actor_id": "ab" * 8}) is False  # a dead job: dead trial too
    monkeypatch.setattr("rllib_recorder._rllib_compat.ray_job_dead", lambda gcs, job: False)
    assert liveness.driver_alive(manifest) is True
    assert liveness.driver_alive({**manifest, "driver_actor_id": "ab" * 8}) is None  # a Tune trial may have died


def test_an_unreachable_gcs_answers_none_at_once():
    from rllib_recorder._rllib_compat import ray_job_dead

    assert ray_job_dead("127.0.0.1:1", "01000000") is None  # refused: the 40 s wait of GcsClient is never entered


def test_a_restarted_writer_names_itself_in_the_heartbeat(tmp_path):
    from rllib_recorder.service.spool_reader import touch_heartbeats

    root = tmp_path / "spool"
    (root / "worker-001").mkdir(parents=True)
    (root / "worker-001" / HEARTBEAT_NAME).write_text(json.dumps(_ended_process()))  # the killed writer's
    touch_heartbeats(str(root), {"worker-001"}, 1.0, claimed := set())
    assert json.loads((root / "worker-001" / HEARTBEAT_NAME).read_text())["pid"] == os.getpid()
    assert claimed == {"worker-001"}


def test_the_manifest_names_the_drivers_ray_job_and_the_gcs_says_whether_it_ended(ray_session):
    from rllib_recorder._rllib_compat import ray_job_dead
    from rllib_recorder.format.manifest import check_manifest
    from rllib_recorder.service.run_dir import driver_identity

    identity = driver_identity()
    context = ray_session.get_runtime_context()
    assert identity["driver_job_id"] == context.get_job_id() and identity["ray_gcs_address"] == context.gcs_address
    assert identity["driver_pid"] == os.getpid() and identity["driver_actor_id"] is None
    check_manifest({"format": "rllib_recorder", **identity}, "manifest.json")
    assert ray_job_dead(context.gcs_address, context.get_job_id()) is False  # this session's job runs
    assert ray_job_dead(context.gcs_address, "7f000000") is None  # a job this cluster never had


def test_a_writer_serving_two_spools_is_one_process_with_its_youngest_heartbeat(tmp_path, child):
    run_dir, manifest = _run(tmp_path, _ended_process(), writer=_identity(child.pid))
    second = os.path.join(run_dir, ".spool", "worker-002", HEARTBEAT_NAME)
    os.makedirs(os.path.dirname(second))
    with open(second, "w") as f:
        json.dump(_identity(child.pid), f)
    first = os.path.join(run_dir, ".spool", "worker-001", HEARTBEAT_NAME)
    os.utime(first, (os.path.getmtime(second) - 5,) * 2)
    (writer,) = liveness.run_processes(run_dir)
    older = time.time() - os.path.getmtime(first)  # the older heartbeat's age, now
    assert writer.pid == child.pid and writer.age_s < older  # the youngest heartbeat names the process
