"""Segments: an env runner's file cut into sealed, immutable pieces, and the index that makes them one file again.

A writer recording to a durable target (``output_dir`` a URI) writes each runner's file in a local staging
directory as always, and now and then *seals* it: closes it and moves it to ``.segments/<stem>/NNNNNN.h5``; the
next chunk starts a new file. Each segment is a complete worker file (plain h5py reads it) holding whole chunks
of the stream. Once a segment is at the target and checked, its record joins ``.segments/<stem>/published.json``
and the *index* ``<stem>.h5`` is rebuilt: a worker file whose step and fragment columns are HDF5 virtual datasets
over the segments (``segments/<stem>/NNNNNN.h5`` beside it), whose batch and episode indexes are real, with the
row offsets (``fragments/first_row``, ``fragments/batch``) counted over the whole stream. Every reader of worker
files reads the index as one file. See docs/FORMAT.md, "Segments".
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

import h5py
import numpy as np

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import commits, durable
from rllib_recorder.format.h5file import open_h5

SEGMENTS_DIR = ".segments"  # in the staging run directory
TARGET_SEGMENTS_DIR = "segments"  # beside the indexes at the target
PUBLISHED = "published.json"
INDEX_FORMAT = 1
# Attributes a segment carries from the segments before it: what its stream committed (re-sent chunks are
# recognised) and the stream's totals (a restarted writer's counters).
CARRIED_COMMITTED = "carried_committed"
CARRIED_TOTALS = "carried_totals"
SEGMENT_ATTR = "segment"
OFFSET_COLUMNS = {"first_row": "steps", "batch": "batches"}
# What the index keeps of each segment's record: enough to read it, and to go on with its stream from the target
# alone (a writer on a node whose staging directory does not have the stream: a Tune trial retried elsewhere).
RECORD_KEYS = ("name", "size", "sha256", "tables", "columns", "committed", "totals")
_SEGMENT_NAME = re.compile(r"^(\d{6})\.h5$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def stem_dir(run_dir: str, stem: str) -> str:
    return os.path.join(run_dir, SEGMENTS_DIR, stem)


def segment_name(number: int) -> str:
    return f"{number:06d}.h5"


def target_segment(stem: str, name: str) -> str:
    """A segment's path at the target, relative to the run (and to the index beside it)."""
    return f"{TARGET_SEGMENTS_DIR}/{stem}/{name}"


def sealed(run_dir: str, stem: str) -> list[str]:
    """Paths of the sealed segments of ``stem`` still in staging (not yet published), oldest first."""
    folder = stem_dir(run_dir, stem)
    try:
        names = sorted(n for n in os.listdir(folder) if _SEGMENT_NAME.match(n))
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in names]


def stems(run_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(run_dir, SEGMENTS_DIR)))
    except FileNotFoundError:
        return []


def read_published(run_dir: str, stem: str) -> list[dict[str, Any]]:
    """The records of the segments of ``stem`` at the target, oldest first."""
    try:
        with open(os.path.join(stem_dir(run_dir, stem), PUBLISHED)) as f:
            return json.load(f)["segments"]
    except FileNotFoundError:
        return []


def write_published(run_dir: str, stem: str, records: list[dict[str, Any]]) -> None:
    path = os.path.join(stem_dir(run_dir, stem), PUBLISHED)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"segments": records}, f)
        f.flush()
        os.fsync(f.fileno())
    durable.replace(tmp, path)


def next_number(run_dir: str, stem: str) -> int:
    """The number the next segment of ``stem`` gets (after every sealed and published one)."""
    numbers = [int(os.path.basename(p)[:6]) for p in sealed(run_dir, stem)]
    numbers += [int(r["name"][:6]) for r in read_published(run_dir, stem)]
    return max(numbers, default=-1) + 1


def carried(h5: h5py.File) -> tuple[dict[bytes, int], dict[str, int]]:
    """What the segments before ``h5`` committed: per sender the first seq not committed, and the totals."""
    committed = {k.encode(): int(v) for k, v in json.loads(h5.attrs.get(CARRIED_COMMITTED, "{}")).items()}
    totals = {k: int(v) for k, v in json.loads(h5.attrs.get(CARRIED_TOTALS, "{}")).items()}
    return committed, totals


