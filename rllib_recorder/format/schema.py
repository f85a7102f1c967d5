"""The HDF5 file layout in one place: names, schema version, create, append, commit, repair."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import durable
from rllib_recorder.format import repair as h5repair
from rllib_recorder.record.convert import (
    HEAD_PREFIX,
    Chunk,
    Stream,
    decode_codes,
    encode_uint8,
    fragment_starts,
    image_grid,
    stack_frames,
    unstack_frames,
    unstack_stream,
)

FORMAT_NAME = "rllib_recorder"
SCHEMA_VERSION = "2.1"
# Majors this reader reads: 2.0 may store frame stacks as their newest frames (FRAME_STACK_ATTR), which a 1.x
# reader would return as they are stored; 1.x files hold nothing a 2.0 reader reads differently.
READABLE_MAJORS = ("1", "2")
SENDER_ID_DTYPE = np.dtype("S32")

# Every name below is documented in docs/FORMAT.md (a test checks it).
FILE_ATTRS = {
    "format": "always 'rllib_recorder'",
    "schema_version": "'MAJOR.MINOR'; readers refuse an unknown major version",
    "recorder_version": "version of the rllib_recorder package that wrote the file",
    "run_id": "id of the run (also in the manifest)",
    "worker_index": "RLlib env runner index (0: the local runner)",
    "is_evaluation": "True for evaluation env runners",
    "created_at": "ISO-8601 time the file was created",
    "commit": "JSON: committed row counts (see 'Commit record')",
}
BATCH_COLUMNS = {
    "sender_id": "id of the env-runner process incarnation that sent the chunk",
    "seq": "sequence number of the chunk within its sender (0, 1, 2, ...)",
    "env_steps": "env steps in the chunk",
    "agent_steps": "agent steps (rows over all agents) in the chunk",
    "num_samples": "on_sample_end calls coalesced into the chunk",
    "sampled_at_s": "wall time (Unix s) of the chunk's first on_sample_end",
    "written_at_s": "wall time (Unix s) the writer committed the chunk",
    "learner_version": "newest weights_seq_no the learner had finished when the chunk was sampled "
                       "(-1: unknown; see 'Policy lag')",
    "weights_seq_no_min": "oldest behaviour-policy version in the chunk",
    "weights_seq_no_max": "newest behaviour-policy version in the chunk",
    "raw_bytes": "bytes of the chunk's arrays before compression",
    "sender_env_steps_sampled": "env steps the sender had sampled (every on_sample_end, stored or not) up to "
                                "and including this chunk's last sample (schema 2.1; see 'Completeness')",
    "sender_env_steps_not_stored": "env steps the sender had sampled but could not hand over by then "
                                   "(back-pressure drops, a full disk, unconvertible samples) (schema 2.1)",
}
# Sender counters a 2.1 batch row keeps (from the record's sender stats), so that verify finds gaps from the file.
SENDER_COUNTERS = {"sender_env_steps_sampled": "env_steps_sampled",
                   "sender_env_steps_not_stored": "env_steps_not_stored"}
STEP_COLUMNS = {
    "obs": "observation the action was computed from (nested spaces: a group)",
    "actions": "action taken (nested spaces: a group)",
    "rewards": "reward of the step",
    "terminateds": "the episode terminated with this step",
    "truncateds": "the episode was truncated with this step",
    "eps_id": "episode id (bytes)",
    "t": "step index within the agent's episode",
    "weights_seq_no": "behaviour policy version that chose the action (-1: unknown)",
    "agent_index": "old API stack: index of the agent in its env",
    "extra_model_outputs": "group: action_logp, action_dist_inputs, vf_preds, ...",
}
FRAGMENT_COLUMNS = {
    "eps_id": "episode id",
    "num_rows": "steps of the fragment",
    "first_row": "row of the fragment's first step in steps/",
    "t_start": "t of the fragment's first step (> 0: continues an earlier fragment)",
    "terminated": "the episode terminated at the fragment's end",
    "truncated": "the episode was truncated at the fragment's end",
    "return": "sum of the fragment's rewards",
    "module_id": "RLModule (policy) that acted",
    "has_last_obs": "the fragment stores its final observation",
    "last_obs": "observation after the fragment's last step (nested: a group)",
    "infos": "JSON list: the info of every observation of the fragment",
    "batch": "row in /batches of the chunk that carried the fragment",
    "start_state": "bytes: the env's state at the episode's start (first fragment only; empty: none)",
    "start_state_kind": "how start_state was captured: 'classic_control/1', 'ale/1', or '' (none)",
}


@dataclass(frozen=True)
class StorageOptions:
    """How datasets are created (mirrors the recorder settings)."""

    compression: str = "gzip"
    compression_level: int = 1
    hdf5_chunk_bytes: int = 64 << 10
    fsync: bool = False
    encode_uint8: bool = True
    # Store frame-stacked observations as their newest frames (convert.stack_frames); checked on every chunk.
    stack_frames: bool = True
    # HDF5 file-space strategy of new files. "none": space a rewritten chunk frees is never
    # handed out again while the file is open, so a kill can't overwrite committed rows
    # that the on-disk index still points at (see docs/RELIABILITY.md); the dead space is
    # compacted away on close. "fsm" is HDF5's default (reuses freed space at once).
    file_space: str = "none"


# A float32 image column holding exact uint8 values scaled is stored as uint8 with these
# attributes; the value is ``stored * scale + offset`` (as float32). RLlib's Atari wrappers
# give u8 / 128 - 1; plain normalisation gives u8 / 255.
ENCODING_ATTRS = {
    "encoding": "'affine_uint8': the column stores uint8 codes of float32 values",
    "scale": "float32 value = code * scale + offset",
    "offset": "see scale",
}
# Rows per chunk of a column of small rows. Every append recompresses each column's partial last chunk, so
# this bounds the work an append does beyond its own rows: 4096 cost 7.7 ms of writer CPU per 600-row CartPole
# append, 1024 4.9 ms, for 3% more bytes (docs/BENCHMARKS.md, 'Writer: cost of one append').
MAX_CHUNK_ROWS = 1024
# Index tables (/batches: one row per append; fragments: one per episode fragment) get a few rows per append, and
# compressing their partial chunks on every flush was half of a CartPole append's writer CPU (3.99 -> 1.97 ms per
# 600-row append; docs/BENCHMARKS.md): their columns of small rows are stored without a filter, in chunks of
# INDEX_CHUNK_ROWS rows, which bounds the space an unfiltered chunk holds before it fills.
INDEX_CHUNK_ROWS = 256
INDEX_PLAIN_ROW_BYTES = 64
# A step column is compressed unless its first rows compress less than this (CartPole's float32 observations and
# log-probs: 1.1x): deflate then costs CPU on every flush for almost no bytes.
MIN_COMPRESSION_RATIO = 1.25
TRIAL_BYTES = 4096  # fewer first rows than this: compressed without a trial
# HDF5 chunk cache of each column of a file open for appending. The writer keeps its columns
# open, so only the partial last chunk of each needs to stay cached (a chunk is at most
# hdf5_chunk_bytes, 64 KiB by default); HDF5's default, 1 MiB per column, would let a file of
# ~35 columns hold ~35 MiB of old chunks in the writer's memory.
APPEND_CHUNK_CACHE_BYTES = 128 << 10


def file_name(worker_index: int, is_evaluation: bool = False, tag: str = "") -> str:
    """The file name of one env runner's data inside a run directory (``tag``: the writer's node, if not the driver's)."""
    return f"{'eval-' if is_evaluation else ''}worker-{worker_index:03d}{'.' + tag if tag else ''}.h5"


