"""Reading a run back: lazily, per worker file, episode or batch, as numpy."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import commits, decode, h5file, layout
from rllib_recorder.format.lag import rows_learner_version, step_lags
from rllib_recorder.format.manifest import read_manifest
from rllib_recorder.read import probe


@dataclass(frozen=True)
class Episode:
    """One agent's episode, stitched from its fragments; arrays are numpy.

    ``obs`` has one more row than ``actions`` when the last observation is stored;
    ``next_obs`` is ``obs[1:]``. Nested observations are dicts/tuples of arrays.
    """

    eps_id: str
    agent_id: str
    worker_index: int
    obs: Any
    actions: Any
    rewards: np.ndarray
    terminateds: np.ndarray
    truncateds: np.ndarray
    t: np.ndarray
    weights_seq_no: np.ndarray
    extra_model_outputs: dict[str, Any] = field(default_factory=dict)
    infos: list[Any] | None = None
    module_id: str = ""
    start_state_kind: str = ""
    start_state: bytes = field(default=b"", repr=False)
    policy_lag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def next_obs(self) -> Any:
        return _map(lambda a: a[1:], self.obs)

    @property
    def episode_return(self) -> float:
        return float(np.sum(self.rewards))

    @property
    def is_done(self) -> bool:
        return bool(len(self) and (self.terminateds[-1] or self.truncateds[-1]))

    def to_single_agent_episode(self) -> Any:
        """This episode as RLlib's ``SingleAgentEpisode`` (numpy)."""
        from rllib_recorder.read.convert import to_single_agent_episode

        return to_single_agent_episode(self)

    def to_sample_batch(self) -> Any:
        """This episode as RLlib's ``SampleBatch`` (obs, new_obs, actions, rewards, ...)."""
        from rllib_recorder.read.convert import to_sample_batch

        return to_sample_batch(self)

    def __repr__(self) -> str:
        shapes = _map(lambda a: f"{a.dtype}{list(a.shape)}", self.obs)
        return (f"Episode(eps_id={self.eps_id!r}, agent_id={self.agent_id!r}, worker={self.worker_index}, "
                f"len={len(self)}, return={self.episode_return:.3g}, obs={shapes})")


@dataclass(frozen=True)
class Batch:
    """One stored chunk, as the writer stored it: its index row and, per agent, its step columns."""

    worker_index: int
    is_evaluation: bool
    row: int
    info: dict[str, Any]
    steps: dict[str, dict[str, Any]]

    def __repr__(self) -> str:
        rows = {agent: len(cols["rewards"]) for agent, cols in self.steps.items()}
        return f"Batch(worker={self.worker_index}, row={self.row}, seq={self.info.get('seq')}, rows={rows})"


