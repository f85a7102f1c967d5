"""Probing possibly damaged HDF5 files in a child process, before this process trusts HDF5 with them.

HDF5 does not always fail cleanly on a damaged file: a corrupted chunk index can make it loop forever
inside one C call, and some damage crashes it. Neither can be interrupted or caught from Python. So before
a file is read in-process, a child process opens it and walks everything that HDF5 follows by address:
every object header and attribute, every chunked dataset's chunk index, and the committed rows of the
small index tables (``batches/``, ``agents/*/fragments/``). If the child finishes, the file's structure is
sound and the reader goes on; if it stalls or dies, the file is reported as damaged with a one-line
``SchemaError`` and this process never touches it.

One long-lived child serves all probes of a process; each file gets ``RLLIB_RECORDER_PROBE_TIMEOUT_S`` seconds (30 by
default). A file that passed is remembered by (size, mtime, inode, ctime) for the life of the process, so reading
a finished run again costs nothing; and across processes by ``sound_files``, with the files their writers closed
cleanly, so that a fresh process starts no child for them (starting one costs about 0.2 s of CPU, more than
reading a 200k-step run). ``RLLIB_RECORDER_PROBE=0`` turns probing off (the caller then trusts HDF5, as plain
h5py does).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

from rllib_recorder.errors import SchemaError
from rllib_recorder.format import sound_files

DEFAULT_TIMEOUT_S = 30.0

# (size, mtime, inode, ctime) of a file: any change to it moves its ctime, which os.utime can't set back.
Stamp = tuple[int, int, int, int]

_passed: dict[str, Stamp] = {}


def enabled() -> bool:
    return os.environ.get("RLLIB_RECORDER_PROBE", "1").strip().lower() not in ("0", "false", "no", "off")


def timeout_s() -> float:
    raw = os.environ.get("RLLIB_RECORDER_PROBE_TIMEOUT_S", "")
    try:
        return float(raw) if raw.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        raise SchemaError(f"RLLIB_RECORDER_PROBE_TIMEOUT_S={raw!r} is not a number of seconds; "
                          "set it to e.g. 60, or unset it") from None


def stamp(path: str) -> Stamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def ensure_readable(paths: Iterable[str]) -> None:
    """Raises SchemaError naming the first of ``paths`` on which HDF5 loops or crashes; returns if all are sound.

    Only the structure is checked here: errors HDF5 reports cleanly (bad signature, truncated file, a
    checksum) are left to the caller, which turns them into its own one-line errors.
    """
    if not enabled():
        return
    todo = [p for p in map(os.fspath, paths) if stamp(p) is not None and _passed.get(p) != stamp(p)]
    for path in todo:  # a missing file is the caller's error to report
        before = stamp(path)
        if sound_files.known_sound(path):  # closed cleanly by its writer, or probed before, and unchanged since
            _passed[path] = before  # type: ignore[assignment]
            continue
        outcome = _PROBER.probe(path, timeout_s())
        if outcome == "ok" and stamp(path) == before:
            _passed[path] = before  # type: ignore[assignment]
            sound_files.remember(path, before)
        elif outcome not in ("ok", "error"):
            raise SchemaError(f"{path} is damaged: {outcome}; this process did not open it. Move the file "
                              "out of the run directory to read the rest of the run (recover cannot mend this)")


class _Prober:
    """A child process that probes one path per request; replaced after it stalls or dies.

    Starting Python and h5py takes a few hundred milliseconds, so one child serves every probe of this
    process. It dies with this process (PR_SET_PDEATHSIG), even while HDF5 loops in it.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def probe(self, path: str, per_file_s: float) -> str:
        """'ok', 'error' (HDF5 raised: the caller's error to report) or why the file is damaged."""
        with self.lock:
            for attempt in range(2):  # a child that died since its last answer is replaced once
                proc = self._started()
                assert proc.stdin is not None
                try:
                    proc.stdin.write((json.dumps(path) + "\n").encode())
                    proc.stdin.flush()
                    break
                except OSError:
                    self._stop()
            return self._answer(path, per_file_s)

    def _answer(self, path: str, per_file_s: float) -> str:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        line = _readline(proc.stdout, time.monotonic() + per_file_s)
        if line is None:
            self._stop()
            return (f"HDF5 made no progress reading its structure for {per_file_s:g} s "
                    "(a damaged chunk index can make it loop forever)")
        if not line:
            code = self._stop()
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return f"HDF5 crashed reading its structure ({why})"
        report = json.loads(line)
        assert report["path"] == path, (report, path)
        return report["outcome"]

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from rllib_recorder.format.probe import _main; _main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "RLLIB_RECORDER_PROBE": "0"})
            assert self.proc.stdout is not None
            if _readline(self.proc.stdout, time.monotonic() + 120.0) != b'"ready"\n':  # imports, not HDF5
                self._stop()
                raise SchemaError("cannot start the file probe (a child Python process importing h5py); "
                                  "set RLLIB_RECORDER_PROBE=0 to read without it")
        return self.proc

    def _stop(self) -> int:
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:
                pass
        return code


