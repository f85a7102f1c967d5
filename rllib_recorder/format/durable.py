"""Making names durable: a file's fsync keeps its bytes, not its name; the directory entry (a new file, a rename)
reaches the disk only when its directory is fsynced too."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """fsyncs the directory ``path`` (a file system that cannot, e.g. some network ones, is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # EINVAL: this file system does not sync directories
        pass
    finally:
        os.close(fd)


def replace(src: str, dst: str) -> None:
    """``os.replace(src, dst)``, then the directory fsynced: after a power loss ``dst`` is the new file."""
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))
