"""The start-state blob a fragment stores for `replay --check`: its kinds, and packing arrays and JSON into bytes and
back.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from typing import Any

import numpy as np

from rllib_recorder.errors import ReplayError

KIND_CLASSIC = "classic_control/1"

KIND_ALE = "ale/1"

# The state blob (docs/FORMAT.md): MAGIC, a flags byte (1: payload zlib-compressed), the header's length
# (uint32 LE), a JSON header {"meta": ..., "arrays": [[name, dtype, shape, offset], ...]}, then the arrays'
# raw bytes back to back. Captured on every episode start inside the env runner, so it is built without
# zip machinery; payloads above COMPRESS_ABOVE bytes (Atari frame stacks) are compressed at zlib level 1.
# Files of schema 1.1 may hold the older npz form (starts with b"PK"); restore reads both.
MAGIC = b"RRS2"

COMPRESS_ABOVE = 4096

_HEADER_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder for every capture's header


# Flags of the blob. FLAG_XOR (schema 3.0): the arrays the header lists under "xor" hold their bytes XOR those of the
# same-named array of a *reference*: the start state stored "ref_back" fragment rows earlier in the same agent's
# fragments table of the same file (an earlier append's too, never another file's: a reader never crosses a
# segment for it), itself stored plain. An env's start states differ in a few bytes from one episode to the next (an ALE state: about 20 of
# 14,449), so the XOR compresses to 100-200 bytes where the state took 7.5 kB (docs/BENCHMARKS.md).
FLAG_ZLIB = 1
FLAG_XOR = 2


def pack(arrays: dict[str, np.ndarray], meta: dict[str, Any], xor: list[str] | None = None,
         ref_back: int = 0) -> bytes:
    """The state blob of ``arrays`` and the JSON-able ``meta``; ``xor``: the arrays given XOR those of the state
    ``ref_back`` fragment rows earlier."""
    table, parts, offset = [], [], 0
    for name, value in arrays.items():
        value = np.ascontiguousarray(value)
        table.append([name, value.dtype.str, list(value.shape), offset])
        parts.append(value.tobytes())
        offset += value.nbytes
    payload = b"".join(parts)
    flags = FLAG_XOR if xor else 0
    if len(payload) > COMPRESS_ABOVE or xor:  # mostly zeros when XORed: level 6 costs little more there
        payload, flags = zlib.compress(payload, 6 if xor else 1), flags | FLAG_ZLIB
    head = {"meta": meta, "arrays": table, **({"xor": xor, "ref_back": int(ref_back)} if xor else {})}
    header = _HEADER_JSON.encode(head).encode()
    return MAGIC + struct.pack("<BI", flags, len(header)) + header + payload


def ref_back(state: bytes) -> int:
    """How many fragment rows earlier the reference of a ``FLAG_XOR`` blob is (0: the blob reads on its own)."""
    if len(state) < 9 or state[:4] != MAGIC or not state[4] & FLAG_XOR:
        return 0
    return int(_unpack(state)[3])


# Plain states an encoder keeps to XOR later ones against: one per layout, the newest, at most this many layouts.
MAX_REFERENCES = 8


def encode_batch(states: list[bytes], first_row: int = 0, plain: list[tuple[int, Any, Any]] | None = None
                 ) -> list[bytes]:
    """Start states of one agent at fragment rows ``first_row, first_row + 1, ...`` (empty: none), each big one
    stored XOR the newest earlier one stored plain whose arrays are alike (names, dtypes, shapes), if any
    (``FLAG_XOR``). ``plain``: (row, layout, arrays) of the plain states stored before in the same file, which the
    call updates (kept by the writer for the file it has open, so that states reference across appends)."""
    out, plain = list(states), plain if plain is not None else []
    for i, state in enumerate(states):
        if len(state) <= COMPRESS_ABOVE // 4 or state[:4] != MAGIC or ref_back(state):
            continue
        try:
            arrays, meta = unpack(state)
        except ReplayError:  # not ours to mend: stored as given
            continue
        layout = [(name, value.dtype.str, value.shape) for name, value in arrays.items()]
        match = next((p for p in reversed(plain) if p[1] == layout), None)
        if match is None:
            plain[:] = [p for p in plain if p[1] != layout][-(MAX_REFERENCES - 1):] + [(first_row + i, layout, arrays)]
            continue
        xored = {name: _xor(value, match[2][name]) for name, value in arrays.items()}
        out[i] = pack(xored, meta, xor=list(arrays), ref_back=first_row + i - match[0])
    return out


def resolve(state: bytes, reference: bytes | None) -> bytes:
    """A blob that reads on its own: a ``FLAG_XOR`` one with its arrays XORed back against ``reference``."""
    if not ref_back(state):
        return state
    if reference is None or ref_back(reference):
        raise ReplayError("the recorded start state is stored against an earlier one, which is missing or not "
                          "plain; the file may be damaged: run 'rllib-recorder verify'")
    arrays, meta, xor, _ = _unpack(state)
    references, _ = unpack(reference)
    for name in xor:
        ref = references.get(name)
        if ref is None or ref.shape != arrays[name].shape or ref.dtype != arrays[name].dtype:
            raise ReplayError(f"the recorded start state's array {name!r} does not match its reference's; the "
                              "file may be damaged: run 'rllib-recorder verify'")
        arrays[name] = _xor(arrays[name], ref)
    return pack(arrays, meta)


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.bitwise_xor(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
    return out.view(a.dtype).reshape(a.shape)


def unpack(state: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, meta) of a state blob (either form); ReplayError if it is neither, or if it is stored against an
    earlier state (``resolve`` it first: the run's reader does)."""
    arrays, meta, xor, _ = _unpack(state)
    if xor:
        raise ReplayError("the recorded start state is stored against an earlier one; read it through the run's "
                          "reader, which resolves it")
    return arrays, meta


def _unpack(state: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str], int]:
    try:
        if state[:2] == b"PK":  # schema 1.1: an npz archive with a "meta" array
            with np.load(io.BytesIO(state), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            return arrays, json.loads(arrays.pop("meta").tobytes()), [], 0
        if state[:4] != MAGIC:
            raise ValueError("unknown magic")
        flags, length = struct.unpack_from("<BI", state, 4)
        start = 4 + struct.calcsize("<BI")
        header = json.loads(state[start:start + length])
        payload = state[start + length:]
        if flags & FLAG_ZLIB:
            payload = zlib.decompress(payload)
        arrays = {}
        for name, dtype, shape, offset in header["arrays"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(payload, dtype, count, offset).reshape(shape).copy()
        xor, back = (header.get("xor"), header.get("ref_back")) if flags & FLAG_XOR else ([], 0)
        if not isinstance(xor, list) or not all(isinstance(n, str) and n in arrays for n in xor) \
                or type(back) is not int or back < 0 or bool(xor) != bool(back):
            raise ValueError("a bad 'xor' or 'ref_back' in its header")
        return arrays, header["meta"], xor, back
    except (ValueError, KeyError, TypeError, struct.error, zlib.error, OSError) as e:
        raise ReplayError(f"the recorded start state is unreadable ({type(e).__name__}: {e}); "
                          "the file may be damaged: run 'rllib-recorder verify'") from None
