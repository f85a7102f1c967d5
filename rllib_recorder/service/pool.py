"""The writer pool: Ray actors that read the spools and write the files, and the runner-to-writer assignment."""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rllib_recorder.config import RecorderConfig
from rllib_recorder.format import datasets, layout
from rllib_recorder.format.chunks import Chunk
from rllib_recorder.format.manifest import place_files
from rllib_recorder.format.spool_files import parse_stem
from rllib_recorder.record.binding import assign_writer
from rllib_recorder.service.ingest import Ingest
from rllib_recorder.service.publish import Publisher
from rllib_recorder.service.writer import RecordingWriter

logger = logging.getLogger(__name__)


def writer_name(run_id: str, index: int, node_index: int = 0, attempt: int = 0) -> str:
    """The Ray actor name of writer ``index`` on node ``node_index`` (0: the driver's node) of run ``run_id``
    (attempt ``attempt`` of it: a Tune trial restarted or restored records on into the same run)."""
    return f"rllib_recorder:{run_id}:{attempt}:node-{node_index}:writer-{index}"


def alive_nodes() -> dict[str, dict[str, str]]:
    """node id -> {node_id, node_ip, hostname} of every alive node of the Ray cluster."""
    return {
        n["NodeID"]: {"node_id": n["NodeID"], "node_ip": n.get("NodeManagerAddress", ""),
                      "hostname": n.get("NodeManagerHostname", "")}
        for n in ray.nodes() if n.get("Alive")
    }


def storage_options(config: RecorderConfig) -> datasets.StorageOptions:
    return datasets.StorageOptions(
        compression=config.compression, compression_level=config.compression_level,
        hdf5_chunk_bytes=config.hdf5_chunk_bytes, fsync=config.fsync, encode_uint8=config.encode_uint8,
        stack_frames=config.stack_frames, frame_delta=config.frame_delta,
        segment_bytes=config.segment_bytes if config.durable else 0, segment_s=config.segment_s if config.durable else 0,
    )


class WriterPool:
    """Creates and addresses the named writer actors of one run: ``num_writers`` on every node with runners.

    Each writer is pinned to its node (``NodeAffinitySchedulingStrategy``, not soft), so observations are
    written where they were sampled and never cross the network; every node writes into its own
    ``run_dir`` (the same path on every node; a shared file system works the same). Writers reserve
    no CPU: on a small machine the env runners may hold every CPU, and an actor waiting for a
    whole-CPU reservation would deadlock the run.
    """

    def __init__(self, run_id: str, run_dir: str, config: RecorderConfig, driver_node_id: str,
                 attempt: int = 0, target: Any = None) -> None:
        self.target = target  # format.store.Target of a durable run: every writer publishes its segments there
        self.run_id = run_id
        self.attempt = attempt
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
        actor_cls = ray.remote(SpoolWriter)
        for node_id in new:
            index = len(self.node_index)
            self.node_index[node_id] = index
            self.node_info[node_id] = {**alive.get(node_id, {"node_id": node_id}), "node_index": index}
            for i in range(self.config.num_writers):
                name = writer_name(self.run_id, i, index, self.attempt)
                self.names.append(name)
                self.actor_nodes.append(node_id)
                self.actors.append(actor_cls.options(
                    name=name, num_cpus=0, max_restarts=self.config.writer_max_restarts,
                    max_task_retries=0, max_concurrency=1,
                    # soft only for a node already gone: its runners are gone too
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=node_id not in alive),
                ).remote(self.run_dir, self.run_id, self.config, layout.node_tag(index), i, target=self.target))
        return True

    def node_tags(self) -> dict[str, str]:
        """node id -> the tag of the files written on that node."""
        return {node_id: layout.node_tag(index) for node_id, index in self.node_index.items()}

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
                out.append({"errors": 1, "unreachable": 1, "writer": name, "node_id": self.actor_nodes[i]})
        return out


def tick_s(coalesce_s: float) -> float:
    """How often a writer reads its spools: often enough to commit within ``coalesce_s``, at most 10 times a second
    (an idle writer's reads of its spools then cost ~0.05% of a CPU)."""
    return min(0.1, max(0.01, coalesce_s / 4))


