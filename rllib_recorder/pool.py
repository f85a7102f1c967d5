"""The writer pool: Ray actors around RecordingWriter, the runner-to-writer assignment, the transport."""

from __future__ import annotations

import concurrent.futures
import glob
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rllib_recorder import schema
from rllib_recorder.config import RecorderConfig
from rllib_recorder.convert import Chunk
from rllib_recorder.manifest import place_files
from rllib_recorder.writer import RecordingWriter

logger = logging.getLogger(__name__)

# Ray inlines an actor-call argument of at most max_direct_call_object_size bytes (100 KiB by default) in the call
# itself, and puts a bigger one in the object store, which also costs the raylet CPU (1.2-2 ms per call here, outside
# the recorder's own processes). Pickled by us and cut into pieces under that limit, a CartPole chunk of 115-922 KiB
# cost 0.34-0.72 of the CPU (caller, writer actor and raylet together) it costs through the object store, 55 KiB
# 0.76-0.78 (Ray's serializer does more per array than one pickle), 1.8 MiB 0.78-0.90 (medians of two runs of
# scripts/bench_transport.py; docs/BENCHMARKS.md). So chunks that pickle to at most INLINE_CHUNK_BYTES go in
# pieces; bigger ones (Atari frames: megabytes per chunk) go through the object store as they are.
INLINE_CHUNK_BYTES = 1 << 20
_DIRECT_CALL_BYTES = int(os.environ.get("RAY_max_direct_call_object_size", 100 << 10))
PIECE_BYTES = max(1 << 10, _DIRECT_CALL_BYTES - (4 << 10))  # room for Ray's own framing of each argument


