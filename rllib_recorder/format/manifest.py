"""The run manifest: one JSON file per run directory, written atomically."""

from __future__ import annotations

import json
import os
import platform
import re
import time
from typing import Any

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import durable

MANIFEST_NAME = "manifest.json"


def versions() -> dict[str, str]:
    """Versions of everything that shapes what a run stores."""
    import gymnasium
    import h5py
    import numpy
    import ray

    from rllib_recorder.version import __version__

    return {
        "rllib_recorder": __version__, "ray": ray.__version__, "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
        "python": platform.python_version(),
    }


# Manifest states of a run whose recording ended (on a stop, an exit or a signal, or repaired by recover).
ENDED_STATUSES = ("finished", "interrupted", "recovered")


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_manifest(run_dir: str, manifest: dict[str, Any]) -> str:
    """Writes ``manifest.json`` atomically (a crash leaves the old or the new one)."""
    return write_json_atomic(os.path.join(run_dir, MANIFEST_NAME), manifest)


def json_bytes(value: Any) -> bytes:
    """``value`` as a manifest's JSON: indented, keys sorted (what ``write_json_atomic`` writes)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str).encode()


def write_json_atomic(path: str, value: Any) -> str:
    """Writes ``value`` as JSON to ``path`` via an fsynced temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(json_bytes(value))
        f.flush()
        os.fsync(f.fileno())
    durable.replace(tmp, path)
    return path


