"""The driver side of a recording: run directory, manifest, writer pool, metrics, drain on stop."""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import re
import socket
import time
import uuid
import weakref
from collections import Counter
from typing import Any

import ray

from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import OutputDirError, RecorderError
from rllib_recorder.format import durable
from rllib_recorder.format.index import entry_from_manifest, update_run
from rllib_recorder.format.lag import PERCENTILES, interval_rates, lag_summary
from rllib_recorder.format.liveness import process_start
from rllib_recorder.format.manifest import now_iso, read_manifest, versions, write_manifest
from rllib_recorder.format.spool import sender_dirs
from rllib_recorder.record.runner import bind_env_runner, drain_env_runner, recorder_for, runner_node_id
from rllib_recorder.service import lifecycle
from rllib_recorder.service.learner import count_consumed, hook_learners
from rllib_recorder.service.pool import Binding, WriterPool, current_node_id

logger = logging.getLogger(__name__)

_RUNNER_SUMS = ("samples", "chunks_written", "env_steps_sampled", "env_steps_written", "chunks_dropped",
                "env_steps_dropped", "rows_dropped", "chunks_failed", "env_steps_failed", "rows_failed", "wait_s",
                "errors", "backlog_bytes")
_WRITER_SUMS = ("env_steps", "agent_steps", "chunks", "raw_bytes", "disk_bytes", "write_s",
                "duplicate_chunks", "errors", "cpu_s", "steps_uncommitted", "bytes_uncommitted")


def resolve_run_dir(output_dir: str, config: RecorderConfig, algorithm: Any) -> str:
    """The run directory.

    Outside Tune: ``output_dir/run_name`` (or ``ALGO_ENV_time_id``). Under Tune, named like Tune's own
    folders: ``output_dir/<experiment>/<trial dir>`` (``run_name`` replaces the experiment name), so the trials
    of a grid search sit side by side under one experiment directory.
    """
    experiment, trial = tune_names(algorithm)
    if trial:
        return os.path.join(output_dir, config.run_name or experiment or "experiment", trial)
    if config.run_name:
        return os.path.join(output_dir, config.run_name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name(algorithm.config.env).rpartition(":")[2])[:40] or "env"
    return os.path.join(output_dir, f"{type(algorithm).__name__}_{env}_{stamp}_{uuid.uuid4().hex[:6]}")