def stream_state(h5: h5py.File) -> tuple[dict[bytes, int], dict[str, int]]:
    """(committed, totals) of the stream up to and including ``h5``: what the next segment carries."""
    committed, totals = carried(h5)
    for sender, upto in commits.committed_upto(h5).items():
        committed[sender] = max(committed.get(sender, 0), upto)
    for key, value in commits.committed_totals(h5).items():
        totals[key] = totals.get(key, 0) + value
    return committed, totals


def carry_attrs(number: int, committed: dict[bytes, int], totals: dict[str, int]) -> dict[str, Any]:
    """The attributes a new live file of a segmented stream starts with."""
    return {SEGMENT_ATTR: number,
            CARRIED_COMMITTED: json.dumps({k.decode(): v for k, v in committed.items()}),
            CARRIED_TOTALS: json.dumps(totals)}


def state_before(run_dir: str, stem: str) -> tuple[int, dict[bytes, int], dict[str, int]]:
    """(number, committed, totals) a new live file of ``stem`` starts from: after the newest sealed segment in
    staging, else the newest published one (a writer restarted between a seal and the next chunk)."""
    local = sealed(run_dir, stem)
    if local:
        with open_h5(local[-1], "r") as h5:
            committed, totals = stream_state(h5)
        return int(os.path.basename(local[-1])[:6]) + 1, committed, totals
    records = read_published(run_dir, stem)
    if records:
        last = records[-1]
        return (int(last["name"][:6]) + 1, {k.encode(): int(v) for k, v in last["committed"].items()},
                dict(last["totals"]))
    return 0, {}, {}


def seal(run_dir: str, path: str) -> str:
    """Moves the closed live file ``path`` into its stem's segments (uncommitted rows dropped first); returns the
    segment's path. A crash leaves the file either live or sealed, never both."""
    stem = os.path.basename(path)[: -len(".h5")]
    with open_h5(path, "r") as h5:
        number = int(h5.attrs.get(SEGMENT_ATTR, next_number(run_dir, stem)))
        dirty = bool(commits.uncommitted_rows(h5))
    if dirty:
        commits.rewrite_committed(path)
    folder = stem_dir(run_dir, stem)
    os.makedirs(folder, exist_ok=True)
    dest = os.path.join(folder, segment_name(number))
    durable.replace(path, dest)
    durable.fsync_dir(run_dir)
    return dest


def seal_or_drop(run_dir: str, path: str) -> str | None:
    """Seals the closed live file ``path`` (``seal``); one that commits nothing is removed instead (None)."""
    with open_h5(path, "r") as h5:
        empty = not commits.read_commit(h5)["batches"]
    if empty:
        os.remove(path)
        return None
    return seal(run_dir, path)


def index_path(run_dir: str, stem: str) -> str:
    """The local copy of ``stem``'s index in staging (the target's ``<stem>.h5``)."""
    return os.path.join(stem_dir(run_dir, stem), "index.h5")


def describe(path: str, stored: dict[str, Any]) -> dict[str, Any]:
    """The published record of a sealed segment: name, size, SHA-256, its tables' committed rows, and the
    stream's state after it."""
    with open_h5(path, "r") as h5:
        commit = commits.read_commit(h5)
        tables = {"batches": int(commit["batches"])}
        for agent, (rows, frags) in commit["agents"].items():
            tables[f"agents/{agent}/steps"] = int(rows)
            tables[f"agents/{agent}/fragments"] = int(frags)
        committed, totals = stream_state(h5)
        columns: list[str] = []
        h5.visititems(lambda p, o: columns.append(p) if isinstance(o, h5py.Dataset) and _table_of(p) else None)
    return {"name": os.path.basename(path), **stored, "tables": tables, "columns": columns,
            "committed": {k.decode(): v for k, v in committed.items()}, "totals": totals}


