"""The env-runner side: one EnvRunnerRecorder per env runner, bound to its run's writers by the driver."""

from __future__ import annotations

import logging
import os
import time
import uuid
import weakref
from collections import Counter
from typing import Any

from rllib_recorder._rllib_compat import episode_custom_data, forget_custom_data
from rllib_recorder.format.chunks import Chunk
from rllib_recorder.format.liveness import HEARTBEAT_NAME, write_owner
from rllib_recorder.format.spool_files import SPOOL_DIR, SegmentWriter
from rllib_recorder.record.batches import batch_to_chunk
from rllib_recorder.record import failpoints, registry
from rllib_recorder.record.binding import Binding, assign_writer, current_node_id
from rllib_recorder.record.convert import START_STATE_KEY, ConvertOptions, episodes_to_chunk
from rllib_recorder.record.envstate import plan_of, sub_envs
from rllib_recorder.record.outbox import Outbox, heartbeat_age_s

logger = logging.getLogger(__name__)

# One recorder per env runner object; a restarted runner is a new object (and process).
_RECORDERS: "weakref.WeakKeyDictionary[Any, EnvRunnerRecorder]" = weakref.WeakKeyDictionary()

# While a runner finds no binding, it looks again at most this often (a GCS read each time).
FIND_BINDING_EVERY_S = 1.0


def recorder_for(env_runner: Any, max_unbound_bytes: int | None = None) -> "EnvRunnerRecorder":
    """The recorder of ``env_runner`` (created on first use; ``max_unbound_bytes``: what it may hold until it is
    bound, the callback's ``max_backlog_bytes``)."""
    recorder = _RECORDERS.get(env_runner)
    if recorder is None:
        recorder = EnvRunnerRecorder(
            worker_index=int(getattr(env_runner, "worker_index", 0) or 0),
            is_evaluation=bool(getattr(env_runner.config, "in_evaluation", False)),
            max_unbound_bytes=max_unbound_bytes,
        )
        _RECORDERS[env_runner] = recorder
    return recorder


def bind_env_runner(env_runner: Any, binding: Binding) -> dict[str, Any]:
    """Run on each env runner by the driver (``foreach_env_runner``): connect it to its writer, and leave the
    binding where a later incarnation of the same actor (Ray restarts it by itself) finds it (``registry``)."""
    recorder = recorder_for(env_runner)
    recorder.bind(binding)
    registry.publish(binding)
    return {"worker_index": recorder.worker_index, "is_evaluation": recorder.is_evaluation,
            "pid": os.getpid(), "actor_id": registry.own_actor_id()}


def runner_node_id(env_runner: Any) -> str:
    """Run on each env runner by the driver: the Ray node it runs on."""
    return current_node_id()


def drain_env_runner(env_runner: Any, timeout_s: float = 0.0) -> dict[str, Any]:
    """Run on each env runner when the algorithm stops: close its spool with its final counters."""
    registry.withdraw()  # a restart after the run's end records nothing into it
    recorder = _RECORDERS.get(env_runner)
    if recorder is None:
        return {"worker_index": getattr(env_runner, "worker_index", 0), "unbound_chunks": 0, "samples": 0}
    return recorder.drain()


class StartStates:
    """Keeps each new episode's start state on the episode, for one env runner's callback object.

    Runs on every episode start (new API stack, single agent), so it remembers its runner's recorder and the
    capture plan of each of the vector env's sub-envs instead of looking them up each time (RLlib passes the
    same objects until it recreates the runner or its env). Nothing when the state can't be captured, or when
    the runner does not record it (an evaluation runner with ``record_evaluation=False``, or
    ``record_start_states=False``).
    """

    __slots__ = ("_runner", "_recorder", "_vector_env", "_envs", "_plans")

    def __init__(self) -> None:
        self._runner: Any = None
        self._recorder: EnvRunnerRecorder | None = None
        self._vector_env: Any = None
        self._envs: Any = None
        self._plans: list[Any] = []  # per sub-env: its plan, None (not planned yet) or False (not supported)

    def keep(self, episode: Any, vector_env: Any, env_index: int, env_runner: Any = None) -> None:
        if env_runner is not self._runner:
            self._runner, self._recorder = env_runner, None if env_runner is None else recorder_for(env_runner)
        if self._recorder is not None and not self._recorder.records_start_states:
            return
        if vector_env is not self._vector_env:
            self._vector_env, self._envs = vector_env, sub_envs(vector_env)
            self._plans = [None] * len(self._envs or ())
        plans = self._plans
        if env_index >= len(plans):
            return
        plan = plans[env_index]
        if plan is None:  # planned after its first reset (a classic-control env has no state before it)
            plan = plans[env_index] = plan_of(self._envs[env_index]) or False
        if plan is False:
            return
        captured = plan.capture()  # packed at conversion
        if captured is not None:
            episode_custom_data(episode)[START_STATE_KEY] = captured


