"""The CLI's one exception boundary: a RecorderError or a damaged file becomes one line 'error: ...', exit 2."""

from __future__ import annotations

import sys
from typing import Any

import click

from rllib_recorder.config import is_uri
from rllib_recorder.errors import RecorderError


def guard(fn: Any) -> Any:
    """``fn()``; a RecorderError or h5py's error on a damaged file ends the process with one ``error:`` line."""
    try:
        return fn()
    except RecorderError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (OSError, KeyError, ValueError) as e:  # h5py's errors on a damaged or truncated file
        click.echo(f"error: cannot read the run ({type(e).__name__}: {e}); "
                   "check it with 'rllib-recorder verify' or repair it with 'rllib-recorder recover'", err=True)
        sys.exit(2)


class Guarded:
    """Iterates lazily read items, each read inside ``guard`` (a damaged file gives a one-line error)."""

    def __init__(self, items: Any) -> None:
        self.items = iter(items)

    def __iter__(self) -> "Guarded":
        return self

    def __next__(self) -> Any:
        return guard(lambda: next(self.items))


def local_run(path: str) -> str:
    """A run at a durable target (``s3://...``): its local copy (segments fetched once, checked); else ``path``."""
    if not is_uri(path):
        return path
    from rllib_recorder.read.remote import local_copy

    return guard(lambda: local_copy(path))