class WorkerFile:
    """One env runner's HDF5 file, opened read-only on first use."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._h5: h5py.File | None = None

    @property
    def h5(self) -> h5py.File:
        if self._h5 is None:
            probe.ensure_readable([self.path])
            try:
                self._h5 = h5file.open_h5(self.path, "r")
            except OSError as e:
                fix = ("it was cut short after it was written (an interrupted copy?), which recover cannot mend: "
                       "copy it again, or move it out of the run directory" if "truncated file" in str(e)
                       else "run 'rllib-recorder recover'")
                raise SchemaError(f"{self.path} is not a readable HDF5 file ({e}); {fix}") from None
            try:
                with h5file.damaged_file_errors(self.path):
                    h5file.validate_header(self._h5, self.path)
            except SchemaError:
                self.close()
                raise
        return self._h5

    def _node(self, path: str) -> Any:
        """``self.h5[path]``; damage HDF5 meets on the way is a one-line SchemaError, a missing path a KeyError."""
        try:
            return self.h5[path]
        except KeyError as e:
            if "doesn't exist" in str(e):
                raise
            error: Exception = e
        except (OSError, RuntimeError, ValueError) as e:
            error = e
        raise SchemaError(f"{self.path} is damaged: {path} is unreadable ({str(error).strip()}); run "
                          "'rllib-recorder recover', or move the file out of the run directory") from None

    @property
    def worker_index(self) -> int:
        with h5file.damaged_file_errors(self.path):
            return int(self.h5.attrs["worker_index"])

    @property
    def is_evaluation(self) -> bool:
        with h5file.damaged_file_errors(self.path):
            return bool(self.h5.attrs["is_evaluation"])

    @property
    def commit(self) -> dict[str, Any]:
        with h5file.damaged_file_errors(self.path):
            return commits.read_commit(self.h5)

    @property
    def agents(self) -> list[str]:
        with h5file.damaged_file_errors(self.path):
            return sorted(self._node("agents").keys())

    def _batches(self) -> dict[str, np.ndarray]:
        """The batch index: one row per stored chunk."""
        n = self.commit["batches"]
        return {k: v[:n] for k, v in self._node("batches").items()}

    def _fragments(self, agent: str) -> dict[str, np.ndarray]:
        """The episode index of ``agent`` (scalar columns; one row per fragment)."""
        group = self._node(f"agents/{agent}/fragments")
        n = self.commit["agents"].get(agent, (0, 0))[1]
        return {k: v[:n] for k, v in group.items() if isinstance(v, h5py.Dataset) and v.ndim == 1
                and not k.startswith("last_") and k not in ("infos", "start_state")}

    def num_rows(self, agent: str) -> int:
        """Committed step rows of ``agent``."""
        return int(self.commit["agents"].get(agent, (0, 0))[0])

    def column_paths(self, agent: str) -> list[str]:
        """Paths of ``agent``'s step columns (``obs``, ``obs/pos``, ``actions``, ``extra_model_outputs/vf_preds``)."""
        paths: list[str] = []
        self._node(f"agents/{agent}/steps").visititems(
            lambda path, node: paths.append(path) if isinstance(node, h5py.Dataset) else None)
        return paths

    def batches_in_order(self) -> Iterator[Batch]:
        """The stored chunks in the order they were stored, each with its step rows (read lazily, chunk by chunk)."""
        with h5file.damaged_file_errors(self.path):
            yield from self._batches_in_order()

    def _batches_in_order(self) -> Iterator[Batch]:
        index = self.batches()
        spans = {}
        for agent in self.agents:
            frags = self.fragments(agent)
            spans[agent] = (frags["batch"], frags["first_row"], frags["first_row"] + frags["num_rows"])
        for row in range(len(index.get("seq", ()))):
            steps = {}
            for agent, (batch, first, end) in spans.items():
                mine = batch == row
                if mine.any():
                    rows = slice(int(first[mine].min()), int(end[mine].max()))
                    group = self._node(f"agents/{agent}/steps")
                    steps[agent] = {k: _read(group[k], rows) for k in group}
            info = {k: (v[row].decode() if isinstance(v[row], bytes) else v[row].item()) for k, v in index.items()}
            yield Batch(self.worker_index, self.is_evaluation, row, info, steps)

    def learner_versions(self, agent: str) -> np.ndarray:
        """Per step row of ``agent``: the learner's version stored with the row's chunk (-1: unknown)."""
        with h5file.damaged_file_errors(self.path):
            batches = self._batches()
            if "learner_version" not in batches:
                return np.full(self.num_rows(agent), -1, np.int64)
            return rows_learner_version(self._fragments(agent), batches["learner_version"], self.num_rows(agent))

    def policy_lag(self, agent: str) -> np.ndarray:
        """Per step row of ``agent``: learner version minus behaviour version (``weights_seq_no``); -1: unknown.

        See docs/FORMAT.md, "Policy lag", for what the learner version is.
        """
        rows = slice(0, self.num_rows(agent))
        return step_lags(self.learner_versions(agent), self.column(agent, "weights_seq_no", rows))

    def column(self, agent: str, path: str, rows: slice = slice(None)) -> Any:
        """One step column of ``agent`` (nested spaces come back as dicts/tuples)."""
        return _read(self._node(f"agents/{agent}/steps/{path}"), rows)

    def episode_ids(self, agent: str | None = None) -> list[str]:
        agents = [agent] if agent else self.agents
        seen: dict[str, None] = {}
        with h5file.damaged_file_errors(self.path):
            for a in agents:
                for eps in self.fragments(a)["eps_id"].tolist():
                    seen.setdefault(eps.decode(), None)
        return list(seen)

    def _episode(self, eps_id: str, agent: str) -> Episode:
        """One agent's episode, read through the episode index (no scan of step data)."""
        frags = self.fragments(agent)
        where = np.flatnonzero(frags["eps_id"] == eps_id.encode())
        if not len(where):
            raise KeyError(f"episode {eps_id!r} of agent {agent!r} is not in {self.path}")
        where = where[np.argsort(frags["t_start"][where], kind="stable")]
        steps = self._node(f"agents/{agent}/steps")
        pieces = [slice(int(frags["first_row"][i]), int(frags["first_row"][i] + frags["num_rows"][i])) for i in where]
        read = lambda path: _concat([_read(steps[path], s) for s in pieces])  # noqa: E731
        last = where[-1]
        obs = read("obs")
        frag_group = self._node(f"agents/{agent}/fragments")
        if frags["has_last_obs"][last]:
            obs = _concat([obs, _read(frag_group["last_obs"], slice(int(last), int(last) + 1))])
        extras = {k: read(f"extra_model_outputs/{k}") for k in steps.get("extra_model_outputs", {})}
        infos = None
        if "infos" in frag_group:
            infos = []
            for i in where:
                fragment_infos = json.loads(frag_group["infos"][i])
                infos.extend(fragment_infos if not infos else fragment_infos[1:])
        kind, state = "", b""
        if "start_state_kind" in frag_group and frags["t_start"][where[0]] == 0:
            kind = frag_group["start_state_kind"][where[0]].decode()
            state = frag_group["start_state"][where[0]].tobytes() if kind else b""
        versions = read("weights_seq_no")
        learner = self._node("batches").get("learner_version")  # only the column needed, not the whole index
        learner_rows = (np.concatenate([np.full(int(frags["num_rows"][i]), learner[int(frags["batch"][i])], np.int64)
                                        for i in where]) if learner is not None else np.full(len(versions), -1))
        return Episode(
            eps_id=eps_id, agent_id=agent, worker_index=self.worker_index, obs=obs,
            start_state_kind=kind, start_state=state, policy_lag=step_lags(learner_rows, versions),
            actions=read("actions"), rewards=read("rewards"), terminateds=read("terminateds"),
            truncateds=read("truncateds"), t=read("t"), weights_seq_no=versions,
            extra_model_outputs=extras, infos=infos,
            module_id=frag_group["module_id"][last].decode() if "module_id" in frag_group else "",
        )

    def batches(self) -> dict[str, np.ndarray]:
        """The batch index: one row per stored chunk."""
        with h5file.damaged_file_errors(self.path):
            return self._batches()

    def fragments(self, agent: str) -> dict[str, np.ndarray]:
        """The episode index of ``agent`` (scalar columns; one row per fragment)."""
        with h5file.damaged_file_errors(self.path):
            return self._fragments(agent)

    def episode(self, eps_id: str, agent: str) -> Episode:
        """One agent's episode, read through the episode index (no scan of step data)."""
        if eps_id.encode() not in self.fragments(agent)["eps_id"]:
            raise KeyError(f"episode {eps_id!r} of agent {agent!r} is not in {self.path}")
        with h5file.damaged_file_errors(self.path):
            return self._episode(eps_id, agent)

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None

    def __repr__(self) -> str:
        if self._h5 is None:  # a repr must not open (and probe) a file
            return f"WorkerFile({self.path!r}, not opened yet)"
        commit = self.commit
        rows = {agent: rows for agent, (rows, _) in commit["agents"].items()}
        return (f"WorkerFile({self.path!r}, worker={self.worker_index}, evaluation={self.is_evaluation}, "
                f"batches={commit['batches']}, rows={rows})")


