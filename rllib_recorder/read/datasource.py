"""A Ray Data source over recorded runs: one read task per worker file, agent and row range."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
from ray.data import Datasource

from rllib_recorder.read.iterate import Block, read_block
from rllib_recorder.read.remote import local_copy
from rllib_recorder.read.worker_file import WorkerFile

# What every row carries beside its stored step columns (the DataFrame's ids and lag).
EXTRA_COLUMNS = ("policy_lag", "worker_index", "agent_id")


def read_step_rows(path: str, agent: str, start: int, stop: int, columns: Sequence[str] | None = None,
                   rename: dict[str, str] | None = None, module_id: str | None = None,
                   min_policy_version: int | None = None) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` of one agent's steps in one worker file: flat columns (``obs/pos``), ids and the
    policy lag, or the ``columns`` asked for (``iterate.read_block``), renamed by ``rename``; only the rows a
    fragment of ``module_id`` holds when it is given, and only the steps a policy of at least version
    ``min_policy_version`` (``weights_seq_no``) took."""
    f = WorkerFile(path)
    try:
        asked = list(columns) if columns is not None else [*f.column_paths(agent), *EXTRA_COLUMNS]
        out = read_block(Block(f, agent, start, stop), asked)
        if "eps_id" in out:
            out["eps_id"] = out["eps_id"].astype(str)
        keep = np.ones(stop - start, bool)
        if module_id is not None:
            keep &= _rows_of_module(f, agent, start, stop, module_id)
        if min_policy_version is not None:
            keep &= f.column(agent, "weights_seq_no", slice(start, stop)) >= min_policy_version
        if not keep.all():
            out = {k: v[keep] for k, v in out.items()}
        return {(rename or {}).get(k, k): v for k, v in out.items()}
    finally:
        f.close()


def _rows_of_module(f: WorkerFile, agent: str, start: int, stop: int, module_id: str) -> np.ndarray:
    frags = f.fragments(agent)
    keep = np.zeros(stop - start, bool)
    if "module_id" not in f.h5[f"agents/{agent}/fragments"]:
        return keep
    modules = f.h5[f"agents/{agent}/fragments/module_id"][:len(frags["first_row"])]
    for first, n, module in zip(frags["first_row"].tolist(), frags["num_rows"].tolist(), modules.tolist()):
        lo, hi = max(first, start), min(first + n, stop)
        if hi > lo and (module.decode() if isinstance(module, bytes) else str(module)) == module_id:
            keep[lo - start:hi - start] = True
    return keep


class RecordedStepsDatasource(Datasource):
    """Ray Data source over one run or several (``read.run.Run``): each read task opens one worker file and reads
    one row range of one agent. ``columns``, ``rename``, ``module_id`` and ``min_policy_version`` as
    ``read_step_rows`` takes them."""

    def __init__(self, run: Any, rows_per_task: int, evaluation: bool | None, *,
                 columns: Sequence[str] | None = None, rename: dict[str, str] | None = None,
                 module_id: str | None = None, min_policy_version: int | None = None) -> None:
        super().__init__()
        self.columns, self.rename, self.module_id = columns, rename, module_id
        self.min_policy_version = min_policy_version
        self.ranges = []  # (path, agent, start, stop, bytes per row, the run's URI if it is at a durable target)
        for one in run if isinstance(run, (list, tuple)) else [run]:
            for f in one.files_of(evaluation):
                for agent in f.agents:
                    row_bytes = f.row_bytes(agent)
                    for low, high in f.segment_rows(agent):  # a task's rows lie in one segment
                        for start in range(low, high, rows_per_task):
                            self.ranges.append((f.path, agent, start, min(high, start + rows_per_task), row_bytes,
                                                one.uri))

    def estimate_inmemory_data_size(self) -> int:
        return sum((stop - start) * row_bytes for _, _, start, stop, row_bytes, _ in self.ranges)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[Any]:
        from ray.data.block import BlockAccessor

        from rllib_recorder._rllib_compat import read_task

        tasks = []
        for path, agent, start, stop, row_bytes, uri in self.ranges:
            def read(path: str = path, agent: str = agent, start: int = start, stop: int = stop,
                     uri: str | None = uri) -> list[Any]:
                if uri is not None and not os.path.exists(path):  # another node: copy the run to its cache first
                    path = os.path.join(local_copy(uri), os.path.basename(path))
                rows = read_step_rows(path, agent, start, stop, self.columns, self.rename, self.module_id,
                                      self.min_policy_version)
                return [BlockAccessor.batch_to_block(rows)]

            filtered = self.module_id is not None or self.min_policy_version is not None
            tasks.append(read_task(read, num_rows=None if filtered else stop - start,
                                   size_bytes=(stop - start) * row_bytes, input_files=[path],
                                   per_task_row_limit=per_task_row_limit))
        return tasks


