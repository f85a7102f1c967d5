"""What recording costs an env runner in instructions: a count that this machine's changing CPU speed can't move.

Throughput ratios here swing by 2-3% from one 20 s block to the next however they are paired (docs/BENCHMARKS.md),
more than the cost they are meant to show. Instructions executed do not depend on the CPU's speed: this script
runs itself under valgrind's callgrind with two algorithms in one process, each with its env runner in the process
(num_env_runners=0) and the same seed, so both play the same episodes: "none" (no recording) and "recorder"
(default settings; its writer actor runs natively in its own process). After a warm-up with instrumentation off,
it counts the instructions of --samples sample() + get_metrics() calls of each (in the order none, recorder,
recorder, none, so that each half plays the same episodes for both) and reports them per env step, for the main
thread: where sample() runs the env, torch, the connectors and the recorder's callbacks (conversion, start states,
pickling each chunk and submitting its actor call).

What it does not see: time the CPU spends waiting for memory (cache misses); the process's other threads (Ray's
core worker, which moves each call's bytes: their work is mostly driven by timers that fire per wall-clock second,
and a run under valgrind lasts ~50x longer); and wall-clock coalescing. Under valgrind a sample() call takes ~20 s,
so the default ``coalesce_s=2`` would send every sample on its own: here the recorder sends by rows instead, as
often as the 2 s hold sends natively on this machine (``SEND_EVERY``). Needs valgrind (Debian's package) and gcc,
for a 4-line helper that issues callgrind's requests. A CartPole row takes ~12 minutes, a Breakout row longer.

    python benchmarks/count_instructions.py --settings "" record_start_states=False --write
    python benchmarks/count_instructions.py --env breakout --modes complete_episodes --keep /tmp/cg
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

HELPER_C = r"""
#include <valgrind/callgrind.h>
void rr_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void rr_zero(void) { CALLGRIND_ZERO_STATS; }
void rr_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
ORDER = ("none", "recorder", "recorder", "none")


def helper(work: str) -> str:
    """Compiles the callgrind-request helper into ``work``; its path."""
    source, library = os.path.join(work, "rr_callgrind.c"), os.path.join(work, "rr_callgrind.so")
    with open(source, "w") as f:
        f.write(HELPER_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def inner(args: argparse.Namespace) -> None:
    """Under callgrind: build both algorithms, warm up, count each block (one dump per block)."""
    import ctypes

    from common import build_local as build
    from common import recorder_settings, start_ray

    requests = ctypes.CDLL(args.helper)
    start_ray()
    settings = recorder_settings(f"recorder:{args.settings[0]}")
    algos = {v: build(args.env[0], args.mode, v == "recorder", os.path.join(args.work, v), **settings)
             for v in ("none", "recorder")}
    runners = {v: a.env_runner_group.local_env_runner for v, a in algos.items()}
    for v, runner in runners.items():  # first forward passes, the recorder's writer, file and first chunks
        for _ in range(args.warmup):
            runner.sample()
            runner.get_metrics()
    requests.rr_start()
    for i, v in enumerate(ORDER):
        requests.rr_zero()
        n = 0
        for _ in range(args.samples):
            n += sum(len(e) for e in runners[v].sample())
            runners[v].get_metrics()
        requests.rr_dump(f"block {i} {v} steps {n}".encode())  # the main thread's counts since rr_zero
    for algo in algos.values():
        algo.stop()


def totals(out_dir: str) -> dict[int, dict[str, Any]]:
    """block -> {variant, steps, instructions}: the main thread's count in each block's dump."""
    blocks: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(out_dir, "cg.out.*")):
        with open(path, errors="replace") as f:
            head = f.read(1 << 16)
        label = re.search(r"^desc: Trigger: Client Request: block (\d+) (\w+) steps (\d+)", head, re.M)
        if label is None:  # the dump at exit, and the other threads'
            continue
        with open(path, errors="replace") as f:
            summary = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
        blocks[int(label.group(1))] = {"variant": label.group(2), "steps": int(label.group(3)),
                                       "instructions": int(summary.group(1))}
    return blocks


# Rows the default 2 s hold sends at once natively here (about 800 CartPole and 150 Breakout steps per second per
# runner); under valgrind the recorder sends by these row counts instead (coalesce_rows, no time limit).
SEND_EVERY = {"cartpole": 1600, "breakout": 300}


