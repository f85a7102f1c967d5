"""Env infos as stored: one JSON list per fragment, zlib-compressed (schema 3.0) or as a string (earlier)."""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from rllib_recorder.errors import SchemaError

ENCODING = "zlib_json"  # fragments/infos: variable-length bytes, zlib of the UTF-8 JSON

# A fragment's infos expand to at most this many bytes: more is a damaged or hostile file, not data.
MAX_JSON_BYTES = 256 << 20


def compress_all(infos: np.ndarray) -> np.ndarray:
    """JSON strings as zlib-compressed bytes (the repeated keys of every step's info compress 10-20x)."""
    out = np.empty(len(infos), dtype=object)
    for i, text in enumerate(infos):
        data = text.encode() if isinstance(text, str) else bytes(text)
        out[i] = np.frombuffer(zlib.compress(data, 6), np.uint8)
    return out


def loads(value: Any, encoding: Any) -> Any:
    """One fragment's infos as stored (``encoding``: the column's ``encoding`` attribute), parsed."""
    if encoding != ENCODING:
        return json.loads(value)
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(np.asarray(value, np.uint8).tobytes(), MAX_JSON_BYTES)
    except zlib.error as e:
        raise SchemaError(f"a fragment's infos are unreadable ({e}); the file may be damaged: run "
                          "'rllib-recorder verify'") from None
    if inflate.unconsumed_tail:
        raise SchemaError(f"a fragment's infos expand beyond {MAX_JSON_BYTES >> 20} MiB; the file is damaged "
                          "or not a recording: move it out of the run directory")
    return json.loads(data)
