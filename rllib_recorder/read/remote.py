"""Reading a run at a durable target: its manifest, indexes and segments copied once to a local cache.

Segments are immutable, so a cached one is fetched again only when its index names another size or SHA-256 than
the copy was checked against (a download is checked against the index's SHA-256 before it is used, and the digest
kept beside it, ``NNNNNN.h5.sha256``): a run recorded again at the same URI, or the same path on another store,
never reads an older run's segment of the same name and size. The manifest and the indexes are small and fetched
every time a run is opened, so a run still recording shows its newest sealed segments.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Any

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import segments, store
from rllib_recorder.format.h5file import open_h5

CACHE_ENV = "RLLIB_RECORDER_CACHE"


def cache_dir_for(uri: str) -> str:
    """The local copy of the run at ``uri``: under ``$RLLIB_RECORDER_CACHE`` or ``~/.cache/rllib_recorder``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rllib_recorder", "runs")
    public = store.public_uri(uri).split("?", 1)[0].rstrip("/")
    name = posixpath.basename(public) or "run"
    return os.path.join(root, f"{name}-{hashlib.sha256(public.encode()).hexdigest()[:12]}")


def local_copy(uri: str, filesystem: Any = None, cache_dir: str | None = None) -> str:
    """Copies what the run at ``uri`` holds that the cache lacks; returns the local run directory."""
    target = store.resolve(uri, filesystem)
    local = cache_dir or cache_dir_for(uri)
    try:
        if target.size("manifest.json") is None:
            raise SchemaError(f"{store.public_uri(uri)} holds no manifest.json; pass the run directory (the "
                              "recorder prints it when the run starts; 'rllib-recorder info' on its parent lists runs)")
        import pyarrow.fs as pafs

        os.makedirs(local, exist_ok=True)
        target.get("manifest.json", os.path.join(local, "manifest.json"))
        listing = target.fs.get_file_info(pafs.FileSelector(target.path, recursive=False))
        for info in listing:
            name = posixpath.basename(info.path)
            if info.type == pafs.FileType.File and name.endswith(".h5"):
                index = os.path.join(local, name)
                target.get(name, index)
                _fetch_segments(target, local, index)
    except OSError as e:
        raise SchemaError(f"cannot read {store.public_uri(uri)} ({(str(e).strip().splitlines() or [''])[0]}); "
                          "check the URI, the store's endpoint and your credentials") from None
    return local


def _fetch_segments(target: store.Target, local: str, index: str) -> None:
    with open_h5(index, "r") as h5:
        records = segments.segment_list(h5)
    stem = os.path.basename(index)[: -len(".h5")]
    for record in records or []:
        rel = segments.target_segment(stem, record["name"])
        path = os.path.join(local, *rel.split("/"))
        if not _cached(path, record):
            target.get(rel, path, size=record["size"], sha256=record.get("sha256"))
            if record.get("sha256"):
                with open(path + ".sha256", "w") as f:
                    f.write(record["sha256"])


def _cached(path: str, record: dict) -> bool:
    """Whether the cached copy at ``path`` is the segment ``record`` names: its size, and the SHA-256 it was checked
    against when it was fetched (read from beside it: nothing is hashed again)."""
    if not (os.path.exists(path) and os.path.getsize(path) == record["size"]):
        return False
    if not record.get("sha256"):
        return True
    try:
        with open(path + ".sha256") as f:
            return f.read() == record["sha256"]
    except OSError:
        return False