def count(env: str, mode: str, settings: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Runs the blocks of one row under callgrind: block -> {variant, steps, instructions}."""
    keep = os.path.join(args.keep, f"{env}-{mode}-{settings or 'defaults'}") if args.keep else None
    work = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="count_instructions_")
    os.makedirs(work, exist_ok=True)
    settings = ",".join(filter(None, [f"coalesce_rows={SEND_EVERY[env]},coalesce_s=1000000.0", settings]))
    command = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
        f"--callgrind-out-file={work}/cg.out.%p", sys.executable, os.path.abspath(__file__), "--inner",
        "--env", env, "--mode", mode, "--samples", str(args.samples), "--warmup", str(args.warmup),
        "--settings", settings, "--helper", helper(work), "--work", work,
    ]
    # one hash seed: the same dict and set orders, so the same instructions, in every run
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
    blocks = totals(work)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    if len(blocks) != len(ORDER):
        raise SystemExit(f"{env} {mode}: found {len(blocks)} of {len(ORDER)} blocks' counts; "
                         "run the valgrind command by hand to see why")
    return blocks


def table(rows: list[tuple[str, str, str, dict[int, dict[str, Any]]]]) -> str:
    lines = ["| env | batch mode | recorder settings | env steps per block | none: instructions per step "
             "| recorder: instructions per step | recorder / none | first half, second half |",
             "|---|---|---|---|---|---|---|---|"]
    for env, mode, settings, blocks in rows:
        per = {v: sum(b["instructions"] for b in blocks.values() if b["variant"] == v)
               / sum(b["steps"] for b in blocks.values() if b["variant"] == v) for v in ("none", "recorder")}
        halves = [(blocks[r]["instructions"] / blocks[r]["steps"]) / (blocks[n]["instructions"] / blocks[n]["steps"])
                  for n, r in ((0, 1), (3, 2))]  # each half: the same episodes for both
        steps = ", ".join(str(blocks[i]["steps"]) for i in sorted(blocks))
        lines.append(f"| {env} | {mode} | {settings or 'defaults'} | {steps} | {per['none']:,.0f} "
                     f"| {per['recorder']:,.0f} | **{per['recorder'] / per['none']:.4f}** "
                     f"| {halves[0]:.4f}, {halves[1]:.4f} |")
    return "\n".join(lines)


NOTE = """

Instructions of the env runner's main thread (callgrind, `--separate-threads=yes`), per env step, in blocks of
{samples} `sample()` + `get_metrics()` calls: none, recorder, recorder, none, after {warmup} uncounted calls of each.
Both algorithms live in one process with the same seed, so in each half (blocks 0 and 1, blocks 3 and 2) both play
the same episodes. Under valgrind the recorder sends by rows (`coalesce_rows` = {send_every}, no time limit): as
often as the default 2 s hold sends natively here. Not counted: the process's other threads (Ray's core worker
moving each call's bytes), cache misses, the writer actor (its own process).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="+", default=["cartpole"], choices=sorted(SEND_EVERY))
    parser.add_argument("--modes", nargs="+", default=["truncate_episodes"],
                        choices=["truncate_episodes", "complete_episodes"])
    parser.add_argument("--settings", nargs="+", default=[""], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="recorder settings besides the defaults, one row each ('' for the defaults)")
    parser.add_argument("--samples", type=int, default=4, help="sample() calls counted per block")
    parser.add_argument("--warmup", type=int, default=3, help="sample() calls per algorithm before counting")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="rows counted at once (counts do not depend on what else runs)")
    parser.add_argument("--keep", metavar="DIR", help="keep callgrind's dumps under DIR (for callgrind_annotate)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/BENCHMARKS.md")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--helper", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"count_instructions: {' and '.join(missing)} not found; install them "
                         "(Debian: apt-get install valgrind gcc)")
    specs = [(env, mode, settings) for env in args.env for mode in args.modes for settings in args.settings]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        counted = list(pool.map(lambda spec: count(*spec, args), specs))
    rows = [(*spec, blocks) for spec, blocks in zip(specs, counted)]
    text = table(rows)
    print(text)
    if args.write:
        note = NOTE.format(samples=args.samples, warmup=args.warmup,
                           send_every=", ".join(f"{k} {v}" for k, v in SEND_EVERY.items()))
        common.write_section("Instructions per env step (benchmarks/count_instructions.py)", text + note)


if __name__ == "__main__":
    main()
