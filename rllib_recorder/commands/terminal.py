"""What the CLI shows on a terminal and leaves out in a pipe or a log: progress bars."""

from __future__ import annotations

import glob
import os
import sys
from typing import Any


def is_terminal() -> bool:
    """Whether stderr is a terminal a person watches (not a pipe, a file, or a dumb terminal)."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def progress_bar() -> Any:
    """A progress bar on stderr while it is a terminal; nothing at all in a pipe or a log."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=not is_terminal())


def count_files(run_dir: str) -> int | None:
    """Worker files in ``run_dir`` (a bar's total; None when there are none)."""
    return len(glob.glob(os.path.join(glob.escape(run_dir), "*.h5"))) or None
