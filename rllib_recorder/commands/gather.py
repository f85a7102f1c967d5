"""Gather: copy a run whose files sit in node-local directories into one directory, through Ray tasks on each node."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import ray

from rllib_recorder._rllib_compat import generator_backpressure
from rllib_recorder.errors import GatherError, SchemaError
from rllib_recorder.format import durable
from rllib_recorder.format.manifest import MANIFEST_NAME, now_iso, read_json, read_manifest, write_manifest

PIECE_BYTES = 4 << 20

MARKER_NAME = "gather.json"  # in the target while a gather is unfinished: which run it is gathering

PART_SUFFIX = ".part"


@dataclass(frozen=True)
class Source:
    """One file of a run and the node that holds it (``node_id`` None: in the run directory here)."""

    name: str
    node_id: str | None = None
    node_ip: str = ""
    hostname: str = ""

    def where(self) -> str:
        return f"node {self.node_id} ({self.node_ip}, {self.hostname})" if self.node_id else "this machine"


def run_sources(run_dir: str, manifest: dict[str, Any]) -> list[Source]:
    """The files of a run: the manifest's ``files`` with their nodes, or (older runs) the ``*.h5`` here."""
    files = manifest.get("files")
    if isinstance(files, dict):
        return [Source(name, info.get("node_id"), info.get("node_ip", ""), info.get("hostname", ""))
                for name, info in sorted(files.items())]
    names = set(files or []) | {os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.h5"))}
    return [Source(name) for name in sorted(names)]


def needs_cluster(run_dir: str) -> bool:
    """True when a file of the run is not readable in ``run_dir`` here (so Ray tasks must read it on its node);
    reads and checks the manifest first (SchemaError, GatherError)."""
    if not os.path.isdir(run_dir):
        raise SchemaError(f"{run_dir} is not a directory; pass the run directory (it holds manifest.json)")
    return any(not os.path.isfile(os.path.join(run_dir, s.name)) for s in run_sources(run_dir, read_manifest(run_dir)))


def gather_run(run_dir: str, target: str, *, progress: Callable[[str, int], None] | None = None,
               piece_bytes: int = PIECE_BYTES) -> dict[str, str]:
    """Copies every file of the run ``run_dir`` into ``target`` and writes its manifest there.

    A file on a live node of the connected Ray cluster is read by tasks pinned to that node and
    streamed here in pieces; a file whose node is not in the cluster is copied from ``run_dir``
    when it is readable here (one machine, or a shared file system). Resumable: a file already
    in ``target`` with the source's size and sha256 is skipped, a ``.part`` file is continued.
    Every copy is checked against the size and sha256 computed next to the source.
    Returns file name -> what was done.
    """
    if not os.path.isdir(run_dir):
        raise SchemaError(f"{run_dir} is not a directory; pass the run directory (it holds manifest.json)")
    manifest = read_manifest(run_dir)
    if manifest.get("status") not in ("finished", "recovered"):
        raise GatherError(f"{run_dir} is still {manifest.get('status')!r}; gather a run once it is finished "
                          "(or after 'rllib-recorder recover')")
    _claim(target, run_dir, manifest)
    alive = _alive_nodes()
    done, copied = {}, {}
    for source in run_sources(run_dir, manifest):
        reader = _reader(source, run_dir, target, alive)
        done[source.name], copied[source.name] = copy_file(reader, os.path.join(target, source.name),
                                                           progress, piece_bytes)
    gathered = dict(manifest)
    gathered["files"] = copied
    gathered["gathered_from"] = {
        "run_dir": os.path.abspath(run_dir), "gathered_at": now_iso(),
        "files": manifest.get("files"), "writer_nodes": manifest.get("writer_nodes"),
    }
    write_manifest(target, gathered)
    os.remove(os.path.join(target, MARKER_NAME))
    return done


def copy_file(reader: "FileReader", path: str, progress: Callable[[str, int], None] | None,
              piece_bytes: int) -> tuple[str, dict[str, Any]]:
    """Copies one file through ``reader`` into ``path`` (via ``path.part``); (what was done, size and sha256)."""
    size, sha256 = reader.digest()
    checked = {"bytes": size, "sha256": sha256}
    if os.path.isfile(path) and _digest_local(path) == (size, sha256):
        return "already copied", checked
    part = path + PART_SUFFIX
    for attempt in range(2):
        offset = os.path.getsize(part) if os.path.isfile(part) else 0
        if offset > size or attempt:
            offset = 0
        resumed = offset
        digest = _hash_prefix(part, offset)
        with open(part, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.truncate()
            for piece in reader.pieces(offset, piece_bytes):
                f.write(piece)
                digest.update(piece)
                offset += len(piece)
                if progress is not None:
                    progress(os.path.basename(path), len(piece))
            f.flush()
            os.fsync(f.fileno())
        if offset == size and digest.hexdigest() == sha256:
            durable.replace(part, path)
            how = f"copied {size - resumed} bytes from {reader.where()}"
            return how + (f" (resumed at byte {resumed})" if resumed else ""), checked
    os.remove(part)
    raise GatherError(f"the copy of {reader.source.name} does not match its source on {reader.source.where()} "
                      f"(size or sha256 differ; was the file changed while gathering?); run gather again")


class FileReader:
    """Reads one source file: in this process, or (``node_id`` given) through tasks pinned to its node."""

    def __init__(self, source: Source, path: str, node_id: str | None) -> None:
        self.source = source
        self.path = path
        self.node_id = node_id

    def where(self) -> str:
        if self.node_id is not None or self.source.node_id is None:
            return self.source.where()
        return f"the run directory here (its {self.source.where()} is not in the cluster)"

    def digest(self) -> tuple[int, str]:
        if self.node_id is None:
            return self._local(_digest_local, self.path)
        with self._remote_errors():
            return ray.get(_remote_digest.options(scheduling_strategy=self._on_node()).remote(self.path))

    def pieces(self, offset: int, piece_bytes: int) -> Iterator[bytes]:
        if self.node_id is None:
            try:
                yield from _read_pieces(self.path, offset, piece_bytes)
            except OSError as e:
                raise self._unreadable(e) from None
            return
        task = _remote_pieces.options(scheduling_strategy=self._on_node(), **generator_backpressure(4))
        with self._remote_errors():
            for ref in task.remote(self.path, offset, piece_bytes):
                yield ray.get(ref)

    def _local(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            raise self._unreadable(e) from None

    def _unreadable(self, error: OSError) -> GatherError:
        return GatherError(f"cannot read {self.path} ({type(error).__name__}: {error}); check that the run is "
                           "complete, or repair it with 'rllib-recorder recover'")

    @contextlib.contextmanager
    def _remote_errors(self) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise GatherError(f"{self.source.name} is not in {os.path.dirname(self.path)} on "
                              f"{self.source.where()}; was the run moved or deleted there?") from None
        except (ray.exceptions.RayError, OSError) as e:
            raise GatherError(
                f"reading {self.source.name} on {self.source.where()} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); if the node is gone, restart it and join the "
                "cluster, then run gather again (what was copied is kept)") from None

    def _on_node(self) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(self.node_id, soft=False)


def _reader(source: Source, run_dir: str, target: str, alive: set[str]) -> FileReader:
    path = os.path.join(run_dir, source.name)
    if source.node_id and source.node_id in alive:
        return FileReader(source, path, source.node_id)
    if os.path.isfile(path):  # the node is gone or unknown here, but its file is readable here
        return FileReader(source, path, None)
    connected = "is not in the connected Ray cluster" if alive else "is not reachable (Ray is not running here)"
    raise GatherError(
        f"{source.name} lives on {source.where()}, which {connected}; start Ray on that machine and join "
        f"this cluster (ray start --address=<head address>), or copy {path} from it into {target} by hand, "
        "then run gather again"
    )


def _claim(target: str, run_dir: str, manifest: dict[str, Any]) -> None:
    """Makes ``target`` ours (new, empty, or holding this same run); GatherError otherwise."""
    if os.path.realpath(target) == os.path.realpath(run_dir):
        raise GatherError(f"{target} is the run directory itself; gather into another directory")
    run_id = manifest.get("run_id")
    marker = os.path.join(target, MARKER_NAME)
    if os.path.isfile(os.path.join(target, MANIFEST_NAME)):
        held = read_manifest(target).get("run_id")
    elif os.path.isfile(marker):
        held = read_json(marker, "gather marker", f"delete {marker} if no gather into {target} is running")
        held = held.get("run_id") if isinstance(held, dict) else None
    elif os.path.isdir(target) and os.listdir(target):
        raise GatherError(f"{target} is not empty and holds no run; gather into a new or empty directory")
    else:
        held = run_id
    if held != run_id:
        raise GatherError(f"{target} already holds run {held}, not run {run_id} of {run_dir}; "
                          "gather into a new or empty directory")
    os.makedirs(target, exist_ok=True)
    with open(marker, "w") as f:
        json.dump({"run_id": run_id, "run_dir": os.path.abspath(run_dir), "started_at": now_iso()}, f)


def _alive_nodes() -> set[str]:
    if not ray.is_initialized():
        return set()
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _read_pieces(path: str, offset: int, piece_bytes: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(offset)
        while piece := f.read(piece_bytes):
            yield piece


def _hash_prefix(path: str, nbytes: int) -> Any:
    digest = hashlib.sha256()
    if nbytes:
        with open(path, "rb") as f:
            while nbytes > 0 and (piece := f.read(min(PIECE_BYTES, nbytes))):
                digest.update(piece)
                nbytes -= len(piece)
    return digest


def _digest_local(path: str) -> tuple[int, str]:
    size = os.path.getsize(path)
    return size, _hash_prefix(path, size).hexdigest()


@ray.remote(num_cpus=0)
def _remote_digest(path: str) -> tuple[int, str]:
    return _digest_local(path)


@ray.remote(num_cpus=0, num_returns="streaming")
def _remote_pieces(path: str, offset: int, piece_bytes: int) -> Iterator[bytes]:
    yield from _read_pieces(path, offset, piece_bytes)


def connect_ray(address: str | None) -> None:
    """Joins the given (or running) Ray cluster; without one, gather copies the files it can read here.
    GatherError when ``address`` is given and can't be joined."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    except (ConnectionError, RuntimeError) as e:
        if address:
            raise GatherError(f"cannot join the Ray cluster at {address} ({e}); check the address "
                              "(the head's GCS address, e.g. 10.0.0.1:6379)") from None
