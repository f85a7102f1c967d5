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
so the default ``coalesce_s=2`` would send every sample on its own: by default the recorder here sends by rows
(``--settings`` sets them: ``coalesce_rows=1600,coalesce_s=1000000.0`` sends as often as the 2 s hold does at this
machine's ~800 CartPole steps per second per runner). Needs valgrind (Debian's package) and gcc, for a 4-line
helper that issues callgrind's requests.

    python scripts/count_instructions.py --env cartpole --mode truncate_episodes --samples 8
"""

from __future__ import annotations

import argparse
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

    from bench_overhead import recorder_settings
    from profile_sampler import build, start_ray

    requests = ctypes.CDLL(args.helper)
    start_ray()
    settings = recorder_settings(f"recorder:{args.settings}")
    algos = {v: build(args.env, args.mode, v == "recorder", os.path.join(args.work, v), **settings)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="cartpole", choices=["cartpole", "breakout"])
    parser.add_argument("--mode", default="truncate_episodes", choices=["truncate_episodes", "complete_episodes"])
    parser.add_argument("--samples", type=int, default=4, help="sample() calls counted per block")
    parser.add_argument("--warmup", type=int, default=3, help="sample() calls per algorithm before counting")
    parser.add_argument("--settings", default="coalesce_s=1000000.0", metavar="KEY=VALUE[,KEY=VALUE]",
                        help="the recorder's settings (default: coalesce_s=1000000.0, send by rows; see above)")
    parser.add_argument("--keep", metavar="DIR", help="keep callgrind's dumps in DIR (for callgrind_annotate)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--helper", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="count_instructions_")
    os.makedirs(work, exist_ok=True)
    command = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
        f"--callgrind-out-file={work}/cg.out.%p", sys.executable, os.path.abspath(__file__), "--inner",
        "--env", args.env, "--mode", args.mode, "--samples", str(args.samples), "--warmup", str(args.warmup),
        "--settings", args.settings, "--helper", helper(work), "--work", work,
    ]
    # one hash seed: the same dict and set orders, so the same instructions, in every run
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
    blocks = totals(work)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if len(blocks) != len(ORDER):
        raise SystemExit(f"found {len(blocks)} of {len(ORDER)} blocks' counts; run valgrind by hand to see why")
    print(f"{args.env}, {args.mode}, recorder settings {args.settings or 'defaults'}: {args.samples} sample() "
          "calls per block; main thread's instructions per env step")
    print("| block | variant | env steps | instructions per step |")
    print("|---|---|---|---|")
    for i, b in sorted(blocks.items()):
        print(f"| {i} | {b['variant']} | {b['steps']} | {b['instructions'] / b['steps']:,.0f} |")
    per = {v: sum(b["instructions"] for b in blocks.values() if b["variant"] == v)
           / sum(b["steps"] for b in blocks.values() if b["variant"] == v) for v in ("none", "recorder")}
    print(f"none {per['none']:,.0f}, recorder {per['recorder']:,.0f} instructions per step: "
          f"recorder / none = {per['recorder'] / per['none']:.4f}")

if __name__ == "__main__":
    main()
