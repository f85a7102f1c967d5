"""Recovery: make a run whose driver or writers were killed readable and finished again, losing no committed row."""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Callable

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import commits, durable, h5file, layout, probe
from rllib_recorder.format import repair as h5repair
from rllib_recorder.format import liveness
from rllib_recorder.format.manifest import now_iso, place_files, read_manifest, write_manifest
from rllib_recorder.format.spool_files import sender_dirs

RECOVERED = "recovered"
# How long recover waits, once the driver has died, for the run's writers and env runners to end. Ray ends a dead
# driver's actors by itself, about 5 s after the kill; a writer on another machine is taken for dead
# HEARTBEAT_STALE_S (15 s) after its last heartbeat. Twice that is left for a loaded machine.
DEAD_DRIVER_WAIT_S = 30.0


def commit_spools(run_dir: str, run_id: str, config: Any = None) -> list[dict[str, Any]]:
    """Commits what env runners handed over to the spools of ``run_dir`` and no writer committed (its writers or
    the driver died, or Ray was shut down first); returns one writer's stats per node tag found.

    Run only where no writer of the run is alive: one ``SpoolWriter`` per node tag takes every file of that tag,
    continues each file after its last commit and skips every record a file already commits.
    """
    from rllib_recorder.config import RecorderConfig
    from rllib_recorder.format.spool_files import parse_stem
    from rllib_recorder.service.pool import SpoolWriter

    config = config if config is not None else RecorderConfig()
    tags = sorted({parse_stem(stem)[2] for stem, _, _ in sender_dirs(run_dir)})  # type: ignore[index]
    out = []
    for tag in tags:
        writer = SpoolWriter(run_dir, run_id, config, tag, None, thread=False)
        out.append(writer.close())
    return out


