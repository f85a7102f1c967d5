"""One run as the driver sees it: its directory and manifest, its writers, its env runners bound to them, its
learners hooked, and its end: every runner drained, every file closed, the manifest finished."""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
import weakref
from collections import Counter
from typing import Any

import ray

from rllib_recorder._rllib_compat import on_algorithm_cleanup
from rllib_recorder.config import RecorderConfig
from rllib_recorder.errors import OutputDirError, RecorderError
from rllib_recorder.format import durable, store
from rllib_recorder.format.index import entry_from_manifest, update_run
from rllib_recorder.format.manifest import json_bytes, now_iso, write_manifest
from rllib_recorder.format.store import public_uri
from rllib_recorder.record.binding import Binding, current_node_id
from rllib_recorder.record.runner import bind_env_runner, drain_env_runner, runner_node_id
from rllib_recorder.service import lifecycle
from rllib_recorder.service.attempts import earlier_totals, previous_attempt, tune_names
from rllib_recorder.service.incarnations import RunnerWatch
from rllib_recorder.service.learner import count_consumed, hook_learners
from rllib_recorder.service.metrics import Rates, RllibSampled, learner_version_of, sum_stats
from rllib_recorder.service.pool import WriterPool
from rllib_recorder.service.publish import publish_run
from rllib_recorder.service.run_dir import config_is_new_stack, initial_manifest, resolve_run_dir

logger = logging.getLogger(__name__)

# After the store refused the manifest at a result, results go on without uploading it for this long.
MANIFEST_RETRY_S = 30.0