def build_index(out: str, stem: str, records: list[dict[str, Any]], newest: str, previous: str | None) -> None:
    """Writes the index of ``stem`` to ``out``: every published segment (``records``) as one worker file.

    ``newest`` is the newest segment's local file (its columns' types and attributes); ``previous`` the index
    before it (the columns of segments no longer in staging, and the row offsets counted so far).
    """
    sources = [h5 for h5 in (_open(previous), _open(newest)) if h5 is not None]
    try:
        columns: dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]] = {}
        groups: dict[str, dict[str, Any]] = {}
        for h5 in sources:  # the newest wins
            h5.visititems(lambda p, o: _note(p, o, columns, groups))
        bases = _bases(records)
        offsets = _offsets(previous and sources[0], sources[-1], records, bases)
        totals: dict[str, int] = {}
        for record in records:
            for table, rows in record["tables"].items():
                totals[table] = totals.get(table, 0) + rows
        tmp = f"{out}.tmp"
        with open_h5(tmp, "w") as idx:
            attrs = {k: v for k, v in sources[-1].attrs.items()
                     if k not in (CARRIED_COMMITTED, CARRIED_TOTALS, SEGMENT_ATTR, "commit")}
            idx.attrs.update(attrs)
            commits.write_commit(idx, _commit(totals))
            idx.attrs["segments"] = json.dumps({"format": INDEX_FORMAT, "segments": [
                {k: r[k] for k in RECORD_KEYS if k in r} for r in records]})
            for path, group_attrs in sorted(groups.items()):
                idx.require_group(path).attrs.update(group_attrs)
            idx.require_group("batches")
            idx.require_group("agents")
            for path, (dtype, tail, col_attrs) in sorted(columns.items()):
                table = _table_of(path)
                if path in offsets:
                    ds = idx.create_dataset(path, data=offsets[path])
                else:
                    ds = _virtual(idx, path, table, dtype, tail, records, bases, stem, totals.get(table, 0))
                ds.attrs.update(col_attrs)
        durable.replace(tmp, out)
    finally:
        for h5 in sources:
            h5.close()


def seed_from_index(run_dir: str, stem: str, index: str) -> None:
    """Makes ``index`` (the stream's index fetched from the target) the local state of ``stem``: its local index
    and published records, so that the next segment continues the stream's numbering and what it committed."""
    with open_h5(index, "r") as h5:
        records = segment_list(h5) or []
    if any(k not in r for r in records for k in RECORD_KEYS):
        raise ValueError(f"the index of {stem} at the target predates resumable indexes")
    folder = stem_dir(run_dir, stem)
    os.makedirs(folder, exist_ok=True)
    durable.replace(index, index_path(run_dir, stem))
    write_published(run_dir, stem, records)


def segment_list(h5: h5py.File) -> list[dict[str, Any]] | None:
    """The segments an index names (None: ``h5`` is a plain worker file). Each record's name, size and SHA-256 are
    checked first: they become paths and downloads, so a name that is not ``NNNNNN.h5`` (``../x``) is refused."""
    raw = h5.attrs.get("segments")
    if raw is None:
        return None
    try:
        records = json.loads(raw)["segments"]
        ok = isinstance(records, list) and all(
            isinstance(r, dict) and isinstance(r.get("name"), str) and _SEGMENT_NAME.match(r["name"])
            and type(r.get("size")) is int and r["size"] >= 0 and isinstance(r.get("tables"), dict)
            and (r.get("sha256") is None or (isinstance(r["sha256"], str) and _SHA256.match(r["sha256"])))
            for r in records)
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise SchemaError(f"{h5.filename}: its 'segments' attribute is not a list of segment records "
                          "(NNNNNN.h5, size, sha256); this index was not written by rllib_recorder")
    return records


def own_sources(stem: str, records: list[dict[str, Any]] | None) -> set[str]:
    """The files an index's virtual datasets may read: its own segments (none for a plain worker file). HDF5 would
    read any file a virtual dataset names, so a reader refuses a file whose virtual datasets name another."""
    return {target_segment(stem, r["name"]) for r in records or []}