def commit_spools_in_child(run_dir: str, run_id: str, config: Any, timeout_s: float) -> list[dict[str, Any]]:
    """``commit_spools`` in a child Python process: HDF5 can crash the process that writes on a full or failing
    disk (a segfault inside ``H5Fflush`` was seen), and the caller is the user's driver. A child that crashes,
    hangs past ``timeout_s`` or fails leaves the spools as they were and raises ``SchemaError`` naming it."""
    import json
    import subprocess
    import sys

    request = json.dumps({"run_dir": run_dir, "run_id": run_id, "config": config.to_dict()})
    try:
        done = subprocess.run([sys.executable, "-c", "from rllib_recorder.service.recover import _commit_main; _commit_main()"],
                              input=request.encode(), capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SchemaError(f"committing the spools of {run_dir} took longer than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        import signal

        for leftover in glob.glob(os.path.join(glob.escape(run_dir), "*.rewrite-tmp")):  # the dead child's copy
            os.remove(leftover)
        text = done.stderr.decode(errors="replace")
        ended = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
                 else f"exit code {done.returncode}")
        full = "No space left on device" in text
        raise SchemaError(f"committing the spools of {run_dir} failed in its child process ({ended}"
                          + ("; the disk is full: free space" if full else "") + "); the spools are kept")
    return json.loads(done.stdout.decode())


def _commit_main() -> None:
    import json
    import sys

    from rllib_recorder.config import RecorderConfig

    request = json.loads(sys.stdin.buffer.read())
    stats = commit_spools(request["run_dir"], request["run_id"], RecorderConfig.from_dict(request["config"]))
    sys.stdout.write(json.dumps(stats, default=str))


def recover_run(run_dir: str, progress: Callable[[int], None] | None = None, publish: bool = False,
                say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Recovers every worker file of ``run_dir`` and finishes its manifest; returns what was done.

    Idempotent. A file is rewritten from its committed rows when it holds rows past its
    commit record (a writer killed mid-append) or the run never finished; its committed
    rows are all read back on the way, so a damaged one raises ``SchemaError`` naming it.
    A file that a writer created but never committed to holds no data: it is renamed
    ``*.h5.empty`` so that readers skip it. Leftover temporary files are removed. ``progress(1)`` is
    called after each file. The staging directory of a durable run is uploaded to the target its manifest names
    only with ``publish`` (the user's say-so: a URI read from a recording alone never decides where data goes).
    A run whose driver has died while its writers or env runners still run is recovered once they have ended
    (``wait_for_the_dead``: ``say`` gets one line saying so).
    """
    if not os.path.isdir(run_dir):
        raise SchemaError(f"{run_dir} is not a directory; pass the run directory (it holds manifest.json)")
    manifest = read_manifest(run_dir)
    layout.check_version(manifest.get("schema_version"), os.path.join(run_dir, "manifest.json"))
    if wait_for_the_dead(run_dir, manifest, say or (lambda line: None)):  # a new attempt may have started since
        manifest = read_manifest(run_dir)
        wait_for_the_dead(run_dir, manifest, say or (lambda line: None))
    spooled = next(sender_dirs(run_dir), None) is not None
    unfinished = manifest.get("status") != "finished" or spooled
    removed = _remove_leftovers(run_dir)
    files: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "*.h5"))):
        files[os.path.basename(path)] = recover_file(path, rewrite=unfinished)
        if progress is not None:
            progress(1)
    committed = commit_spools(run_dir, str(manifest.get("run_id") or ""), _config(manifest)) if spooled else []
    for path in sorted(glob.glob(os.path.join(run_dir, "*.h5"))) if committed else []:  # new files, new rows
        files[os.path.basename(path)] = recover_file(path, rewrite=False)
    report = {
        "run_dir": run_dir, "status_before": manifest.get("status"), "files": files,
        "removed_temporary_files": removed,
        "env_steps": sum(f.get("env_steps", 0) for f in files.values()),
        "spool_env_steps_committed": sum(int(s.get("env_steps", 0)) for s in committed),
    }
    if unfinished:
        manifest.update(
            status=RECOVERED, recovered_at=now_iso(), finished_at=manifest.get("finished_at") or now_iso(),
            files=place_files([n for n, f in files.items() if not f.get("renamed_to")],
                              manifest.get("writer_nodes") or {}),
            totals=_totals(manifest, committed, report["env_steps"]),
            recovery={k: v for k, v in report.items() if k != "run_dir"},
        )
        write_manifest(run_dir, manifest)
    report["status"] = manifest["status"]
    if manifest.get("target"):  # a durable run's staging directory: what it holds goes to the target, if asked
        report["target"] = str(manifest["target"])
        if publish:
            report["published"] = _publish(run_dir, manifest)
    return report


def wait_for_the_dead(run_dir: str, manifest: dict[str, Any], say: Callable[[str], None],
                      bound_s: float = DEAD_DRIVER_WAIT_S, clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep,
                      ask_ray: Callable[[dict[str, Any]], bool | None] | None = None) -> bool:
    """Returns once no process of the run runs: whether it waited for some. SchemaError while its driver runs, or
    may (its writers beat and nothing tells that its driver died), with the advice to let it finish or stop it.
    When its driver has died and its writers or env runners still run (Ray ends them within seconds), says so in
    one line and waits for them, at most ``bound_s``; SchemaError naming those left after that."""
    alive = liveness.driver_alive(manifest, ask_ray)
    if manifest.get("status") == "running" and alive:
        _refuse(run_dir, f"its driver (pid {manifest['driver_pid']} on {manifest['driver_host']}) is running")
    if alive is not False:  # nothing says its driver died: a writer that beats is recording
        writers = liveness.run_processes(run_dir, runners=False)
        if writers:
            _refuse(run_dir, f"a writer of it was alive {min(p.age_s or 0.0 for p in writers):.0f} s ago")
        return False
    processes = liveness.run_processes(run_dir)
    if not processes:
        return False
    say(f"{run_dir}: its driver (pid {manifest.get('driver_pid')} on {manifest.get('driver_host')}) has died; "
        f"waiting up to {bound_s:.0f} s for Ray to end its {liveness.describe(processes)}")
    deadline = clock() + bound_s
    while processes and clock() < deadline:
        sleep(0.2)
        processes = liveness.run_processes(run_dir)
    if processes:
        pids = " ".join(str(p.pid) for p in processes if p.pid)
        raise SchemaError(f"{run_dir}: its driver has died, but its {liveness.describe(processes)} still ran "
                          f"{bound_s:.0f} s later; end them (kill {pids or 'them'}, or 'ray stop' on their node) and "
                          "run recover again")
    return True


def _refuse(run_dir: str, why: str) -> None:
    raise SchemaError(f"{run_dir} is recording ({why}); recover only a run whose driver has died: let it finish, "
                      "or stop it first")


def _publish(run_dir: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Seals and uploads what the staging ``run_dir`` of a durable run holds, then the manifest; one-line
    SchemaError when the target refuses (everything stays here for the next ``recover``)."""
    from rllib_recorder.format import store
    from rllib_recorder.format.manifest import json_bytes
    from rllib_recorder.service.publish import publish_run

    target = store.resolve(manifest["target"])
    stats = publish_run(run_dir, target, _config(manifest), timeout_s=60.0)
    try:
        if stats["upload_backlog_segments"]:
            raise OSError(stats["last_upload_error"] or "uploads failed")
        pending = manifest.pop("publish_pending", None)
        target.put_bytes(json_bytes(manifest), "manifest.json")
        if pending is not None:  # the run's end that the store refused at stop is complete now
            manifest["published_by_recover"] = {"at": now_iso(), "segments_uploaded": stats["segments_uploaded"]}
            write_manifest(run_dir, manifest)
            target.put_bytes(json_bytes(manifest), "manifest.json")
    except OSError as e:
        raise SchemaError(f"{run_dir} is recovered here, but uploading it to {manifest['target']} failed "
                          f"({(str(e).strip().splitlines() or [''])[0]}); its segments stay here: run recover again "
                          "once the store is reachable (credentials as pyarrow finds them)") from None
    return stats


def _config(manifest: dict[str, Any]) -> Any:
    """The run's own recorder settings (they decide how its rows are stored), or the defaults if unreadable."""
    from rllib_recorder.config import RecorderConfig

    settings = manifest.get("recorder")
    try:
        return RecorderConfig.from_dict(settings) if isinstance(settings, dict) else RecorderConfig()
    except Exception:  # noqa: BLE001 - a manifest from another version: its layout settings are in the files
        return RecorderConfig()


def _totals(manifest: dict[str, Any], committed: list[dict[str, Any]], env_steps: int) -> dict[str, Any]:
    """The manifest's totals with what recovery committed: the senders' last counters and what is still left."""
    totals = dict(manifest.get("totals")) if isinstance(manifest.get("totals"), dict) else {}
    senders = dict(totals.get("senders")) if isinstance(totals.get("senders"), dict) else {}
    for stats in committed:
        senders.update(stats.get("runners") or {})
    leftovers = {k: v for s in committed for k, v in (s.get("spool_leftovers") or {}).items()}
    totals.update(senders=senders, spool_leftovers=leftovers, unacked_at_stop=len(leftovers),
                  env_steps_stored=env_steps)
    return totals


def recover_file(path: str, rewrite: bool = True) -> dict[str, Any]:
    """Recovers one worker file (see ``recover_run``); returns its committed counts and drops."""
    with h5file.damaged_file_errors(path, "recover cannot mend this damage: move the file out of the run "
                                    "directory to recover and read the rest of the run"):
        h5repair.extend_eoa_to_eof(path)  # a killed writer's last chunks may lie past the recorded EOA
        probe.ensure_readable([path])  # HDF5 may loop or crash on damage; find out in a child first
        with h5file.open_h5(path, "r") as h5:
            if "format" not in h5.attrs or "commit" not in h5.attrs:
                empty = True
            else:
                empty = False
                h5file.validate_header(h5, path)
                dirty = commits.uncommitted_rows(h5)
        if empty:
            durable.replace(path, f"{path}.empty")
            return {"renamed_to": os.path.basename(path) + ".empty", "env_steps": 0}
        dropped = commits.rewrite_committed(path) if rewrite or dirty else {}
        with h5file.open_h5(path, "r") as h5:
            commit = commits.read_commit(h5)
            steps = int(h5["batches/env_steps"][: commit["batches"]].sum()) if commit["batches"] else 0
    return {"batches": commit["batches"], "env_steps": steps,
            "rows_dropped": sum(dropped.values()), "columns_cut": sorted(dropped)}


def _remove_leftovers(run_dir: str) -> list[str]:
    removed = []
    for pattern in ("*.rewrite-tmp", "manifest.json.tmp-*"):
        for path in glob.glob(os.path.join(run_dir, pattern)):
            os.remove(path)
            removed.append(os.path.basename(path))
    return sorted(removed)
