"""Random damage to a real recorded file, many times: every command must answer in one line, never hang or crash.

CI runs a fixed set of 40 mutations (tests/test_reliability.py); this script explores freely. For each example it
copies RUN_DIR, damages its first worker file (flipped bits, zeroed ranges, truncation or random bytes), runs
``info``, ``verify``, ``recover``, ``verify`` in-process and checks: exit code 0/1/2, no traceback, exit 2 only with
one ``error: ...`` line. Prints the counts, and every violation with what reproduces it. With ``--known`` the copy
is first remembered as sound (as its writer does when it closes a file, format/sound_files.py), then damaged in
place with its mtime put back, as a copy tool keeps it: no damaged file may still be known sound.

    python tests/stress/fuzz_damaged.py recordings/<run> --examples 2000 --seed 11
    python tests/stress/fuzz_damaged.py recordings/<run> --examples 200 --seed 12 --known
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import helpers  # noqa: E402 - the damaged-file test's mutations


def damage(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["flip", "truncate", "zero", "random"])
    at, size = rng.randrange(len(data)), rng.randint(1, 64)
    return helpers.damage(data, kind, at, size, rng), f"{kind} at={at} size={size}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-timeout", type=float, default=5.0, help="RLLIB_RECORDER_PROBE_TIMEOUT_S")
    parser.add_argument("--known", action="store_true", help="damage a file known sound, in place, mtime kept")
    args = parser.parse_args()
    os.environ["RLLIB_RECORDER_PROBE_TIMEOUT_S"] = str(args.probe_timeout)
    from click.testing import CliRunner

    from rllib_recorder.cli import main as cli
    from rllib_recorder.format import sound_files

    victim = sorted(glob.glob(os.path.join(args.run_dir, "*.h5")))[0]
    original = open(victim, "rb").read()
    rng = random.Random(args.seed)
    counts = {"answered_0_or_1": 0, "one_line_error": 0, "of_which_probe_reported": 0, "violations": 0}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.examples):
            run = os.path.join(tmp, f"example-{i}")
            shutil.copytree(args.run_dir, run)
            data, how = damage(original, rng)
            path = os.path.join(run, os.path.basename(victim))
            if args.known:
                sound_files.remember(path)
                before = os.stat(path)
            with open(path, "r+b") as f:  # in place: the same inode
                f.write(data)
                f.truncate(len(data))
            if args.known:
                os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
                if data != original and sound_files.known_sound(path):
                    counts["violations"] += 1
                    print(f"VIOLATION example {i} ({how}): damaged, still known sound", flush=True)
            for command in (["info", run], ["verify", run], ["recover", run], ["verify", run]):
                result = CliRunner().invoke(cli, command)
                lines = result.output.strip().splitlines()
                fine = (result.exit_code in (0, 1, 2) and "Traceback" not in result.output
                        and (result.exception is None or isinstance(result.exception, SystemExit)))
                if result.exit_code == 2:
                    fine = fine and len(lines) == 1 and lines[0].startswith("error: ")
                    counts["one_line_error"] += 1
                    counts["of_which_probe_reported"] += "made no progress" in result.output or "crashed" in result.output
                else:
                    counts["answered_0_or_1"] += 1
                if not fine:
                    counts["violations"] += 1
                    print(f"VIOLATION example {i} ({how}), {command[0]}: exit {result.exit_code}, "
                          f"{result.output[-300:]!r} {result.exception!r}", flush=True)
            shutil.rmtree(run)
    print(f"{args.examples} damaged copies of {victim}, seed {args.seed}, {time.time() - started:.0f} s: {counts}")


if __name__ == "__main__":
    main()
