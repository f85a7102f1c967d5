"""Is a run still recording? Its driver's process, and its writers' heartbeats in the spool.

``recover`` must never touch a run that records (it would rewrite files a writer holds open), and ``info`` and
``verify`` say when what they show is a moment of a live run. A process id alone can be reused after a reboot
or a long time, so the manifest keeps the driver's pid with its start time (Linux: ``/proc/<pid>/stat``).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from typing import Any

from rllib_recorder.format.spool_files import SPOOL_DIR

HEARTBEAT_NAME = ".heartbeat"
# A writer touches its heartbeats every second while it runs; older than this, it is taken for dead.
HEARTBEAT_STALE_S = 15.0


def process_start(pid: int | None = None) -> str | None:
    """The start time of process ``pid`` (default: this one) in clock ticks since boot, with the boot id; None
    where ``/proc`` does not tell."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{int(fields[19])}"
    except (OSError, IndexError, ValueError):
        return None


def driver_alive(manifest: dict[str, Any]) -> bool:
    """True when the manifest's driver runs on this host and is the same process that started the run."""
    if manifest.get("driver_host") != socket.gethostname():
        return False
    return _same_process_alive(manifest.get("driver_pid"), manifest.get("driver_started"))


def heartbeat_owner() -> str:
    """What a writer writes into its heartbeat file: host, pid and start of its process."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": process_start()})


def _owner_dead(path: str) -> bool:
    """True when the heartbeat's writer was a process on this host that no longer runs."""
    try:
        with open(path, "rb") as f:
            owner = json.loads(f.read(4096) or b"{}")
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict):
        return False
    return owner.get("host") == socket.gethostname() and not _same_process_alive(owner.get("pid"),
                                                                                  owner.get("started"))


def _same_process_alive(pid: Any, started: Any) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        pass
    return started is None or process_start(pid) in (None, started)


def fresh_heartbeat_s(run_dir: str, now: float | None = None) -> float | None:
    """Age of the newest heartbeat of a writer that may be alive (younger than ``HEARTBEAT_STALE_S``, and not of
    a process here that has ended)."""
    now = time.time() if now is None else now
    ages = []
    for path in glob.glob(os.path.join(glob.escape(run_dir), SPOOL_DIR, "*", HEARTBEAT_NAME)):
        try:
            age = now - os.path.getmtime(path)
        except OSError:
            continue
        if age < HEARTBEAT_STALE_S and not _owner_dead(path):
            ages.append(age)
    age = min(ages, default=None)
    return age if age is not None and age < HEARTBEAT_STALE_S else None


def recording_now(run_dir: str, manifest: dict[str, Any]) -> str | None:
    """Why the run is taken to be recording right now (None when nothing of it is alive here)."""
    if manifest.get("status") == "running" and driver_alive(manifest):
        return f"its driver (pid {manifest['driver_pid']} on {manifest['driver_host']}) is running"
    age = fresh_heartbeat_s(run_dir)
    if age is not None:
        return f"a writer of it was alive {age:.0f} s ago"
    return None
