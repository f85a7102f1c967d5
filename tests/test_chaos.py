"""Chaos with RLlib's defaults: env runners SIGKILLed at random moments, between ``train()`` calls and during
``sample()``, writers killed too, with no ``fault_tolerance()`` call, on both API stacks and multi-agent.

RLlib 2.60 creates its env runners with Ray's ``max_restarts``: a runner killed while the learner updates is
restarted by Ray before RLlib's next call, and RLlib never learns of it (``num_remote_worker_restarts`` stays 0).
A kill during ``sample()`` is one RLlib notices. Either way every step RLlib got back must be stored exactly once
(every row checked against the env's code), its count checked against RLlib's own, and ``verify`` clean.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import ray

from rllib_recorder import RecorderCallback
from rllib_recorder.commands.verify import verify_report
from rllib_recorder.format.manifest import read_manifest
from rllib_recorder.read.run import open_run
from rllib_recorder.service.pool import writer_name
from tests.helpers import rllib_sampled as rllib_sampled_of
from tests.integrity import check_run
from tests.test_recording import ppo

CASES = {
    "new stack": {},
    "new stack, multi-agent": {"env": "counting_ma", "multi_agent": True},
    "old stack": {"old_stack": True},
}


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def _runner_pids(algo, dead=(), timeout: float = 60.0) -> dict[int, int]:
    """Each remote env runner's pid, from Ray's actor table (RLlib's own call skips runners it has taken out of
    service, which may be all of them just after a kill), once every runner is alive. Ray's table may still name a
    process just killed as alive: a pid in ``dead`` or no longer running is waited out."""
    from ray._private import state

    deadline = time.time() + timeout
    while time.time() < deadline:
        infos = {i: state.actors(a._actor_id.hex()) for i, a in algo.env_runner_group._worker_manager.actors().items()}
        if all(info.get("State") == "ALIVE" and info.get("Pid") and info["Pid"] not in dead and _alive(info["Pid"])
               for info in infos.values()):
            return {i: int(info["Pid"]) for i, info in infos.items()}
        time.sleep(0.2)
    raise AssertionError(f"env runners not alive within {timeout} s: {infos}")


def _actor_of(algo, index: int):
    return algo.env_runner_group._worker_manager.actors()[index]


def _await_restart(actor, old_pid: int, timeout: float = 60.0) -> int:
    """Waits until Ray has the actor alive again in a new process (as it is after a learner update of some
    seconds, before RLlib's next call); returns the new pid."""
    from ray._private import state

    deadline = time.time() + timeout
    while time.time() < deadline:
        info = state.actors(actor._actor_id.hex())
        if info.get("State") == "ALIVE" and info.get("Pid") not in (None, 0, old_pid):
            return int(info["Pid"])
        time.sleep(0.2)
    raise AssertionError(f"Ray did not restart the env runner within {timeout} s")


def _writer_pids(run_dir: str) -> list[int]:
    run_id = read_manifest(run_dir)["run_id"]
    namespace = ray.get_runtime_context().namespace
    writer = ray.get_actor(writer_name(run_id, 0), namespace=namespace)
    return [ray.get(writer.__ray_call__.remote(lambda self: os.getpid()), timeout=60)]


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.compat) if c == "new stack" else c
                                  for c in sorted(CASES)])
