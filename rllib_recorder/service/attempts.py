"""Tune trials: their names, and the earlier attempt of a trial that Tune restarted, resumed or restored,
recovered first and continued."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from rllib_recorder._rllib_compat import tune_dir_names
from rllib_recorder.errors import OutputDirError, RecorderError
from rllib_recorder.format.manifest import read_manifest
from rllib_recorder.format.spool_files import sender_dirs


def previous_attempt(run_dir: str, experiment: str | None, trial: str | None) -> dict[str, Any] | None:
    """The manifest of an earlier attempt of this Tune trial in ``run_dir``, ready to be continued (None when
    there is none: outside Tune, a new trial, or a run of something else).

    Tune restarts a failed trial (``FailureConfig``), resumes a paused one (PBT, HyperBand) and restores an
    experiment (``Tuner.restore``) in the same trial dir, so the recording continues there. An attempt that did
    not end cleanly (its actor was killed) is recovered first: what its runners had handed over is committed.
    """
    path = os.path.join(run_dir, "manifest.json")
    if trial is None or not os.path.isfile(path):
        return None
    try:
        manifest = read_manifest(run_dir)
    except RecorderError:
        return None
    if manifest.get("trial") != trial or manifest.get("experiment") != experiment or not manifest.get("run_id"):
        return None
    if manifest.get("status") not in ("finished", "interrupted") or next(sender_dirs(run_dir), None) is not None:
        manifest = _recover_earlier(run_dir)
    attempts = manifest.get("attempts")
    if not isinstance(attempts, list) or not attempts:
        attempts = [{"attempt": 0, "started_at": manifest.get("started_at"), "finished_at":
                     manifest.get("finished_at"), "status": manifest.get("status"),
                     "ended_by": manifest.get("ended_by"), "driver_pid": manifest.get("driver_pid")}]
    elif attempts[-1].get("status") == "running":  # recovered: that attempt ended with its process
        attempts[-1].update(status=manifest.get("status"), finished_at=manifest.get("finished_at"),
                            ended_by="its process died (recovered)")
    manifest["attempts"] = attempts
    return manifest


def _recover_earlier(run_dir: str) -> dict[str, Any]:
    """Recovers the earlier attempt of a trial, once its processes are gone (a killed trial actor's writers
    follow it within seconds)."""
    from rllib_recorder.format.liveness import recording_now
    from rllib_recorder.service.recover import recover_run

    deadline = time.monotonic() + 30.0
    while True:
        manifest = read_manifest(run_dir)
        live = recording_now(run_dir, manifest)
        if live is None or manifest.get("driver_pid") == os.getpid() and manifest.get("status") != "running":
            break
        if time.monotonic() > deadline:
            raise OutputDirError(f"run directory {run_dir!r} is still recording ({live}); a trial's earlier "
                                 "attempt must end before the next one records into it")
        time.sleep(0.5)
    recover_run(run_dir)
    return read_manifest(run_dir)


def earlier_totals(previous: dict[str, Any] | None) -> dict[str, Any]:
    totals = (previous or {}).get("totals")
    totals = totals if isinstance(totals, dict) else {}
    senders = totals.get("senders")
    return {"senders": senders if isinstance(senders, dict) else {},
            "env_steps_stored": int(totals.get("env_steps_stored") or 0),
            "env_steps_consumed": int(totals.get("env_steps_consumed") or 0)}


def tune_names(algorithm: Any) -> tuple[str | None, str | None]:
    """(experiment dir name, trial dir name) of the Tune trial running ``algorithm``; (None, None) outside Tune.

    Tune hands a trainable its storage context before ``setup()``; the trial name itself is not yet
    known to an Algorithm at ``on_algorithm_init`` (it reports "default"), the trial dir name is.
    """
    return tune_dir_names(algorithm)


def tune_trial(trial_dir: str | None) -> tuple[str | None, str | None]:
    """(trial name, trial id) read from Tune's default trial dir name ``<name>_<id>_<tag>``.

    An Algorithm in a Tune trial is not told its trial id (results get it outside the trial);
    its dir name holds both. (None, None) outside Tune or with a custom ``trial_dirname_creator``.
    """
    match = re.match(r"^(.*?_([0-9a-f]{5,8}_\d{5}))(_|$)", trial_dir or "")
    return (match.group(1), match.group(2)) if match else (None, None)