class EnvRunnerRecorder:
    """Counts, converts and hands each sample of one env runner to its spool; never touches HDF5."""

    def __init__(self, worker_index: int, is_evaluation: bool, max_unbound_bytes: int | None = None) -> None:
        self.worker_index = worker_index
        self.is_evaluation = is_evaluation
        self.binding: Binding | None = None
        self.outbox: Outbox | None = None
        self.options = ConvertOptions()
        self.errors: Counter[str] = Counter()
        # every on_sample_end payload, counted before anything can fail: the completeness check's reference
        self.sampled: Counter[str] = Counter()
        self.payloads = 0  # every on_sample_end payload this process saw (the failpoint's count)
        self._unbound: list[Chunk] = []
        self._unbound_bytes = 0
        self.max_unbound_bytes = max_unbound_bytes if max_unbound_bytes is not None else (256 << 20)
        self._next_lookup = 0.0  # when an unbound runner looks for its binding again (monotonic seconds)
        # Read on every episode start: unbound runners capture (their samples are held until bound), bound ones
        # as configured. Set again by ``bind``.
        self.records_start_states = self.enabled

    @property
    def enabled(self) -> bool:
        return self.binding is None or not self.is_evaluation or self.binding.config.record_evaluation

    def bind(self, binding: Binding) -> None:
        if self.binding is not None and self.binding.run_id == binding.run_id and self.outbox is not None:
            return
        config = binding.config
        self.binding = binding
        self.options = ConvertOptions(config.record_infos, config.record_extra_model_outputs, config.encode_uint8,
                                      config.stack_frames)
        self.records_start_states = self.enabled and config.record_start_states
        if not self.enabled:
            self._unbound.clear()
            return
        stem = binding.stem_for(current_node_id(), self.worker_index, self.is_evaluation)
        if stem is None:  # no writers on this node yet: samples wait here until the driver binds again
            logger.warning("rllib_recorder: no writer on this node yet; env runner %d holds its samples until "
                           "the driver starts one", self.worker_index)
            return
        spool = os.path.join(binding.run_dir, SPOOL_DIR, stem)
        segments = SegmentWriter(os.path.join(spool, uuid.uuid4().hex), spool_segment_bytes(config.max_backlog_bytes))
        write_owner(segments.directory)  # recover waits for this process to end before it reads the spool
        self.outbox = Outbox(
            segments,
            policy=config.backpressure,
            max_backlog_bytes=config.max_backlog_bytes, max_wait_s=config.drain_timeout_s,
            writer_heartbeat_s=lambda: heartbeat_age_s(os.path.join(spool, HEARTBEAT_NAME)),
            encode=config.encode_uint8, extra_stats=self._extra_stats,
        )
        for chunk in self._unbound:
            self.outbox.add(chunk)
        self._unbound.clear()
        self._unbound_bytes = 0

    def find_binding(self) -> None:
        """An unbound runner looks for its run's binding itself (at most every ``FIND_BINDING_EVERY_S``): the
        driver leaves it under the runner's actor id, which stays the same when Ray restarts the actor."""
        now = time.monotonic()
        if now < self._next_lookup:
            return
        self._next_lookup = now + FIND_BINDING_EVERY_S
        binding = registry.lookup()
        if binding is not None:
            logger.info("rllib_recorder: env runner %d (pid %d) found run %s and records into it",
                        self.worker_index, os.getpid(), binding.run_id)
            self.bind(binding)

    def record(self, samples: Any, env_runner: Any) -> None:
        """Counts, converts and hands one ``on_sample_end`` payload to the spool."""
        if not self.enabled:
            return
        self.payloads += 1
        if failpoints.POINTS and failpoints.hit("drop_sample", self.payloads):
            return  # tests only: a sample lost and not counted (record/failpoints.py)
        self.sampled["samples"] += 1
        steps = _env_steps(samples)
        self.sampled["env_steps"] += steps
        try:
            chunk = self._convert(samples, env_runner)
        except Exception:  # counted here as not stored; the callback counts and logs the error itself
            self.sampled["env_steps_unconvertible"] += steps
            raise
        if not chunk.streams:
            self.sampled["env_steps_empty"] += chunk.env_steps  # e.g. episodes of length 0: nothing to store
            return
        if self.outbox is None and self.binding is None:
            self.find_binding()
        if self.outbox is None or self.outbox.closed:
            size = chunk.held_nbytes
            if self._unbound_bytes + size > self.max_unbound_bytes:  # held for its writer up to the backlog bound
                self.count_error("unbound_overflow")
                self.sampled["env_steps_unbound_dropped"] += chunk.env_steps
                return
            self._unbound.append(chunk)
            self._unbound_bytes += size
            return
        self.outbox.add(chunk)

    def _convert(self, samples: Any, env_runner: Any) -> Chunk:
        now = time.time()
        if isinstance(samples, list):
            chunk = episodes_to_chunk(samples, self.options, sampled_at_s=now)
            for episode in samples:  # stored now: do not ship start states on to the learner
                forget_custom_data(episode, START_STATE_KEY)
            return chunk
        version = getattr(env_runner, "weights_seq_no", None)
        return batch_to_chunk(samples, self.options, -1 if version is None else int(version), now)

    def count_error(self, kind: str) -> None:
        self.errors[kind] += 1
        if self.outbox is not None and not self.outbox.closed:
            try:
                self.outbox.report()
            except Exception:  # reporting is best effort; the count stays here
                pass

    def _extra_stats(self) -> dict[str, Any]:
        return {"worker_index": self.worker_index, "is_evaluation": self.is_evaluation,
                "env_steps_sampled": self.sampled["env_steps"], "samples_sampled": self.sampled["samples"],
                "env_steps_empty": self.sampled["env_steps_empty"],
                "env_steps_unbound_dropped": self.sampled["env_steps_unbound_dropped"],
                "env_steps_unconvertible": self.sampled["env_steps_unconvertible"],
                "errors": sum(self.errors.values()), "error_kinds": dict(self.errors),
                "unbound_chunks": len(self._unbound)}

    def writer_name(self) -> str | None:
        """The name of the writer actor that owns this runner's file (None while unbound)."""
        if self.binding is None:
            return None
        names = self.binding.node_writers.get(current_node_id(), ())
        index = assign_writer(self.worker_index, self.is_evaluation, len(names) or 1)
        return names[index] if names else None

    def stats(self) -> dict[str, Any]:
        return self.outbox.stats_dict() if self.outbox is not None else self._extra_stats()

    def drain(self) -> dict[str, Any]:
        """Closes the spool with the final counters (the writer commits what it holds); returns the counters."""
        if self.outbox is None:
            return self.stats()
        return self.outbox.close()


def _env_steps(samples: Any) -> int:
    """Env steps of one ``on_sample_end`` payload (episodes, or an old-stack batch), before any conversion."""
    try:
        if isinstance(samples, list):
            return sum(int(e.env_steps()) if hasattr(e, "agent_episodes") else len(e) for e in samples)
        return int(samples.env_steps()) if hasattr(samples, "policy_batches") else len(samples["rewards"])
    except Exception:  # noqa: BLE001 - a payload we can't count is counted by the conversion's error instead
        return 0


def spool_segment_bytes(max_backlog_bytes: int) -> int:
    """Bytes of one spool segment file: 16 MiB, or a quarter of the backlog bound when that is smaller. The writer
    deletes a segment only once the sender has moved on to the next, so a segment as big as the bound would keep
    the backlog full for good (every later sample dropped, or blocked) even with every record committed."""
    return max(64 << 10, min(16 << 20, max_backlog_bytes // 4))