def test_env_runners_and_writers_killed_at_random_moments_with_rllib_defaults_lose_nothing(ray_session, tmp_path,
                                                                                          case):
    multi_agent = CASES[case].get("multi_agent", False)
    algo = ppo(runners=2, **CASES[case]).callbacks(RecorderCallback.configured(output_dir=str(tmp_path))) \
        .build_algo()
    rng = random.Random()
    faults = ["between", "during", rng.choice(["between", "during"]), "writer"]
    rng.shuffle(faults)
    results, killed = [algo.train()], []  # killed: (worker index, pid) of each runner kill
    run_dir = results[0]["recorder"]["run_dir"]
    try:
        for fault in faults:
            pids = _runner_pids(algo, dead={pid for _, pid in killed})
            index = rng.choice(sorted(pids))
            if fault == "between":  # the learner's update outlasts Ray's restart: RLlib never notices
                time.sleep(rng.uniform(0.0, 0.5))
                os.kill(pids[index], signal.SIGKILL)
                killed.append((index, pids[index]))
                _await_restart(_actor_of(algo, index), pids[index])
                results.append(algo.train())
                continue
            victim = pids[index] if fault == "during" else rng.choice(_writer_pids(run_dir))
            timer = threading.Timer(rng.uniform(0.05, 0.8), os.kill, (victim, signal.SIGKILL))
            timer.start()  # fires while train() below samples (or its writer commits)
            results.append(algo.train())
            timer.join()
            if fault == "during":
                killed.append((index, victim))
        for _ in range(8):  # until every runner RLlib lost is back and has sampled again
            results.append(algo.train())
            healthy = results[-1].get("fault_tolerance", {}).get("num_healthy_workers", 2) == 2
            if healthy and set(_runner_pids(algo).values()).isdisjoint(pid for _, pid in killed):
                break
        results.append(algo.train())  # every runner samples once more after the last restart
    finally:
        algo.stop()

    rllib_sampled = rllib_sampled_of(results)  # RLlib's own count, on either stack
    # every row against the env's code (no gap, no duplicate), every step RLlib counted, and at most the sample a
    # runner killed inside sample() returned to its callback (40 steps) before RLlib could get it back
    during = sum(1 for fault in faults if fault == "during")
    counts = check_run(run_dir, multi_agent=multi_agent, sampled=(rllib_sampled, rllib_sampled + 40 * during))
    report = verify_report(run_dir)
    assert report["problems"] == [] and report["notes"] == [], report
    with open_run(run_dir) as run:
        stored = run.num_env_steps
        manifest = run.manifest
        newest_sender_steps = {}
        for f in run.files:
            batches = f.batches()  # in commit order: the last row's sender is the newest incarnation
            last = batches["sender_id"][-1]
            newest_sender_steps[f.worker_index] = int(batches["env_steps"][batches["sender_id"] == last].sum())
    print(f"\nfigure: chaos ({case}; {', '.join(faults)}): RLlib sampled {rllib_sampled}, stored {stored}, "
          f"{sum(r['incarnations'] for r in manifest['runners'].values())} runner incarnations, RLlib saw "
          f"{results[-1].get('fault_tolerance', {}).get('num_remote_worker_restarts')} restart(s)")
    # RLlib's own count: every step it got back is stored (a runner killed after sample() ended stored more)
    assert stored >= rllib_sampled and manifest["rllib_counts"]["env_steps_sampled"] <= stored
    for index, _ in killed:  # the fault hit a runner that then kept sampling, into its file, under a new sender
        assert counts["senders"][index, False] >= 2, (index, counts["senders"])
        assert newest_sender_steps[index] > 0, (index, newest_sender_steps)
    incarnations = {int(k.split("-")[-1]): v["incarnations"] for k, v in manifest["runners"].items()}
    for index in {i for i, _ in killed}:
        assert incarnations[index] >= 1 + sum(1 for i, _ in killed if i == index), manifest["runners"]


class _RunnerTwoNotRecorded(RecorderCallback):
    """A recorder that never runs in env runner 2 (as a runner whose process never recorded)."""

    def on_sample_end(self, *, env_runner=None, **kwargs):
        if getattr(env_runner, "worker_index", None) != 2:
            super().on_sample_end(env_runner=env_runner, **kwargs)


@pytest.mark.compat
@pytest.mark.slow
def test_a_runner_whose_recorder_never_ran_is_an_unexplained_gap_verify_exits_1(ray_session, tmp_path):
    """The gap is made for real: runner 2 samples, RLlib trains on it, its recorder never sees it. Only RLlib's own
    count can tell; verify, info and train's summary must."""
    from click.testing import CliRunner

    from rllib_recorder.cli import main
    from rllib_recorder.commands.progress import run_summary

    callback = type("Partial", (_RunnerTwoNotRecorded,),
                    {"recorder_config": RecorderCallback.configured(output_dir=str(tmp_path)).recorder_config})
    algo = ppo(runners=2).callbacks(callback).build_algo()
    results = [algo.train() for _ in range(2)]
    algo.stop()
    run_dir = results[-1]["recorder"]["run_dir"]
    rllib_sampled = rllib_sampled_of(results)
    with open_run(run_dir) as run:
        stored = run.num_env_steps
    assert 0 < stored < rllib_sampled
    result = CliRunner().invoke(main, ["verify", run_dir])
    assert result.exit_code == 1, result.output
    gap = f"unexplained gap: {rllib_sampled - stored} env steps RLlib sampled are neither stored nor counted"
    assert gap in result.output and "worker-002: 0 of its 1 incarnation(s) reached a writer" in result.output
    assert f"{stored} of {rllib_sampled} sampled env steps stored, by RLlib's count" in result.output
    result = CliRunner().invoke(main, ["info", run_dir])
    assert result.exit_code == 0 and "unexplained gap" in result.output, result.output
    assert any("NOT sound: unexplained gap" in line for line in run_summary(run_dir)), run_summary(run_dir)
