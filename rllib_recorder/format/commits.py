"""The commit record: which rows count as stored, what a file holds past it, and copies that keep only committed
rows.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import durable
from rllib_recorder.format.chunks import Chunk
from rllib_recorder.format.h5file import open_h5, validate_header


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
    return write_commit_data(h5, commit_json(commit))


def commit_json(commit: Mapping[str, Any]) -> bytes:
    return json.dumps(commit, separators=(",", ":")).encode()


def padded_commit(data: bytes, capacity: int) -> np.ndarray:
    """The commit record as the fixed-size string its attribute holds."""
    return np.array(data.ljust(capacity), dtype=f"S{capacity}")


def write_commit_data(h5: h5py.File, data: bytes) -> int:
    """``write_commit`` of a record already encoded; returns the attribute's capacity."""
    capacity = _commit_capacity(h5)
    if len(data) <= capacity:
        h5.attrs.modify("commit", padded_commit(data, capacity))
        return capacity
    capacity = COMMIT_BYTES
    while capacity < 2 * len(data):
        capacity *= 2
    if "commit" in h5.attrs:
        del h5.attrs["commit"]
    h5.attrs.create("commit", padded_commit(data, capacity))
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


def datasets_bytes(h5: h5py.File) -> int:
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