def node_tag(node_index: int) -> str:
    """The tag in the names of files written on node ``node_index`` of a run: none on the driver's node (0).

    File names are unique over the whole run, so node-local directories gather into one without clashes,
    and a runner restarted on another node never shares a file with its old writer.
    """
    return f"node{node_index}" if node_index else ""


def file_tag_of(name: str) -> str:
    """The node tag in a file name made by ``file_name`` ('' when it has none)."""
    stem = name[: -len(".h5")] if name.endswith(".h5") else name
    return stem.rpartition(".")[2] if "." in stem else ""


def check_version(found: Any, where: str) -> None:
    """Raises SchemaError unless ``found`` is a schema version this reader understands."""
    from rllib_recorder import __version__

    major = str(found).split(".")[0]
    if major not in READABLE_MAJORS:
        raise SchemaError(
            f"{where} has schema version {found}, but rllib_recorder {__version__} reads "
            f"versions {' and '.join(m + '.x' for m in READABLE_MAJORS)}; install a matching rllib_recorder"
        )


def open_h5(path: str, mode: str = "r", **kwargs: Any) -> h5py.File:
    """``h5py.File`` for every open of a worker file by this package; a writer's opens take no HDF5 file lock.

    A worker file has one writer by design, and readers coordinate with it through the file's commit record, not
    a lock: with HDF5's locks a reader could not open a file while it records, and a writer reopening its file
    (after a compaction) would fail while a reader had it open. Reads open as plain ``h5py.File`` does (so that a
    user's own ``h5py.File`` of the same file in the same process still opens) and fall back to no locking when
    the file is locked or already open here without locks.
    """
    if mode != "r":
        try:
            return h5py.File(path, mode, locking=False, **kwargs)
        except OSError as e:
            if not _lock_trouble(e):
                raise
            return h5py.File(path, mode, **kwargs)
    try:
        return h5py.File(path, mode, **kwargs)
    except OSError as e:
        if not _lock_trouble(e):
            raise
        return h5py.File(path, mode, locking=False, **kwargs)


def _lock_trouble(error: OSError) -> bool:
    text = str(error)
    return "lock" in text and ("flag values don't match" in text or "unable to lock" in text
                               or getattr(error, "errno", None) == 11)


def create_file(path: str, file_space: str = "none") -> h5py.File:
    """Creates a new HDF5 file with the file-space strategy ``file_space`` (refuses an existing one)."""
    if file_space == "none":
        # fs_persist/threshold only matter for the "fsm" and "page" strategies.
        return open_h5(path, "x", fs_strategy="none", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES)
    return open_h5(path, "x", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES)


