"""How steady this machine's CPU speed is: a fixed pure-Python work unit, counted per time window on every core.

One process per CPU runs the same loop; each counts the units it finishes in each window and the CPU time it got.
With a full CPU in every window (CPU seconds = window), a change in units per window is a change in the speed of
the (virtual) CPU itself, which no benchmark on this machine can tell from the code it times. The spread across
windows, and across cores in the same window, is the noise floor of any timing here.

    python scripts/cpu_speed.py --seconds 30 --window 1 [--write]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402


def _unit() -> int:
    s = 0
    for i in range(20000):
        s += i * i
    return s


def _count(seconds: float, window: float, start: float, queue: "multiprocessing.Queue") -> None:
    while time.time() < start:  # every process starts its windows at the same moment
        time.sleep(0.001)
    out = []
    end = start + seconds
    while time.time() < end:
        t, c, n = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - t < window:
            _unit()
            n += 1
        out.append((n / (time.perf_counter() - t), (time.process_time() - c) / (time.perf_counter() - t)))
    queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--procs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument("--write", action="store_true", help="write the table into docs/BENCHMARKS.md")
    args = parser.parse_args()
    queue: multiprocessing.Queue = multiprocessing.Queue()
    start = time.time() + 0.5
    procs = [multiprocessing.Process(target=_count, args=(args.seconds, args.window, start, queue))
             for _ in range(args.procs)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    lines = ["| process | units/s per window: min | median | max | max / min | its CPU share, min |",
             "|---|---|---|---|---|---|"]
    for i, out in enumerate(results):
        rates = [r for r, _ in out]
        lines.append(f"| {i} | {min(rates):.0f} | {statistics.median(rates):.0f} | {max(rates):.0f} "
                     f"| {max(rates) / min(rates):.2f} | {min(c for _, c in out):.2f} |")
        print(f"process {i}, units/s per window: " + " ".join(f"{r:.0f}" for r in rates))
    pairs = [a[0] / b[0] for a, b in zip(results[0], results[1])] if len(results) > 1 else []
    text = "\n".join(lines) + (
        f"\n\nSame window, process 0 over process 1: min {min(pairs):.2f}, median {statistics.median(pairs):.2f}, "
        f"max {max(pairs):.2f}." if pairs else "")
    print(text)
    if args.write:
        benchdoc.write_section("CPU speed of this machine (scripts/cpu_speed.py)", text + f"""

One process per CPU runs the same pure-Python work unit for {args.seconds:g} s and counts the units it finishes in
each {args.window:g} s window; each had a whole CPU in every window (its CPU share), so a change in units per window is
a change in the CPU's own speed (a virtual machine's CPUs share their host). No timing on this machine is steadier
than this: it is why the sequential sampling benchmark cannot resolve 2%, and why `bench_paired.py` times the
variants in the same seconds and moves their env runners between the CPUs.
""")


if __name__ == "__main__":
    main()