def chunk_pieces(chunk: Chunk, limit: int = INLINE_CHUNK_BYTES) -> list[memoryview] | None:
    """``chunk`` pickled and cut into pieces Ray inlines in an actor call, or None if it pickles to more than
    ``limit`` bytes (it then goes as it is, through the object store). ``RecordingWriter.append_pieces`` joins
    them."""
    if chunk.held_nbytes > limit:  # the arrays alone are too big: don't pickle to find out
        return None
    data = pickle.dumps(chunk, protocol=5)
    if len(data) > limit:
        return None
    view = memoryview(data)
    return [view[i:i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]


def writer_name(run_id: str, index: int, node_index: int = 0) -> str:
    """The Ray actor name of writer ``index`` on node ``node_index`` (0: the driver's node) of run ``run_id``."""
    return f"rllib_recorder:{run_id}:node-{node_index}:writer-{index}"


def current_node_id() -> str:
    """The Ray node id of the calling process."""
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> dict[str, dict[str, str]]:
    """node id -> {node_id, node_ip, hostname} of every alive node of the Ray cluster."""
    return {
        n["NodeID"]: {"node_id": n["NodeID"], "node_ip": n.get("NodeManagerAddress", ""),
                      "hostname": n.get("NodeManagerHostname", "")}
        for n in ray.nodes() if n.get("Alive")
    }


def assign_writer(worker_index: int, is_evaluation: bool, num_writers: int) -> int:
    """The writer that owns env runner ``worker_index``'s file.

    Training runners 1..N go round-robin from writer 0; evaluation runners start
    half-way round, so that the two kinds spread over the pool.
    """
    offset = num_writers // 2 if is_evaluation else 0
    return (max(worker_index - 1, 0) + offset) % num_writers


def storage_options(config: RecorderConfig) -> schema.StorageOptions:
    return schema.StorageOptions(
        compression=config.compression, compression_level=config.compression_level,
        hdf5_chunk_bytes=config.hdf5_chunk_bytes, fsync=config.fsync, encode_uint8=config.encode_uint8,
        stack_frames=config.stack_frames,
    )


@dataclass(frozen=True)
class Binding:
    """What an env runner needs to reach its run's writers (sent to it by the driver)."""

    run_id: str
    run_dir: str
    namespace: str
    num_writers: int
    config: RecorderConfig
    # node id -> names of the writers on that node; the first entry is the driver's node
    node_writers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def writer_for(self, node_id: str, worker_index: int, is_evaluation: bool) -> str:
        """The writer of env runner ``worker_index`` running on ``node_id``: one on its own node.

        A node without writers (a runner that moved after the driver last looked) falls back
        to the driver's node: the data then crosses the network, but none is lost.
        """
        names = self.node_writers.get(node_id)
        if not names:
            logger.warning("rllib_recorder: no writer on node %s yet; env runner %d writes through the "
                           "driver's node", node_id, worker_index)
            names = next(iter(self.node_writers.values()))
        return names[assign_writer(worker_index, is_evaluation, len(names))]


class WriterPool:
    """Creates and addresses the named writer actors of one run: ``num_writers`` on every node with runners.

    Each writer is pinned to its node (``NodeAffinitySchedulingStrategy``, not soft), so observations are
    written where they were sampled and never cross the network; every node writes into its own
    ``run_dir`` (the same path on every node; a shared file system works the same). Writers reserve
    no CPU: on a small machine the env runners may hold every CPU, and an actor waiting for a
    whole-CPU reservation would deadlock the run.
    """

    def __init__(self, run_id: str, run_dir: str, config: RecorderConfig, driver_node_id: str) -> None:
        self.run_id = run_id
        self.run_dir = run_dir
        self.config = config
        self.node_index: dict[str, int] = {}
        self.node_info: dict[str, dict[str, str]] = {}
        self.names: list[str] = []
        self.actors: list[Any] = []
        self.actor_nodes: list[str] = []
        self._files_seen: dict[int, set[str]] = {}  # writer -> files it reported
        self.ensure_nodes([driver_node_id])

    def ensure_nodes(self, node_ids: list[str]) -> bool:
        """Starts writers on each node of ``node_ids`` that has none yet; True if any was started."""
        new = [n for n in dict.fromkeys(node_ids) if n and n not in self.node_index]
        if not new:
            return False
        alive = alive_nodes()
        actor_cls = ray.remote(RecordingWriter)
        for node_id in new:
            index = len(self.node_index)
            self.node_index[node_id] = index
            self.node_info[node_id] = {**alive.get(node_id, {"node_id": node_id}), "node_index": index}
            for i in range(self.config.num_writers):
                name = writer_name(self.run_id, i, index)
                self.names.append(name)
                self.actor_nodes.append(node_id)
                self.actors.append(actor_cls.options(
                    name=name, num_cpus=0, max_restarts=self.config.writer_max_restarts,
                    max_task_retries=0, max_concurrency=1,
                    # soft only for a node already gone: its runners are gone too
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=node_id not in alive),
                ).remote(self.run_dir, self.run_id, storage_options(self.config), schema.node_tag(index)))
        return True

    def node_writers(self) -> dict[str, tuple[str, ...]]:
        """node id -> writer names on it, the driver's node first."""
        out: dict[str, list[str]] = {}
        for name, node_id in zip(self.names, self.actor_nodes):
            out.setdefault(node_id, []).append(name)
        return {k: tuple(v) for k, v in out.items()}

    def placement(self) -> dict[str, dict[str, Any]]:
        """file name -> the node holding it (node_id, node_ip, hostname, node_index).

        From what writers reported, and from the run directory here, so that the files of a writer
        lost with its node are still listed when they are readable here (a shared file system).
        """
        files = {}
        for i, names in self._files_seen.items():
            for name in names:
                files[name] = dict(self.node_info[self.actor_nodes[i]])
        # Files in the run directory here (all of them on a shared file system): their tag names their node.
        here = [os.path.basename(p) for p in glob.glob(os.path.join(self.run_dir, "*.h5"))]
        for name, node in place_files(here, self.writer_nodes()).items():
            if node and name not in files:
                files[name] = node
        return dict(sorted(files.items()))

    def writer_nodes(self) -> dict[str, dict[str, str]]:
        """node index -> the node's id, IP and hostname, for every node with writers (the manifest's form)."""
        return {str(info["node_index"]): {k: v for k, v in info.items() if k != "node_index"}
                for info in self.node_info.values()}

    def set_learner_version(self, version: int, at_s: float | None = None) -> None:
        at_s = time.time() if at_s is None else at_s
        for writer_actor in self.actors:
            writer_actor.set_learner_version.remote(version, at_s)

    def stats(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return self._gather("stats", timeout_s)

    def close(self, timeout_s: float) -> list[dict[str, Any]]:
        stats = self._gather("close", timeout_s)
        for writer_actor in self.actors:
            ray.kill(writer_actor, no_restart=True)
        return stats

    def _gather(self, method: str, timeout_s: float) -> list[dict[str, Any]]:
        refs = [getattr(w, method).remote() for w in self.actors]
        out = []
        for i, (name, ref) in enumerate(zip(self.names, refs)):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
                self._files_seen.setdefault(i, set()).update(out[-1].get("files_written", []))
            except Exception as e:  # one unreachable writer must not hide the others
                logger.warning("rllib_recorder: %s.%s failed: %s: %s", name, method, type(e).__name__, e)
                out.append({"errors": 1, "unreachable": 1})
        return out


class RayTransport:
    """The outbox's way to a writer actor: an async actor call per chunk.

    Acknowledgements are event-driven: each call's ObjectRef gets a completion callback
    (``ObjectRef.future()``), so the outbox's non-blocking poll on every sample is a flag
    check, not a ``ray.wait`` round trip through the core worker (0.6 ms each, measured).
    """

    def __init__(self, binding: Binding, worker_index: int, is_evaluation: bool) -> None:
        self.worker_index = worker_index
        self.is_evaluation = is_evaluation
        self.writer_name = binding.writer_for(current_node_id(), worker_index, is_evaluation)
        self.writer_actor = ray.get_actor(self.writer_name, namespace=binding.namespace)
        self._futures: dict[Any, concurrent.futures.Future] = {}

    def send(self, sender_id: bytes, seq: int, chunk: Chunk, stats: dict[str, Any]) -> Any:
        pieces = chunk_pieces(chunk)
        if pieces is None:
            ref = self.writer_actor.append.remote(self.worker_index, self.is_evaluation, sender_id, seq, chunk, stats)
        else:
            ref = self.writer_actor.append_pieces.remote(
                self.worker_index, self.is_evaluation, sender_id, seq, stats, *pieces
            )
        self._futures[ref] = ref.future()
        return ref

    def report(self, stats: dict[str, Any]) -> None:
        self.writer_actor.report.remote(self.worker_index, self.is_evaluation, stats)

    def wait(self, handles: list[Any], timeout_s: float) -> list[Any]:
        futures = [self._futures[h] for h in handles]
        if timeout_s > 0 and not any(f.done() for f in futures):
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        return [h for h, f in zip(handles, futures) if f.done()]

    def result(self, handle: Any) -> dict[str, Any]:
        self._futures.pop(handle, None)
        return ray.get(handle)  # done: a local read (and Ray's own error types, unchanged)

    def retryable(self, error: Exception) -> bool:
        # A task error is the writer refusing the chunk; anything else (actor died,
        # restarting, unreachable) may pass when the chunk is sent again.
        return not isinstance(error, ray.exceptions.RayTaskError)
