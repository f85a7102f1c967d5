"""RLlib's ``OfflineData`` reading a recorded run directly (RLlib imported: only when offline training asks for it)."""

from __future__ import annotations

import atexit
from typing import Any

from ray.rllib.offline.offline_data import OfflineData

from rllib_recorder._rllib_compat import close_ray_data_iterators, ray_data_read_method

READ_METHOD = "read_rllib_recorder_runs"
# The columns of RLlib's columnar offline format, from the recording's step columns (``next_obs`` as ``new_obs``).
TRANSITIONS = ("obs", "next_obs", "actions", "rewards", "terminateds", "truncateds", "eps_id")


def read_runs(paths: Any, *, rows_per_task: int = 50_000, evaluation: bool | None = False,
              module_id: str | None = None, min_policy_version: int | None = None, read_cpus: float = 0.0,
              read_tasks: int | None = 2, **ignored: Any) -> Any:
    """A ``ray.data.Dataset`` of transitions in RLlib's columnar format from run directories (read lazily, one task
    per file, agent and row range; at most ``read_tasks`` at once, each reserving ``read_cpus``)."""
    import ray.data

    from rllib_recorder.read.datasource import RecordedStepsDatasource
    from rllib_recorder.read.run import open_run

    runs = [open_run(str(p)) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
    try:
        source = RecordedStepsDatasource(runs, rows_per_task, evaluation, columns=TRANSITIONS,
                                         rename={"next_obs": "new_obs"}, module_id=module_id,
                                         min_policy_version=min_policy_version)
    finally:
        for run in runs:
            run.close()
    return ray.data.read_datasource(source, num_cpus=read_cpus, concurrency=read_tasks)


class RecordedOfflineData(OfflineData):
    """``OfflineData`` whose dataset is a recording's transitions (``read_runs``), everything else RLlib's own.

    At interpreter exit it closes the process's Ray Data iterators before Ray shuts down: collected afterwards,
    Ray 2.60's iterator logs a traceback (a script that ends after ``algo.stop()`` would print one).
    """

    def __init__(self, config: Any) -> None:
        with ray_data_read_method(READ_METHOD, read_runs):
            super().__init__(config)
        atexit.register(close_ray_data_iterators)
