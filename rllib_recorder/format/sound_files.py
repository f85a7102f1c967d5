"""Files known to be sound, remembered across processes: so that a fresh process reads them without the probe.

The probe (``probe.py``) exists for bytes HDF5 did not write: damage on a disk or in a copy, and hostile files.
A file that a writer created, appended to and closed cleanly in one process holds only bytes HDF5 wrote there;
a file the probe walked holds none that make HDF5 loop or crash. Either is remembered here, with the identity
it had then: device and inode (the key), size, mtime and ctime in nanoseconds, this boot of the machine, and a
SHA-256 of its first and last 4 KiB. Any change to the file moves its ctime, which no user-space call can set
back (``os.utime`` sets mtime and atime only), so a record matches only the very bytes it was made for; a copy,
a download or an extracted archive is a new inode, and a reboot voids every record (a crash can lose data
blocks whose inode survived).

The records live in the user's own cache (``$RLLIB_RECORDER_SOUND_DIR``, default
``~/.cache/rllib_recorder/sound``), never in a run directory: a run directory is data from anywhere, and nothing
in it can vouch for its own files. Where that cache can't be written, nothing is remembered and every process
probes, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any

ENV = "RLLIB_RECORDER_SOUND_DIR"
_EDGE_BYTES = 4096
MAX_RECORDS = 4096  # past this, the older half is forgotten (each record is one small file)


def directory() -> str:
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rllib_recorder", "sound")


def remember(path: str, stamp: tuple[int, int, int, int] | None = None) -> None:
    """Records ``path`` as sound as it is now (if given, only while its (size, mtime, inode, ctime) is ``stamp``:
    the state a probe passed). Never raises: a record that can't be written only costs a probe later."""
    try:
        key, identity = _identity(path)
        if stamp is not None and (identity["size"], identity["mtime_ns"], _inode(key), identity["ctime_ns"]) != stamp:
            return
        root = directory()
        os.makedirs(root, mode=0o700, exist_ok=True)
        tmp = os.path.join(root, f".{key}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(identity, f)
        os.replace(tmp, os.path.join(root, key))  # no fsync: a reboot voids every record anyway
        _forget_oldest(root)
    except (OSError, ValueError):
        pass


def known_sound(path: str) -> bool:
    """Whether ``path`` is the very file a record was made for, unchanged."""
    try:
        key, identity = _identity(path)
        with open(os.path.join(directory(), key), "rb") as f:
            return json.loads(f.read(4096)) == identity
    except (OSError, ValueError):
        return False


def _identity(path: str) -> tuple[str, dict[str, Any]]:
    """(record name, what must stay the same) of the file at ``path``; OSError if it can't be read."""
    from rllib_recorder.format.liveness import boot_id

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO named like a worker file must not block this process
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        edges = hashlib.sha256(os.pread(fd, _EDGE_BYTES, 0))
        edges.update(os.pread(fd, _EDGE_BYTES, max(0, st.st_size - _EDGE_BYTES)))
    finally:
        os.close(fd)
    return f"{st.st_dev}-{st.st_ino}", {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                                        "boot": boot_id(), "edges_sha256": edges.hexdigest()}


def _inode(key: str) -> int:
    return int(key.rsplit("-", 1)[1])


def _forget_oldest(root: str) -> None:
    names = [n for n in os.listdir(root) if not n.startswith(".")]
    if len(names) <= MAX_RECORDS:
        return
    aged = []
    for name in names:
        try:
            aged.append((os.path.getmtime(os.path.join(root, name)), name))
        except OSError:
            pass
    for _, name in sorted(aged)[: len(aged) // 2]:
        try:
            os.remove(os.path.join(root, name))
        except OSError:
            pass
