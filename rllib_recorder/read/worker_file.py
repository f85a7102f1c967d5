"""One env runner's HDF5 file, read lazily: its indexes, columns, episodes and batches."""

from __future__ import annotations

import json
from typing import Any, Iterator

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import commits, decode, h5file, probe
from rllib_recorder.format.lag import rows_learner_version, step_lags
from rllib_recorder.read.multi_agent import to_multi_agent_episode
from rllib_recorder.read.records import Batch, Episode


class WorkerFile:
    """One env runner's HDF5 file, opened read-only on first use."""

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} holds an open HDF5 file and can't be pickled: "
                        "send its path and open it in the other process with WorkerFile(path)")

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

    def batches_in_order(self, start: int = 0) -> Iterator[Batch]:
        """The stored chunks in the order they were stored (from batch row ``start``), each with its step rows (read
        lazily, chunk by chunk)."""
        with h5file.damaged_file_errors(self.path):
            yield from self._batches_in_order(start)

    def _batches_in_order(self, start: int) -> Iterator[Batch]:
        index = self.batches()
        spans = {}
        for agent in self.agents:
            frags = self.fragments(agent)
            spans[agent] = (frags["batch"], frags["first_row"], frags["first_row"] + frags["num_rows"])
        for row in range(start, len(index.get("seq", ()))):
            steps = {}
            for agent, (batch, first, end) in spans.items():
                mine = batch == row
                if mine.any():
                    rows = slice(int(first[mine].min()), int(end[mine].max()))
                    group = self._node(f"agents/{agent}/steps")
                    steps[agent] = {k: read_node(group[k], rows) for k in group}
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
        return read_node(self._node(f"agents/{agent}/steps/{path}"), rows)

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
        read = lambda path: concat_values([read_node(steps[path], s) for s in pieces])  # noqa: E731
        last = where[-1]
        obs = read("obs")
        frag_group = self._node(f"agents/{agent}/fragments")
        if frags["has_last_obs"][last]:
            obs = concat_values([obs, read_node(frag_group["last_obs"], slice(int(last), int(last) + 1))])
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
            env_t=_env_ts(frags, steps, where, pieces),
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

    def multi_agent_episode(self, eps_id: str) -> Any:
        """One multi-agent episode, all its agents, as RLlib's ``MultiAgentEpisode`` (``read.multi_agent``)."""
        agents = [a for a in self.agents if eps_id.encode() in self.fragments(a)["eps_id"]]
        if not agents:
            raise KeyError(f"episode {eps_id!r} is not in {self.path}")
        return to_multi_agent_episode(eps_id, [self.episode(eps_id, a) for a in agents])

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


def _env_ts(frags: dict[str, np.ndarray], steps: Any, where: np.ndarray, pieces: list[slice]) -> np.ndarray:
    """The env step of each of an episode's observations (multi-agent episodes of schema 2.2; else empty): its
    rows' ``env_t`` and its final observation's ``env_t_last_obs``. A continuing fragment's first row may have
    -1 (its observation was older than what the sampled episode's map held): it is the previous fragment's last
    observation, whose env step that fragment has."""
    if "env_t" not in steps or "env_t_last_obs" not in frags:
        return np.zeros(0, np.int64)
    last = frags["env_t_last_obs"]
    parts = []
    for j, rows in enumerate(pieces):
        part = steps["env_t"][rows].astype(np.int64)
        if len(part) and part[0] < 0 and j:
            part[0] = last[where[j - 1]]
        parts.append(part)
    if last[where[-1]] >= 0:
        parts.append(last[where[-1]:where[-1] + 1].astype(np.int64))
    return np.concatenate(parts)


def read_node(node: Any, rows: slice) -> Any:
    if isinstance(node, h5py.Dataset):
        return decode.read_rows(node, rows)
    kind = node.attrs.get("container", "dict")
    if kind == "tuple":
        return tuple(read_node(node[str(i)], rows) for i in range(len(node)))
    return {k: read_node(v, rows) for k, v in node.items()}


def concat_values(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat_values([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(concat_values([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)
