"""RecorderCallback: the RLlib face of the recorder, for both API stacks; never raises into RLlib."""

from __future__ import annotations

import logging
from typing import Any

from rllib_recorder._rllib_compat import callback_base, unsupported_ray, warn_untested_ray
from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import RecorderError
from rllib_recorder.record.runner import StartStates, recorder_for
from rllib_recorder.service.run import AlgorithmRecorder

logger = logging.getLogger(__name__)

# Episode type -> whether its start state is kept (single-agent new-stack episodes): decided once per type, since
# on_episode_start runs on every episode and a failing hasattr costs an exception each time.
_KEEPS_START_STATE: dict[type, bool] = {}


def _keeps_start_state(episode: Any) -> bool:
    keeps = _KEEPS_START_STATE.get(type(episode))
    if keeps is None:
        keeps = _KEEPS_START_STATE[type(episode)] = (
            not hasattr(episode, "agent_episodes") and hasattr(episode, "id_")  # _rllib_compat.episode_custom_data
        )
    return keeps


def check_ray() -> None:
    """Raises one line where the installed Ray can't record; warns once where it is newer than the tested range."""
    problem = unsupported_ray()
    if problem:
        raise RecorderError(problem)
    warn_untested_ray()


class RecorderCallback(callback_base()):
    """Records every sample of every env runner into one HDF5 file per runner.

    Add it to any ``AlgorithmConfig``::

        config.callbacks(RecorderCallback)                                  # defaults
        config.callbacks(RecorderCallback.configured(output_dir="runs", num_writers=2))
        config.callbacks([MyCallback, RecorderCallback])                    # with your own

    RLlib creates one instance in the algorithm's process and one in every env
    runner (again when RLlib recreates a failed runner). What happens where:

    * ``on_algorithm_init`` (algorithm process): checks the output dir, creates the
      run directory and manifest, asks every env runner for its Ray node, starts
      the writer actors on each of those nodes, connects every env runner to a
      writer on its own node, makes every learner report each weights version it
      finishes to the writers (``service/learner.py``: the source of the stored learner version
      and so of the policy lag), and hooks ``Algorithm.cleanup`` so that
      ``algo.stop()`` (and the end of a Tune trial) drains every runner, closes
      every file and marks the manifest finished. Bad settings raise here.
    * ``on_episode_start`` (each env runner, new API stack, single agent): captures the
      sub-env's start state (``record/envstate``) into ``episode.custom_data``; it is
      stored with the episode's first fragment so ``replay --check`` can re-simulate.
    * ``on_sample_end`` (each env runner): counts the sampled steps, converts the
      episodes or batch to columns and writes them into the runner's spool, a
      node-local file its writer reads (``record/outbox``, ``format/spool``): when ``sample()``
      returns, what it sampled has left the runner's process, and a kill of the
      runner can't take it. It waits only when the spool's backlog is full
      (``max_backlog_bytes``). Any exception is caught, logged once with its cause
      and counted: the env runner never crashes because of the recorder.
    * ``on_train_result`` (algorithm process): adds ``result["recorder"]`` (steps and
      bytes stored, steps not yet committed, sampler wait, drops, errors, policy lag, the
      produced/stored/consumed rates) and updates the Tune experiment's index; with
      ``fail_on_error=True`` it raises there once any error was counted.
    * ``on_env_runners_recreated``: connects the recreated runners, to writers on
      their (possibly new) nodes, started there first if needed.
    """

    recorder_config: RecorderConfig = RecorderConfig()

    def __init__(self) -> None:
        super().__init__()
        self._run: AlgorithmRecorder | None = None
        self._logged: set[str] = set()
        self._start_states = StartStates()

    @classmethod
    def configured(cls, config: RecorderConfig | None = None, **settings: Any) -> type["RecorderCallback"]:
        """A RecorderCallback class bound to these settings (validated now, output dir checked now)."""
        check_ray()
        config = config.replace(**settings) if config is not None else RecorderConfig(**settings)
        config.check_output_dir()
        return type(cls.__name__, (cls,), {"recorder_config": config, "__module__": cls.__module__})

    @property
    def run(self) -> AlgorithmRecorder | None:
        """The driver-side recording (None inside env runners)."""
        return self._run

    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        check_ray()
        self._run = AlgorithmRecorder(algorithm, self.recorder_config)

    def on_episode_start(self, *, episode: Any, env_runner: Any = None, env: Any = None, env_index: int = 0,
                         **kwargs: Any) -> None:
        # New stack, single agent: keep the sub-env's state for `replay --check` (stored with the first fragment).
        if env is None or not _keeps_start_state(episode):
            return
        try:
            self._start_states.keep(episode, env, env_index, env_runner)
        except Exception as e:
            self._count(env_runner, "start_state", e)

    def on_sample_end(self, *, samples: Any, env_runner: Any = None, worker: Any = None, **kwargs: Any) -> None:
        runner = env_runner if env_runner is not None else worker
        try:
            recorder_for(runner, self.recorder_config.max_backlog_bytes).record(samples, runner)
        except Exception as e:  # the one place exceptions are caught: never crash the runner
            self._count(runner, "sample", e)

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        if self._run is None:
            return
        try:
            self._run.on_train_result(result)
        except Exception as e:
            if self.recorder_config.fail_on_error:
                raise
            self._run.errors["train_result"] += 1
            self._log_once("train_result", e)

    def on_env_runners_recreated(
        self, *, algorithm: Any, env_runner_group: Any, env_runner_indices: list[int], **kwargs: Any
    ) -> None:
        self._rebind(env_runner_group, env_runner_indices)

    def on_workers_recreated(self, *, algorithm: Any, worker_set: Any, worker_ids: list[int], **kwargs: Any) -> None:
        # Old API stack name of the same event; binding twice is harmless.
        self._rebind(worker_set, worker_ids)

    def _rebind(self, group: Any, indices: list[int]) -> None:
        if self._run is None or not indices:
            return
        try:
            self._run.bind(group, list(indices))
        except Exception as e:
            self._run.errors["rebind"] += 1
            self._log_once("rebind", e)

    def _count(self, runner: Any, kind: str, error: Exception) -> None:
        self._log_once(kind, error)
        try:
            recorder_for(runner).count_error(kind)
        except Exception:  # counting must not raise either
            pass

    def _log_once(self, kind: str, error: Exception) -> None:
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.error(
            "rllib_recorder: %s failed (%s: %s); recording continues, the error is counted "
            "in result['recorder']['errors'] (further ones are not logged)",
            kind, type(error).__name__, error, exc_info=error,
        )