class RunRecorder:
    """Everything the recorder does in the algorithm's process, for one run."""

    def __init__(self, algorithm: Any, config: RecorderConfig) -> None:
        self.config = config
        self.run_dir = resolve_run_dir(config.check_output_dir(), config, algorithm)
        previous = previous_attempt(self.run_dir, *tune_names(algorithm))
        if previous is None and os.path.exists(self.run_dir) and os.listdir(self.run_dir):
            raise OutputDirError(
                f"run directory {self.run_dir!r} already holds a run; choose another run_name "
                "or output_dir (a recording never overwrites an earlier one)"
            )
        os.makedirs(self.run_dir, exist_ok=True)
        durable.fsync_dir(os.path.dirname(self.run_dir))  # the run's name survives a power loss, like its rows
        # a Tune trial restarted, resumed or restored records on into its run: same id, the next attempt
        self.run_id = previous["run_id"] if previous else uuid.uuid4().hex[:16]
        self.attempt = len(previous["attempts"]) if previous else 0
        self._started_monotonic = time.monotonic()
        self.closed = False
        self.learner_version = -1
        self.learner_version_since = time.time()
        self.errors: Counter[str] = Counter()
        self._rate_base: tuple[float, int, int, int] = (time.monotonic(), 0, 0, 0)
        self._lifetime: dict[str, float] = {}
        self.manifest = self._initial_manifest(algorithm)
        if previous is not None:
            self.manifest.update(started_at=previous.get("started_at") or self.manifest["started_at"],
                                 totals=previous.get("totals") or {})
        self.manifest["attempts"] = (previous["attempts"] if previous else []) + [
            {"attempt": self.attempt, "started_at": now_iso(), "finished_at": None, "status": "running",
             "ended_by": None, "driver_pid": os.getpid()}]
        self._before = _earlier_totals(previous)
        write_manifest(self.run_dir, self.manifest)
        # Under Tune the experiment directory indexes its trials' runs (recorder_index.json).
        self.experiment_dir = os.path.dirname(self.run_dir) if self.manifest["trial"] else None
        self._update_index()
        self.pool = WriterPool(self.run_id, self.run_dir, config, current_node_id(), attempt=self.attempt)
        self.binding = self._binding()
        self._algorithm = weakref.ref(algorithm)
        self.learners_reporting = 0
        if config_is_new_stack(algorithm):
            self.learner_version = 0  # RLlib's learners start at weights_seq_no 0
        self._writers_added()
        # held here too: the driver may end (atexit, SIGTERM) after the algorithm object is gone
        self._held_groups = self._groups(algorithm)
        for group, _ in self._held_groups:
            self.bind(group)
        # After binding: every node with runners has its writers, and the learners report to all of them.
        self.learners_reporting = self._hook_learners(algorithm)
        self.consumed = count_consumed(algorithm, start=self._before["env_steps_consumed"])
        self._install_stop_hook(algorithm)
        lifecycle.register(self)  # closed however the driver ends, also without algo.stop()
        logger.info("rllib_recorder: recording into %s", self.run_dir)

    def bind(self, group: Any, indices: list[int] | None = None) -> None:
        """Connects the env runners of ``group`` (or just ``indices``) to writers on their own nodes.

        Asks the runners for their nodes first and starts writers on any node that has none yet
        (a restarted runner may come back on another node).
        """
        local = indices is None
        nodes = group.foreach_env_runner(runner_node_id, local_env_runner=local, remote_worker_ids=indices)
        if self.pool.ensure_nodes([n for n in nodes if isinstance(n, str)]):
            self._writers_added()
        group.foreach_env_runner(
            functools.partial(bind_env_runner, binding=self.binding),
            local_env_runner=local, remote_worker_ids=indices,
        )

    def _writers_added(self) -> None:
        """New writers: tell them the learner's version, re-address the runners, note the nodes."""
        if self.learner_version >= 0:  # in effect since then; writers that know it already ignore it
            self.pool.set_learner_version(self.learner_version, self.learner_version_since)
        self.binding = self._binding()
        self.manifest["writer_nodes"] = self.pool.writer_nodes()
        write_manifest(self.run_dir, self.manifest)
        algorithm = self._algorithm()
        if self.learners_reporting and algorithm is not None:  # learners report to the new writers too
            self.learners_reporting = self._hook_learners(algorithm)

    def _binding(self) -> Binding:
        return Binding(
            run_id=self.run_id, run_dir=self.run_dir, namespace=ray.get_runtime_context().namespace,
            num_writers=self.config.num_writers, config=self.config, node_writers=self.pool.node_writers(),
            node_tags=self.pool.node_tags(),
        )

    def on_train_result(self, result: dict[str, Any]) -> None:
        """Adds ``result['recorder']`` (and tells writers the learner's version if learners don't report it)."""
        version = _learner_version(result)
        if version is not None and version != self.learner_version:
            self.learner_version, self.learner_version_since = version, time.time()
            if not self.learners_reporting:  # coarse: known only once per iteration
                self.pool.set_learner_version(version, self.learner_version_since)
        result["recorder"] = self.metrics(self.pool.stats(), result)
        self._update_index(env_steps=result["recorder"]["env_steps_stored"])
        errors = result["recorder"]["errors"]
        if self.config.fail_on_error and errors:
            cause = result["recorder"]["last_error"] or "see the env runner logs"
            raise RecorderError(
                f"rllib_recorder counted {errors} error(s), last: {cause}; "
                "training stops because fail_on_error=True"
            )

    def metrics(self, writer_stats: list[dict[str, Any]], result: dict[str, Any] | None = None) -> dict[str, Any]:
        """Sums writer and env-runner counters into one flat dict of recorder metrics."""
        writers = Counter()
        runners = Counter()
        lag: Counter[int] = Counter()
        max_wait = 0.0
        for stats in writer_stats:
            writers.update({k: stats.get(k, 0) for k in _WRITER_SUMS})
            lag.update({int(k): v for k, v in stats.get("policy_lag_counts", {}).items()})
            for runner in stats.get("runners", {}).values():
                runners.update({k: runner.get(k, 0) for k in _RUNNER_SUMS})
                max_wait = max(max_wait, runner.get("max_wait_s", 0.0))
        lags = lag_summary(lag)
        last_error = next((s["last_error"] for s in writer_stats if s.get("last_error")), None) or next(
            (r["last_error"] for s in writer_stats for r in s.get("runners", {}).values() if r.get("last_error")),
            None)
        # Each env-runner process sends under its own sender id: more than one per file is a restart.
        restarts = sum(max(0, n - 1) for s in writer_stats for n in s.get("senders", {}).values())
        out = {
            "run_dir": self.run_dir,
            "env_steps_stored": writers["env_steps"], "agent_steps_stored": writers["agent_steps"],
            "chunks_stored": writers["chunks"], "raw_bytes": writers["raw_bytes"],
            "disk_bytes": writers["disk_bytes"], "writer_busy_s": writers["write_s"],
            "writer_cpu_s": round(writers["cpu_s"], 3),
            "duplicate_chunks": writers["duplicate_chunks"],
            "steps_uncommitted": writers["steps_uncommitted"], "spool_backlog_bytes": runners["backlog_bytes"],
            "sampler_wait_s": runners["wait_s"],
            "sampler_max_wait_s": max_wait, "chunks_dropped": runners["chunks_dropped"],
            "env_steps_dropped": runners["env_steps_dropped"],
            "rows_dropped": runners["rows_dropped"], "chunks_failed": runners["chunks_failed"],
            "rows_failed": runners["rows_failed"], "env_steps_failed": runners["env_steps_failed"],
            "errors": writers["errors"] + runners["errors"] + runners["chunks_failed"] + sum(self.errors.values()),
            "learner_version": self.learner_version,
            "last_error": last_error, "runner_restarts_seen": restarts,
            "learners_reporting": self.learners_reporting,
            "policy_lag_mean": lags["mean"] if lags["steps"] else 0.0,
            "policy_lag_max": lags["max"] if lags["steps"] else 0,
            "policy_lag_hist": lags["hist"], "policy_lag_unknown_steps": lags["unknown"],
            **{f"policy_lag_p{p}": lags[f"p{p}"] for p in PERCENTILES},
        }
        if result is not None:
            out.update(self._rates(out["env_steps_stored"], result))
        out.update({k: v for k, v in self._lifetime.items() if k not in out})
        return out

    def close(self, algorithm: Any = None, ended_by: str | None = None, interrupted: bool = False) -> dict[str, Any]:
        """Drains every env runner, closes every file, finishes the manifest (idempotent).

        ``ended_by`` says what ended the run (default: the algorithm's stop); ``interrupted`` marks an end by an
        exception, KeyboardInterrupt or SIGTERM (status ``interrupted``; the data is as complete as on a stop).
        """
        if self.closed:
            return self.manifest.get("totals", {})
        self.closed = True
        lifecycle.unregister(self)
        ended_by = ended_by or ("Tune stopped the trial" if self.manifest.get("trial") else "algo.stop()")
        groups = self._groups(algorithm) if algorithm is not None else self._held_groups
        ray_up = ray.is_initialized()
        drains = []
        for group, is_evaluation in groups if ray_up else []:
            drains += self._drain(group, is_evaluation)
        writer_stats = self.pool.close(self.config.drain_timeout_s) if ray_up else []
        leftovers = {k: v for s in writer_stats for k, v in (s.get("spool_leftovers") or {}).items()}
        local = self._commit_left_spools()
        if local is not None:  # what the writers could not commit, committed here (or still left)
            writer_stats += local
            here = {k.split("/")[0] for s in local for k in s.get("spool_leftovers") or {}}
            leftovers = {k: v for k, v in leftovers.items() if k.split("/")[0] not in here}
            leftovers.update({k: v for s in local for k, v in (s.get("spool_leftovers") or {}).items()})
        totals = self.metrics(writer_stats)
        totals["unacked_at_stop"] = len(leftovers)  # senders whose handed-over samples could not be committed
        totals["spool_leftovers"] = leftovers
        senders = {k: v for s in writer_stats for k, v in (s.get("runners") or {}).items()}
        totals["senders"] = {**self._before["senders"], **senders}  # earlier attempts' too
        totals["env_steps_stored"] += self._before["env_steps_stored"]
        status = "interrupted" if interrupted else "finished"
        self.manifest["attempts"][-1].update(finished_at=now_iso(), status=status, ended_by=ended_by,
                                             senders=sorted(senders))
        self.manifest.update(
            status=status, ended_by=ended_by, finished_at=now_iso(),
            totals=totals, files=self.pool.placement(), writer_nodes=self.pool.writer_nodes(),
            nodes=sorted({s.get("node") for s in writer_stats if s.get("node")}),
        )
        write_manifest(self.run_dir, self.manifest)
        self._update_index()
        if leftovers:
            logger.error("rllib_recorder: samples of %d env runner(s) stay in the spool, not committed (%s); "
                         "'rllib-recorder recover %s' commits them once the cause is fixed", len(leftovers),
                         next(iter(leftovers.values())), self.run_dir)
        logger.info("rllib_recorder: recording %s %s (%s)", self.run_dir, self.manifest["status"], ended_by)
        return totals

    def close_unstopped(self, ended_by: str, interrupted: bool) -> dict[str, Any]:
        """Closes a recording whose algorithm was never stopped (``lifecycle``: exit, signal, ray.shutdown)."""
        logger.warning("rllib_recorder: %s; closing the recording %s", ended_by, self.run_dir)
        return self.close(self._algorithm(), ended_by=ended_by, interrupted=interrupted)

    def _commit_left_spools(self) -> list[dict[str, Any]] | None:
        """Commits here what is still in this node's spools after the writers closed (writers that died, or Ray
        shut down first); None if nothing was left."""
        from rllib_recorder.format.spool import sender_dirs
        from rllib_recorder.service.recover import commit_spools_in_child

        if next(sender_dirs(self.run_dir), None) is None:
            return None
        try:  # in a child: HDF5 may crash a process that writes to a failing disk, and this is the user's driver
            return commit_spools_in_child(self.run_dir, self.run_id, self.config, self.config.drain_timeout_s)
        except Exception as e:  # noqa: BLE001 - the spool stays; recover commits it
            self.errors["spool_commit"] += 1
            logger.error("rllib_recorder: committing the spools left in %s failed (%s: %s); run "
                         "'rllib-recorder recover %s'", self.run_dir, type(e).__name__, e, self.run_dir)
            return None

    def _drain(self, group: Any, is_evaluation: bool) -> list[dict[str, Any]]:
        timeout = self.config.drain_timeout_s
        try:
            reports = group.foreach_env_runner(
                functools.partial(drain_env_runner, timeout_s=timeout),
                local_env_runner=True, timeout_seconds=timeout + 10,
            )
        except Exception as e:  # a dead runner must not keep the others from closing
            self.errors["drain"] += 1
            logger.warning("rllib_recorder: draining %s env runners failed: %s",
                           "evaluation" if is_evaluation else "training", e)
            return []
        return [r for r in reports if isinstance(r, dict)]

    def _groups(self, algorithm: Any) -> list[tuple[Any, bool]]:
        groups = [(getattr(algorithm, "env_runner_group", None), False)]
        if self.config.record_evaluation:
            groups.append((getattr(algorithm, "eval_env_runner_group", None), True))
        return [(g, e) for g, e in groups if g is not None]

    def _install_stop_hook(self, algorithm: Any) -> None:
        # RLlib has no stop callback. Trainable.stop() (algo.stop(), and Tune at the end
        # of a trial) calls self.cleanup(), which stops the env runners: drain first.
        original_cleanup = algorithm.cleanup

        def cleanup_after_recording() -> None:
            try:
                self.close(algorithm)
            except Exception:
                logger.exception("rllib_recorder: closing the recording failed")
            finally:
                original_cleanup()

        algorithm.cleanup = cleanup_after_recording

    def _initial_manifest(self, algorithm: Any) -> dict[str, Any]:
        config = algorithm.config
        return {
            "format": "rllib_recorder", "schema_version": _schema_version(), "run_id": self.run_id,
            "status": "running", "started_at": now_iso(), "finished_at": None,
            "versions": versions(), "algorithm": type(algorithm).__name__,
            "env": env_name(config.env), **self._env_config(config.env_config),
            "api_stack": "new" if config_is_new_stack(algorithm) else "old",
            "batch_mode": config.batch_mode, "num_env_runners": config.num_env_runners,
            "trial": tune_names(algorithm)[1],
            "trial_name": tune_trial(tune_names(algorithm)[1])[0], "trial_id": tune_trial(tune_names(algorithm)[1])[1],
            "experiment": tune_names(algorithm)[0],
            "spaces": _spaces(algorithm), "recorder": self.config.to_dict(),
            "driver_host": socket.gethostname(), "driver_pid": os.getpid(), "driver_started": process_start(),
        }

    def _env_config(self, env_config: Any) -> dict[str, Any]:
        """The manifest's ``env_config`` (verbatim, as JSON) without the keys ``omit_env_config_keys`` names."""
        env_config = dict(env_config or {})
        omitted = sorted(str(k) for k in env_config if k in self.config.omit_env_config_keys)
        kept = {k: v for k, v in env_config.items() if k not in self.config.omit_env_config_keys}
        return {"env_config": _jsonable(kept), **({"env_config_omitted": omitted} if omitted else {})}

    def _rates(self, stored: int, result: dict[str, Any]) -> dict[str, Any]:
        """TianJi's three rates since the last result: env steps produced, stored and consumed per second.

        Produced: sampled by the env runners (RLlib's lifetime count); stored: committed by the
        writers; consumed: handed to the learners to train on, each step once (not once per epoch or
        minibatch; ``learner.ConsumedSteps``). ``steps_not_stored`` is what the env runners
        sampled and the writers have not committed (held, in flight, dropped or failed): writers that
        keep up hold it near one coalescing window.
        """
        produced = int(_find(result, ("env_runners", "num_env_steps_sampled_lifetime"), None)
                       or result.get("num_env_steps_sampled") or 0)  # the old API stack's lifetime count
        # Trained on once: the steps handed to the learners (learner.ConsumedSteps), not RLlib's per-minibatch
        # count; the old API stack counts each train batch once itself.
        consumed = self.consumed.total if self.consumed is not None else int(result.get("num_env_steps_trained") or 0)
        now = (time.monotonic(), produced, stored, consumed)
        rates = interval_rates(self._rate_base, now)
        self._rate_base = now
        self._lifetime = {
            "env_steps_sampled": produced, "env_steps_consumed": consumed,
            "recording_s": now[0] - self._started_monotonic, "last_result_at_s": time.time(),
        }
        return {**rates, "steps_not_stored": max(0, produced - stored)}

    def _update_index(self, **changes: Any) -> None:
        if self.experiment_dir is None:
            return
        try:
            update_run(self.experiment_dir, self.run_dir, {**entry_from_manifest(self.manifest), **changes})
        except Exception as e:  # the index is a convenience; the run's manifest stays the truth
            self.errors["index"] += 1
            logger.warning("rllib_recorder: updating %s failed: %s", self.experiment_dir, e)

    def _hook_learners(self, algorithm: Any) -> int:
        """Makes the learners report their versions to the writers; 0 if they can't (old stack)."""
        if not config_is_new_stack(algorithm):
            return 0
        try:
            return hook_learners(algorithm, self.run_id, self.binding.namespace, self.pool.names)
        except Exception as e:  # fall back to the driver's once-per-iteration version
            self.errors["learner_hook"] += 1
            logger.warning("rllib_recorder: learners cannot report their versions (%s: %s); the policy lag "
                           "falls back to once per iteration", type(e).__name__, e)
            return 0


