"""The columns of a file open for appending: how each is created (filters, chunks, uint8 codes), written and widened."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format.chunks import Stream
from rllib_recorder.format.decode import stored_rows
from rllib_recorder.format.frames import (
    DELTA_ATTR,
    DELTA_KEY_ATTR,
    DELTA_KEY_ROWS,
    DELTA_XOR,
    decode_codes,
    image_grid,
    uint8_codes,
    xor_encode,
)
from rllib_recorder.format.layout import FLOAT_SUFFIX, FRAME_STACK_ATTR
from rllib_recorder.format.open_columns import Column, OpenColumns


@dataclass(frozen=True)
class StorageOptions:
    """How datasets are created (mirrors the recorder settings)."""

    compression: str = "gzip"
    compression_level: int = 1
    hdf5_chunk_bytes: int = 64 << 10
    fsync: bool = False
    encode_uint8: bool = True
    # Store frame-stacked observations as their newest frames (chunks.newest_frames); checked on every chunk.
    stack_frames: bool = True
    # Store image columns of uint8 (Atari frames) as each row XOR the row before (frames.xor_encode), schema 3.0.
    frame_delta: bool = True
    # HDF5 file-space strategy of new files. "none": space a rewritten chunk frees is never
    # handed out again while the file is open, so a kill can't overwrite committed rows
    # that the on-disk index still points at (see docs/RELIABILITY.md); the dead space is
    # compacted away on close. "fsm" is HDF5's default (reuses freed space at once).
    file_space: str = "none"
    # Seal a file into a segment (format.segments) once it holds this many bytes or is this many seconds old
    # (0: never; files are segmented only when the run records to a durable target).
    segment_bytes: int = 0
    segment_s: float = 0.0


# Rows per chunk of a column of small rows. Every append recompresses each column's partial last chunk, so
# this bounds the work an append does beyond its own rows: 4096 cost 7.7 ms of writer CPU per 600-row CartPole
# append, 1024 4.9 ms, for 3% more bytes (docs/BENCHMARKS.md, 'Writer: cost of one append').
MAX_CHUNK_ROWS = 1024

# Index tables (/batches: one row per append; fragments: one per episode fragment) get a few rows per append, and
# compressing their partial chunks on every flush was half of a CartPole append's writer CPU (3.99 -> 1.97 ms per
# 600-row append; docs/BENCHMARKS.md): their columns of small rows are stored without a filter, in chunks of
# INDEX_CHUNK_ROWS rows, which bounds the space an unfiltered chunk holds before it fills.
# 64 rows, not 256: a file's ~35 index columns allocate a whole chunk each from their first row, 70 kB of a young
# Atari run's 1,000-step file at 256 rows (docs/BENCHMARKS.md, 'Atari bytes per step').
INDEX_CHUNK_ROWS = 64

INDEX_PLAIN_ROW_BYTES = 64

# A step column is compressed unless its first rows compress less than this (CartPole's float32 observations and
# log-probs: 1.1x): deflate then costs CPU on every flush for almost no bytes.
MIN_COMPRESSION_RATIO = 1.25

TRIAL_BYTES = 4096  # fewer first rows than this: compressed without a trial


def _image_encoding(values: np.ndarray, options: StorageOptions) -> tuple[np.float32, np.float32] | None:
    """The (scale, offset) that stores this new float32 image column exactly as uint8, if any."""
    return image_grid(values) if options.encode_uint8 else None


def _encoded_rows(columns: OpenColumns, group: h5py.Group, path: str, values: np.ndarray, start: int,
                  options: StorageOptions) -> np.ndarray:
    """The rows to append to an encoded column; turns the column back into float32 if they are not exact."""
    column = columns.column(group, path)
    if column.encoding is None:
        return values
    encoded = uint8_codes(values, *column.encoding)
    if encoded is not None:
        return encoded
    # Not exact: rewrite the column as float32 (stored rows decoded exactly), then append as is.
    decoded = decode_codes(stored_rows(column.dataset, slice(0, start)), *column.encoding)
    attrs = {} if column.stack is None else {FRAME_STACK_ATTR: np.int64(column.stack)}
    del column  # with the cache's, the last reference to the old dataset: closed before it is unlinked
    replace_column(columns, group, path, decoded, values, options, attrs=attrs)
    return values


def replace_column(columns: OpenColumns, group: h5py.Group, path: str, stored: np.ndarray, sample: np.ndarray,
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
                  options: StorageOptions) -> Column:
    """Rewrites a column as ``dtype`` (its ``start`` stored rows cast exactly) for values its own dtype can't
    hold, instead of casting them (an int64 reward column would cut 0.5 to 0). As a float32 rewrite: a copy under
    FLOAT_SUFFIX replaces the column, so a crash leaves one or the other (``_finish_float_rewrites``)."""
    old = columns.column(group, path)
    stored = stored_rows(old.dataset, slice(0, start)).astype(dtype)
    attrs = {k: v for k, v in old.dataset.attrs.items() if k not in (DELTA_ATTR, DELTA_KEY_ATTR)}
    del old
    replace_column(columns, group, path, stored, stored, options, attrs=attrs)
    return columns.column(group, path)


def sent_encodings(stream: Stream, table: str) -> dict[str, tuple[np.float32, np.float32]]:
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


def append_columns(
    columns: OpenColumns, group: h5py.Group, values_of: Mapping[str, np.ndarray], start: int,
    options: StorageOptions, codes: Mapping[str, tuple[np.float32, np.float32]] | None = None,
    stacks: Mapping[str, int] | None = None, fragment_lengths: np.ndarray | None = None,
) -> None:
    """Appends each of ``values_of`` as rows ``start:`` of its column (created if new). ``fragment_lengths``: the
    rows of each fragment the values hold (step columns), which image columns stored as frame deltas need."""
    codes = codes or {}
    for path, values in values_of.items():
        code = codes.get(path)
        if code is not None and not options.encode_uint8:  # the writer was told to keep floats
            values, code = decode_codes(values, *code), None
        if columns.column(group, path) is None:
            encoding = code if code is not None else _image_encoding(values, options)
            delta = (fragment_lengths is not None and options.frame_delta and columns.stores_frame_deltas
                     and values.ndim >= 3 and (encoding is not None or values.dtype == np.uint8))
            _create_column(group, path, values, start, options, encoding=encoding, delta=delta)
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
        if column.delta is not None:
            if fragment_lengths is None or int(np.sum(fragment_lengths)) != len(values):
                raise SchemaError(f"column {group.name}/{path} stores frame deltas, which need the rows' fragments")
            values = xor_encode(np.asarray(values, column.dtype), fragment_lengths, column.delta)
        _write_rows(column, start, values)
        # One column per flush: HDF5 frees a rewritten compressed chunk's old space and may
        # hand it to another chunk of the same flush before the index pointing away from it
        # is on disk; a kill then corrupts committed rows. Flushing per column keeps the
        # space a flush frees out of that flush's own allocations of other columns.
        columns.h5.flush()


def _write_rows(column: Column, start: int, values: np.ndarray) -> None:
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
    encoding: tuple[np.float32, np.float32] | None = None, delta: bool = False,
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
    if delta:
        dataset.attrs.update({DELTA_ATTR: DELTA_XOR, DELTA_KEY_ATTR: np.int64(DELTA_KEY_ROWS)})


def _compresses(values: np.ndarray, options: StorageOptions) -> bool:
    """Whether a new column's first rows compress at least MIN_COMPRESSION_RATIO with the configured filter
    (byte-shuffled like HDF5's shuffle filter; gzip's level, or zlib level 1 for lzf); True if too few to tell."""
    if options.compression == "none" or values.dtype == object or values.nbytes < TRIAL_BYTES:
        return True
    data = np.ascontiguousarray(values)
    raw = data.view(np.uint8).reshape(-1, data.dtype.itemsize).T.tobytes() if data.dtype.itemsize > 1 else data.tobytes()
    level = options.compression_level if options.compression == "gzip" else 1
    return len(raw) >= MIN_COMPRESSION_RATIO * len(zlib.compress(raw, level))
