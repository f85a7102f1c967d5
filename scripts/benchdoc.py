"""Shared by the benchmarks: machine facts, min/median, and writing a section of docs/BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
import shlex
import statistics
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "BENCHMARKS.md")
HEADER = """# Benchmarks

Every table below was written by the script named in its section, with the command, date, machine and versions
that made it. Throughputs are compared as ratios measured in the same run (variants interleaved, the machine is
noisy); each cell gives the median and, in brackets, the min over the repetitions. Re-run a script to refresh its
section; the others stay as they are.
"""


def machine() -> str:
    """One line: CPU count and model, memory, Python, Ray, h5py/HDF5, numpy versions."""
    import h5py
    import numpy as np
    import ray

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"ray {ray.__version__}, h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}), numpy {np.__version__}")


def min_median(values: Sequence[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def cell(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    low, mid = min_median(values)
    return f"{fmt.format(mid)} ({fmt.format(low)})"


def write_section(name: str, body: str) -> None:
    """Replaces (or appends) the section ``name`` of docs/BENCHMARKS.md with ``body``."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    section = (f"<!-- {name}:start -->\n## {name}\n\n`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
               f"\n\nMachine: {machine()}\n\n{body.strip()}\n<!-- {name}:end -->\n")
    text = open(DOC).read() if os.path.exists(DOC) else HEADER
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote section {name!r} of {DOC}")