def record_sample(env_runner: Any, samples: Any) -> None:
    """Hands one ``on_sample_end`` payload to this env runner's recorder."""
    recorder_for(env_runner).record(samples, env_runner)


def previous_attempt(run_dir: str, experiment: str | None, trial: str | None) -> dict[str, Any] | None:
    """The manifest of an earlier attempt of this Tune trial in ``run_dir``, ready to be continued (None when
    there is none: outside Tune, a new trial, or a run of something else).

    Tune restarts a failed trial (``FailureConfig``), resumes a paused one (PBT, HyperBand) and restores an
    experiment (``Tuner.restore``) in the same trial dir, so the recording continues there. An attempt that did
    not end cleanly (its actor was killed) is recovered first: what its runners had handed over is committed.
    """
    path = os.path.join(run_dir, "manifest.json")
    if trial is None or not os.path.isfile(path):
        return None
    try:
        manifest = read_manifest(run_dir)
    except RecorderError:
        return None
    if manifest.get("trial") != trial or manifest.get("experiment") != experiment or not manifest.get("run_id"):
        return None
    if manifest.get("status") not in ("finished", "interrupted") or next(sender_dirs(run_dir), None) is not None:
        manifest = _recover_earlier(run_dir)
    attempts = manifest.get("attempts")
    if not isinstance(attempts, list) or not attempts:
        attempts = [{"attempt": 0, "started_at": manifest.get("started_at"), "finished_at":
                     manifest.get("finished_at"), "status": manifest.get("status"),
                     "ended_by": manifest.get("ended_by"), "driver_pid": manifest.get("driver_pid")}]
    elif attempts[-1].get("status") == "running":  # recovered: that attempt ended with its process
        attempts[-1].update(status=manifest.get("status"), finished_at=manifest.get("finished_at"),
                            ended_by="its process died (recovered)")
    manifest["attempts"] = attempts
    return manifest


