"""Hostile YAML experiment files, many of them: each must load and check to success or one ConfigError line.

CI runs a few hundred (tests/test_yaml_inputs.py, hypothesis); this script explores further with the same
generator (tests/hostile_yaml.py). Each example is loaded and checked in this process (``load_experiment`` and
``check_experiment``, as ``rllib-recorder train`` does before Ray starts) with the cwd an empty directory and
tripwires on os.system, subprocess.Popen and friends. A violation is any other exception, an error that is not
one line, a file written, the sentinel module (named in env:/config:, never in register:) imported, or a
tripwire called. Prints the counts, and every violation with the seed and example number that reproduce it.

    python tests/stress/fuzz_yaml.py --examples 3000 --seed 0
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import hostile_yaml  # noqa: E402 - the generator the test uses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # RLlib's warnings about accepted configs are not what this counts
    warnings.simplefilter("ignore")
    counts = {"examples": 0, "accepted": 0, "one_line_errors": 0, "violations": 0}
    with tempfile.TemporaryDirectory() as tmp, hostile_yaml.Harness(tmp) as harness:
        for i in range(args.examples):
            data = hostile_yaml.document(random.Random(f"{args.seed}-{i}"))
            outcome, detail = harness.examine(data)
            counts["examples"] += 1
            if outcome == "accepted":
                counts["accepted"] += 1
            elif outcome == "error":
                counts["one_line_errors"] += 1
            else:
                counts["violations"] += 1
                print(f"violation (--seed {args.seed}, example {i}): {detail[:500]}\n  document: {data[:300]!r}")
                harness.reset()
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    sys.exit(1 if counts["violations"] else 0)


if __name__ == "__main__":
    main()
