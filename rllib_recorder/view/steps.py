"""One episode's stored columns as the page's tracks: every agent's values per step, as typed arrays (base64 of
their little-endian bytes: exact, NaN kept, quick to send and to read in a browser)."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

from rllib_recorder.read.records import Episode
from rllib_recorder.read.worker_file import WorkerFile

# What the page is sent of a column with more values per step than this: its shape, and no values.
MAX_DIMS = 256
# The columns read for the tracks (``obs`` only when it is not a picture).
TRACK_COLUMNS = ["actions", "rewards", "terminateds", "truncateds", "t", "weights_seq_no", "env_t",
                 "extra_model_outputs", "infos", "policy_lag", "start_state"]


def typed(values: np.ndarray) -> dict[str, Any]:
    """A numeric array as ``{"type", "b64"}``: float32 as f4, other floats and big integers as f8, small integers
    as i4, booleans as u1."""
    values = np.asarray(values)
    if values.dtype == bool:
        kind, out = "u1", values.astype("<u1")
    elif values.dtype == np.float32:
        kind, out = "f4", values.astype("<f4")
    elif values.dtype.kind in "iu" and (not values.size or (values.min() >= -2**31 and values.max() < 2**31)):
        kind, out = "i4", values.astype("<i4")
    else:
        kind, out = "f8", values.astype("<f8")
    return {"type": kind, "b64": base64.b64encode(np.ascontiguousarray(out).tobytes()).decode("ascii")}


def flat_columns(name: str, value: Any, rows: int) -> list[tuple[str, np.ndarray]]:
    """A (possibly nested) column as ``(name, array of rows)`` pairs: dicts and tuples by their keys."""
    if isinstance(value, dict):
        return [c for key, v in value.items() for c in flat_columns(f"{name}/{key}", v, rows)]
    if isinstance(value, tuple):
        return [c for i, v in enumerate(value) for c in flat_columns(f"{name}/{i}", v, rows)]
    array = np.asarray(value)
    return [(name, array[:rows])] if array.ndim else []


def column_json(name: str, values: np.ndarray) -> dict[str, Any]:
    """One column: its name, dtype, shape of a step's value and, when numeric and small, its values
    (``dims`` per step, row-major)."""
    shape = list(values.shape[1:])
    dims = int(np.prod(shape, dtype=np.int64)) if shape else 1
    out: dict[str, Any] = {"name": name, "dtype": str(values.dtype), "shape": shape, "dims": dims}
    if values.dtype.kind in "biuf" and dims <= MAX_DIMS:
        out["values"] = typed(values.reshape(len(values), dims) if shape else values)
    elif values.dtype.kind in "SUO" and dims == 1:
        out["text"] = [_text(v) for v in values.tolist()]
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def is_picture(obs: Any) -> bool:
    """Observations drawn as pictures: one (H, W) or (H, W, C) array of uint8 values per step (``render``'s
    rule: Atari frames, stored as uint8 codes)."""
    return isinstance(obs, np.ndarray) and obs.dtype == np.uint8 and obs.ndim in (3, 4) and min(obs.shape[1:3]) >= 8


def obs_is_picture(f: WorkerFile, agent: str) -> bool:
    """Whether ``agent``'s stored observations are pictures (one row read, as stored)."""
    if "obs" not in f.column_paths(agent) or not f.num_rows(agent):
        return False
    return is_picture(f.column(agent, "obs", slice(0, 1), decode=False))


def track_json(episode: Episode, with_obs: bool) -> dict[str, Any]:
    """One agent's track of an episode: every stored column per step, its infos, where it sits in env steps."""
    n = len(episode)
    columns = []
    if with_obs:
        columns += [column_json(name, v) for name, v in flat_columns("obs", episode.obs, n)]
    columns += [column_json(name, v) for name, v in flat_columns("actions", episode.actions, n)]
    for name in ("rewards", "terminateds", "truncateds", "t", "weights_seq_no"):
        columns.append(column_json(name, np.asarray(getattr(episode, name))[:n]))
    lag = np.asarray(episode.policy_lag)
    if len(lag) == n:
        columns.append(column_json("policy_lag", np.where(lag >= 0, lag, np.nan).astype(np.float32)))
    for key, value in episode.extra_model_outputs.items():
        columns += [column_json(name, v) for name, v in flat_columns(f"extra_model_outputs/{key}", value, n)]
    env_t = np.asarray(episode.env_t)
    return {
        "agent": episode.agent_id, "module": episode.module_id, "length": n, "return": _number(episode.episode_return),
        "terminated": bool(n and episode.terminateds[-1]), "truncated": bool(n and episode.truncateds[-1]),
        "x": typed(env_t[:n].astype(np.int64)) if len(env_t) >= n and n else None,
        "steps": int(env_t[:n].max()) + 1 if len(env_t) >= n and n else n,
        "columns": columns, "infos": plain_infos(episode.infos or []),
        "start_state": episode.start_state_kind or None,
    }


def plain_infos(infos: list[Any]) -> list[Any]:
    """Infos as plain JSON: as read (the reader parsed them from JSON) unless one holds what JSON can't (NaN)."""
    try:
        json.dumps(infos, allow_nan=False)
        return infos
    except (TypeError, ValueError):
        return [jsonable(i) for i in infos]


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def jsonable(value: Any, depth: int = 0) -> Any:
    """A value read from a recording (an info) as plain JSON: non-finite numbers as text, numpy as lists, keys as
    text, anything else as its text; nested at most 32 deep."""
    if depth > 32:
        return "..."
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist(), depth + 1)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
