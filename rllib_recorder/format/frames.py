"""Lossless encodings both sides share: float32 frames as uint8 codes, frame stacks as their newest frames."""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

# (scale, offset) of the float32 images RLlib's wrappers make from uint8 frames: u8 / 128 - 1 (Atari) and u8 / 255.
IMAGE_ENCODINGS = ((np.float32(1 / 128), np.float32(-1.0)), (np.float32(1 / 255), np.float32(0.0)))


def uint8_codes(values: np.ndarray, scale: np.float32, offset: np.float32, block_rows: int = 8) -> np.ndarray | None:
    """The uint8 codes of float32 ``values`` if every value is exactly ``code * scale + offset``, else None.

    Works in blocks of rows that stay in the CPU cache (about 6x faster than whole-array passes on
    Atari chunks); a value out of range, not on the grid or NaN fails the round trip.
    """
    out = np.empty(values.shape, np.uint8)
    inv, shift = np.float32(1 / scale), np.float32(-offset / scale)
    scratch = np.empty(values[:block_rows].shape, np.float32)
    with np.errstate(invalid="ignore"):
        for i in range(0, len(values), block_rows):
            rows = values[i:i + block_rows]
            tmp, codes = scratch[:len(rows)], out[i:i + block_rows]
            np.multiply(rows, inv, out=tmp)
            tmp += shift
            np.copyto(codes, tmp, casting="unsafe")
            np.multiply(codes, scale, out=tmp)
            tmp += offset
            if not np.array_equal(tmp, rows):
                return None
    return out


def decode_codes(codes: np.ndarray, scale: float, offset: float) -> np.ndarray:
    """The float32 values of uint8 ``codes`` (exact inverse of ``uint8_codes``)."""
    out = codes.astype(np.float32)
    out *= np.float32(scale)
    out += np.float32(offset)
    return out


def encode_image(values: np.ndarray) -> tuple[np.ndarray, tuple[np.float32, np.float32]] | None:
    """(uint8 codes, (scale, offset)) of a float32 image column (3 or more dims) that lies exactly on one of
    ``IMAGE_ENCODINGS``, else None.

    Grids are tried in order, each only if the first row lies on it; a row of zeros lies on both (black in
    ``u8 / 255``, code 128 in ``u8 / 128 - 1``), so a column is checked whole against each such grid.
    """
    if not image_like(values) or not len(values):
        return None
    for scale, offset in IMAGE_ENCODINGS:
        if uint8_codes(values[:1], scale, offset) is not None:
            codes = uint8_codes(values, scale, offset)
            if codes is not None:
                return codes, (scale, offset)
    return None


def image_like(values: np.ndarray) -> bool:
    """A float32 column of 3 or more dims: the only kind ``encode_image`` may store as uint8."""
    return values.dtype == np.float32 and values.ndim >= 3


def image_grid(values: np.ndarray) -> tuple[np.float32, np.float32] | None:
    """The (scale, offset) of ``IMAGE_ENCODINGS`` on which every value of a float32 image column lies, if any."""
    encoded = encode_image(values)
    return None if encoded is None else encoded[1]


# Frame stacks. RLlib's Atari wrappers (and others) observe the K latest frames stacked on the last axis,
# (84, 84, 4): each row repeats K - 1 frames of the row before. Such a column is sent and stored as the newest
# frame of each row (last axis of size 1) plus, per fragment, the K - 1 older frames of its first row
# (``fragments/head_<path>``), a quarter of the bytes to send, compress and store for K = 4. Lossless: every
# chunk is checked, and a column whose rows do not repeat their frames stays as full stacks.
HEAD_PREFIX = "head_"


def fragment_starts(lengths: Sequence[int], start: int = 0) -> np.ndarray:
    """The first row of each of consecutive fragments of ``lengths`` rows, the first at row ``start``."""
    return start + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def repeats_frames(values: np.ndarray, lengths: Sequence[int]) -> bool:
    """Whether each row but a fragment's first holds the row before's frames 1.. as its frames ..-1, bit for bit."""
    if len(lengths) == 0 or min(lengths) < 1 or sum(lengths) != len(values):
        return False
    start = 0
    for n in lengths:
        if n > 1 and not _rows_repeat(values[start:start + n]):
            return False
        start += n
    return True


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _rows_repeat(rows: np.ndarray, block_rows: int = 8) -> bool:
    """``repeats_frames`` of one fragment. A pixel's stack of 2, 4 or 8 bytes is compared as one integer (older
    frames shifted down against newer ones masked), in blocks of rows that stay in the CPU cache: 0.6 ms for 200
    Atari rows, against 10 ms for one strided comparison of the whole arrays."""
    k, size = rows.shape[-1], rows.itemsize
    word = _WORDS.get(k * size) if sys.byteorder == "little" and rows.flags.c_contiguous else None
    if word is not None:
        packed = rows.view(word)[..., 0]
        shift, mask = word(8 * size), word((1 << (8 * size * (k - 1))) - 1)
        for i in range(1, len(packed), block_rows):
            cur = packed[i:i + block_rows]
            if not np.array_equal(cur & mask, packed[i - 1:i - 1 + len(cur)] >> shift):
                return False
        return True
    bits = rows.view(f"u{size}")  # bit-exact: -0.0 is not 0.0, a NaN equals itself
    for i in range(1, len(bits), block_rows):
        cur = bits[i:i + block_rows]
        if not np.array_equal(cur[..., :-1], bits[i - 1:i - 1 + len(cur), ..., 1:]):
            return False
    return True


