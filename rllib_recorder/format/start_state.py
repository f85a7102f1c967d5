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


def pack(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    """The state blob of ``arrays`` and the JSON-able ``meta``."""
    table, parts, offset = [], [], 0
    for name, value in arrays.items():
        value = np.ascontiguousarray(value)
        table.append([name, value.dtype.str, list(value.shape), offset])
        parts.append(value.tobytes())
        offset += value.nbytes
    payload = b"".join(parts)
    flags = 0
    if len(payload) > COMPRESS_ABOVE:
        payload, flags = zlib.compress(payload, 1), 1
    header = _HEADER_JSON.encode({"meta": meta, "arrays": table}).encode()
    return MAGIC + struct.pack("<BI", flags, len(header)) + header + payload


def unpack(state: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, meta) of a state blob (either form); ReplayError if it is neither."""
    try:
        if state[:2] == b"PK":  # schema 1.1: an npz archive with a "meta" array
            with np.load(io.BytesIO(state), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            return arrays, json.loads(arrays.pop("meta").tobytes())
        if state[:4] != MAGIC:
            raise ValueError("unknown magic")
        flags, length = struct.unpack_from("<BI", state, 4)
        start = 4 + struct.calcsize("<BI")
        header = json.loads(state[start:start + length])
        payload = state[start + length:]
        if flags & 1:
            payload = zlib.decompress(payload)
        arrays = {}
        for name, dtype, shape, offset in header["arrays"]:
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(payload, dtype, count, offset).reshape(shape).copy()
        return arrays, header["meta"]
    except (ValueError, KeyError, TypeError, struct.error, zlib.error, OSError) as e:
        raise ReplayError(f"the recorded start state is unreadable ({type(e).__name__}: {e}); "
                          "the file may be damaged: run 'rllib-recorder verify'") from None