def read_manifest(run_dir: str) -> dict[str, Any]:
    """Reads a run's manifest and checks every field the recorder reads (``check_manifest``); SchemaError names
    the problem in one line when it is missing, broken or holds something no recorder wrote."""
    path = os.path.join(run_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise SchemaError(f"{run_dir} is not an rllib_recorder run: it has no {MANIFEST_NAME}")
    manifest = read_json(path, "manifest", "run 'rllib-recorder recover'")
    if not isinstance(manifest, dict) or manifest.get("format") != "rllib_recorder":
        raise SchemaError(f"{path} is not an rllib_recorder manifest")
    check_manifest(manifest, path)
    return manifest


MAX_JSON_BYTES = 64 << 20


def read_json(path: str, what: str, fix: str) -> Any:
    """The JSON value in ``path``: UTF-8, at most 64 MiB, no NaN or Infinity; SchemaError otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES >> 20} MiB")
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:200]
        raise SchemaError(f"{path} is not a readable {what} ({reason}); {fix}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# A file name a run may list: what layout.file_name makes, and nothing that could leave the run directory.
FILE_NAME = re.compile(r"(eval-)?worker-[0-9]{3,9}(\.node[0-9]{1,6})?\.h5")
# A run directory's name inside an experiment directory: one plain path component.
RUN_DIR_NAME = re.compile(r"(?!\.\.?$)[^/\\\x00]{1,255}")
NODE_ID = re.compile(r"[0-9a-f]{8,128}")
GCS_ADDRESS = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,255}:[0-9]{1,5}")
MAX_COUNT = 1 << 62

_STR, _NUM, _INT, _DICT, _LIST = "a string", "a number", "a whole number", "an object", "a list"
# field -> what it must be, when present and not null
_FIELDS = {
    "schema_version": _STR, "run_id": _STR, "status": _STR, "ended_by": _STR, "env": _STR, "algorithm": _STR,
    "api_stack": _STR, "started_at": _STR, "finished_at": _STR, "driver_host": _STR, "trial": _STR,
    "trial_id": _STR, "trial_name": _STR, "experiment": _STR, "recorder_version": _STR,
    "driver_pid": _INT, "driver_started": _STR, "driver_node_id": _STR, "driver_job_id": _STR,
    "driver_actor_id": _STR, "ray_gcs_address": _STR,
    "env_config": _DICT, "totals": _DICT, "writer_nodes": _DICT, "recorder": _DICT,
    "versions": _DICT, "spaces": _DICT, "recovery": _DICT, "gathered_from": _DICT, "attempts": _LIST,
    "env_config_omitted": _LIST, "target": _STR, "staging_dir": _STR, "lost_nodes": _LIST,
    # an attempt's RLlib counts (attempts[k])
    "rllib_env_steps_sampled": _INT, "rllib_env_steps_before": _INT, "rllib_evaluation_env_steps_sampled": _INT,
    "rllib_evaluation_env_steps_before": _INT,
}


def check_manifest(manifest: dict[str, Any], path: str) -> None:
    """SchemaError (one line: the field, what it holds, what it must hold) unless every field the recorder reads
    has the type a recorder writes, every count is a whole number in range, every file name is a plain name of a
    worker file and every node id is hex. Nothing in a manifest is executed, imported or used as a path."""
    def bad(field: str, problem: str) -> SchemaError:
        return SchemaError(f"{path}: {field} {problem}; this manifest was not written by rllib_recorder (or was "
                           "changed by hand): restore it from the run's source")

    for field, kind in _FIELDS.items():
        value = manifest.get(field)
        if value is None and kind in (_DICT, _LIST) and field in manifest:
            del manifest[field]  # a null object or list reads as an absent one
        if value is None:  # older and hand-made manifests may lack any field but format
            continue
        if not _is(value, kind):
            raise bad(field, f"is {_what(value)}, not {kind}")
    if manifest.get("driver_pid") is not None and not 0 < manifest["driver_pid"] < 1 << 31:
        raise bad("driver_pid", f"is {manifest['driver_pid']}, not a process id")
    for field in ("driver_node_id", "driver_job_id", "driver_actor_id"):
        if manifest.get(field) is not None and not NODE_ID.fullmatch(manifest[field]):
            raise bad(field, f"is {manifest[field][:80]!r}, not a Ray id (hex)")
    if manifest.get("ray_gcs_address") is not None and not GCS_ADDRESS.fullmatch(manifest["ray_gcs_address"]):
        raise bad("ray_gcs_address", f"is {manifest['ray_gcs_address'][:80]!r}, not a host:port")
    files = manifest.get("files")
    if files is None:
        manifest.pop("files", None)
    elif not isinstance(files, (dict, list)):
        raise bad("files", f"is {_what(files)}, not {_DICT}")
    if isinstance(files, list):  # older runs: the names alone
        files = {name: {} if isinstance(name, str) else None for name in files}
        if None in files.values():
            raise bad("files", "lists something that is not a file name")
    for name, info in (files or {}).items():
        if not FILE_NAME.fullmatch(name):
            raise bad("files", f"names {name[:80]!r}, not a worker file name (worker-NNN.h5, eval-worker-NNN.h5, "
                               "worker-NNN.nodeK.h5)")
        if not isinstance(info, dict):
            raise bad(f"files.{name}", f"is {_what(info)}, not {_DICT}")
        _check_node(info, f"files.{name}", bad)
        for key in ("bytes", "node_index"):
            if info.get(key) is not None and not _is(info[key], _INT):
                raise bad(f"files.{name}.{key}", f"is {_what(info[key])}, not {_INT}")
    for index, info in (manifest.get("writer_nodes") or {}).items():
        if not index.isdigit() or len(index) > 6 or not isinstance(info, dict):
            raise bad("writer_nodes", f"has {index[:80]!r}: {_what(info)}, not a node number and its node")
        _check_node(info, f"writer_nodes.{index}", bad)
    for i, attempt in enumerate(manifest.get("attempts") or []):
        if not isinstance(attempt, dict):
            raise bad(f"attempts[{i}]", f"is {_what(attempt)}, not {_DICT}")
        for key, value in attempt.items():
            kind = _FIELDS.get(key, _INT if key == "attempt" else None)
            if value is not None and kind is not None and not _is(value, kind):
                raise bad(f"attempts[{i}].{key}", f"is {_what(value)}, not {kind}")
    _check_counts(manifest.get("totals") or {}, bad)


def _check_node(info: dict[str, Any], field: str, bad: Any) -> None:
    node_id = info.get("node_id")
    if node_id is not None and not (isinstance(node_id, str) and NODE_ID.fullmatch(node_id)):
        raise bad(f"{field}.node_id", f"is {_what(node_id)}, not a Ray node id (hex)")
    for key in ("node_ip", "hostname"):
        if info.get(key) is not None and not isinstance(info[key], str):
            raise bad(f"{field}.{key}", f"is {_what(info[key])}, not {_STR}")


# Every other field of ``totals`` and of each sender's stats is a number (or null).
_TOTALS_OTHER = {"last_error": _STR, "last_upload_error": _STR, "run_dir": _STR, "target": _STR, "senders": _DICT, "spool_leftovers": _DICT,
                 "policy_lag_hist": _DICT}
_SENDER_OTHER = {"last_error": _STR, "sender_id": _STR, "is_evaluation": "a boolean", "drop_causes": _DICT,
                 "error_kinds": _DICT}


def _check_counts(totals: dict[str, Any], bad: Any) -> None:
    """Counts are numbers in range; senders map to objects of counts; nothing nests deeper than 5."""
    _check_values(totals, "totals", bad, 0)
    _check_stats(totals, "totals", _TOTALS_OTHER, bad)
    for sender, stats in (totals.get("senders") or {}).items():
        if not isinstance(stats, dict):
            raise bad(f"totals.senders.{sender[:40]}", f"is {_what(stats)}, not {_DICT} of counts")
        _check_stats(stats, f"totals.senders.{sender[:40]}", _SENDER_OTHER, bad)
        for key in ("drop_causes", "error_kinds"):
            if not all(_is(v, _NUM) for v in (stats.get(key) or {}).values()):
                raise bad(f"totals.senders.{sender[:40]}.{key}", f"is not {_DICT} of counts")


def _check_stats(stats: dict[str, Any], field: str, other: dict[str, str], bad: Any) -> None:
    for key, value in stats.items():
        kind = other.get(key, _NUM)
        fine = isinstance(value, bool) if kind == "a boolean" else _is(value, kind)
        if value is not None and not fine:
            raise bad(f"{field}.{key[:40]}", f"is {_what(value)}, not {kind}")


def _check_values(value: Any, field: str, bad: Any, depth: int) -> None:
    if isinstance(value, (dict, list)):
        if depth >= 5:
            raise bad(field, "is nested too deeply")
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            _check_values(item, f"{field}.{str(key)[:40]}", bad, depth + 1)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not -MAX_COUNT <= value <= MAX_COUNT:
        raise bad(field, f"is {value:.3g}, out of range")


def _is(value: Any, kind: str) -> bool:
    if kind == _STR:
        return isinstance(value, str)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool) and -MAX_COUNT <= value <= MAX_COUNT
    if kind == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and -MAX_COUNT <= value <= MAX_COUNT
    if kind == _DICT:
        return isinstance(value, dict)
    return isinstance(value, list)


def _what(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def place_files(names: list[str], writer_nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """file name -> the node that wrote it (node_id, node_ip, hostname, node_index), read from the node tag
    in its name and the manifest's ``writer_nodes``; {} for a file of an unknown node."""
    from rllib_recorder.format.layout import file_tag_of, node_tag

    index_of = {node_tag(int(i)): i for i in writer_nodes}
    placed = {}
    for name in sorted(names):
        index = index_of.get(file_tag_of(name))
        placed[name] = {**writer_nodes[index], "node_index": int(index)} if index is not None else {}
    return placed