def _open(path: str | None) -> h5py.File | None:
    return open_h5(path, "r") if path and os.path.exists(path) else None


def _note(path: str, obj: Any, columns: dict, groups: dict) -> None:
    if isinstance(obj, h5py.Dataset):
        if _table_of(path):
            columns[path] = (obj.dtype, obj.shape[1:], dict(obj.attrs))
    else:
        groups[path] = dict(obj.attrs)


def _table_of(path: str) -> str:
    """The table (``batches``, ``agents/<a>/steps``, ``agents/<a>/fragments``) a column path belongs to."""
    parts = path.split("/")
    if parts[0] == "batches" and len(parts) == 2:
        return "batches"
    if parts[0] == "agents" and len(parts) >= 4:
        return "/".join(parts[:3])
    return ""


def _bases(records: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per record: the row of the whole stream each of its tables starts at."""
    out, running = [], {}
    for record in records:
        out.append(dict(running))
        for table, rows in record["tables"].items():
            running[table] = running.get(table, 0) + rows
    return out


def _offsets(previous: h5py.File | None, newest: h5py.File, records: list[dict[str, Any]],
             bases: list[dict[str, int]]) -> dict[str, np.ndarray]:
    """The row-offset columns over the whole stream: the previous index's, then the newest segment's shifted."""
    out: dict[str, np.ndarray] = {}
    last = records[-1]
    for table in last["tables"]:
        if not table.endswith("/fragments"):
            continue
        agent = table.split("/")[1]
        for column, target in OFFSET_COLUMNS.items():
            path = f"{table}/{column}"
            shift = bases[-1].get("batches" if target == "batches" else f"agents/{agent}/steps", 0)
            rows = last["tables"][table]
            new = newest[path][:rows] + shift if path in newest else np.zeros(rows, np.int64)
            before_rows = bases[-1].get(table, 0)
            old = previous[path][:before_rows] if previous is not None and path in previous \
                else np.zeros(before_rows, np.int64)
            out[path] = np.concatenate([old, new]).astype(np.int64)
    for record, base in zip(records[:-1], bases[:-1]):  # tables the newest segment lacks keep their old columns
        for table in record["tables"]:
            if table.endswith("/fragments") and table not in last["tables"] and previous is not None:
                for column in OFFSET_COLUMNS:
                    path = f"{table}/{column}"
                    if path in previous and path not in out:
                        out[path] = previous[path][:]
    return out


def _virtual(idx: h5py.File, path: str, table: str, dtype: Any, tail: tuple[int, ...],
             records: list[dict[str, Any]], bases: list[dict[str, int]], stem: str, total: int) -> h5py.Dataset:
    layout = h5py.VirtualLayout(shape=(total,) + tuple(tail), dtype=dtype)
    for record, base in zip(records, bases):
        rows = record["tables"].get(table, 0)
        if rows and path in record.get("columns", [path]):
            start = base.get(table, 0)
            source = h5py.VirtualSource(target_segment(stem, record["name"]), path, shape=(rows,) + tuple(tail))
            layout[start:start + rows] = source
    return idx.create_virtual_dataset(path, layout)


def _commit(totals: dict[str, int]) -> dict[str, Any]:
    agents: dict[str, list[int]] = {}
    for table, rows in totals.items():
        if table.startswith("agents/"):
            agent, kind = table.split("/")[1:3]
            agents.setdefault(agent, [0, 0])[0 if kind == "steps" else 1] = rows
    return {"batches": totals.get("batches", 0), "agents": agents}


def verify_local(index_path: str, segments: Iterable[dict[str, Any]]) -> list[str]:
    """Problems with the segment files an index names, beside it (missing, or the wrong size)."""
    folder = os.path.dirname(index_path)
    stem = os.path.basename(index_path)[: -len(".h5")]
    problems = []
    for record in segments:
        path = os.path.join(folder, target_segment(stem, record["name"]))
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{path} is missing")
            continue
        if size != record["size"]:
            problems.append(f"{path} holds {size} bytes, its index says {record['size']}")
    return problems
