"""Reading stored rows back as recorded: uint8 codes decoded, frame stacks rebuilt from their newest frames."""

from __future__ import annotations

import weakref
from typing import Any

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format.frames import (
    DELTA_ATTR,
    DELTA_KEY_ATTR,
    HEAD_PREFIX,
    decode_codes,
    delta_key_rows,
    unstack_frames,
    xor_decode,
)
from rllib_recorder.format.layout import ENCODING_ATTRS, FRAME_STACK_ATTR


def row_shape(dataset: h5py.Dataset) -> tuple[int, ...]:
    """The shape of one row as recorded (a frame-stacked column stores one frame of each row's stack)."""
    stack = dataset.attrs.get(FRAME_STACK_ATTR)
    return tuple(dataset.shape[1:]) if stack is None else tuple(dataset.shape[1:-1]) + (int(stack),)


def read_rows(dataset: h5py.Dataset, rows: slice, decode: bool = True) -> np.ndarray:
    """Rows of a column as recorded: ``affine_uint8`` codes decoded to float32 (unless ``decode`` is False), the
    frame stacks of a frame-stacked step column rebuilt from its newest frames and its fragments' head frames."""
    attrs = column_attrs(dataset)
    stack = attrs.get(FRAME_STACK_ATTR)
    if stack is None:
        values = stored_rows(dataset, rows)
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
    newest, head_frames = stored_rows(dataset, slice(newest_start, stop)), heads[lo:hi]
    if decode:
        newest, head_frames = decode_uint8(dataset, newest), decode_uint8(heads, head_frames)
    elif not same_encoding(dataset, heads):
        raise SchemaError(f"{dataset.name} and its head frames are stored in different encodings; read them decoded")
    return unstack_frames(newest, newest_start, head_frames, first_rows[lo:hi], start, stop)


# A column's attributes, read once while a reader holds its dataset (h5py looks each one up in the file on every
# access: a fifth of a CartPole block's reading time went to them). A column's attributes are set when it is
# created; a column rewritten (widened, unstacked) is a new dataset.
_ATTRS: "weakref.WeakKeyDictionary[h5py.Dataset, dict]" = weakref.WeakKeyDictionary()


def column_attrs(dataset: h5py.Dataset) -> dict:
    """The attributes of ``dataset`` as a dict, read once while it is held."""
    try:
        return _ATTRS[dataset]
    except (KeyError, TypeError):
        attrs = dict(dataset.attrs)
        try:
            _ATTRS[dataset] = attrs
        except TypeError:  # not weakly referable: read each time
            pass
        return attrs


def stored_rows(dataset: h5py.Dataset, rows: slice) -> np.ndarray:
    """Rows of a column as the writer was given them: a column stored as frame deltas (``frames.xor_encode``) is
    read from the key row at or before ``rows.start`` and decoded (``frames.xor_decode``); others as they are."""
    attrs = column_attrs(dataset)
    if attrs.get(DELTA_ATTR) is None:
        return row_range(dataset, rows)
    start, stop, step = rows.indices(dataset.shape[0])
    if step != 1:
        raise ValueError(f"column {dataset.name} stores frame deltas: it reads contiguous rows only (got step {step})")
    stop = max(start, stop)
    fragments = dataset.name.partition("/steps/")[0] + "/fragments"
    if f"{fragments}/first_row" not in dataset.file or f"{fragments}/num_rows" not in dataset.file:
        raise SchemaError(f"{dataset.file.filename}: {dataset.name} stores frame deltas, but {fragments}/first_row "
                          "or num_rows is missing, so its rows can't be decoded; the file is damaged: move it out of "
                          "the run directory to read the rest of the run")
    first_rows = dataset.file[f"{fragments}/first_row"][:]
    at = max(int(np.searchsorted(first_rows, start, "right")) - 1, 0)  # the fragment holding row start
    hi = max(int(np.searchsorted(first_rows, stop, "left")), at + 1)
    firsts, counts = first_rows[at:hi], dataset.file[f"{fragments}/num_rows"][at:hi]
    keys = delta_key_rows(firsts, counts, 0, stop, int(attrs[DELTA_KEY_ATTR]))
    before = keys[keys <= start]
    key = int(before[-1]) if len(before) else start  # rows before any fragment (none in a sound file): as stored
    return xor_decode(row_range(dataset, slice(key, stop)), keys[keys >= key], key)[start - key:]


def row_range(dataset: h5py.Dataset, rows: slice) -> np.ndarray:
    """``dataset[rows]``; contiguous rows of a numeric column are read through h5py's low-level API, without the
    high-level selection machinery (0.6 ms of an 8 ms read of five 200,000-row CartPole columns)."""
    start, stop, step = rows.indices(dataset.shape[0]) if dataset.shape else (0, 0, 0)
    dtype = dataset.dtype
    if step != 1 or stop <= start or dtype.kind not in "biuf" or dtype.metadata:
        return dataset[rows]
    shape = (stop - start,) + dataset.shape[1:]
    out = np.empty(shape, dtype)
    space = dataset.id.get_space()
    space.select_hyperslab((start,) + (0,) * (len(shape) - 1), shape)
    dataset.id.read(h5py.h5s.create_simple(shape), space, out)
    return out


def same_encoding(a: h5py.Dataset, b: h5py.Dataset) -> bool:
    """Whether two columns store their values alike (both as they are, or both as codes of one grid)."""
    return a.dtype == b.dtype and all(a.attrs.get(k) == b.attrs.get(k) for k in ENCODING_ATTRS)


def decode_uint8(dataset: h5py.Dataset, values: np.ndarray) -> np.ndarray:
    """Float32 values of an ``affine_uint8`` column's codes (anything else is returned as is)."""
    attrs = column_attrs(dataset)
    if attrs.get("encoding") != "affine_uint8":
        return values
    return decode_codes(values, attrs["scale"], attrs["offset"])


def read_node(node: Any, rows: slice, decode_codes: bool = True) -> Any:
    """Rows of a step column as recorded: a dataset's rows (``read_rows``), or a nested space's group as the
    tuple or dict of its members' rows."""
    if isinstance(node, h5py.Dataset):
        return read_rows(node, rows, decode_codes)
    kind = node.attrs.get("container", "dict")
    if kind == "tuple":
        return tuple(read_node(node[str(i)], rows, decode_codes) for i in range(len(node)))
    return {k: read_node(v, rows, decode_codes) for k, v in node.items()}
