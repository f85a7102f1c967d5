"""One env runner's HDF5 file, read lazily: its indexes, columns, episodes and batches."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Sequence

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import commits, h5file, probe, segments
from rllib_recorder.format.decode import read_node, row_shape
from rllib_recorder.format.lag import rows_learner_version, step_lags
from rllib_recorder.read import episodes
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
        self._worker_index: int | None = None
        self._is_evaluation: bool | None = None
        self._learner_versions: tuple[int, np.ndarray | None] | None = None  # (committed batches, column)
        # An agent's step columns are fixed once it has rows (the writer refuses a column that appears later), so
        # their paths, datasets and row size are looked up once, not for every block.
        self._paths: dict[str, list[str]] = {}
        self._nodes: dict[str, Any] = {}

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
                foreign = _foreign_sources(self.path, self._h5)
                if foreign:
                    raise SchemaError(f"{self.path} has virtual datasets reading {foreign[0]!r}, not one of its own "
                                      "segments; a recording reads nothing outside its run: remove the file")
                missing = self.missing_segments()  # HDF5 would read a missing segment's rows as zeros
                if missing:
                    raise SchemaError(f"{self.path} names segments that are not there ({missing[0]}"
                                      f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); copy the "
                                      "run's segments/ folder with it, or open the run at its target URI")
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

    def missing_segments(self) -> list[str]:
        """The segment files this index names that are not beside it, or not whole ([] for a plain file)."""
        with h5file.damaged_file_errors(self.path):
            records = segments.segment_list(self._h5 if self._h5 is not None else self.h5)
        return segments.verify_local(self.path, records) if records else []

    def stored_bytes(self) -> int:
        """Bytes on disk: the file, and for an index the segments it names."""
        with h5file.damaged_file_errors(self.path):
            records = segments.segment_list(self.h5) or []
        return os.path.getsize(self.path) + sum(int(r["size"]) for r in records)

    def segment_rows(self, agent: str) -> list[tuple[int, int]]:
        """``agent``'s step rows per segment, as [start, stop) ranges (one range for a plain file)."""
        with h5file.damaged_file_errors(self.path):
            records = segments.segment_list(self.h5)
        total = self.num_rows(agent)
        if not records:
            return [(0, total)] if total else []
        out, start = [], 0
        for record in records:
            rows = record["tables"].get(f"agents/{agent}/steps", 0)
            if rows:
                out.append((start, start + rows))
            start += rows
        return out

    @property
    def worker_index(self) -> int:
        if self._worker_index is None:  # written once when the file is created: read once
            with h5file.damaged_file_errors(self.path):
                self._worker_index = int(self.h5.attrs["worker_index"])
        return self._worker_index

    @property
    def is_evaluation(self) -> bool:
        if self._is_evaluation is None:
            with h5file.damaged_file_errors(self.path):
                self._is_evaluation = bool(self.h5.attrs["is_evaluation"])
        return self._is_evaluation

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

    def _fragments(self, agent: str, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The episode index of ``agent`` (scalar columns; one row per fragment); ``names``: only those."""
        group = self._node(f"agents/{agent}/fragments")
        n = self.commit["agents"].get(agent, (0, 0))[1]
        if names is not None:
            return {k: group[k][:n] for k in names if k in group}
        return {k: v[:n] for k, v in group.items() if isinstance(v, h5py.Dataset) and v.ndim == 1
                and not k.startswith("last_") and k not in ("infos", "start_state")}

    def num_rows(self, agent: str) -> int:
        """Committed step rows of ``agent``."""
        return int(self.commit["agents"].get(agent, (0, 0))[0])

    def column_paths(self, agent: str) -> list[str]:
        """Paths of ``agent``'s step columns (``obs``, ``obs/pos``, ``actions``, ``extra_model_outputs/vf_preds``)."""
        if agent in self._paths:
            return self._paths[agent]

        fixed = True  # remembered in this process: listed when the agent had rows

        def listed() -> list[str]:
            nonlocal fixed
            paths: list[str] = []
            self._node(f"agents/{agent}/steps").visititems(
                lambda path, node: paths.append(path) if isinstance(node, h5py.Dataset) else None)
            fixed = self.num_rows(agent) > 0  # fixed from the agent's first rows on
            return paths

        paths = _remembered(_PATHS, (self.path, agent), self.path, listed, lambda: fixed)
        if fixed:
            self._paths[agent] = paths
        return paths

    def _step_column(self, agent: str, path: str) -> Any:
        """The dataset (or group of a nested space) of ``agent``'s step column ``path``, looked up once."""
        key = f"agents/{agent}/steps/{path}"
        node = self._nodes.get(key)
        if node is None:
            steps = self._nodes.get(f"agents/{agent}/steps")
            if steps is None:
                steps = self._nodes[f"agents/{agent}/steps"] = self._node(f"agents/{agent}/steps")
            try:  # from the held group: HDF5 walks one level, not four
                node = steps[path]
            except (KeyError, OSError, RuntimeError, ValueError):
                node = self._node(key)  # a missing column a KeyError, damage one line
            self._nodes[key] = node
        return node

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

    def column(self, agent: str, path: str, rows: slice = slice(None), decode: bool = True) -> Any:
        """One step column of ``agent`` (nested spaces come back as dicts/tuples); ``decode`` False: image columns
        stored as uint8 codes come as codes (``encoding`` says how to decode them)."""
        return read_node(self._step_column(agent, path), rows, decode)

    def encoding(self, agent: str, path: str) -> tuple[float, float] | None:
        """``(scale, offset)`` of a step column stored as uint8 codes (value = code * scale + offset), else None."""
        attrs = self._node(f"agents/{agent}/steps/{path}").attrs
        if attrs.get("encoding") != "affine_uint8":
            return None
        return float(attrs["scale"]), float(attrs["offset"])

    def episode_ids(self, agent: str | None = None) -> list[str]:
        agents = [agent] if agent else self.agents
        seen: dict[str, None] = {}
        with h5file.damaged_file_errors(self.path):
            for a in agents:
                for eps in self.fragments(a)["eps_id"].tolist():
                    seen.setdefault(eps.decode(), None)
        return list(seen)

    def _episode(self, eps_id: str, agent: str, index: dict[str, np.ndarray] | None = None,
                 columns: Sequence[str] | None = None) -> Episode:
        """One agent's episode, read through the episode index (``index``: the agent's, when read already)."""
        frags = self._fragments(agent) if index is None else index
        where = np.flatnonzero(frags["eps_id"] == eps_id.encode())
        if not len(where):
            raise KeyError(f"episode {eps_id!r} of agent {agent!r} is not in {self.path}")
        where = where[np.argsort(frags["t_start"][where], kind="stable")].tolist()
        reader = episodes.Fragments(self, agent, frags, self.row_bytes(agent, columns), only=where, columns=columns)
        return episodes.assemble(self, eps_id, agent, frags, where, [reader.take(i) for i in where],
                                 self.learner_version_column())

    def iter_episodes(self, agent: str, decode: bool = True, columns: Sequence[str] | None = None
                      ) -> Iterator[Episode]:
        """Every episode of ``agent``, streamed block by block (``read.episodes``), in the order its first
        fragment was stored; ``decode`` False: image observations stored as uint8 codes stay codes; ``columns``:
        only those read (``Run.episodes``)."""
        with h5file.damaged_file_errors(self.path):
            frags = self._fragments(agent, episodes.INDEX_NAMES)  # module ids (strings) read when first asked for
            yield from episodes.iter_episodes(self, agent, frags, self.row_bytes(agent), self.learner_version_column(),
                                              decode, columns)

    def learner_version_column(self) -> np.ndarray | None:
        """The batch index's learner_version column (None: files written before it existed), read again only when
        the file has committed more batches (reading episodes one by one, each needs it)."""
        batches = self.commit["batches"]
        if self._learner_versions is None or self._learner_versions[0] != batches:
            column = self._node("batches").get("learner_version")
            self._learner_versions = (batches, None if column is None else column[:batches])
        return self._learner_versions[1]

    def row_bytes(self, agent: str, columns: Sequence[str] | None = None) -> int:
        """Bytes of one of ``agent``'s step rows as the reader gives them (uint8 codes as float32, stacks rebuilt);
        ``columns``: of those step columns only (paths, or the first part of paths: ``obs`` for ``obs/pos``)."""
        def counted() -> int:
            total = 0
            for path in self.column_paths(agent):
                if columns is not None and path not in columns and path.split("/")[0] not in columns:
                    continue
                column = self._step_column(agent, path)
                itemsize = 4 if column.attrs.get("encoding") == "affine_uint8" else column.dtype.itemsize
                itemsize = 8 if column.dtype == object else itemsize
                total += int(np.prod(row_shape(column), dtype=np.int64)) * itemsize
            return max(1, total)

        key = (self.path, agent, None if columns is None else tuple(columns))
        return _remembered(_ROW_BYTES, key, self.path, counted, lambda: self.num_rows(agent) > 0)

    def batches(self) -> dict[str, np.ndarray]:
        """The batch index: one row per stored chunk."""
        with h5file.damaged_file_errors(self.path):
            return self._batches()

    def fragments(self, agent: str) -> dict[str, np.ndarray]:
        """The episode index of ``agent`` (scalar columns; one row per fragment)."""
        with h5file.damaged_file_errors(self.path):
            return self._fragments(agent)

    def episode(self, eps_id: str, agent: str, index: dict[str, np.ndarray] | None = None,
                columns: Sequence[str] | None = None) -> Episode:
        """One agent's episode, read through the episode index (no scan of step data); ``index``: the agent's
        ``fragments()``, when the caller has read it (reading many episodes: it is not read again for each);
        ``columns``: only those read, as for ``Run.episodes`` (the viewer reads an Atari episode's values without
        its frames)."""
        with h5file.damaged_file_errors(self.path):
            return self._episode(eps_id, agent, index, columns)

    def multi_agent_episode(self, eps_id: str) -> Any:
        """One multi-agent episode, all its agents, as RLlib's ``MultiAgentEpisode`` (``read.multi_agent``)."""
        indexes = {a: self.fragments(a) for a in self.agents}
        agents = [a for a, index in indexes.items() if eps_id.encode() in index["eps_id"]]
        if not agents:
            raise KeyError(f"episode {eps_id!r} is not in {self.path}")
        return to_multi_agent_episode(eps_id, [self.episode(eps_id, a, indexes[a]) for a in agents])

    def close(self) -> None:
        self._nodes.clear()
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


# What a reader found in a file before, by key, with the file's stamp (size, mtime, inode, ctime) then: a finished
# file is read again without walking every object of it again, or listing its columns again.
_CHECKED: dict[str, tuple[probe.Stamp, list[str]]] = {}  # virtual datasets' sources outside the file
_PATHS: dict[tuple[str, str], tuple[probe.Stamp, list[str]]] = {}  # each agent's step column paths
_ROW_BYTES: dict[tuple[str, str, Any], tuple[probe.Stamp, int]] = {}  # a row's bytes per columns asked


def _remembered(cache: dict, key: Any, path: str, make: Callable[[], Any],
                keep: Callable[[], bool] = lambda: True) -> Any:
    """``cache[key]`` if it was made from the file at ``path`` as it is now (its stamp), else ``make()``, kept
    when ``keep()`` says it is final and the file did not change while it was made."""
    stamp = probe.stamp(path)
    known = cache.get(key)
    if stamp is not None and known is not None and known[0] == stamp:
        return known[1]
    value = make()
    if stamp is not None and keep() and stamp == probe.stamp(path):
        cache[key] = (stamp, value)
    return value


def _foreign_sources(path: str, h5: h5py.File) -> list[str]:
    """One walk of every object of a file a reader opens: the files its virtual datasets read outside its own
    segments (returned), and a column stored with a filter this HDF5 lacks (a one-line SchemaError here, before
    any of it is read: HDF5's own error names a plugin directory, not the filter)."""
    return _remembered(_CHECKED, path, path, lambda: _walk(path, h5))


def _walk(path: str, h5: h5py.File) -> list[str]:
    allowed = segments.own_sources(os.path.basename(path)[:-3], segments.segment_list(h5))
    foreign: list[str] = []
    lacking: list[tuple[str, int]] = []

    def visit(name: str, obj: Any) -> None:
        if not isinstance(obj, h5py.Dataset):
            return
        if obj.is_virtual:
            foreign.extend(m.file_name for m in obj.virtual_sources() if m.file_name not in allowed)
        elif not lacking and obj.chunks is not None:
            lacking.extend((name, i) for i in h5file.unavailable_filters(obj))

    h5.visititems(visit)
    if lacking:
        raise h5file.filter_error(path, *lacking[0])
    return sorted(set(foreign))
