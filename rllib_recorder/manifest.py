"""The run manifest: one JSON file per run directory, written atomically."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

from rllib_recorder.errors import SchemaError

MANIFEST_NAME = "manifest.json"


def versions() -> dict[str, str]:
    """Versions of everything that shapes what a run stores."""
    import gymnasium
    import h5py
    import numpy
    import ray

    from rllib_recorder import __version__

    return {
        "rllib_recorder": __version__, "ray": ray.__version__, "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
        "python": platform.python_version(),
    }


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_manifest(run_dir: str, manifest: dict[str, Any]) -> str:
    """Writes ``manifest.json`` atomically (a crash leaves the old or the new one)."""
    return write_json_atomic(os.path.join(run_dir, MANIFEST_NAME), manifest)


def write_json_atomic(path: str, value: Any) -> str:
    """Writes ``value`` as JSON to ``path`` via an fsynced temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(run_dir: str) -> dict[str, Any]:
    """Reads a run's manifest; SchemaError names the problem when it is missing or broken."""
    path = os.path.join(run_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise SchemaError(f"{run_dir} is not an rllib_recorder run: it has no {MANIFEST_NAME}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise SchemaError(f"{path} is not a readable manifest ({e}); run 'rllib-recorder recover'") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "rllib_recorder":
        raise SchemaError(f"{path} is not an rllib_recorder manifest")
    return manifest


def place_files(names: list[str], writer_nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """file name -> the node that wrote it (node_id, node_ip, hostname, node_index), read from the node tag
    in its name and the manifest's ``writer_nodes``; {} for a file of an unknown node."""
    from rllib_recorder.schema import file_tag_of, node_tag

    index_of = {node_tag(int(i)): i for i in writer_nodes}
    placed = {}
    for name in sorted(names):
        index = index_of.get(file_tag_of(name))
        placed[name] = {**writer_nodes[index], "node_index": int(index)} if index is not None else {}
    return placed