def unstack_frames(newest: np.ndarray, newest_start: int, heads: np.ndarray, first_rows: Sequence[int],
                   start: int, stop: int) -> np.ndarray:
    """The full frame stacks of rows ``start:stop`` of a stacked column.

    ``newest``: the stored rows (last axis of size 1) from row ``newest_start`` to ``stop``; it must begin at or
    before ``max(start - K + 1, first_rows[0])``. ``heads`` and ``first_rows``: the head frames and the first row
    of each fragment that holds rows of ``start:stop``, in row order.
    """
    k = heads.shape[-1] + 1
    out = np.empty((max(stop - start, 0),) + newest.shape[1:-1] + (k,), np.result_type(newest, heads))
    ends = list(first_rows[1:]) + [stop]
    for head, first, end in zip(heads, first_rows, ends):
        lo, hi = max(start, int(first)), min(stop, int(end))
        if lo >= hi:
            continue
        p = lo - (k - 1)  # the first frame row lo needs: head frames stand for the rows first-K+1 .. first-1
        # seq[i]: the frame of row p + i, time first; row r's stack is seq[r - lo : r - lo + K] on the last axis
        seq = np.concatenate([np.moveaxis(head[..., max(p - first + k - 1, 0):], -1, 0),
                              newest[max(p, first) - newest_start:hi - newest_start, ..., 0]])
        for j in range(k):  # K strided copies of whole frames: 3x faster than one copy of a sliding window view
            out[lo - start:hi - start, ..., j] = seq[j:j + hi - lo]
    return out


# Frame deltas (schema 3.0). Consecutive Atari frames differ in a few pixels, so an image column of uint8 codes
# (a stacked column's newest frames, or whole frames) stores each row XOR the row before it, except *key rows*
# stored as they are: the first row of every fragment and every DELTA_KEY_ROWS-th row of a fragment after it. Mostly
# zeros compress to half the bytes of the frames under the same gzip (docs/BENCHMARKS.md, 'Atari bytes per step'),
# and a reader undoes it with one ``np.bitwise_xor.accumulate`` per run of rows between keys: any row is at most
# DELTA_KEY_ROWS - 1 rows from a key, and a whole fragment (an episode's piece) is read from its own first row.
DELTA_ATTR = "delta"  # value: DELTA_XOR
DELTA_XOR = "xor_previous_row"
DELTA_KEY_ATTR = "delta_key_rows"
DELTA_KEY_ROWS = 128


def delta_key_rows(first_rows: np.ndarray, num_rows: np.ndarray, start: int, stop: int, every: int) -> np.ndarray:
    """The key rows in ``[start, stop)`` (sorted) of fragments starting at ``first_rows`` with ``num_rows`` rows."""
    keys = [np.arange(first, first + n, every) for first, n in zip(first_rows.tolist(), num_rows.tolist())
            if first < stop and first + n > start]
    keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    return keys[(keys >= start) & (keys < stop)]


def xor_encode(values: np.ndarray, lengths: Sequence[int], every: int) -> np.ndarray:
    """Rows of consecutive fragments of ``lengths`` rows, each XOR the row before it but for key rows."""
    out = np.empty_like(values)
    np.bitwise_xor(values[1:], values[:-1], out=out[1:])
    keys = delta_key_rows(fragment_starts(lengths), np.asarray(lengths), 0, len(values), every)
    out[keys] = values[keys]
    return out


def xor_decode(stored: np.ndarray, keys: np.ndarray, start: int) -> np.ndarray:
    """Rows ``start, start + 1, ...`` as recorded, from ``stored`` XOR rows whose first row is a key; ``keys``:
    the key rows among them (absolute row numbers), sorted. Decodes in place and returns ``stored``."""
    bounds = np.append(keys - start, len(stored))
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if b - a > 1:
            np.bitwise_xor.accumulate(stored[a:b], axis=0, out=stored[a:b])
    return stored