class SpoolWriter:
    """One writer actor: a ``RecordingWriter`` (the files) fed by an ``Ingest`` (the spools), driven by a thread.

    The thread reads the spools of the env runners this writer owns every ``tick_s`` and commits what is due;
    the actor's methods (stats, learner versions, close) take the same lock. Nothing here needs the env runners
    to be alive, and a restarted writer goes on where its files' commits stand.
    """

    def __init__(self, run_dir: str, run_id: str, config: RecorderConfig, file_tag: str = "",
                 writer_index: int | None = 0, *, clock: Callable[[], float] = time.time, thread: bool = True,
                 target: Any = None) -> None:
        num_writers = config.num_writers
        self.config = config

        def owns(stem: str) -> bool:  # writer_index None: every file of the node (``recover``)
            parsed = parse_stem(stem)
            return parsed is not None and parsed[2] == file_tag and (
                writer_index is None or assign_writer(parsed[0], parsed[1], num_writers) == writer_index)

        # A durable run: files are sealed into segments, which the publisher uploads (without a target, e.g. the
        # driver committing left spools, they wait in staging for ``publish_run``).
        self.publisher = Publisher(run_dir, target, owns, max_backlog_bytes=config.max_upload_backlog_bytes,
                                   check=config.check_uploads, thread=thread) if target is not None else None
        on_sealed = (self.publisher.sealed if self.publisher else _ignore) if config.durable else None
        self.writer = RecordingWriter(run_dir, run_id, storage_options(config), file_tag, on_sealed=on_sealed,
                                      seed=self.publisher.seed if self.publisher else None)
        self._backlogged_s = 0.0

        self.tick_s = tick_s(config.coalesce_s)
        self.ingest = Ingest(
            run_dir, owns=owns, commit=self._commit, committed_upto=self._committed_upto,
            report=lambda key, stats: self.writer.report(key[0], key[1], stats),
            coalesce_rows=config.coalesce_rows, coalesce_s=config.coalesce_s, coalesce_bytes=config.coalesce_bytes,
            tick_s=self.tick_s, clock=clock,
        )
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._loop_errors = 0
        if thread:
            threading.Thread(target=self._loop, name="rllib_recorder-ingest", daemon=True).start()

    def poll(self) -> dict[str, Any]:
        """One tick of the thread, by hand (tests, and writers made with ``thread=False``)."""
        with self._lock:
            self.ingest.poll()
            return self._stats()

    def __reduce__(self) -> Any:
        raise TypeError("SpoolWriter holds open HDF5 files and a thread and cannot be pickled; use the writer "
                        "actor handle from the pool instead")

    def _loop(self) -> None:
        while not self._stopped.wait(self.tick_s):
            if self.publisher is not None and self.publisher.backlogged():
                self._backlogged_s += self.tick_s  # spools fill up; the env runners' back-pressure applies
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    self.ingest.poll()
                except Exception:  # noqa: BLE001 - the thread must live on; counted and logged once
                    self._loop_errors += 1
                    if self._loop_errors == 1:
                        logger.exception("rllib_recorder: reading the spools failed; retrying every tick")

    def _commit(self, worker_index: int, is_evaluation: bool, sender_id: bytes, seq: int, chunk: Chunk,
                stats: dict[str, Any]) -> None:
        self.writer.append(worker_index, is_evaluation, sender_id, seq, chunk, stats)

    def _committed_upto(self, key: tuple[int, bool], sender: str) -> int:
        try:
            self.writer.open_file(key)
        except Exception:  # noqa: BLE001 - the commit then fails too, is counted and is tried again
            return 0
        return self.writer.committed_upto(key, sender.encode())

    def set_learner_version(self, version: int, at_s: float | None = None) -> None:
        self.writer.set_learner_version(version, at_s)

    def flush(self) -> dict[str, Any]:
        """Reads and commits everything handed over so far; returns the stats."""
        with self._lock:
            self.ingest.poll(final=True)
            return self._stats()

    def stats(self) -> dict[str, Any]:
        """Reads what is new first, so that counters a runner wrote before ``sample()`` returned are in (not while the
        upload backlog holds the writer back: it takes no chunks then)."""
        with self._lock:
            if self.publisher is None or not self.publisher.backlogged():
                self.ingest.poll()
            return self._stats()

    def close(self) -> dict[str, Any]:
        """Commits everything handed over, closes the files, deletes the committed spools; returns the stats."""
        self._stopped.set()
        with self._lock:
            self.ingest.poll(final=True)
            leftovers = self.ingest.leftovers()
            self.ingest.remove_committed()
            self.ingest.close()
            stats = self.writer.close()
            if self.publisher is not None:  # everything sealed now; uploads get most of the time left
                self.publisher.stop()
                self.publisher.drain(min(0.75 * self.config.drain_timeout_s, self.config.stop_upload_timeout_s))
            return {**stats, **self._ingest_stats(), "spool_leftovers": leftovers}

    def _stats(self) -> dict[str, Any]:
        return {**self.writer.stats(), **self._ingest_stats()}

    def _ingest_stats(self) -> dict[str, Any]:
        pending = self.ingest.pending()
        out = {"errors": self.ingest.errors + self._loop_errors, "steps_uncommitted": pending["rows"],
               "bytes_uncommitted": pending["bytes"], "last_error": self.ingest.last_error or self.writer.last_error}
        if self.publisher is not None:
            out.update(self.publisher.stats(), upload_backpressure_s=self._backlogged_s)
        return out


def _ignore(_: str) -> None:
    pass
