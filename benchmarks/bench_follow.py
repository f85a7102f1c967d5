"""Follow latency: how long after a chunk's first sample (``sampled_at_s``) a follower in another process sees it.

The user's training script (tests/user_program.py: PPO on the counting env, 2 env runners, default recorder
settings, so ``coalesce_s`` = 2 s) records in a child process; this process follows the run with
``run.follow(poll_s=...)`` and notes, for every chunk it sees while the run records, now - sampled_at_s.
Target: p99 <= coalesce_s + 1 s.

    python benchmarks/bench_follow.py --seconds 60 --write
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the script records")
    parser.add_argument("--poll", type=float, default=0.5, help="follow()'s poll_s")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from rllib_recorder import open_run
    from rllib_recorder.read.follow import follow_latency_s

    out = tempfile.mkdtemp(prefix="bench_follow_")
    proc = subprocess.Popen([sys.executable, "-m", "tests.user_program", "loop", out], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    latencies, chunks = [], 0
    try:
        run_dir = json.loads(proc.stdout.readline())["run_dir"]
        deadline = time.time() + args.seconds
        with open_run(run_dir) as run:
            for batch in run.follow(poll_s=args.poll):
                chunks += 1
                if time.time() < deadline:
                    latencies.append(follow_latency_s(batch))
                elif proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # the run ends; follow reads what remains and stops
    finally:
        if proc.poll() is None:
            proc.kill()
    p50, p99, top = np.percentile(latencies, 50), np.percentile(latencies, 99), max(latencies)
    table = ("| chunks followed while recording | latency p50 | p99 | max | target (coalesce_s + 1 s) |\n"
             "|---|---|---|---|---|\n"
             f"| {len(latencies)} (of {chunks}) | {p50:.2f} s | {p99:.2f} s | {top:.2f} s | 3.00 s: "
             f"{'met' if p99 <= 3.0 else 'missed'} |\n\n"
             f"`follow(poll_s={args.poll})` over {args.seconds:.0f} s of the user's script recording (2 env runners, "
             "default settings: a runner's samples wait up to coalesce_s = 2 s in the spool to be committed "
             "together).\n")
    print(table)
    if args.write:
        common.write_section("Follow latency (benchmarks/bench_follow.py)", table)


if __name__ == "__main__":
    main()
