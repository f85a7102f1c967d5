"""The experiment index: ``recorder_index.json`` lists the runs (Tune trials) of one experiment directory.

Trials run in several processes at once, each updating its own entry: an update takes an exclusive
``fcntl`` lock on ``.recorder_index.lock`` beside the index, reads the index, changes one entry and
replaces the file atomically, so a reader sees the old or the new index, never a torn one, and no
concurrent update is lost. The runs' manifests stay the truth: ``rebuild_index`` makes the index
again from them (``rllib-recorder info EXPERIMENT_DIR`` reads the manifests, not the index).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Any, Iterator

from rllib_recorder.errors import SchemaError
from rllib_recorder.format.manifest import MANIFEST_NAME, RUN_DIR_NAME, read_json, read_manifest, write_json_atomic

INDEX_NAME = "recorder_index.json"
LOCK_NAME = ".recorder_index.lock"
INDEX_FORMAT = "rllib_recorder.format.index"


@contextlib.contextmanager
def _locked(experiment_dir: str) -> Iterator[None]:
    os.makedirs(experiment_dir, exist_ok=True)
    with open(os.path.join(experiment_dir, LOCK_NAME), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def read_index(experiment_dir: str) -> dict[str, Any]:
    """The index of ``experiment_dir`` (an empty one if there is none yet)."""
    path = os.path.join(experiment_dir, INDEX_NAME)
    if not os.path.isfile(path):
        return {"format": INDEX_FORMAT, "runs": {}}
    index = read_json(path, "index", f"delete it: 'rllib-recorder info {experiment_dir}' reads the runs' manifests")
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise SchemaError(f"{path} is not an rllib_recorder index")
    runs = index.get("runs")
    if not isinstance(runs, dict) or not all(
            isinstance(entry, dict) and RUN_DIR_NAME.fullmatch(name) for name, entry in runs.items()):
        raise SchemaError(f"{path}: runs must map run directory names (one plain path component each) to "
                          "objects; this index was changed by hand: delete it, the runs' manifests are the truth")
    return index


def _write(experiment_dir: str, index: dict[str, Any]) -> None:
    index["updated_at_s"] = time.time()
    write_json_atomic(os.path.join(experiment_dir, INDEX_NAME), index)


def update_run(experiment_dir: str, run_dir: str, entry: dict[str, Any]) -> None:
    """Sets the entry of ``run_dir`` (keyed by its directory name) under the lock."""
    with _locked(experiment_dir):
        index = read_index(experiment_dir)
        key = os.path.basename(os.path.normpath(run_dir))
        index["runs"][key] = {**index["runs"].get(key, {}), **entry, "run_dir": key}
        _write(experiment_dir, index)


def run_dirs(experiment_dir: str) -> list[str]:
    """Run directories directly below ``experiment_dir`` (those holding a manifest), sorted."""
    if not os.path.isdir(experiment_dir):
        return []
    return sorted(
        os.path.join(experiment_dir, name) for name in os.listdir(experiment_dir)
        if os.path.isfile(os.path.join(experiment_dir, name, MANIFEST_NAME))
    )


def entry_from_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """An index entry from a run's manifest."""
    totals = manifest.get("totals") or {}
    return {
        "trial": manifest.get("trial"), "trial_id": manifest.get("trial_id"),
        "trial_name": manifest.get("trial_name"), "status": manifest.get("status"),
        "run_id": manifest.get("run_id"), "env_steps": totals.get("env_steps_stored"),
        "started_at": manifest.get("started_at"), "finished_at": manifest.get("finished_at"),
    }


def rebuild_index(experiment_dir: str) -> dict[str, Any]:
    """Makes the index again from the runs' manifests (under the lock); returns it."""
    with _locked(experiment_dir):
        index = {"format": INDEX_FORMAT, "runs": {}}
        for run_dir in run_dirs(experiment_dir):
            with contextlib.suppress(SchemaError):
                index["runs"][os.path.basename(run_dir)] = {
                    **entry_from_manifest(read_manifest(run_dir)), "run_dir": os.path.basename(run_dir)}
        _write(experiment_dir, index)
        return index
