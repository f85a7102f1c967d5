"""Training RLlib's offline algorithms (BC, MARWIL, CQL) straight from a recording, without a copy:
``config.offline_data(**offline_input("recordings/<run>"))``."""

from __future__ import annotations

import os
from typing import Any

from rllib_recorder._rllib_compat import ray_data_pandas_problem
from rllib_recorder.errors import ConfigError
from rllib_recorder.format.store import is_uri
from rllib_recorder.read.run import open_run


def offline_input(*run_dirs: str, module_id: str | None = None, min_policy_version: int | None = None,
                  batches_per_iteration: int = 4, rows_per_task: int = 50_000, evaluation: bool = False,
                  concurrency: int = 1, read_tasks: int = 2, read_cpus: float = 0.0) -> dict[str, Any]:
    """Keyword arguments for ``AlgorithmConfig.offline_data()`` that make RLlib read the runs ``run_dirs`` as
    transitions (``obs``, ``new_obs``, ``actions``, ``rewards``, ``terminateds``, ``truncateds``, ``eps_id``).

    Rows are read lazily by Ray Data tasks, one per worker file, agent and ``rows_per_task`` rows, never all in
    memory. A step whose next observation was not stored (the last step of a fragment the run's end cut off) gets
    its own observation as ``new_obs``. A multi-agent run trains one module at a time (``module_id``): its rows are
    single-agent data, which RLlib 2.60 can train on (it can't load multi-agent offline data).
    ``min_policy_version``: only the steps a policy of at least this version (``weights_seq_no``) took, e.g. the
    later, better part of a training run.
    ``batches_per_iteration``: train batches each ``train()`` call takes from the data (RLlib's
    ``dataset_num_iters_per_learner``; RLlib 2.60 needs it set with a local learner, and CQL needs it above 1).
    ``concurrency``: RLlib's ``OfflinePreLearner`` actors (one CPU each); raise it on a machine with CPUs to spare,
    or pass ``map_batches_kwargs`` to a later ``offline_data()`` call.
    ``read_tasks``: Ray Data read tasks at once; each reserves ``read_cpus`` (default none: RLlib's own actors, an
    evaluation env runner or a remote learner, may hold every CPU, and a read task that waits for one never runs:
    BC with an evaluation runner on 2 CPUs hung so; reading shares the CPUs instead).
    """
    if batches_per_iteration < 1:
        raise ConfigError(f"batches_per_iteration must be at least 1; it is {batches_per_iteration}")
    if not run_dirs:
        raise ConfigError("offline_input needs at least one run directory, e.g. offline_input('recordings/<run>')")
    problem = ray_data_pandas_problem()
    if problem:
        raise ConfigError(problem)
    for run_dir in run_dirs:
        with open_run(run_dir) as run:
            agents = {a for f in run.files_of(evaluation) for a in f.agents}
            modules = _modules(run)
        if not agents:
            raise ConfigError(f"{run_dir} holds no {'evaluation ' if evaluation else ''}steps to train on")
        if agents != {"default_agent"} and module_id is None:
            raise ConfigError(f"{run_dir} is a multi-agent run (agents {', '.join(sorted(agents))}); RLlib trains "
                              f"offline on one module at a time: pass module_id=, one of {', '.join(modules)}")
        if module_id is not None and module_id not in modules:
            raise ConfigError(f"{run_dir} has no module {module_id!r}; its modules are {', '.join(modules)}")
    from rllib_recorder.read.offline_data import READ_METHOD, RecordedOfflineData

    return {
        "input_": [d if is_uri(d) else os.path.abspath(d) for d in run_dirs],
        "offline_data_class": RecordedOfflineData,
        "input_read_method": READ_METHOD,
        "input_read_method_kwargs": {"rows_per_task": rows_per_task, "evaluation": evaluation,
                                     "module_id": module_id, "min_policy_version": min_policy_version,
                                     "read_tasks": read_tasks, "read_cpus": read_cpus},
        "dataset_num_iters_per_learner": batches_per_iteration,
        "map_batches_kwargs": {"concurrency": concurrency, "num_cpus": 1},
    }


def _modules(run: Any) -> list[str]:
    found = set()
    for f in run.files:
        for agent in f.agents:
            group = f.h5[f"agents/{agent}/fragments"]
            if "module_id" in group:
                found.update(m.decode() if isinstance(m, bytes) else str(m) for m in set(group["module_id"][:]))
    return sorted(found)
