"""Appending one chunk to a worker file and committing it; opening a file to append to, dropping what no commit
names.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

import h5py
import numpy as np

from rllib_recorder.format import infos as infos_codec
from rllib_recorder.format import repair as h5repair
from rllib_recorder.format import start_state
from rllib_recorder.format.chunks import Chunk, Stream, full_stacks, newest_frames
from rllib_recorder.format.commits import rewrite_committed, uncommitted_rows, write_commit
from rllib_recorder.format.datasets import StorageOptions, append_columns, replace_column, sent_encodings
from rllib_recorder.format.decode import read_rows, same_encoding
from rllib_recorder.format.frames import (
    DELTA_ATTR,
    DELTA_KEY_ATTR,
    HEAD_PREFIX,
    fragment_starts,
    xor_encode,
)
from rllib_recorder.format.h5file import APPEND_CHUNK_CACHE_BYTES, create_file, open_h5, validate_header
from rllib_recorder.format.layout import (
    ENCODING_ATTRS,
    FLOAT_SUFFIX,
    FORMAT_NAME,
    FRAME_STACK_ATTR,
    SCHEMA_VERSION,
    SENDER_COUNTERS,
    SENDER_ID_DTYPE,
)
from rllib_recorder.format.open_columns import OpenColumns


def open_for_append(path: str, attrs: Mapping[str, Any], file_space: str = "none") -> h5py.File:
    """Opens (creating if needed) a worker file for appending, dropping uncommitted rows."""
    exists = os.path.exists(path)
    if exists:  # before HDF5 opens it for writing, which would cut a killed writer's last bytes off
        h5repair.extend_eoa_to_eof(path)
    h5 = open_h5(path, "a", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES) if exists else create_file(path, file_space)
    if not exists or "format" not in h5.attrs:
        from rllib_recorder.version import __version__

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
    append_columns(columns, batches, batch, batch_row, options)
    # Rows first, commit second: one flush for both would let HDF5 write the commit
    # record before the rows it names, and a kill in between would commit garbage.
    _flush(h5, options)
    commit["batches"] = batch_row + 1
    columns.write_commit(commit)
    _flush(h5, options)
    columns.keep_state_references()  # committed: later appends may store their start states against these
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
    if columns.stores_frame_deltas and options.frame_delta and "start_state" in frag_cols:
        frag_cols["start_state"] = _states_against_earlier(frag_cols["start_state"], frags,
                                                           columns.state_references(name))
    if "infos" in frag_cols and _infos_compressed(columns, fragments):
        frag_cols["infos"] = infos_codec.compress_all(frag_cols["infos"])
    frag_cols["first_row"] = fragment_starts(frag_cols["num_rows"], rows)
    frag_cols["batch"] = np.full(len(frag_cols["first_row"]), batch_row, dtype=np.int64)
    append_columns(columns, steps, stream.steps, rows, options, sent_encodings(stream, "steps"), stream.stacked,
                   fragment_lengths=np.asarray(frag_cols["num_rows"]))
    append_columns(columns, fragments, frag_cols, frags, options, sent_encodings(stream, "fragments"))
    if "infos" in frag_cols and (name, "infos", "zlib") not in columns.containers_marked:
        column = columns.column(fragments, "infos")
        if h5py.check_vlen_dtype(column.dtype) == np.uint8 and column.dataset.attrs.get("encoding") is None:
            column.dataset.attrs["encoding"] = infos_codec.ENCODING
        columns.containers_marked.add((name, "infos", "zlib"))
    for path, kind in stream.containers.items():
        if (name, path, kind) in columns.containers_marked:
            continue
        target = steps if path in steps else fragments if path in fragments else None
        if target is not None and target[path].attrs.get("container") != kind:
            target[path].attrs["container"] = kind
        columns.containers_marked.add((name, path, kind))


def _infos_compressed(columns: OpenColumns, fragments: h5py.Group) -> bool:
    """Whether this file stores infos zlib-compressed (schema 3.0: a new column is; a 2.x file's column of JSON
    strings stays so)."""
    column = columns.column(fragments, "infos")
    return columns.stores_frame_deltas if column is None else h5py.check_vlen_dtype(column.dtype) == np.uint8


def _states_against_earlier(states: np.ndarray, first_row: int, plain: list) -> np.ndarray:
    """One append's start states (its fragments from row ``first_row``), each stored against an earlier alike one
    of the file (schema 3.0, ``start_state.encode_batch``; ``plain``: the file's plain states the writer keeps)."""
    encoded = start_state.encode_batch([np.asarray(s, np.uint8).tobytes() for s in states], first_row, plain)
    out = np.empty(len(states), dtype=object)
    for i, blob in enumerate(encoded):
        out[i] = np.frombuffer(blob, np.uint8)
    return out


def _stacks_as_stored(columns: OpenColumns, steps: h5py.Group, fragments: h5py.Group, stream: Stream, rows: int,
                      options: StorageOptions) -> Stream:
    """``stream`` with its frame stacks as the file stores them (``chunks.newest_frames``).

    A stream the env runner did not stack is stacked here if it can be. A stacked stream for a column stored as
    full stacks is rebuilt as full stacks; a stream that can't be stacked for a column stored stacked turns the
    column (its ``rows`` stored rows) into full stacks, once, lossless either way."""
    if options.stack_frames and columns.stores_frame_stacks:
        stream = newest_frames(stream, stream.fragments["num_rows"])
    elif stream.stacked:  # the writer was told to keep full stacks (or the file is 1.x)
        stream = full_stacks(stream, list(stream.stacked))
    for path in [p for p in stream.steps if p.startswith("obs")]:
        column = columns.column(steps, path)
        stored = None if column is None else column.stack
        if column is None or stored == stream.stacked.get(path):
            continue
        stream = full_stacks(stream, [path])
        if stored is not None:
            _unstack_column(columns, steps, fragments, path, rows, options)
    return stream


def _unstack_column(columns: OpenColumns, steps: h5py.Group, fragments: h5py.Group, path: str, rows: int,
                    options: StorageOptions) -> None:
    """Rewrites a frame-stacked step column as full stacks (its first ``rows`` rows) and drops its head column.

    As a float32 rewrite: a copy under FLOAT_SUFFIX replaces the column, so a crash leaves one or the other
    (``_finish_float_rewrites``); a head column left behind is dropped when the file is opened again."""
    dataset = steps[path]
    as_stored = same_encoding(dataset, fragments[HEAD_PREFIX + path])  # else both as float32 (one was rewritten)
    full = read_rows(dataset, slice(0, rows), decode=not as_stored)
    attrs = {k: v for k, v in dataset.attrs.items()
             if k != FRAME_STACK_ATTR and (as_stored or k not in (*ENCODING_ATTRS, DELTA_ATTR, DELTA_KEY_ATTR))}
    if DELTA_ATTR in attrs:  # the full stacks as frame deltas too, over the fragments stored so far
        full = xor_encode(full, fragments["num_rows"][()], int(attrs[DELTA_KEY_ATTR]))
    del dataset
    encoding = (np.float32(attrs["scale"]), np.float32(attrs["offset"])) if "scale" in attrs else None
    replace_column(columns, steps, path, full, full, options, encoding=encoding, attrs=attrs)
    columns.forget(fragments, HEAD_PREFIX + path)
    if HEAD_PREFIX + path in fragments:
        del fragments[HEAD_PREFIX + path]


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
