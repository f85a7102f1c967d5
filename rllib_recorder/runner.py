"""The env-runner side: one RunnerRecorder per env runner, bound to its run's writers by the driver."""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from typing import Any

from rllib_recorder.convert import START_STATE_KEY, Chunk, ConvertOptions, batch_to_chunk, episodes_to_chunk
from rllib_recorder.envstate import plan_of, sub_envs
from rllib_recorder.outbox import Outbox
from rllib_recorder.pool import Binding, RayTransport

logger = logging.getLogger(__name__)

# One recorder per env runner object; a restarted runner is a new object (and process).
_RECORDERS: "weakref.WeakKeyDictionary[Any, RunnerRecorder]" = weakref.WeakKeyDictionary()
# Samples held while a runner is not bound yet (it normally is before its first sample).
MAX_UNBOUND_CHUNKS = 64


def recorder_for(env_runner: Any) -> "RunnerRecorder":
    """The recorder of ``env_runner`` (created on first use)."""
    recorder = _RECORDERS.get(env_runner)
    if recorder is None:
        recorder = RunnerRecorder(
            worker_index=int(getattr(env_runner, "worker_index", 0) or 0),
            is_evaluation=bool(getattr(env_runner.config, "in_evaluation", False)),
        )
        _RECORDERS[env_runner] = recorder
    return recorder


def bind_env_runner(env_runner: Any, binding: Binding) -> dict[str, Any]:
    """Run on each env runner by the driver (``foreach_env_runner``): connect it to its writer."""
    recorder = recorder_for(env_runner)
    recorder.bind(binding)
    return {"worker_index": recorder.worker_index, "is_evaluation": recorder.is_evaluation}


def runner_node_id(env_runner: Any) -> str:
    """Run on each env runner by the driver: the Ray node it runs on."""
    from rllib_recorder.pool import current_node_id

    return current_node_id()


def drain_env_runner(env_runner: Any, timeout_s: float) -> dict[str, Any]:
    """Run on each env runner when the algorithm stops: send and await everything held."""
    recorder = _RECORDERS.get(env_runner)
    if recorder is None:
        return {"worker_index": getattr(env_runner, "worker_index", 0), "unacked": 0, "samples": 0}
    return recorder.drain(timeout_s)


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
        self._recorder: RunnerRecorder | None = None
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
            episode.custom_data[START_STATE_KEY] = captured


class RunnerRecorder:
    """Converts each sample of one env runner and hands it to the outbox; never touches HDF5."""

    def __init__(self, worker_index: int, is_evaluation: bool) -> None:
        self.worker_index = worker_index
        self.is_evaluation = is_evaluation
        self.binding: Binding | None = None
        self.outbox: Outbox | None = None
        self.options = ConvertOptions()
        self.errors: Counter[str] = Counter()
        self._unbound: list[Chunk] = []
        # Read on every episode start: unbound runners capture (their samples are held until bound), bound ones
        # as configured. Set again by ``bind``.
        self.records_start_states = self.enabled

    @property
    def enabled(self) -> bool:
        return self.binding is None or not self.is_evaluation or self.binding.config.record_evaluation

    def bind(self, binding: Binding) -> None:
        if self.binding is not None and self.binding.run_id == binding.run_id:
            return
        config = binding.config
        self.binding = binding
        self.options = ConvertOptions(config.record_infos, config.record_extra_model_outputs, config.encode_uint8,
                                      config.stack_frames)
        self.records_start_states = self.enabled and config.record_start_states
        if not self.enabled:
            self._unbound.clear()
            return
        self.transport = RayTransport(binding, self.worker_index, self.is_evaluation)
        self.outbox = Outbox(
            self.transport, window=config.max_in_flight, policy=config.backpressure,
            coalesce_rows=config.coalesce_rows, coalesce_s=config.coalesce_s, coalesce_bytes=config.coalesce_bytes,
            max_wait_s=config.drain_timeout_s, encode=config.encode_uint8,
        )
        for chunk in self._unbound:
            self.outbox.add(chunk)
        self._unbound.clear()

    def record(self, samples: Any, env_runner: Any) -> None:
        """Converts one ``on_sample_end`` payload and queues it for its writer."""
        if not self.enabled:
            return
        now = time.time()
        if isinstance(samples, list):
            chunk = episodes_to_chunk(samples, self.options, sampled_at_s=now)
            for episode in samples:  # stored now: do not ship start states on to the learner
                getattr(episode, "custom_data", {}).pop(START_STATE_KEY, None)
        else:
            version = getattr(env_runner, "weights_seq_no", None)
            chunk = batch_to_chunk(samples, self.options, -1 if version is None else int(version), now)
        if not chunk.streams:
            return
        if self.outbox is None:
            if len(self._unbound) >= MAX_UNBOUND_CHUNKS:
                self.count_error("unbound_overflow")
                return
            self._unbound.append(chunk)
            return
        self.outbox.add(chunk)

    def count_error(self, kind: str) -> None:
        self.errors[kind] += 1
        if self.outbox is not None:
            try:
                self.transport.report(self.stats())
            except Exception:  # reporting is best effort; the count stays here
                pass

    def stats(self) -> dict[str, Any]:
        stats = self.outbox.stats_dict() if self.outbox is not None else {}
        stats["errors"] = sum(self.errors.values())
        stats["error_kinds"] = dict(self.errors)
        stats["unbound_chunks"] = len(self._unbound)
        return stats

    def drain(self, timeout_s: float) -> dict[str, Any]:
        unacked = self.outbox.drain(timeout_s) if self.outbox is not None else len(self._unbound)
        stats = self.stats()
        if self.outbox is not None:
            self.transport.report(stats)
        return {"worker_index": self.worker_index, "is_evaluation": self.is_evaluation,
                "unacked": unacked, **stats}
