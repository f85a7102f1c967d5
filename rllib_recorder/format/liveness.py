"""Is a run still recording? Its driver (by pid on its host, else by its Ray job), its writers and its env runners.

``recover`` must never touch a run that records (it would rewrite files a writer holds open), and ``info`` and
``verify`` say when what they show is a moment of a live run. A process id alone can be reused after a reboot
or a long time, so every process is named by its host, pid and start time (Linux: ``/proc/<pid>/stat``, with the
boot id): the driver in the manifest, each writer in the heartbeat of the spools it reads, each env-runner
incarnation in the ``.owner`` file of its own spool. Off the driver's host, the driver's Ray job tells, when the
Ray cluster this environment names (``RAY_ADDRESS``, or the one ``ray start`` started here) is the run's.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rllib_recorder.format.spool_files import SPOOL_DIR

HEARTBEAT_NAME = ".heartbeat"
OWNER_NAME = ".owner"  # in a sender's spool directory: the env-runner process that writes it
# A writer touches its heartbeats every second while it runs; older than this, it is taken for dead.
HEARTBEAT_STALE_S = 15.0
# Where ``ray start`` leaves the address of the cluster it started on this machine (Ray's default temp dir).
RAY_CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"


def process_start(pid: int | None = None) -> str | None:
    """The start time of process ``pid`` (default: this one) in clock ticks since boot, with the boot id; None
    where ``/proc`` does not tell."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{boot_id()}:{int(fields[19])}"
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str:
    """This boot of this machine (Linux); raises OSError where it is not known."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def process_identity() -> str:
    """How this process names itself in a heartbeat or owner file: host, pid and start."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": process_start()})


def write_owner(directory: str) -> None:
    """Names this process as the one that writes the spool ``directory`` (an env-runner incarnation's)."""
    try:
        with open(os.path.join(directory, OWNER_NAME), "w") as f:
            f.write(process_identity())
    except OSError:  # a full disk: the spool itself fails and is counted; recover then goes by the writers
        pass


def on_this_host(host: Any, started: Any) -> bool:
    """Whether a process named by ``host`` and ``started`` (``process_start``) ran on this machine in this boot."""
    if host != socket.gethostname():
        return False
    try:
        return not isinstance(started, str) or started.split(":", 1)[0] == boot_id()
    except OSError:
        return True


def same_process_alive(pid: Any, started: Any) -> bool:
    """Whether process ``pid`` of this machine runs and is the one that started at ``started`` (if known)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        pass
    return started is None or process_start(pid) in (None, started)


def driver_alive(manifest: dict[str, Any], ask_ray: Callable[[dict[str, Any]], bool | None] | None = None
                 ) -> bool | None:
    """Whether the run's driver runs: on its host by its pid and start time; elsewhere by its Ray job
    (``ask_ray``, default ``ray_driver_alive``); None when neither can tell."""
    if on_this_host(manifest.get("driver_host"), manifest.get("driver_started")):
        return same_process_alive(manifest.get("driver_pid"), manifest.get("driver_started"))
    return (ask_ray or ray_driver_alive)(manifest)


def ray_driver_alive(manifest: dict[str, Any]) -> bool | None:
    """The driver's state from its Ray job, asked of the GCS this environment names, and only when that is the
    run's (nothing a manifest says is contacted on its word alone). A Tune trial's driver is an actor, which can
    die while its job lives on: then only a dead job tells."""
    job, gcs = manifest.get("driver_job_id"), manifest.get("ray_gcs_address")
    if not (isinstance(job, str) and isinstance(gcs, str)) or ray_address_here() != gcs:
        return None
    from rllib_recorder._rllib_compat import ray_job_dead

    dead = ray_job_dead(gcs, job)
    if dead is None:
        return None
    return False if dead else (None if manifest.get("driver_actor_id") else True)


def ray_address_here() -> str | None:
    """The GCS address (host:port) of the Ray cluster this environment names, without asking Ray."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address or address in ("auto", "local"):
        try:
            with open(RAY_CURRENT_CLUSTER) as f:
                address = f.read(256).strip()
        except OSError:
            return None
    return address.removeprefix("ray://") or None


@dataclass(frozen=True)
class RunProcess:
    """A writer or env-runner process of a run that may still run."""

    role: str  # "writer" or "env runner"
    host: str
    pid: int
    here: bool  # on this machine (then known to run); elsewhere its heartbeat is fresh
    started: Any = field(default=None, compare=False)
    age_s: float | None = field(default=None, compare=False)  # of its heartbeat (writers)

    def __str__(self) -> str:
        if not self.pid:
            return f"a {self.role} whose heartbeat is {self.age_s or 0:.0f} s old"
        return f"{self.role} pid {self.pid}" + ("" if self.here else f" on {self.host}")

    def runs(self) -> bool:
        return not self.here or same_process_alive(self.pid, self.started)


def run_processes(run_dir: str, now: float | None = None, runners: bool = True) -> list[RunProcess]:
    """The run's writers (by their heartbeats: younger than ``HEARTBEAT_STALE_S`` and not of a process here that
    has ended) and, with ``runners``, its env-runner incarnations on this machine whose processes run (by their
    spools' owners)."""
    now = time.time() if now is None else now
    spool = os.path.join(glob.escape(run_dir), SPOOL_DIR)
    found: dict[RunProcess, RunProcess] = {}  # a writer serves several spools: its youngest heartbeat
    for path in sorted(glob.glob(os.path.join(spool, "*", HEARTBEAT_NAME))):
        try:
            age = now - os.path.getmtime(path)
        except OSError:
            continue
        writer = _named(path, "writer", age)
        if age < HEARTBEAT_STALE_S and writer.runs():
            found[writer] = min(found.get(writer, writer), writer, key=lambda p: p.age_s or 0.0)
    for path in sorted(glob.glob(os.path.join(spool, "*", "*", OWNER_NAME))) if runners else []:
        runner = _named(path, "env runner", None)
        if runner.pid and runner.here and runner.runs():
            found[runner] = runner
    return list(found.values())


def _named(path: str, role: str, age_s: float | None) -> RunProcess:
    """The process an owner or heartbeat file names (pid 0: none named, taken for one elsewhere)."""
    try:
        with open(path, "rb") as f:
            owner = json.loads(f.read(4096) or b"{}")
    except (OSError, ValueError):
        owner = {}
    owner = owner if isinstance(owner, dict) else {}
    pid, host, started = owner.get("pid"), owner.get("host"), owner.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return RunProcess(role, "an unknown host", 0, False, None, age_s)
    return RunProcess(role, host[:255], pid, on_this_host(host, started), started, age_s)


def recording_now(run_dir: str, manifest: dict[str, Any]) -> str | None:
    """Why the run is taken to be recording right now (None when neither its driver nor a writer of it runs)."""
    if manifest.get("status") == "running" and driver_alive(manifest):
        return f"its driver (pid {manifest['driver_pid']} on {manifest['driver_host']}) is running"
    writers = run_processes(run_dir, runners=False)
    if not writers:
        return None
    if driver_alive(manifest) is False:
        return f"its driver has died, and Ray is ending its {describe(writers)}"
    return f"a writer of it was alive {min(p.age_s or 0.0 for p in writers):.0f} s ago"


def describe(processes: list[RunProcess]) -> str:
    """'writer pid 12, env runner pid 34 and 1 more'."""
    shown = ", ".join(map(str, processes[:3]))
    return shown + (f" and {len(processes) - 3} more" if len(processes) > 3 else "")
