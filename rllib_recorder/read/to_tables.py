"""A run's steps as a pandas DataFrame, one row per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from rllib_recorder.extras import require_extra

if TYPE_CHECKING:
    from rllib_recorder.read.worker_file import WorkerFile

# Step columns with one number per row: what a DataFrame holds.
SCALAR_COLUMNS = ("eps_id", "t", "rewards", "terminateds", "truncateds", "weights_seq_no")


def to_dataframe(files: Iterable["WorkerFile"]) -> Any:
    """One row per step: worker, agent, the scalar step columns (actions too when they are scalars), policy lag."""
    pd = require_extra("pandas")
    frames = []
    for f in files:
        for agent in f.agents:
            rows = slice(0, f.num_rows(agent))
            data = {"worker_index": f.worker_index, "is_evaluation": f.is_evaluation, "agent_id": agent}
            for path in SCALAR_COLUMNS + ("actions",):
                value = f.column(agent, path, rows) if path in f.h5[f"agents/{agent}/steps"] else None
                if isinstance(value, np.ndarray) and value.ndim == 1:
                    data[path] = value.astype(str) if path == "eps_id" else value
            data["policy_lag"] = f.policy_lag(agent)
            frames.append(pd.DataFrame(data, index=pd.RangeIndex(f.num_rows(agent))))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
