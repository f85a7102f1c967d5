"""The spool: the node-local files an env runner hands its samples over in, and the writer reads them from.

Why a file and not an actor call: a sample must leave the env runner before ``sample()`` returns, so that a runner
killed right after cannot take it along. Once ``os.writev`` into a file has returned, the bytes are in the
kernel's page cache and outlive the process that wrote them; an asynchronous actor call has only been queued in
the runner's own core worker by then, and waiting for the writer's receipt would cost the sampler a round trip
per sample. The writer, on the same node, reads the spool, coalesces and commits, and deletes what it committed.

Layout: ``<run_dir>/.spool/<file stem>/<sender id>/<segment>.spool``, where the stem names the HDF5 file the
rows go into (``worker-001``, ``eval-worker-002.node1``) and the sender id one env-runner process incarnation.
A segment is a sequence of records; an env runner only appends to its newest segment and starts a new one once a
segment holds ``segment_bytes``. A record::

    header (32 bytes, little endian): magic b"RRS1", version u16, kind u16, seq u64, meta bytes u32,
                                      data bytes u64, crc32 u32 of the header (crc 0), meta and data
    meta: JSON (utf-8): the chunk's fields, the sender's counters, and one entry per array
    data: the arrays' bytes, each at an offset that is a multiple of 8

A record is data, never code: arrays are rebuilt with ``np.frombuffer`` from a short list of plain dtypes, and
strings and byte strings from lengths; nothing is unpickled, so reading a hostile spool (``recover`` on a
downloaded run) executes nothing. A record cut short (its process killed inside ``writev``) is incomplete
forever and is never read: ``sample()`` had not returned it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from rllib_recorder.errors import ConversionError, SchemaError
from rllib_recorder.format.chunks import Chunk, Stream

MAGIC = b"RRS1"

VERSION = 1

HEADER = struct.Struct("<4sHHQIQI")

KIND_CHUNK, KIND_STATS, KIND_END = 1, 2, 3

KINDS = (KIND_CHUNK, KIND_STATS, KIND_END)

MAX_META_BYTES = 64 << 20

MAX_DATA_BYTES = 1 << 34

# dtypes a record may carry as raw arrays: bools, integers, floats and fixed-size byte strings, never objects
_RAW_KINDS = "biufS"


def encode_record(kind: int, seq: int, meta: dict[str, Any], chunk: Chunk | None = None) -> list[Any]:
    """The buffers of one record (header first), to be written with one ``os.writev``."""
    buffers: list[Any] = []
    offset = 0

    def add(array: np.ndarray) -> int:
        nonlocal offset
        start = offset
        view = memoryview(np.ascontiguousarray(array)).cast("B")
        buffers.append(view)
        offset += view.nbytes
        pad = -offset % 8
        if pad:
            buffers.append(bytes(pad))
            offset += pad
        return start

    if chunk is not None:
        meta = {**meta, "chunk": _chunk_meta(chunk, add)}
    meta_bytes = json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()
    crc = zlib.crc32(meta_bytes, zlib.crc32(HEADER.pack(MAGIC, VERSION, kind, seq, len(meta_bytes), offset, 0)))
    for buffer in buffers:
        crc = zlib.crc32(buffer, crc)
    header = HEADER.pack(MAGIC, VERSION, kind, seq, len(meta_bytes), offset, crc)
    return [header, meta_bytes, *buffers]


def _chunk_meta(chunk: Chunk, add: Any) -> dict[str, Any]:
    streams = {}
    for key, stream in chunk.streams.items():
        entries = []
        for table, columns in (("steps", stream.steps), ("fragments", stream.fragments)):
            for path, values in columns.items():
                entries.append(_array_entry(table, path, values, add))
        streams[key] = {"columns": entries, "containers": stream.containers,
                        "encoded": {k: list(v) for k, v in stream.encoded.items()}, "stacked": stream.stacked}
    return {"env_steps": int(chunk.env_steps), "num_samples": int(chunk.num_samples),
            "sampled_at_s": float(chunk.sampled_at_s), "streams": streams}


def _array_entry(table: str, path: str, values: np.ndarray, add: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"t": table, "p": path, "s": list(values.shape)}
    if values.dtype != object:
        entry.update(k="a", d=values.dtype.str, o=add(values), n=int(values.nbytes))
        return entry
    if values.ndim != 1:
        raise ConversionError(f"column {table}/{path} holds objects in {values.ndim} dimensions; only 1-D object "
                          "columns (strings, byte strings) can be spooled")
    if all(isinstance(v, str) for v in values):
        parts, kind = [v.encode() for v in values], "s"
    elif all(isinstance(v, (bytes, np.ndarray)) for v in values):
        parts, kind = [v.tobytes() if isinstance(v, np.ndarray) else bytes(v) for v in values], "b"
    else:
        found = sorted({type(v).__name__ for v in values})
        raise ConversionError(f"column {table}/{path} holds {', '.join(found)} objects; only str and bytes can be spooled")
    lengths = np.array([len(p) for p in parts], np.int64)
    blob = np.frombuffer(b"".join(parts), np.uint8)
    entry.update(k=kind, lo=add(lengths), o=add(blob), n=int(blob.nbytes))
    return entry


@dataclass(frozen=True)
class Record:
    """One record read back from a spool segment."""

    kind: int
    seq: int
    meta: dict[str, Any]
    chunk: Chunk | None
    end: int  # offset just past the record in its segment
    nbytes: int

    def __repr__(self) -> str:
        return f"Record(kind={self.kind}, seq={self.seq}, bytes={self.nbytes}, chunk={self.chunk!r})"


def read_record(fd: int, offset: int, size: int, where: str) -> Record | None:
    """The record at ``offset`` of an open segment of ``size`` bytes; None while it is not complete yet.

    Raises SchemaError when the bytes there are not a record (a damaged or hostile spool).
    """
    if size - offset < HEADER.size:
        return None
    header = os.pread(fd, HEADER.size, offset)
    if len(header) < HEADER.size:
        return None
    magic, version, kind, seq, meta_len, data_len, crc = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or kind not in KINDS:
        raise SchemaError(f"{where}: no spool record at byte {offset} (magic {magic!r}, version {version}, "
                          f"kind {kind}); the spool is damaged")
    if meta_len > MAX_META_BYTES or data_len > MAX_DATA_BYTES:
        raise SchemaError(f"{where}: record at byte {offset} claims {meta_len} + {data_len} bytes; the spool "
                          "is damaged")
    end = offset + HEADER.size + meta_len + data_len
    if end > size:
        return None  # still being written, or cut short by a kill: never returned by sample()
    body = os.pread(fd, meta_len + data_len, offset + HEADER.size)
    unsigned = HEADER.pack(magic, version, kind, seq, meta_len, data_len, 0)
    if len(body) < meta_len + data_len or zlib.crc32(body, zlib.crc32(unsigned)) != crc:
        raise SchemaError(f"{where}: record at byte {offset} fails its checksum; the spool is damaged")
    view = memoryview(body)
    try:
        meta = json.loads(bytes(view[:meta_len]))
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        chunk = _chunk(meta.pop("chunk"), view[meta_len:]) if "chunk" in meta else None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SchemaError(f"{where}: record at byte {offset} is malformed ({type(e).__name__}: {e}); "
                          "the spool is damaged") from None
    return Record(kind, seq, meta, chunk, end, end - offset)


def _chunk(meta: dict[str, Any], data: memoryview) -> Chunk:
    streams = {}
    for key, spec in dict(meta["streams"]).items():
        _check_name(key, "agent key")
        tables: dict[str, dict[str, np.ndarray]] = {"steps": {}, "fragments": {}}
        for entry in spec["columns"]:
            table, path = entry["t"], entry["p"]
            if table not in tables:
                raise ValueError(f"unknown table {table!r}")
            _check_name(path, "column path")
            tables[table][path] = _array(entry, data)
        if "rewards" not in tables["steps"] or "eps_id" not in tables["fragments"]:
            raise ValueError(f"stream {key!r} lacks rewards or eps_id")
        encoded = {str(k): (float(v[0]), float(v[1])) for k, v in dict(spec.get("encoded") or {}).items()}
        stacked = {str(k): int(v) for k, v in dict(spec.get("stacked") or {}).items()}
        containers = {str(k): str(v) for k, v in dict(spec.get("containers") or {}).items()}
        streams[key] = Stream(tables["steps"], tables["fragments"], containers, encoded, stacked)
    return Chunk(streams=streams, env_steps=int(meta["env_steps"]), num_samples=int(meta["num_samples"]),
                 sampled_at_s=float(meta["sampled_at_s"]))


def _check_name(name: Any, what: str) -> None:
    if (not isinstance(name, str) or not name or "\x00" in name or name.startswith("/")
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise ValueError(f"{what} {name!r} is not a plain name")


def _array(entry: dict[str, Any], data: memoryview) -> np.ndarray:
    shape = tuple(int(n) for n in entry["s"])
    if any(n < 0 for n in shape):
        raise ValueError(f"negative shape {shape}")
    kind = entry["k"]
    if kind == "a":
        dtype = np.dtype(str(entry["d"]))
        if dtype.kind not in _RAW_KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise ValueError(f"dtype {dtype} is not a plain dtype")
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(_slice(data, entry["o"], count * dtype.itemsize), dtype).reshape(shape)
    if kind not in ("s", "b") or len(shape) != 1:
        raise ValueError(f"unknown column kind {kind!r} of shape {shape}")
    lengths = np.frombuffer(_slice(data, entry["lo"], 8 * shape[0]), np.int64)
    blob = _slice(data, entry["o"], int(entry["n"]))
    if (lengths < 0).any() or int(lengths.sum()) != len(blob):
        raise ValueError("string lengths do not add up to the stored bytes")
    out = np.empty(shape[0], dtype=object)
    start = 0
    for i, length in enumerate(lengths.tolist()):
        piece = blob[start:start + length]
        out[i] = bytes(piece).decode() if kind == "s" else np.frombuffer(piece, np.uint8)
        start += length
    return out


def _slice(data: memoryview, offset: Any, nbytes: int) -> memoryview:
    offset = int(offset)
    if offset < 0 or nbytes < 0 or offset + nbytes > len(data):
        raise ValueError(f"array bytes {offset}..{offset + nbytes} lie outside the record's {len(data)} bytes")
    return data[offset:offset + nbytes]
