"""A recorded run: its manifest and worker files, opened lazily; episodes, batches and counts across files."""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator, Sequence

import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import layout, probe
from rllib_recorder.format.manifest import read_manifest
from rllib_recorder.format.store import is_uri, public_uri
from rllib_recorder.read.follow import follow
from rllib_recorder.read.iterate import iter_batches
from rllib_recorder.read.multi_agent import iter_multi_agent_episodes
from rllib_recorder.read.records import Batch, Episode
from rllib_recorder.read.remote import local_copy
from rllib_recorder.read.to_tables import to_dataframe
from rllib_recorder.read.worker_file import WorkerFile


class Run:
    """A recorded run: its manifest and worker files; nothing is read until asked for."""

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} holds its worker files, opened lazily and can't be pickled: "
                        "send the run directory and call rllib_recorder.open_run(path) in the other process")

    def __init__(self, path: str, *, filesystem: Any = None, cache_dir: str | None = None,
                 skip_damaged: bool = False) -> None:
        self.uri: str | None = None  # a run at a durable target: read from its local copy
        if is_uri(path) or filesystem is not None:
            self.uri, path = path, local_copy(path, filesystem, cache_dir)
        if not os.path.isdir(path):
            raise SchemaError(f"{path} is not a directory; pass the run directory (it holds manifest.json)")
        self.path = path
        self.manifest = read_manifest(path)
        layout.check_version(self.manifest.get("schema_version"), os.path.join(path, "manifest.json"))
        self.files = [WorkerFile(p) for p in sorted(glob.glob(os.path.join(glob.escape(path), "*.h5")))]
        # files the probe found damaged, set aside (``skip_damaged``): their path and why
        self.damaged: dict[str, str] = {}
        if skip_damaged:
            self.files = [f for f in self.files if self._readable(f.path)]
        else:
            probe.ensure_readable(f.path for f in self.files)  # one child for all files

    def _readable(self, path: str) -> bool:
        try:
            probe.ensure_readable([path])
        except SchemaError as e:
            self.damaged[path] = str(e)
            return False
        return True

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()

    def worker(self, worker_index: int, is_evaluation: bool = False) -> WorkerFile:
        for f in self.files:
            if f.worker_index == worker_index and f.is_evaluation == is_evaluation:
                return f
        raise KeyError(f"run {self.path} has no {'evaluation ' if is_evaluation else ''}worker {worker_index}")

    @property
    def workers(self) -> list[tuple[int, bool]]:
        """(worker_index, is_evaluation) of every file."""
        return [(f.worker_index, f.is_evaluation) for f in self.files]

    def counts(self) -> dict[str, int]:
        """Files, batches, env steps, agent steps, fragments and distinct episodes (index reads only)."""
        out = {"files": len(self.files), "batches": 0, "env_steps": 0, "agent_steps": 0, "fragments": 0, "episodes": 0}
        for f in self.files:
            commit = f.commit
            out["batches"] += commit["batches"]
            out["env_steps"] += self._env_steps(f)
            for agent, (rows, frags) in commit["agents"].items():
                out["agent_steps"] += rows
                out["fragments"] += frags
                out["episodes"] += len(np.unique(f.fragments(agent)["eps_id"]))
        return out

    def batches(self, *, evaluation: bool | None = False) -> Iterator[Batch]:
        """Every stored chunk, file by file, in the order each file stored them."""
        for f in self.files_of(evaluation):
            yield from f.batches_in_order()

    def to_dataframe(self, *, evaluation: bool | None = False) -> Any:
        """A pandas DataFrame of the scalar step columns, one row per step (needs the 'export' extra)."""
        return to_dataframe(self.files_of(evaluation))

    def iter_batches(self, batch_size: int = 1024, *, columns: Sequence[str] | None = None, shuffle: bool = False,
                     buffer_rows: int = 65_536, buffer_bytes: int = 256 << 20, seed: int | None = None,
                     drop_last: bool = False, block_bytes: int = 16 << 20, shard: tuple[int, int] | None = None,
                     decode: bool = True, evaluation: bool | None = False) -> Iterator[dict[str, np.ndarray]]:
        """Numpy batches of steps for your own training loop (``read.iterate``): the stored step columns by path,
        and ``next_obs``, ``has_next_obs``, ``policy_lag``, ``worker_index``, ``agent_id`` when asked for;
        ``shuffle`` within a bounded buffer. Memory holds a block, the buffer and a batch, whatever the run's size."""
        return iter_batches(self.files_of(evaluation), batch_size, columns=columns, shuffle=shuffle,
                            buffer_rows=buffer_rows, buffer_bytes=buffer_bytes, seed=seed, drop_last=drop_last,
                            block_bytes=block_bytes, shard=shard, decode=decode)

    def torch_dataset(self, batch_size: int = 1024, **options: Any) -> Any:
        """A ``torch.utils.data.IterableDataset`` of this run's batches (``iter_batches`` with ``options``) as
        tensors: ``DataLoader(dataset, batch_size=None, num_workers=N)``; N workers read every row once between
        them, each opening the run itself."""
        from rllib_recorder.read.torch_data import RecordedBatches  # imports torch: only when asked

        return RecordedBatches(self.path, batch_size, opener=open_run, **options)

    def follow(self, *, episodes: bool = False, poll_s: float = 0.5, timeout_s: float | None = None,
               evaluation: bool | None = False) -> Iterator[Batch | Episode]:
        """Follows the run while it records (``read.follow``): every stored chunk, or with ``episodes`` every
        episode, exactly once, as soon as it is committed, until the run has ended and all of it is read."""
        return follow(self.path, episodes=episodes, poll_s=poll_s, timeout_s=timeout_s, evaluation=evaluation)

    def to_ray_dataset(self, *, rows_per_task: int = 50_000, evaluation: bool | None = False) -> Any:
        """A ``ray.data.Dataset`` of steps: one read task per worker file and row range, read in parallel."""
        import ray.data

        from rllib_recorder.read.datasource import RecordedStepsDatasource  # imports Ray Data: only when asked

        return ray.data.read_datasource(RecordedStepsDatasource(self, rows_per_task, evaluation))

    def files_of(self, evaluation: bool | None) -> list[WorkerFile]:
        """The training files (``evaluation=False``), the evaluation files (True) or all of them (None)."""
        return [f for f in self.files if evaluation is None or f.is_evaluation == evaluation]

    @staticmethod
    def _env_steps(f: WorkerFile) -> int:
        return int(f.batches()["env_steps"].sum()) if f.commit["batches"] else 0

    @property
    def num_env_steps(self) -> int:
        return sum(int(f.batches()["env_steps"].sum()) for f in self.files if f.commit["batches"])

    def episodes(self, *, decode: bool = True, evaluation: bool | None = False,
                 columns: Sequence[str] | None = None) -> Iterator[Episode]:
        """Every agent episode, file by file, in the order their first fragment was stored, streamed (memory holds
        a block and the open episodes); ``decode`` False: image observations stored as uint8 codes (Atari frames)
        stay codes, stacks rebuilt (``WorkerFile.encoding`` says how to decode them). ``columns``: read only these
        of ``obs``, ``actions``, ``rewards``, ``terminateds``, ``truncateds``, ``t``, ``weights_seq_no``,
        ``env_t``, ``extra_model_outputs``, ``infos``, ``policy_lag``, ``start_state`` (``rewards`` always); the
        others come empty. An episode within one fragment holds views into the block it was read with, and makes
        each field when first asked for (``Episode``)."""
        for f in self.files:
            if evaluation is not None and f.is_evaluation != evaluation:
                continue
            for agent in f.agents:
                yield from f.iter_episodes(agent, decode, columns)

    def multi_agent_episodes(self, *, evaluation: bool | None = False) -> Iterator[Any]:
        """Every episode as RLlib's ``MultiAgentEpisode``, all its agents in one, rebuilt env step by env step
        (new API stack multi-agent runs, schema 2.2), file by file, streamed: each as soon as its agents are read."""
        for f in self.files_of(evaluation):
            yield from iter_multi_agent_episodes(f)

    def episode(self, eps_id: str, agent: str | None = None) -> Episode:
        """One episode by id; ``agent`` is needed only for multi-agent runs."""
        for f in self.files:
            for a in [agent] if agent else f.agents:
                if a in f.agents and eps_id.encode() in f.fragments(a)["eps_id"]:
                    return f.episode(eps_id, a)
        raise KeyError(f"episode {eps_id!r} is not in run {self.path}")

    def __repr__(self) -> str:
        shown = public_uri(self.uri) if self.uri else self.path
        return f"Run({shown!r}, files={len(self.files)}, status={self.manifest.get('status')!r})"


def open_run(path: str, *, filesystem: Any = None, cache_dir: str | None = None, skip_damaged: bool = False) -> Run:
    """Opens a run for reading: a run directory, or a run at a durable target (``s3://bucket/prefix/run``, or a
    path in ``filesystem``, a ``pyarrow.fs.FileSystem``), whose segments are copied once into ``cache_dir``
    (default ``~/.cache/rllib_recorder``, or ``$RLLIB_RECORDER_CACHE``). ``skip_damaged``: a file on which HDF5
    would loop or crash is set aside (``run.damaged`` names it and why) instead of refusing the whole run."""
    return Run(path if is_uri(path) else os.fspath(path), filesystem=filesystem, cache_dir=cache_dir,
               skip_damaged=skip_damaged)
