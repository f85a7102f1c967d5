"""The runs a viewer was given: an id for each, found again as folders fill, each opened once per file stamp."""

from __future__ import annotations

import glob
import os
import posixpath
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rllib_recorder.config import is_uri, public_uri
from rllib_recorder.errors import RecorderError, SchemaError
from rllib_recorder.read.remote import local_copy
from rllib_recorder.read.run import Run, open_run

# Runs held open at once (each holds its HDF5 files and their chunk caches); the least recently used is closed.
MAX_OPEN_RUNS = 8
# A folder is walked for new runs at most this often (a page polls the runs while one records).
RESCAN_S = 2.0


class NotFound(Exception):
    """What a request named is not among the runs the viewer was given (the server answers 404)."""


@dataclass(frozen=True)
class Tools:
    """What the viewer takes from the commands: it reads runs only through ``read/``, and ``commands/view.py``
    passes in the rest (how ``info`` finds runs, a run's status, ``verify``'s report, ``info``'s rates, and
    ``render``'s re-simulation)."""

    find_runs: Callable[[str], list[str]]
    status: Callable[[str, dict[str, Any]], Any]
    verify: Callable[[str], dict[str, Any]]
    rates: Callable[[Run, dict[str, Any]], dict[str, Any]]
    # (run, episode) -> the env's pictures of each step, re-simulated from its start state; raises RecorderError
    simulate: Callable[[Run, Any], Iterator[Any]] | None = None


@dataclass(frozen=True)
class Root:
    """One PATH the viewer was given: as given (shown), and the local directory it reads."""

    given: str
    local: str


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """(size, mtime, inode) of a file, as the reader stamps files; None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def run_stamps(run_dir: str) -> tuple[Any, ...]:
    """The stamps of a run's manifest and worker files: when they change, what was read of it is read again."""
    names = sorted(glob.glob(os.path.join(glob.escape(run_dir), "*.h5")))
    return (file_stamp(os.path.join(run_dir, "manifest.json")),) + tuple((p, file_stamp(p)) for p in names)


@dataclass
class Handle:
    """A run opened for reading (worker files the probe finds damaged set aside), with what was computed from it
    while its files stay as they were (``memo``); used under its lock, one request at a time."""

    run_id: str
    path: str
    stamps: tuple[Any, ...]
    run: Run
    memo: dict[str, Any] = field(default_factory=dict)

    def fresh(self) -> bool:
        """Whether the run's files are still as they were when it was opened."""
        return run_stamps(self.path) == self.stamps


class Catalog:
    """The runs at or below the given paths, by id (their path below the root, prefixed by the root's number when
    several were given). A request can name nothing else: an id is looked up, never joined to a path."""

    def __init__(self, paths: list[str], tools: Tools, *, cache_dir: str | None = None) -> None:
        self.tools = tools
        self.roots = [Root(public_uri(p) if is_uri(p) else p, local_copy(p, cache_dir=cache_dir) if is_uri(p) else
                           os.path.abspath(p)) for p in paths]
        for root in self.roots:
            if not os.path.isdir(root.local):
                raise SchemaError(f"{root.given} is not a directory; pass a run directory (it holds manifest.json), "
                                  "a folder of runs or a run's URI")
        self._runs: dict[str, str] = {}
        self._groups: dict[str, str] = {}
        self._scanned_at = -RESCAN_S
        self._lock = threading.Lock()
        self._handles: OrderedDict[str, Handle] = OrderedDict()
        self._run_locks: dict[str, threading.RLock] = {}
        self.scan(force=True)

    def scan(self, force: bool = False) -> dict[str, str]:
        """Every run's id and directory, walking the roots again when ``RESCAN_S`` has passed (or ``force``)."""
        with self._lock:
            if force or time.monotonic() - self._scanned_at >= RESCAN_S:
                runs, groups = {}, {}
                for k, root in enumerate(self.roots):
                    prefix = f"{k}/" if len(self.roots) > 1 else ""
                    for run_dir in self.tools.find_runs(root.local):
                        relative = os.path.relpath(run_dir, root.local).replace(os.sep, "/")
                        if relative == ".":
                            relative = os.path.basename(root.local.rstrip(os.sep)) or "run"
                        run_id = prefix + relative
                        runs[run_id] = run_dir
                        groups[run_id] = prefix + posixpath.dirname(relative)
                self._runs, self._groups, self._scanned_at = runs, groups, time.monotonic()
            return dict(self._runs)

    def group_of(self, run_id: str) -> str:
        return self._groups.get(run_id, "")

    def path_of(self, run_id: str) -> str:
        """The directory of run ``run_id``; NotFound for anything that is not one of the runs found."""
        if not run_id or run_id.startswith("/") or ".." in run_id.split("/") or "\\" in run_id or "\0" in run_id:
            raise NotFound(f"no run {run_id!r}")
        path = self.scan().get(run_id)
        if path is None:
            raise NotFound(f"no run {run_id!r} below the paths this viewer was given")
        return path

    @contextmanager
    def opened(self, run_id: str) -> Iterator[Handle]:
        """Run ``run_id`` opened (again, when any of its files changed since), held under its lock."""
        path = self.path_of(run_id)
        with self._lock:
            lock = self._run_locks.setdefault(run_id, threading.RLock())
        with lock:
            handle = self._handles.get(run_id)
            if handle is None or not handle.fresh():
                if handle is not None:
                    handle.run.close()
                stamps = run_stamps(path)
                handle = Handle(run_id, path, stamps, open_run(path, skip_damaged=True))
            with self._lock:
                self._handles[run_id] = handle
                self._handles.move_to_end(run_id)
                stale = [h for h in list(self._handles.values())[:-MAX_OPEN_RUNS]]
            for old in stale:
                self._close(old)
            yield handle

    def _close(self, handle: Handle) -> None:
        lock = self._run_locks.get(handle.run_id)
        if lock is not None and lock.acquire(blocking=False):  # in use: closed when next found stale
            try:
                with self._lock:
                    if self._handles.get(handle.run_id) is handle:
                        del self._handles[handle.run_id]
                handle.run.close()
            finally:
                lock.release()

    def close(self) -> None:
        for handle in list(self._handles.values()):
            self._close(handle)


def guarded(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, the one-line reason)`` when the run or a file is damaged or not ours."""
    try:
        return fn(), None
    except (RecorderError, OSError, KeyError, ValueError) as e:
        return None, " ".join(str(e).split()) or type(e).__name__