_PROBER = _Prober()


def _readline(pipe: Any, deadline: float) -> bytes | None:
    """One line from ``pipe``; b'' at its end, None if no full line came before ``deadline``."""
    fd = pipe.fileno()
    buffer = b""
    while not buffer.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            buffer += chunk
    return buffer


_MAX_DEPTH = 16  # the schema nests at most 5 deep (agents/<id>/steps/obs/<key>)


def walk(path: str) -> None:
    """Follows every address in ``path`` that a reader may follow; HDF5 raises, loops or crashes if one is bad.

    An object HDF5 reports as damaged does not stop the walk: its siblings and everything after it are
    walked too (a reader may reach them first, in another order), and the first error is raised at the end.
    """
    import h5py

    errors: list[Exception] = []

    def attempt(step: Any, *args: Any) -> Any:
        try:
            return step(*args)
        except Exception as e:  # noqa: BLE001 - reported after the rest is walked
            errors.append(e)
            return None

    def dataset(name: str, obj: h5py.Dataset, commit: dict[str, Any]) -> None:
        dict(obj.attrs)
        obj.shape, obj.dtype  # noqa: B018 - reads the dataspace and datatype messages
        if obj.chunks is not None:
            obj.id.chunk_iter(lambda info: None)  # walks the whole chunk index
        rows = _committed_rows(name, commit)
        if rows and obj.ndim == 1:
            obj[:rows]  # the index tables the reader reads whole

    def group(prefix: str, obj: h5py.Group, commit: dict[str, Any]) -> None:
        if prefix.count("/") > _MAX_DEPTH:  # a damaged link can point back up: a cycle, not a tree
            errors.append(ValueError(f"groups nested deeper than {_MAX_DEPTH} at {prefix}"))
            return
        attempt(lambda: dict(obj.attrs))
        for key in attempt(lambda: list(obj.keys())) or []:
            name = f"{prefix}{key}"
            child = attempt(obj.__getitem__, key)  # reads the child's object header
            if isinstance(child, h5py.Group):
                group(f"{name}/", child, commit)
            elif isinstance(child, h5py.Dataset):
                attempt(dataset, name, child, commit)

    with h5py.File(path, "r", locking=False) as h5:  # as h5file.open_h5 (this child imports little)
        attrs = dict(h5.attrs)
        commit = json.loads(attrs["commit"]) if "commit" in attrs else {"batches": 0, "agents": {}}
        group("", h5, commit)
    if errors:
        raise errors[0]


def _committed_rows(name: str, commit: dict[str, Any]) -> int:
    parts = name.split("/")
    if parts[0] == "batches":
        return int(commit.get("batches", 0))
    if parts[0] == "agents" and len(parts) >= 3 and parts[2] == "fragments":
        return int(commit.get("agents", {}).get(parts[1], (0, 0))[1])
    return 0


def _main() -> None:
    """The child: for each JSON path on stdin, one JSON line {"path", "outcome"} on stdout."""
    try:  # die with the parent, even while HDF5 loops here
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import h5py  # noqa: F401 - imported before "ready" so probes are timed without it

    out = sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        path = json.loads(line)
        try:
            walk(path)
            outcome = "ok"
        except Exception:  # noqa: BLE001 - HDF5 reported the damage cleanly; the caller reports it its way
            outcome = "error"
        out.write((json.dumps({"path": path, "outcome": outcome}) + "\n").encode())
        out.flush()