def open_for_append(path: str, attrs: Mapping[str, Any], file_space: str = "none") -> h5py.File:
    """Opens (creating if needed) a worker file for appending, dropping uncommitted rows."""
    exists = os.path.exists(path)
    if exists:  # before HDF5 opens it for writing, which would cut a killed writer's last bytes off
        h5repair.extend_eoa_to_eof(path)
    h5 = open_h5(path, "a", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES) if exists else create_file(path, file_space)
    if not exists or "format" not in h5.attrs:
        from rllib_recorder import __version__

        h5.attrs.update({
            "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION,
            "recorder_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        write_commit(h5, {"batches": 0, "agents": {}})
        h5.attrs.update({k: v for k, v in attrs.items() if v is not None})
        h5.require_group("batches")
        h5.require_group("agents")
        h5.flush()
    else:
        validate_header(h5, path)
        _finish_float_rewrites(h5)
        if uncommitted_rows(h5):
            # Truncating in place would rewrite chunks and variable-length heaps that a
            # killed writer may have left half-written: copy the committed rows instead.
            h5.close()
            rewrite_committed(path)
            h5 = open_h5(path, "a", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES)
    return h5


@contextlib.contextmanager
def damaged_file_errors(
    path: str, fix: str = "run 'rllib-recorder recover' on its run directory, or remove the file"
) -> Iterator[None]:
    """Turns what h5py raises on a damaged or foreign file into a one-line SchemaError naming ``path`` and ``fix``."""
    try:
        yield
    except SchemaError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, AttributeError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise SchemaError(
            f"{path} is damaged or not an rllib_recorder file ({type(e).__name__}: {first}); {fix}"
        ) from None


def validate_header(h5: h5py.File, path: str) -> None:
    """Raises SchemaError if ``h5`` is not an rllib_recorder worker file of a known version."""
    if h5.attrs.get("format") != FORMAT_NAME:
        raise SchemaError(f"{path} is an HDF5 file but not an rllib_recorder worker file")
    check_version(h5.attrs.get("schema_version"), path)


def read_commit(h5: h5py.File) -> dict[str, Any]:
    """The commit record: how many batches, and rows/fragments per agent, are committed."""
    return json.loads(h5.attrs["commit"])


# Bytes the commit record holds before its attribute must be made larger (about 25 agents).
COMMIT_BYTES = 1024


def write_commit(h5: h5py.File, commit: Mapping[str, Any]) -> int:
    """Writes the commit record in place: a fixed-size byte string (JSON padded with spaces).

    A variable-length string attribute is rewritten by deleting and re-creating it, which now and then
    gives the root group's object header a new chunk at the end of the file; HDF5 flushes metadata in
    address order, so the header pointing at that chunk reached the disk first, and a kill in between
    left a file no HDF5 could open (found by scripts/killloop.py). Overwriting a fixed-size attribute
    allocates nothing. It is re-created (at twice the size) only when the record outgrows it.
    Returns the attribute's capacity in bytes.
    """
    return _write_commit_data(h5, _commit_json(commit))


def _commit_json(commit: Mapping[str, Any]) -> bytes:
    return json.dumps(commit, separators=(",", ":")).encode()


def _padded(data: bytes, capacity: int) -> np.ndarray:
    """The commit record as the fixed-size string its attribute holds."""
    return np.array(data.ljust(capacity), dtype=f"S{capacity}")


def _write_commit_data(h5: h5py.File, data: bytes) -> int:
    """``write_commit`` of a record already encoded; returns the attribute's capacity."""
    capacity = _commit_capacity(h5)
    if len(data) <= capacity:
        h5.attrs.modify("commit", _padded(data, capacity))
        return capacity
    capacity = COMMIT_BYTES
    while capacity < 2 * len(data):
        capacity *= 2
    if "commit" in h5.attrs:
        del h5.attrs["commit"]
    h5.attrs.create("commit", _padded(data, capacity))
    return capacity


def _commit_capacity(h5: h5py.File) -> int:
    """Bytes the existing commit attribute holds in place (0: none, or a variable-length string)."""
    if "commit" not in h5.attrs:
        return 0
    dtype = h5.attrs.get_id("commit").dtype
    return dtype.itemsize if dtype.kind == "S" else 0


def committed_upto(h5: h5py.File) -> dict[bytes, int]:
    """Per sender id: the first seq not yet committed (a batch row commits seqs ``seq .. seq + num_samples - 1``)."""
    batches = h5["batches"]
    rows = int(read_commit(h5)["batches"])
    if "seq" not in batches or not rows:
        return {}
    ends = batches["seq"][:rows] + (batches["num_samples"][:rows] if "num_samples" in batches else 1)
    out: dict[bytes, int] = {}
    for sender, end in zip(batches["sender_id"][:rows].tolist(), ends.tolist()):
        out[sender] = max(out.get(sender, 0), int(end))
    return out


def committed_totals(h5: h5py.File) -> dict[str, int]:
    """What a file's committed batch rows hold: chunks, env and agent steps, raw bytes (a writer's totals)."""
    rows = int(read_commit(h5)["batches"])
    batches = h5["batches"]
    if not rows or "env_steps" not in batches:
        return {}
    return {"chunks": rows, **{name: int(batches[name][:rows].sum()) for name in ("env_steps", "agent_steps", "raw_bytes")
                               if name in batches}}


def _tables(h5: h5py.File) -> list[tuple[str, int]]:
    """(group path, committed rows) of every table in the file."""
    commit = read_commit(h5)
    tables = [("batches", int(commit["batches"]))]
    for key in h5["agents"]:
        rows, frags = commit["agents"].get(key, (0, 0))
        tables += [(f"agents/{key}/steps", int(rows)), (f"agents/{key}/fragments", int(frags))]
    return tables


def uncommitted_rows(h5: h5py.File) -> dict[str, int]:
    """Rows past the commit record per column (left by a writer killed mid-append).

    Raises SchemaError when a column holds fewer rows than the commit names.
    """
    extra: dict[str, int] = {}
    for name, rows in _tables(h5):
        if name not in h5:
            continue

        def visit(path: str, item: Any, name: str = name, rows: int = rows) -> None:
            if isinstance(item, h5py.Dataset) and item.shape[0] != rows:
                if item.shape[0] < rows:
                    raise SchemaError(
                        f"{h5.filename}: {name}/{path} has {item.shape[0]} rows but {rows} are "
                        "committed; the file is damaged beyond repair"
                    )
                extra[f"{name}/{path}"] = item.shape[0] - rows

        h5[name].visititems(visit)
    return extra


def rewrite_committed(path: str, copy_rows: int = 1 << 16) -> dict[str, int]:
    """Replaces ``path`` by a fresh copy holding only committed rows; returns rows dropped per column.

    Only reads the old file, so it works on files a killed writer left behind; the
    new file replaces the old one atomically (a crash leaves one or the other).
    """
    tmp = f"{path}.rewrite-tmp"
    with _temporary(tmp), open_h5(path, "r") as src, open_h5(tmp, "w", fs_strategy="none") as dst:
        validate_header(src, path)
        dropped = uncommitted_rows(src)
        dst.attrs.update(dict(src.attrs))
        dst.require_group("batches")
        dst.require_group("agents")
        for name, rows in _tables(src):
            if name in src:
                _copy_table(src[name], dst.require_group(name), rows, copy_rows)
        dst.flush()
        os.fsync(dst.id.get_vfd_handle())
    durable.replace(tmp, path)
    return dropped


@contextlib.contextmanager
def _temporary(tmp: str) -> Iterator[None]:
    """Removes ``tmp`` when the block fails (a full disk must not leave half a copy behind)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def chunk_bytes(h5: h5py.File) -> int:
    """Bytes the datasets' chunks take (for variable-length columns only the heap references)."""
    sizes: list[int] = []
    h5.visititems(lambda _, o: sizes.append(o.id.get_storage_size()) if isinstance(o, h5py.Dataset) else None)
    return sum(sizes)


def heap_bytes(chunk: Chunk) -> int:
    """Bytes a chunk's variable-length values (JSON infos, start states, ids) add to the file's heap."""
    total = 0
    for stream in chunk.streams.values():
        for table in (stream.steps, stream.fragments):
            for values in table.values():
                if values.dtype == object:
                    total += sum(len(v) + 16 for v in values)  # + the heap object's header
    return total


def should_compact(file_bytes: int, live: int, slack_bytes: int = 8 << 20) -> bool:
    """Whether a file's dead space (space freed chunks left behind, never reused) is worth a copy.

    Compacting once the dead space exceeds the live data bounds the file at about twice its
    data plus ``slack_bytes``, at an amortised cost of at most one extra copy of each byte.
    """
    return file_bytes - live > live + slack_bytes


def compact(path: str) -> int:
    """Rewrites a closed, fully committed file without dead space; returns the bytes saved.

    Datasets are copied by HDF5 (H5Ocopy: compressed chunks are copied as they are). The
    copy is fsynced and then atomically replaces the file: a crash leaves one or the other.
    """
    before = os.path.getsize(path)
    tmp = f"{path}.rewrite-tmp"
    with open_h5(path, "r") as src:
        if uncommitted_rows(src):
            src.close()
            rewrite_committed(path)
            return before - os.path.getsize(path)
        with _temporary(tmp), open_h5(tmp, "w", fs_strategy="none") as dst:
            dst.attrs.update(dict(src.attrs))
            for name in src:
                src.copy(src[name], dst, name=name)
            dst.flush()
            os.fsync(dst.id.get_vfd_handle())
    durable.replace(tmp, path)
    return before - os.path.getsize(path)


def _copy_table(src: h5py.Group, dst: h5py.Group, rows: int, copy_rows: int) -> None:
    def visit(path: str, item: Any) -> None:
        if isinstance(item, h5py.Group):
            dst.require_group(path).attrs.update(dict(item.attrs))
            return
        out = dst.create_dataset(
            path, shape=(rows,) + item.shape[1:], maxshape=item.maxshape, dtype=item.dtype,
            chunks=item.chunks, compression=item.compression, compression_opts=item.compression_opts,
            shuffle=item.shuffle,
        )
        out.attrs.update(dict(item.attrs))
        for start in range(0, rows, copy_rows):
            stop = min(rows, start + copy_rows)
            try:
                values = item[start:stop]
                if h5py.check_vlen_dtype(item.dtype) == np.uint8:  # byte arrays (start states): row by row
                    for i, value in enumerate(values):
                        out[start + i] = value
                else:
                    out[start:stop] = values
            except (OSError, ValueError, TypeError) as e:
                raise SchemaError(
                    f"{src.file.filename}: committed rows {start}-{stop} of {src.name}/{path} are "
                    f"unreadable ({e}); the file is damaged beyond repair"
                ) from None

    src.visititems(visit)


class OpenColumns:
    """The groups and columns of one file open for appending, with what each append checks.

    An append writes a few dozen columns; looking each one up through h5py (group lookup,
    shape, dtype, attributes: new Python objects every time) cost as much as writing it.
    The writer keeps one of these per open file and drops it before closing the file.
    """

    def __init__(self, h5: h5py.File) -> None:
        self.h5 = h5
        self._groups: dict[str, h5py.Group] = {}
        self._names: dict[int, str] = {}  # id(group) -> its name (h5py looks a name up on every access)
        self._columns: dict[str, _Column] = {}
        # (stream group, column, container kind) already marked on the file
        self.containers_marked: set[tuple[str, str, str]] = set()
        # The commit record as last written, and its attribute held open: reading it back (attribute read, JSON
        # parse of 1 KiB) and writing it through h5py's attrs (lookups) took 108 us per append, 10 us this way.
        self._commit: dict[str, Any] | None = None
        self._commit_attr: Any = None
        self._commit_capacity = 0

    @functools.cached_property
    def stores_frame_stacks(self) -> bool:
        """Whether the file's schema version has frame-stacked columns (2.0; a 1.x file keeps full stacks)."""
        return str(self.h5.attrs.get("schema_version", SCHEMA_VERSION)).split(".")[0] != "1"

    def commit(self) -> dict[str, Any]:
        """A copy of the file's commit record, to change and pass to ``write_commit``."""
        if self._commit is None:
            self._commit = read_commit(self.h5)
        return {**self._commit, "agents": dict(self._commit["agents"])}

    def write_commit(self, commit: dict[str, Any]) -> None:
        """Writes ``commit`` in place (``write_commit``, without the lookups) and keeps it as the file's record."""
        data = _commit_json(commit)
        if self._commit_attr is not None and len(data) <= self._commit_capacity:
            self._commit_attr.write(_padded(data, self._commit_capacity))
        else:
            self._commit_attr = None  # re-created when it outgrows its capacity: open it anew
            self._commit_capacity = _write_commit_data(self.h5, data)
            self._commit_attr = self.h5.attrs.get_id("commit")
        self._commit = commit

    def group(self, name: str) -> h5py.Group:
        """The group ``name`` (created if missing)."""
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = self.h5.require_group(name)
            self._names[id(group)] = group.name
        return group

    def _key(self, group: h5py.Group, path: str) -> str:
        name = self._names.get(id(group))
        return f"{group.name if name is None else name}/{path}"

    def column(self, group: h5py.Group, path: str) -> "_Column | None":
        """The column ``path`` of ``group``, or None if the file has none yet."""
        key = self._key(group, path)
        column = self._columns.get(key)
        if column is None and path in group:
            column = self._columns[key] = _Column.of(group[path])
        return column

    def forget(self, group: h5py.Group, path: str) -> None:
        """Drops a column whose dataset is about to be replaced, and closes its dataset now rather than whenever
        Python frees it. (A full test run once segfaulted inside HDF5 in ``del group[path]`` of the replaced
        column; whether the still-open old dataset caused it is not proven, but unlinking a closed one is what
        ``_replace_column`` promises.)"""
        column = self._columns.pop(self._key(group, path), None)
        if column is not None and column.dataset.id.valid:
            column.dataset.id.close()

    def clear(self) -> None:
        """Drops every held dataset and group (before the file is closed)."""
        self._groups.clear()
        self._names.clear()
        self._columns.clear()
        self.containers_marked.clear()
        self._commit, self._commit_attr = None, None


@dataclass
class _Column:
    dataset: h5py.Dataset
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    encoding: tuple[np.float32, np.float32] | None
    stack: int | None = None  # frames per row of a frame-stacked column (FRAME_STACK_ATTR)

    @classmethod
    def of(cls, dataset: h5py.Dataset) -> "_Column":
        attrs = dataset.attrs
        encoding = None
        if attrs.get("encoding") == "affine_uint8":
            encoding = (np.float32(attrs["scale"]), np.float32(attrs["offset"]))
        stack = attrs.get(FRAME_STACK_ATTR)
        return cls(dataset, dataset.shape[0], dataset.shape[1:], dataset.dtype, encoding,
                   None if stack is None else int(stack))


def append_chunk(
    h5: h5py.File, chunk: Chunk, *, sender_id: bytes, seq: int, learner_version: int,
    options: StorageOptions, columns: OpenColumns | None = None, sender_stats: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Appends one chunk and commits it (one attribute write), then flushes.

    The chunk counts as stored only once the commit record names it; rows written
    before a crash but not committed are dropped when the file is reopened.
    ``columns``: the file's open columns, kept by the caller from one append to the next.
    """
    columns = columns if columns is not None else OpenColumns(h5)
    commit = columns.commit()
    batch_row = commit["batches"]
    versions = [s.steps["weights_seq_no"] for s in chunk.streams.values() if len(s.steps["weights_seq_no"])]
    all_versions = np.concatenate(versions) if versions else np.array([-1])
    for key, stream in chunk.streams.items():
        rows, frags = commit["agents"].get(key, (0, 0))
        _append_stream(columns, f"agents/{key}", stream, rows, frags, batch_row, options)
        commit["agents"][key] = (rows + stream.num_rows, frags + len(stream.fragments["eps_id"]))
    batch = {
        "sender_id": np.array([sender_id], dtype=SENDER_ID_DTYPE),
        "seq": np.array([seq], np.int64),
        "env_steps": np.array([chunk.env_steps], np.int64),
        "agent_steps": np.array([chunk.agent_steps], np.int64),
        "num_samples": np.array([chunk.num_samples], np.int64),
        "sampled_at_s": np.array([chunk.sampled_at_s], np.float64),
        "written_at_s": np.array([time.time()], np.float64),
        "learner_version": np.array([learner_version], np.int64),
        "weights_seq_no_min": np.array([all_versions.min()], np.int64),
        "weights_seq_no_max": np.array([all_versions.max()], np.int64),
        "raw_bytes": np.array([chunk.nbytes], np.int64),
    }
    batches = columns.group("batches")
    if not batch_row or "sender_env_steps_sampled" in batches:  # a 2.0 file being continued has no such columns
        stats = sender_stats or {}
        batch.update({column: np.array([int(stats.get(key, -1))], np.int64) for column, key in SENDER_COUNTERS.items()})
    _append_columns(columns, batches, batch, batch_row, options)
    # Rows first, commit second: one flush for both would let HDF5 write the commit
    # record before the rows it names, and a kill in between would commit garbage.
    _flush(h5, options)
    commit["batches"] = batch_row + 1
    columns.write_commit(commit)
    _flush(h5, options)
    return {"rows": chunk.agent_steps, "batch_row": batch_row}


def _flush(h5: h5py.File, options: StorageOptions) -> None:
    h5.flush()
    if options.fsync:
        os.fsync(h5.id.get_vfd_handle())


def _append_stream(
    columns: OpenColumns, name: str, stream: Stream, rows: int, frags: int, batch_row: int, options: StorageOptions
) -> None:
    steps = columns.group(f"{name}/steps")
    fragments = columns.group(f"{name}/fragments")
    stream = _stacks_as_stored(columns, steps, fragments, stream, rows, options)
    frag_cols = dict(stream.fragments)
    frag_cols["first_row"] = fragment_starts(frag_cols["num_rows"], rows)
    frag_cols["batch"] = np.full(len(frag_cols["first_row"]), batch_row, dtype=np.int64)
    _append_columns(columns, steps, stream.steps, rows, options, _codes(stream, "steps"), stream.stacked)
    _append_columns(columns, fragments, frag_cols, frags, options, _codes(stream, "fragments"))
    for path, kind in stream.containers.items():
        if (name, path, kind) in columns.containers_marked:
            continue
        target = steps if path in steps else fragments if path in fragments else None
        if target is not None and target[path].attrs.get("container") != kind:
            target[path].attrs["container"] = kind
        columns.containers_marked.add((name, path, kind))


def _stacks_as_stored(columns: OpenColumns, steps: h5py.Group, fragments: h5py.Group, stream: Stream, rows: int,
                      options: StorageOptions) -> Stream:
    """``stream`` with its frame stacks as the file stores them (``convert.stack_frames``).

    A stream the env runner did not stack is stacked here if it can be. A stacked stream for a column stored as
    full stacks is rebuilt as full stacks; a stream that can't be stacked for a column stored stacked turns the
    column (its ``rows`` stored rows) into full stacks, once, lossless either way."""
    if options.stack_frames and columns.stores_frame_stacks:
        stream = stack_frames(stream, stream.fragments["num_rows"])
    elif stream.stacked:  # the writer was told to keep full stacks (or the file is 1.x)
        stream = unstack_stream(stream, list(stream.stacked))
    for path in [p for p in stream.steps if p.startswith("obs")]:
        column = columns.column(steps, path)
        stored = None if column is None else column.stack
        if column is None or stored == stream.stacked.get(path):
            continue
        stream = unstack_stream(stream, [path])
        if stored is not None:
            _unstack_column(columns, steps, fragments, path, rows, options)
    return stream


def _unstack_column(columns: OpenColumns, steps: h5py.Group, fragments: h5py.Group, path: str, rows: int,
                    options: StorageOptions) -> None:
    """Rewrites a frame-stacked step column as full stacks (its first ``rows`` rows) and drops its head column.

    As a float32 rewrite: a copy under FLOAT_SUFFIX replaces the column, so a crash leaves one or the other
    (``_finish_float_rewrites``); a head column left behind is dropped when the file is opened again."""
    dataset = steps[path]
    as_stored = _same_encoding(dataset, fragments[HEAD_PREFIX + path])  # else both as float32 (one was rewritten)
    full = read_rows(dataset, slice(0, rows), decode=not as_stored)
    attrs = {k: v for k, v in dataset.attrs.items()
             if k != FRAME_STACK_ATTR and (as_stored or k not in ENCODING_ATTRS)}
    del dataset
    encoding = (np.float32(attrs["scale"]), np.float32(attrs["offset"])) if "scale" in attrs else None
    _replace_column(columns, steps, path, full, full, options, encoding=encoding, attrs=attrs)
    columns.forget(fragments, HEAD_PREFIX + path)
    if HEAD_PREFIX + path in fragments:
        del fragments[HEAD_PREFIX + path]


FRAME_STACK_ATTR = "frame_stack"


def row_shape(dataset: h5py.Dataset) -> tuple[int, ...]:
    """The shape of one row as recorded (a frame-stacked column stores one frame of each row's stack)."""
    stack = dataset.attrs.get(FRAME_STACK_ATTR)
    return tuple(dataset.shape[1:]) if stack is None else tuple(dataset.shape[1:-1]) + (int(stack),)


def read_rows(dataset: h5py.Dataset, rows: slice, decode: bool = True) -> np.ndarray:
    """Rows of a column as recorded: ``affine_uint8`` codes decoded to float32 (unless ``decode`` is False), the
    frame stacks of a frame-stacked step column rebuilt from its newest frames and its fragments' head frames."""
    stack = dataset.attrs.get(FRAME_STACK_ATTR)
    if stack is None:
        values = dataset[rows]
        return decode_uint8(dataset, values) if decode else values
    start, stop, step = rows.indices(dataset.shape[0])
    if step != 1:
        raise ValueError(f"frame-stacked column {dataset.name} reads contiguous rows only (got step {step})")
    agent, _, path = dataset.name.partition("/steps/")
    head_path, firsts_path = f"{agent}/fragments/{HEAD_PREFIX}{path}", f"{agent}/fragments/first_row"
    if head_path not in dataset.file or firsts_path not in dataset.file:
        raise SchemaError(f"{dataset.file.filename}: {dataset.name} stores frame stacks as newest frames, but "
                          f"{head_path} or {firsts_path} is missing, so its stacks can't be rebuilt; the file is "
                          "damaged: move it out of the run directory to read the rest of the run")
    heads, firsts = dataset.file[head_path], dataset.file[firsts_path]
    stop = max(start, stop)
    first_rows = firsts[:]
    lo = max(int(np.searchsorted(first_rows, start, "right")) - 1, 0)
    hi = max(int(np.searchsorted(first_rows, stop, "left")), lo + 1)
    newest_start = max(start - int(stack) + 1, int(first_rows[lo]) if len(first_rows) else 0)
    newest, head_frames = dataset[newest_start:stop], heads[lo:hi]
    if decode:
        newest, head_frames = decode_uint8(dataset, newest), decode_uint8(heads, head_frames)
    elif not _same_encoding(dataset, heads):
        raise SchemaError(f"{dataset.name} and its head frames are stored in different encodings; read them decoded")
    return unstack_frames(newest, newest_start, head_frames, first_rows[lo:hi], start, stop)


ENCODING_ATTRS = ("encoding", "scale", "offset")


def _same_encoding(a: h5py.Dataset, b: h5py.Dataset) -> bool:
    """Whether two columns store their values alike (both as they are, or both as codes of one grid)."""
    return a.dtype == b.dtype and all(a.attrs.get(k) == b.attrs.get(k) for k in ENCODING_ATTRS)


def decode_uint8(dataset: h5py.Dataset, values: np.ndarray) -> np.ndarray:
    """Float32 values of an ``affine_uint8`` column's codes (anything else is returned as is)."""
    if dataset.attrs.get("encoding") != "affine_uint8":
        return values
    return decode_codes(values, dataset.attrs["scale"], dataset.attrs["offset"])


def _image_encoding(values: np.ndarray, options: StorageOptions) -> tuple[np.float32, np.float32] | None:
    """The (scale, offset) that stores this new float32 image column exactly as uint8, if any."""
    return image_grid(values) if options.encode_uint8 else None


def _encoded_rows(columns: OpenColumns, group: h5py.Group, path: str, values: np.ndarray, start: int,
                  options: StorageOptions) -> np.ndarray:
    """The rows to append to an encoded column; turns the column back into float32 if they are not exact."""
    column = columns.column(group, path)
    if column.encoding is None:
        return values
    encoded = encode_uint8(values, *column.encoding)
    if encoded is not None:
        return encoded
    # Not exact: rewrite the column as float32 (stored rows decoded exactly), then append as is.
    decoded = decode_codes(column.dataset[:start], *column.encoding)
    attrs = {} if column.stack is None else {FRAME_STACK_ATTR: np.int64(column.stack)}
    del column  # with the cache's, the last reference to the old dataset: closed before it is unlinked
    _replace_column(columns, group, path, decoded, values, options, attrs=attrs)
    return values


FLOAT_SUFFIX = ".__float32"


def _replace_column(columns: OpenColumns, group: h5py.Group, path: str, stored: np.ndarray, sample: np.ndarray,
                    options: StorageOptions, *, encoding: tuple[np.float32, np.float32] | None = None,
                    attrs: Mapping[str, Any] | None = None) -> None:
    """Replaces column ``path`` by a new one holding the rows ``stored``, created as ``sample`` would create it
    (dtype, filters, chunks) with ``encoding`` and ``attrs``. The new column is written under FLOAT_SUFFIX and
    renamed over the old one, so a crash leaves one or the other (``_finish_float_rewrites``). The caller holds
    no reference to the old dataset (it is closed before it is unlinked)."""
    columns.forget(group, path)
    _create_column(group, path + FLOAT_SUFFIX, sample, 0, options, encoding=encoding)
    replacement = group[path + FLOAT_SUFFIX]
    replacement.attrs.update(attrs or {})
    replacement.resize(len(stored), axis=0)
    if len(stored):
        replacement[:] = stored
    del replacement
    del group[path]
    group.move(path + FLOAT_SUFFIX, path)


def _widen_column(columns: OpenColumns, group: h5py.Group, path: str, start: int, dtype: np.dtype,
                  options: StorageOptions) -> _Column:
    """Rewrites a column as ``dtype`` (its ``start`` stored rows cast exactly) for values its own dtype can't
    hold, instead of casting them (an int64 reward column would cut 0.5 to 0). As a float32 rewrite: a copy under
    FLOAT_SUFFIX replaces the column, so a crash leaves one or the other (``_finish_float_rewrites``)."""
    old = columns.column(group, path)
    stored = old.dataset[:start].astype(dtype)
    attrs = dict(old.dataset.attrs)
    del old
    _replace_column(columns, group, path, stored, stored, options, attrs=attrs)
    return columns.column(group, path)


def _codes(stream: Stream, table: str) -> dict[str, tuple[np.float32, np.float32]]:
    """The columns of ``table`` that the env runner sent as uint8 codes, with their (scale, offset)."""
    prefix = f"{table}/"
    return {k[len(prefix):]: (np.float32(v[0]), np.float32(v[1])) for k, v in stream.encoded.items()
            if k.startswith(prefix)}


def _sent_codes(columns: OpenColumns, group: h5py.Group, path: str, codes: np.ndarray,
                code: tuple[np.float32, np.float32], start: int, options: StorageOptions) -> np.ndarray:
    """The rows to append for uint8 ``codes`` the runner sent: as they are if the column stores the same
    codes, else their float32 values (through the float path: the column's own check and fallback)."""
    encoding = columns.column(group, path).encoding
    if encoding is not None and encoding[0] == code[0] and encoding[1] == code[1]:
        return codes
    return _encoded_rows(columns, group, path, decode_codes(codes, *code), start, options)


def _append_columns(
    columns: OpenColumns, group: h5py.Group, values_of: Mapping[str, np.ndarray], start: int,
    options: StorageOptions, codes: Mapping[str, tuple[np.float32, np.float32]] | None = None,
    stacks: Mapping[str, int] | None = None,
) -> None:
    codes = codes or {}
    for path, values in values_of.items():
        code = codes.get(path)
        if code is not None and not options.encode_uint8:  # the writer was told to keep floats
            values, code = decode_codes(values, *code), None
        if columns.column(group, path) is None:
            encoding = code if code is not None else _image_encoding(values, options)
            _create_column(group, path, values, start, options, encoding=encoding)
            if stacks and path in stacks:
                group[path].attrs[FRAME_STACK_ATTR] = np.int64(stacks[path])
        if code is not None:
            values = _sent_codes(columns, group, path, values, code, start, options)
        else:
            values = _encoded_rows(columns, group, path, values, start, options)
        column = columns.column(group, path)
        if column.rows != start:
            raise SchemaError(
                f"column {group.name}/{path} has {column.rows} rows, the commit record "
                f"says {start}; run 'rllib-recorder recover' on the file"
            )
        if column.row_shape != values.shape[1:]:
            raise SchemaError(
                f"column {group.name}/{path} holds rows of shape {column.row_shape}, "
                f"got {values.shape[1:]}; record spaces of one fixed shape per run"
            )
        if (column.encoding is None and column.dtype.kind in "biuf" and values.dtype.kind in "biuf"
                and not np.can_cast(values.dtype, column.dtype, "safe")):  # e.g. int rewards, then 0.5
            column = _widen_column(columns, group, path, start, np.result_type(column.dtype, values.dtype), options)
        _write_rows(column, start, values)
        # One column per flush: HDF5 frees a rewritten compressed chunk's old space and may
        # hand it to another chunk of the same flush before the index pointing away from it
        # is on disk; a kill then corrupts committed rows. Flushing per column keeps the
        # space a flush frees out of that flush's own allocations of other columns.
        columns.h5.flush()


def _write_rows(column: _Column, start: int, values: np.ndarray) -> None:
    """Appends ``values`` as rows ``start:`` of ``column`` (one HDF5 write) and counts them."""
    end = start + len(values)
    column.dataset.id.set_extent((end,) + column.row_shape)
    column.rows = end
    if not len(values):
        return
    if h5py.check_vlen_dtype(column.dtype) == np.uint8:
        _write_byte_arrays(column.dataset, start, values)
    elif column.dtype.kind == "O":  # variable-length strings: h5py converts str and bytes
        column.dataset[start:end] = values
    else:
        rows = np.ascontiguousarray(values, dtype=column.dtype)
        file_space = column.dataset.id.get_space()
        file_space.select_hyperslab((start,) + (0,) * len(column.row_shape), rows.shape)
        column.dataset.id.write(h5py.h5s.create_simple(rows.shape), file_space, rows)


def _write_byte_arrays(dataset: h5py.Dataset, start: int, values: np.ndarray) -> None:
    """Writes variable-length byte arrays to rows ``start:`` in one HDF5 call.

    ``dataset[start:] = values`` fails when the arrays have equal lengths (h5py makes them one 2-D array), and
    one call per row cost a third of the writer's time on CartPole (a start state per episode).
    """
    if not len(values):
        return
    rows = np.empty(len(values), dtype=dataset.dtype)
    for i, value in enumerate(values):
        rows[i] = np.asarray(value, dtype=np.uint8)
    file_space = dataset.id.get_space()
    file_space.select_hyperslab((start,), (len(values),))
    dataset.id.write(h5py.h5s.create_simple((len(values),)), file_space, rows)


def _create_column(
    group: h5py.Group, path: str, values: np.ndarray, start: int, options: StorageOptions,
    encoding: tuple[np.float32, np.float32] | None = None,
) -> None:
    if start:
        raise SchemaError(
            f"column {group.name}/{path} appears after {start} rows were stored without it; "
            "every chunk of one agent must carry the same columns"
        )
    dtype = np.dtype(np.uint8) if encoding else values.dtype
    if values.dtype == object:  # variable-length: bytes arrays (start states) or strings
        dtype = h5py.vlen_dtype(np.uint8) if len(values) and isinstance(values[0], np.ndarray) else h5py.string_dtype()
    row_bytes = max(1, int(np.prod(values.shape[1:], dtype=np.int64)) * (8 if values.dtype == object else dtype.itemsize))
    chunk_rows = int(min(max(1, options.hdf5_chunk_bytes // row_bytes), MAX_CHUNK_ROWS))
    filters: dict[str, Any] = {}
    index = group.name == "/batches" or group.name.endswith("/fragments")
    if index and row_bytes < INDEX_PLAIN_ROW_BYTES:  # unfiltered, in smaller chunks
        chunk_rows = min(chunk_rows, INDEX_CHUNK_ROWS)
    elif encoding is not None or _compresses(values, options):  # codes of images always compress
        if options.compression == "gzip":
            filters = {"compression": "gzip", "compression_opts": options.compression_level,
                       "shuffle": values.dtype != object and dtype.itemsize > 1}
        elif options.compression == "lzf":
            filters = {"compression": "lzf"}
    dataset = group.create_dataset(
        path, shape=(0,) + values.shape[1:], maxshape=(None,) + values.shape[1:],
        dtype=dtype, chunks=(chunk_rows,) + values.shape[1:], **filters,
    )
    if encoding:
        dataset.attrs.update({"encoding": "affine_uint8", "scale": encoding[0], "offset": encoding[1]})


def _compresses(values: np.ndarray, options: StorageOptions) -> bool:
    """Whether a new column's first rows compress at least MIN_COMPRESSION_RATIO with the configured filter
    (byte-shuffled like HDF5's shuffle filter; gzip's level, or zlib level 1 for lzf); True if too few to tell."""
    if options.compression == "none" or values.dtype == object or values.nbytes < TRIAL_BYTES:
        return True
    data = np.ascontiguousarray(values)
    raw = data.view(np.uint8).reshape(-1, data.dtype.itemsize).T.tobytes() if data.dtype.itemsize > 1 else data.tobytes()
    level = options.compression_level if options.compression == "gzip" else 1
    return len(raw) >= MIN_COMPRESSION_RATIO * len(zlib.compress(raw, level))


def _finish_float_rewrites(h5: h5py.File) -> None:
    """Completes or undoes a float32 rewrite of an encoded column that a crash interrupted."""
    leftovers: list[str] = []
    h5.visititems(lambda path, item: leftovers.append(path) if path.endswith(FLOAT_SUFFIX) else None)
    for path in leftovers:
        original = path[: -len(FLOAT_SUFFIX)]
        if original in h5:  # the rewrite had not replaced the column yet: drop the copy
            del h5[path]
        else:  # the column was deleted, the copy not yet renamed: finish
            h5.move(path, original)
    for agent in h5.get("agents", {}).values():  # head frames of a column an interrupted rewrite made full stacks
        fragments, steps = agent.get("fragments"), agent.get("steps")
        heads: list[str] = []
        if fragments is not None:
            fragments.visititems(lambda path, item: heads.append(path) if path.startswith(HEAD_PREFIX)
                                 and isinstance(item, h5py.Dataset) else None)
        for head in heads:
            column = steps.get(head[len(HEAD_PREFIX):]) if steps is not None else None
            if column is None or FRAME_STACK_ATTR not in column.attrs:
                del fragments[head]