class Run:
    """A recorded run: its manifest and worker files; nothing is read until asked for."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise SchemaError(f"{path} is not a directory; pass the run directory (it holds manifest.json)")
        self.path = path
        self.manifest = read_manifest(path)
        layout.check_version(self.manifest.get("schema_version"), os.path.join(path, "manifest.json"))
        self.files = [WorkerFile(p) for p in sorted(glob.glob(os.path.join(path, "*.h5")))]
        probe.ensure_readable(f.path for f in self.files)  # one child for all files

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
        for f in self._files(evaluation):
            yield from f.batches_in_order()

    def to_dataframe(self, *, evaluation: bool | None = False) -> Any:
        """A pandas DataFrame of the scalar step columns, one row per step (needs the 'export' extra)."""
        from rllib_recorder.read.convert import to_dataframe

        return to_dataframe(self._files(evaluation))

    def to_ray_dataset(self, *, rows_per_task: int = 50_000, evaluation: bool | None = False) -> Any:
        """A ``ray.data.Dataset`` of steps: one read task per worker file and row range, read in parallel."""
        from rllib_recorder.read.convert import to_ray_dataset

        return to_ray_dataset(self, rows_per_task=rows_per_task, evaluation=evaluation)

    def _files(self, evaluation: bool | None) -> list[WorkerFile]:
        return [f for f in self.files if evaluation is None or f.is_evaluation == evaluation]

    @staticmethod
    def _env_steps(f: WorkerFile) -> int:
        return int(f.batches()["env_steps"].sum()) if f.commit["batches"] else 0

    @property
    def num_env_steps(self) -> int:
        return sum(int(f.batches()["env_steps"].sum()) for f in self.files if f.commit["batches"])

    def episodes(self, *, evaluation: bool | None = False) -> Iterator[Episode]:
        """Every agent episode, file by file, in the order their first fragment was stored."""
        for f in self.files:
            if evaluation is not None and f.is_evaluation != evaluation:
                continue
            for agent in f.agents:
                for eps_id in f.episode_ids(agent):
                    yield f.episode(eps_id, agent)

    def episode(self, eps_id: str, agent: str | None = None) -> Episode:
        """One episode by id; ``agent`` is needed only for multi-agent runs."""
        for f in self.files:
            for a in [agent] if agent else f.agents:
                if a in f.agents and eps_id.encode() in f.fragments(a)["eps_id"]:
                    return f.episode(eps_id, a)
        raise KeyError(f"episode {eps_id!r} is not in run {self.path}")

    def __repr__(self) -> str:
        return f"Run({self.path!r}, files={len(self.files)}, status={self.manifest.get('status')!r})"


def open_run(path: str) -> Run:
    """Opens a run directory for reading."""
    return Run(os.fspath(path))


def _read(node: Any, rows: slice) -> Any:
    if isinstance(node, h5py.Dataset):
        return decode.read_rows(node, rows)
    kind = node.attrs.get("container", "dict")
    if kind == "tuple":
        return tuple(_read(node[str(i)], rows) for i in range(len(node)))
    return {k: _read(v, rows) for k, v in node.items()}


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(_concat([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)


def _map(fn: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_map(fn, v) for v in value)
    return fn(value)