def _recover_earlier(run_dir: str) -> dict[str, Any]:
    """Recovers the earlier attempt of a trial, once its processes are gone (a killed trial actor's writers
    follow it within seconds)."""
    from rllib_recorder.format.liveness import recording_now
    from rllib_recorder.service.recover import recover_run

    deadline = time.monotonic() + 30.0
    while True:
        manifest = read_manifest(run_dir)
        live = recording_now(run_dir, manifest)
        if live is None or manifest.get("driver_pid") == os.getpid() and manifest.get("status") != "running":
            break
        if time.monotonic() > deadline:
            raise OutputDirError(f"run directory {run_dir!r} is still recording ({live}); a trial's earlier "
                                 "attempt must end before the next one records into it")
        time.sleep(0.5)
    recover_run(run_dir)
    return read_manifest(run_dir)


def _earlier_totals(previous: dict[str, Any] | None) -> dict[str, Any]:
    totals = (previous or {}).get("totals")
    totals = totals if isinstance(totals, dict) else {}
    senders = totals.get("senders")
    return {"senders": senders if isinstance(senders, dict) else {},
            "env_steps_stored": int(totals.get("env_steps_stored") or 0),
            "env_steps_consumed": int(totals.get("env_steps_consumed") or 0)}


def tune_names(algorithm: Any) -> tuple[str | None, str | None]:
    """(experiment dir name, trial dir name) of the Tune trial running ``algorithm``; (None, None) outside Tune.

    Tune hands a trainable its storage context before ``setup()``; the trial name itself is not yet
    known to an Algorithm at ``on_algorithm_init`` (it reports "default"), the trial dir name is.
    """
    storage = getattr(algorithm, "_storage", None)
    trial = getattr(storage, "trial_dir_name", None)
    if not trial:
        return None, None
    return getattr(storage, "experiment_dir_name", None), str(trial)


