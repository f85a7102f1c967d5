"""Hostile run directories, many times: no command may run code from a recording, write outside its output, or
answer with anything but its result or one ``error:`` line.

CI runs a few hundred derandomized examples (tests/test_hostile.py); this script runs as many as asked on any
recorded run. Each example copies RUN_DIR, changes its manifest (or its experiment's index) in one hostile way
(tests/hostile.py: wrong types, nulls, huge and negative numbers, non-UTF-8, documents that are lists, names with
'..' or absolute paths, envs naming subprocess/os/a sentinel module, env_configs spelling shell commands), runs
one real command in-process and checks it. Prints the counts per command and every violation.

    python tests/stress/fuzz_hostile.py recordings/<run> --examples 3000 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import hostile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    per_command: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    violations = 0
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "root")
        os.makedirs(root)
        sentinel = hostile.install(tmp)
        for i in range(args.examples):
            outcome = hostile.run_one(rng, args.run_dir, root, sentinel, i)
            counts = per_command[outcome.command]
            counts["examples"] += 1
            counts["exit 2 (one-line error)" if outcome.exit_code == 2 else f"exit {outcome.exit_code}"] += 1
            if outcome.violations:
                violations += 1
                counts["violations"] += 1
                print(f"VIOLATION example {i} ({outcome.how}), {outcome.command}: {outcome.violations}", flush=True)
    total = collections.Counter()
    for name, counts in sorted(per_command.items()):
        total.update(counts)
        print(f"  {name:16s} {dict(counts)}")
    print(f"{args.examples} hostile copies of {args.run_dir}, seed {args.seed}, {time.time() - started:.0f} s: "
          f"{dict(total)}; violations (tracebacks, code run, processes started, writes outside): {violations}")


if __name__ == "__main__":
    main()