class AlgorithmRecorder:
    """Everything the recorder does in the algorithm's process, for one run."""

    def __init__(self, algorithm: Any, config: RecorderConfig) -> None:
        self.config = config
        self.run_dir = resolve_run_dir(config.check_output_dir(), config, algorithm)
        self.target, fetched = self._target()
        previous = previous_attempt(self.run_dir, *tune_names(algorithm))
        if previous is None and fetched:
            os.remove(os.path.join(self.run_dir, "manifest.json"))
            raise OutputDirError(f"{self.target.uri_of('')!r} already holds a run; choose another run_name or "
                                 "output_dir (a recording never overwrites an earlier one)")
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
        self.closed = False
        self._counts_retry_at = 0.0  # monotonic seconds: when a failed upload of RLlib's counts is tried again
        self._upload_errors_seen = 0  # the writers' failed segment uploads, as of the last result
        self.learner_version = -1
        self.learner_version_since = time.time()
        self.errors: Counter[str] = Counter()
        self.rates = Rates()  # RLlib's count of this attempt: every attempt counts from its own first iteration
        self.evaluation_sampled = RllibSampled(evaluation=True)
        self.manifest = initial_manifest(algorithm, self.run_id, config)
        if previous is not None:
            self.manifest.update(started_at=previous.get("started_at") or self.manifest["started_at"],
                                 totals=previous.get("totals") or {})
        self.manifest["attempts"] = (previous["attempts"] if previous else []) + [
            {"attempt": self.attempt, "started_at": now_iso(), "finished_at": None, "status": "running",
             "ended_by": None, "driver_pid": os.getpid()}]
        self._before = earlier_totals(previous)
        self._senders_seen: dict[str, Any] = {}  # the env runners' counters as of the last result
        if self.target is not None:
            self.manifest.update(target=public_uri(self.target.uri), staging_dir=self.run_dir)
        self._write_manifest()
        # Under Tune the experiment directory indexes its trials' runs (recorder_index.json).
        self.experiment_dir = os.path.dirname(self.run_dir) if self.manifest["trial"] else None
        self._update_index()
        self.pool = WriterPool(self.run_id, self.run_dir, config, current_node_id(), attempt=self.attempt,
                               target=self.target)
        self.binding = self._binding()
        self._algorithm = weakref.ref(algorithm)
        self.learners_reporting = 0
        if config_is_new_stack(algorithm):
            self.learner_version = 0  # RLlib's learners start at weights_seq_no 0
        self._writers_added()
        # held here too: the driver may end (atexit, SIGTERM) after the algorithm object is gone
        self._held_groups = self._groups(algorithm)
        self.watch = RunnerWatch()
        for group, is_evaluation in self._held_groups:
            self.bind(group)
            self.watch.check(group, is_evaluation)  # the incarnations bound now
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
        self._write_manifest()
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
        version = learner_version_of(result)
        if version is not None and version != self.learner_version:
            self.learner_version, self.learner_version_since = version, time.time()
            if not self.learners_reporting:  # coarse: known only once per iteration
                self.pool.set_learner_version(version, self.learner_version_since)
        self._watch_runners()
        writer_stats = self.pool.stats()
        for stats in writer_stats:  # kept: a node lost later takes its writer's counters with it
            self._senders_seen.update(stats.get("runners") or {})
        result["recorder"] = self.metrics(writer_stats, result)
        result["recorder"]["runner_incarnations"] = sum(r["incarnations"] for r in self.watch.runners.values())
        self._keep_rllib_counts(result)
        self._update_index(env_steps=result["recorder"]["env_steps_stored"])
        errors = result["recorder"]["errors"]
        if self.config.fail_on_error and errors:
            cause = result["recorder"]["last_error"] or "see the env runner logs"
            raise RecorderError(
                f"rllib_recorder counted {errors} error(s), last: {cause}; "
                "training stops because fail_on_error=True"
            )

    def _watch_runners(self) -> None:
        """Counts every runner's incarnations (Ray's restarts included, which RLlib never reports) and binds those
        that are new or restarted since the last result (a restart may land on a node without writers)."""
        for group, is_evaluation in self._groups(self._algorithm()) if self._algorithm() is not None else []:
            try:
                indices = self.watch.check(group, is_evaluation)
                if indices:
                    self.bind(group, indices)
            except Exception as e:  # noqa: BLE001 - the runner has bound itself at its first sample, as a rule
                self.errors["rebind"] += 1
                logger.warning("rllib_recorder: binding restarted env runners failed (%s: %s)",
                               type(e).__name__, e)

    def _keep_rllib_counts(self, result: dict[str, Any]) -> None:
        """RLlib's own sampled counts, kept in the manifest at every result: what ``verify`` checks the stored
        steps against (someone else's count, not the recorder's). Each attempt keeps its own (what RLlib sampled
        since the attempt's first iteration: a Tune retry may start at 0 again, a restore at a checkpoint's count);
        ``rllib_counts`` holds their sum over the run's attempts."""
        attempt = self.manifest["attempts"][-1]
        attempt["rllib_env_steps_sampled"] = int(self.rates.lifetime.get("env_steps_sampled") or 0)
        attempt["rllib_env_steps_before"] = self.rates.sampled.offset
        evaluated = self.evaluation_sampled.update(result)
        if evaluated is not None and self.config.record_evaluation:
            attempt["rllib_evaluation_env_steps_sampled"] = evaluated
            attempt["rllib_evaluation_env_steps_before"] = self.evaluation_sampled.offset
        attempts = self.manifest["attempts"]
        counts = {"env_steps_sampled": sum(int(a.get("rllib_env_steps_sampled") or 0) for a in attempts),
                  "training_iteration": result.get("training_iteration"), "at": now_iso()}
        if any("rllib_evaluation_env_steps_sampled" in a for a in attempts):
            counts["evaluation_env_steps_sampled"] = sum(int(a.get("rllib_evaluation_env_steps_sampled") or 0)
                                                         for a in attempts)
        self.manifest["rllib_counts"] = counts
        self.manifest["runners"] = self.watch.as_dict()
        try:
            write_manifest(self.run_dir, self.manifest)
        except OSError as e:
            self.errors["manifest"] += 1
            logger.warning("rllib_recorder: writing the manifest failed: %s", e)
        self._upload_counts(result.get("recorder") or {})

    def _upload_counts(self, recorder: dict[str, Any]) -> None:
        """A durable run's target gets the manifest with RLlib's counts at every result while the store answers:
        a Tune retry on another node, or verify at the URI after the driver or its node was lost, checks against
        them (the counts of an attempt that never ended reached the target no other way). While the store is
        down (segment uploads failed since the last result, or this upload less than MANIFEST_RETRY_S ago) a
        result does not wait for it: the end of the run, or the store's return, puts it."""
        upload_errors = int(recorder.get("upload_errors") or 0)
        failing = upload_errors > self._upload_errors_seen  # segments' uploads failed since the last result
        self._upload_errors_seen = upload_errors
        if self.target is None or failing or time.monotonic() < self._counts_retry_at:
            return
        try:
            self.target.put_bytes(json_bytes(self.manifest), "manifest.json")
        except Exception as e:  # noqa: BLE001 - the store's errors vary; the local manifest stays the truth
            # counted, not logged: the store's outage shows in result['recorder'] (upload errors, the last one),
            # and its end-of-run consequence is said once, at stop (``_publish_pending``)
            self.errors["manifest_upload"] += 1
            self._counts_retry_at = time.monotonic() + MANIFEST_RETRY_S
            logger.debug("rllib_recorder: writing the manifest to %s failed: %s", self.target.uri_of(""), e)

    def metrics(self, writer_stats: list[dict[str, Any]], result: dict[str, Any] | None = None) -> dict[str, Any]:
        """Sums writer and env-runner counters into one flat dict of recorder metrics (with the rates since the
        last result, when ``result`` is a train result)."""
        out = sum_stats(writer_stats, run_dir=self.run_dir, errors_here=sum(self.errors.values()),
                        learner_version=self.learner_version, learners_reporting=self.learners_reporting)
        if result is not None:
            out.update(self.rates.update(out["env_steps_stored"], result,
                                         self.consumed.total if self.consumed is not None else None))
        out.update({k: v for k, v in self.rates.lifetime.items() if k not in out})
        if self.target is not None:  # where the run is kept (run_dir: its staging directory on this node)
            out["target"] = public_uri(self.target.uri)
        return out

    def close(self, algorithm: Any = None, ended_by: str | None = None, interrupted: bool = False) -> dict[str, Any]:
        """Drains every env runner, closes every file, finishes the manifest (idempotent).

        ``ended_by`` says what ended the run (default: the algorithm's stop); ``interrupted`` marks an end by an
        exception, KeyboardInterrupt or SIGTERM (status ``interrupted``; the data is as complete as on a stop).
        """
        if self.closed:
            return self.manifest.get("totals", {})
        self.closed = True
        started = time.monotonic()
        lifecycle.unregister(self)
        ended_by = ended_by or ("Tune stopped the trial" if self.manifest.get("trial") else "algo.stop()")
        groups = self._groups(algorithm) if algorithm is not None else self._held_groups
        ray_up = ray.is_initialized()
        if ray_up and algorithm is not None:
            try:
                for group, is_evaluation in groups:
                    self.watch.check(group, is_evaluation)
            except Exception:  # noqa: BLE001 - the counts as of the last result stay
                pass
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
        published = None
        if self.target is not None:  # what this node's staging still holds (left spools committed here)
            # the store refused the writers' last attempts: one more attempt, not another full wait
            down = any(st.get("upload_backlog_segments") and st.get("last_upload_error") for st in writer_stats)
            left = 0.0 if down else max(0.0, self.config.stop_upload_timeout_s - (time.monotonic() - started))
            published = publish_run(self.run_dir, self.target, self.config, left)
            here = socket.gethostname()  # this node's backlog is counted anew by publish_run
            writer_stats = [{k: v for k, v in st.items() if st.get("node") != here or not k.startswith(
                "upload_backlog")} for st in writer_stats] + [published]
        totals = self.metrics(writer_stats)
        totals["unacked_at_stop"] = len(leftovers)  # senders whose handed-over samples could not be committed
        totals["spool_leftovers"] = leftovers
        senders = {k: v for s in writer_stats for k, v in (s.get("runners") or {}).items()}
        # earlier attempts' too, and those of writers lost since the last result (with their node)
        totals["senders"] = {**self._before["senders"], **self._senders_seen, **senders}
        lost = sorted({s["node_id"] for s in writer_stats if s.get("unreachable") and s.get("node_id")})
        if lost:
            self.manifest["lost_nodes"] = lost
        totals["env_steps_stored"] += self._before["env_steps_stored"]
        status = "interrupted" if interrupted else "finished"
        self.manifest["attempts"][-1].update(finished_at=now_iso(), status=status, ended_by=ended_by,
                                             senders=sorted(senders))
        self.manifest.update(
            status=status, ended_by=ended_by, finished_at=now_iso(),
            totals=totals, files=self.pool.placement(), writer_nodes=self.pool.writer_nodes(),
            runners=self.watch.as_dict(),
            nodes=sorted({s.get("node") for s in writer_stats if s.get("node")}),
        )
        if published is not None and published.get("upload_backlog_segments"):
            self._publish_pending(published)
        else:
            self._write_manifest()
            if self.target is not None and self.errors["manifest_upload_at_stop"]:
                self._publish_pending(published or {})
        self._update_index()
        if leftovers:
            logger.error("rllib_recorder: samples of %d env runner(s) stay in the spool, not committed (%s); "
                         "'rllib-recorder recover %s' commits them once the cause is fixed", len(leftovers),
                         next(iter(leftovers.values())), self.run_dir)
        logger.info("rllib_recorder: recording %s %s (%s)", self.run_dir, self.manifest["status"], ended_by)
        return totals

    def _target(self) -> tuple[Any, bool]:
        """Where a durable run's segments go (``output_dir`` joined with the run's path under the staging root), and
        whether its manifest was fetched from there: a run the target holds and this node has not staged (a Tune
        trial retried on another node) is continued from the target's manifest, or refused if it is another's."""
        if not self.config.durable:
            return None, False
        rel = os.path.relpath(self.run_dir, self.config.staging_root()).split(os.sep)
        store.check_writable(store.resolve(self.config.output_dir, self.config.storage_filesystem))
        target = store.resolve(store.uri_join(self.config.output_dir, *rel), self.config.storage_filesystem)
        local = os.path.join(self.run_dir, "manifest.json")
        if target.size("manifest.json") is None or os.path.exists(local):
            return target, False
        os.makedirs(self.run_dir, exist_ok=True)
        target.get("manifest.json", local)
        return target, True

    def _write_manifest(self) -> None:
        """The manifest in the run directory, and at the target of a durable run (a failure there is counted:
        the next write, at the latest the run's end, puts it again)."""
        write_manifest(self.run_dir, self.manifest)
        if self.target is None:
            return
        try:
            self.target.put_bytes(json_bytes(self.manifest), "manifest.json")
        except Exception as e:  # noqa: BLE001 - the store's errors vary; the local manifest stays the truth
            self.errors["manifest_upload"] += 1
            if self.closed:  # the end of the run: named once, with what completes it (``_publish_pending``)
                self.errors["manifest_upload_at_stop"] += 1
                self._upload_error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                return
            logger.warning("rllib_recorder: writing the manifest to %s failed: %s", self.target.uri_of(""), e)

    def _publish_pending(self, published: dict[str, Any]) -> None:
        """The store refused the end of a durable run: the staging directory keeps it, the local manifest says
        so (``publish_pending``), and one line names the command that completes the run once the store is back."""
        import shlex

        command = f"rllib-recorder recover {shlex.quote(self.run_dir)} --publish"
        error = published.get("last_upload_error") or getattr(self, "_upload_error", None) or "uploads failed"
        self.manifest["publish_pending"] = {
            "segments": int(published.get("upload_backlog_segments") or 0),
            "bytes": int(published.get("upload_backlog_bytes") or 0), "staging_dir": self.run_dir,
            "node_id": current_node_id() if ray.is_initialized() else None, "error": error, "command": command,
            "waited_s": self.config.stop_upload_timeout_s}
        write_manifest(self.run_dir, self.manifest)  # here only: the target is what refused
        logger.error("rllib_recorder: %s refused the end of the run (%s); %d segment(s) and the manifest stay "
                     "staged in %s: once the store is back, run '%s'", self.target.uri_of(""), error,
                     self.manifest["publish_pending"]["segments"], self.run_dir, command)

    def close_unstopped(self, ended_by: str, interrupted: bool) -> dict[str, Any]:
        """Closes a recording whose algorithm was never stopped (``lifecycle``: exit, signal, ray.shutdown)."""
        logger.warning("rllib_recorder: %s; closing the recording %s", ended_by, self.run_dir)
        return self.close(self._algorithm(), ended_by=ended_by, interrupted=interrupted)

    def _commit_left_spools(self) -> list[dict[str, Any]] | None:
        """Commits here what is still in this node's spools after the writers closed (writers that died, or Ray
        shut down first); None if nothing was left."""
        from rllib_recorder.format.spool_files import sender_dirs
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
        # algo.stop() (and Tune at the end of a trial) stops the env runners in cleanup(): drain them first.
        def close_first() -> None:
            try:
                self.close(algorithm)
            except Exception:  # noqa: BLE001 - the driver's boundary: RLlib's cleanup must still run
                logger.exception("rllib_recorder: closing the recording failed")

        on_algorithm_cleanup(algorithm, close_first)

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


