"""A Ray Data source over a recorded run: one read task per worker file and row range."""

from __future__ import annotations

from typing import Any

import numpy as np
from ray.data import Datasource

from rllib_recorder.format import decode
from rllib_recorder.read.worker_file import WorkerFile


def read_step_rows(path: str, agent: str, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows ``[start, stop)`` of one agent's steps in one worker file, flat columns (``obs/pos``) plus ids."""
    f = WorkerFile(path)
    try:
        columns = {p: f.column(agent, p, slice(start, stop)) for p in f.column_paths(agent)}
        columns["eps_id"] = columns["eps_id"].astype(str)
        n = stop - start
        columns["worker_index"] = np.full(n, f.worker_index, np.int64)
        columns["agent_id"] = np.full(n, agent)
        return columns
    finally:
        f.close()


class RecordedStepsDatasource(Datasource):
    """Ray Data source over a run (a ``read.run.Run``): each read task opens one worker file and reads one row range."""

    def __init__(self, run: Any, rows_per_task: int, evaluation: bool | None) -> None:
        super().__init__()
        self.ranges = []  # (path, agent, start, stop, bytes per row)
        for f in run.files_of(evaluation):
            for agent in f.agents:
                total = f.num_rows(agent)
                steps = f.h5[f"agents/{agent}/steps"]
                row_bytes = sum(int(np.prod(decode.row_shape(steps[p]), dtype=np.int64)) * steps[p].dtype.itemsize
                                for p in f.column_paths(agent))
                for start in range(0, total, rows_per_task):
                    self.ranges.append((f.path, agent, start, min(total, start + rows_per_task), row_bytes))

    def estimate_inmemory_data_size(self) -> int:
        return sum((stop - start) * row_bytes for _, _, start, stop, row_bytes in self.ranges)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[Any]:
        from ray.data.block import BlockAccessor, BlockMetadata
        from ray.data.datasource import ReadTask

        tasks = []
        for path, agent, start, stop, row_bytes in self.ranges:
            def read(path: str = path, agent: str = agent, start: int = start, stop: int = stop) -> list[Any]:
                return [BlockAccessor.batch_to_block(read_step_rows(path, agent, start, stop))]

            meta = BlockMetadata(num_rows=stop - start, size_bytes=(stop - start) * row_bytes,
                                 input_files=[path], exec_stats=None)
            tasks.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
        return tasks