def tune_trial(trial_dir: str | None) -> tuple[str | None, str | None]:
    """(trial name, trial id) read from Tune's default trial dir name ``<name>_<id>_<tag>``.

    An Algorithm in a Tune trial is not told its trial id (results get it outside the trial);
    its dir name holds both. (None, None) outside Tune or with a custom ``trial_dirname_creator``.
    """
    match = re.match(r"^(.*?_([0-9a-f]{5,8}_\d{5}))(_|$)", trial_dir or "")
    return (match.group(1), match.group(2)) if match else (None, None)


def env_name(env: Any) -> str:
    """The env as the user named it: a registered name or gymnasium id as given, an env class as
    ``module:Class`` (what ``replay --env`` takes), anything else by its type."""
    if isinstance(env, str):
        return env
    if isinstance(env, type):
        return f"{env.__module__}:{env.__qualname__}"
    return "None" if env is None else f"{type(env).__module__}:{type(env).__qualname__}"


def config_is_new_stack(algorithm: Any) -> bool:
    return bool(algorithm.config.enable_env_runner_and_connector_v2)


def _learner_version(result: dict[str, Any]) -> int | None:
    learners = result.get("learners") or {}
    versions_seen = [
        v["weights_seq_no"] for k, v in learners.items()
        if k != "__all_modules__" and isinstance(v, dict) and "weights_seq_no" in v
    ]
    # APPO reports NaN before its learner's first update.
    versions_seen = [int(x) for x in versions_seen if isinstance(x, numbers.Real) and math.isfinite(x)]
    return max(versions_seen) if versions_seen else None


def _find(tree: dict[str, Any], path: tuple[str, ...], default: Any) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def _spaces(algorithm: Any) -> dict[str, Any]:
    try:
        spaces = algorithm.env_runner_group.get_spaces()
        return {str(k): {"observation": repr(v[0]), "action": repr(v[1])} for k, v in spaces.items()}
    except Exception as e:  # spaces are informative; their absence must not stop a run
        return {"error": f"{type(e).__name__}: {e}"}


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _schema_version() -> str:
    from rllib_recorder.format.layout import SCHEMA_VERSION

    return SCHEMA_VERSION
