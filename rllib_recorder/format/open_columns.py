"""The groups and columns of one file open for appending, kept from one append to the next with its commit record."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from rllib_recorder.format.commits import commit_json, padded_commit, read_commit, write_commit_data
from rllib_recorder.format.frames import DELTA_ATTR, DELTA_KEY_ATTR
from rllib_recorder.format.layout import FRAME_STACK_ATTR, SCHEMA_VERSION


class OpenColumns:
    """The groups and columns of one file open for appending, with what each append checks.

    An append writes a few dozen columns; looking each one up through h5py (group lookup,
    shape, dtype, attributes: new Python objects every time) cost as much as writing it.
    The writer keeps one of these per open file and drops it before closing the file.
    """

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} holds the open datasets of a file and can't be pickled: "
                        "keep it in the process that appends")

    def __init__(self, h5: h5py.File) -> None:
        self.h5 = h5
        self._groups: dict[str, h5py.Group] = {}
        self._names: dict[int, str] = {}  # id(group) -> its name (h5py looks a name up on every access)
        self._columns: dict[str, Column] = {}
        # (stream group, column, container kind) already marked on the file
        self.containers_marked: set[tuple[str, str, str]] = set()
        # The commit record as last written, and its attribute held open: reading it back (attribute read, JSON
        # parse of 1 KiB) and writing it through h5py's attrs (lookups) took 108 us per append, 10 us this way.
        self._commit: dict[str, Any] | None = None
        self._commit_attr: Any = None
        self._commit_capacity = 0
        # Per agent group: the plain start states this file holds, which later ones are stored against
        # (start_state.encode_batch); an append's new ones count only once it is committed.
        self._state_references: dict[str, list] = {}
        self._pending_references: dict[str, list] = {}

    @functools.cached_property
    def stores_frame_deltas(self) -> bool:
        """Whether the file's schema version has image columns stored as frame deltas (3.0; an earlier reader
        would read such rows as they are stored)."""
        return int(str(self.h5.attrs.get("schema_version", SCHEMA_VERSION)).split(".")[0]) >= 3

    @functools.cached_property
    def stores_frame_stacks(self) -> bool:
        """Whether the file's schema version has frame-stacked columns (2.0; a 1.x file keeps full stacks)."""
        return str(self.h5.attrs.get("schema_version", SCHEMA_VERSION)).split(".")[0] != "1"

    def commit(self) -> dict[str, Any]:
        """A copy of the file's commit record, to change and pass to ``write_commit``."""
        if self._commit is None:
            self._commit = read_commit(self.h5)
        return {**self._commit, "agents": dict(self._commit["agents"])}

    def write_commit(self, commit: dict[str, Any]) -> None:
        """Writes ``commit`` in place (``write_commit``, without the lookups) and keeps it as the file's record."""
        data = commit_json(commit)
        if self._commit_attr is not None and len(data) <= self._commit_capacity:
            self._commit_attr.write(padded_commit(data, self._commit_capacity))
        else:
            self._commit_attr = None  # re-created when it outgrows its capacity: open it anew
            self._commit_capacity = write_commit_data(self.h5, data)
            self._commit_attr = self.h5.attrs.get_id("commit")
        self._commit = commit

    def state_references(self, agent_group: str) -> list:
        """The plain start states (row, layout, arrays) of ``agent_group`` this file held at its last commit, as a
        list the current append may extend (``keep_state_references`` keeps it once the append is committed)."""
        pending = self._pending_references[agent_group] = list(self._state_references.get(agent_group, []))
        return pending

    def keep_state_references(self) -> None:
        """The current append is committed: its plain start states may be referenced from now on."""
        self._state_references.update(self._pending_references)
        self._pending_references = {}

    def group(self, name: str) -> h5py.Group:
        """The group ``name`` (created if missing)."""
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = self.h5.require_group(name)
            self._names[id(group)] = group.name
        return group

    def _key(self, group: h5py.Group, path: str) -> str:
        name = self._names.get(id(group))
        return f"{group.name if name is None else name}/{path}"

    def column(self, group: h5py.Group, path: str) -> "Column | None":
        """The column ``path`` of ``group``, or None if the file has none yet."""
        key = self._key(group, path)
        column = self._columns.get(key)
        if column is None and path in group:
            column = self._columns[key] = Column.of(group[path])
        return column

    def forget(self, group: h5py.Group, path: str) -> None:
        """Drops a column whose dataset is about to be replaced, and closes its dataset now rather than whenever
        Python frees it. (A full test run once segfaulted inside HDF5 in ``del group[path]`` of the replaced
        column; whether the still-open old dataset caused it is not proven, but unlinking a closed one is what
        ``replace_column`` promises.)"""
        column = self._columns.pop(self._key(group, path), None)
        if column is not None and column.dataset.id.valid:
            column.dataset.id.close()

    def clear(self) -> None:
        """Drops every held dataset and group (before the file is closed)."""
        self._groups.clear()
        self._names.clear()
        self._columns.clear()
        self.containers_marked.clear()
        self._commit, self._commit_attr = None, None
        self._state_references, self._pending_references = {}, {}


@dataclass
class Column:
    dataset: h5py.Dataset
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    encoding: tuple[np.float32, np.float32] | None
    stack: int | None = None  # frames per row of a frame-stacked column (FRAME_STACK_ATTR)
    delta: int | None = None  # key rows of a column stored as frame deltas (DELTA_KEY_ATTR)

    @classmethod
    def of(cls, dataset: h5py.Dataset) -> "Column":
        attrs = dataset.attrs
        encoding = None
        if attrs.get("encoding") == "affine_uint8":
            encoding = (np.float32(attrs["scale"]), np.float32(attrs["offset"]))
        stack = attrs.get(FRAME_STACK_ATTR)
        delta = int(attrs[DELTA_KEY_ATTR]) if attrs.get(DELTA_ATTR) is not None else None
        return cls(dataset, dataset.shape[0], dataset.shape[1:], dataset.dtype, encoding,
                   None if stack is None else int(stack), delta)
