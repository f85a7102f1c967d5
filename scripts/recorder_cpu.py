"""The recorder's CPU inside live env runners, per function, without a profiler; and its writers' CPU.

Runs as ``bench_overhead.py`` samples (remote env runners, all at once, sample() then get_metrics()), with the
recorder's main functions wrapped, inside each env runner, by a timer of the calling thread's CPU time
(``time.thread_time``: two clock reads per call, no tracing of everything else as cProfile does). Prints, per
function, CPU per call, per sample and as a share of the env runners' main-thread CPU; then the writer actors'
CPU as a share of all CPU. Why not a micro-benchmark: the same conversion code measured on saved episodes in a
loop took 1/5 to 1/7 of its time here, where the runner's Python competes for the CPU's caches with torch,
the env and the other runners.

    python scripts/recorder_cpu.py --env cartpole --runners 4 --mode complete_episodes --seconds 15
    python scripts/recorder_cpu.py --env breakout --runners 2 --mode truncate_episodes --write
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402
from bench_overhead import build, writers_cpu  # noqa: E402

# (module, class or None, function): the callbacks, then what they call. Functions imported by name into another
# module are wrapped where they are called from.
TARGETS = (
    ("rllib_recorder.callback", "RecorderCallback", "on_sample_end"),
    ("rllib_recorder.callback", "RecorderCallback", "on_episode_start"),
    ("rllib_recorder.runner", None, "episodes_to_chunk"),
    ("rllib_recorder.convert", None, "_start_state_columns"),
    ("rllib_recorder.convert", None, "encode_stream"),
    ("rllib_recorder.outbox", "Outbox", "add"),
    ("rllib_recorder.outbox", "Outbox", "flush"),
    ("rllib_recorder.outbox", None, "merge_chunks"),
    ("rllib_recorder.pool", "RayTransport", "send"),
    ("rllib_recorder.runner", None, "capture_state"),
)


def _times() -> dict[str, list[float]]:
    """{target: [CPU seconds, calls]} of this env runner process, kept on the package (functions of this script
    reach the runner pickled by value, with copies of any global of their own)."""
    import rllib_recorder

    return rllib_recorder.__dict__.setdefault("_cpu_timers", {})


def install_timers(runner: Any) -> bool:
    """Runs inside one env runner: wraps every target with a thread-CPU timer (once per process)."""
    import importlib

    TIMES = _times()
    if TIMES:
        return False
    for module, owner_name, name in TARGETS:
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        original = getattr(owner, name)
        key = f"{owner_name or module.rsplit('.', 1)[-1]}.{name}"
        TIMES[key] = [0.0, 0]

        def timed(*args: Any, _original: Any = original, _times: list = TIMES[key], **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                _times[0] += time.thread_time() - start
                _times[1] += 1

        setattr(owner, name, timed)
    return True


def timed_sampling(runner: Any, seconds: float) -> dict[str, Any]:
    """Runs inside one env runner: samples as RLlib's training loop for ``seconds``; CPU of each target."""
    TIMES = _times()
    before = {k: list(v) for k, v in TIMES.items()}
    steps = samples = 0
    start, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        episodes = runner.sample()
        steps += sum(len(e) for e in episodes)
        samples += 1
        runner.get_metrics()
    return {"steps": steps, "samples": samples, "cpu": time.thread_time() - cpu,
            "times": {k: (v[0] - before[k][0], v[1] - before[k][1]) for k, v in TIMES.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="cartpole", choices=["cartpole", "breakout"])
    parser.add_argument("--runners", type=int, default=4)
    parser.add_argument("--mode", default="complete_episodes", choices=["truncate_episodes", "complete_episodes"])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="also write the table into docs/BENCHMARKS.md")
    args = parser.parse_args()

    import ray

    ray.init(address="local", num_cpus=2 * args.runners + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as out:
        algo = build(args.env, args.runners, args.mode, "recorder", out)
        group = algo.env_runner_group
        group.foreach_env_runner(install_timers, local_env_runner=False)
        group.foreach_env_runner(lambda r: timed_sampling(r, 3.0), local_env_runner=False)  # warm up
        steps = samples = 0
        cpu = writer_s = 0.0
        totals: dict[str, list[float]] = {}
        for _ in range(args.reps):
            wcpu = writers_cpu(group)
            for part in group.foreach_env_runner(lambda r: timed_sampling(r, args.seconds), local_env_runner=False):
                steps, samples, cpu = steps + part["steps"], samples + part["samples"], cpu + part["cpu"]
                for key, (seconds, calls) in part["times"].items():
                    total = totals.setdefault(key, [0.0, 0])
                    total[0] += seconds
                    total[1] += calls
            writer_s += sum(v - wcpu.get(k, 0.0) for k, v in writers_cpu(group).items())
        algo.stop()
    ray.shutdown()
    lines = [f"{args.env}, {args.runners} env runners, {args.mode}: {steps} steps in {samples} samples, "
             f"{1e6 * cpu / steps:.0f} us of runner main-thread CPU per step", "",
             "| function | calls | us per call | us per sample | % of runner CPU |", "|---|---|---|---|---|"]
    for key, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {key} | {calls} | {1e6 * seconds / max(1, calls):.1f} | {1e6 * seconds / samples:.1f} "
                     f"| {100 * seconds / cpu:.2f} |")
    callbacks = sum(totals[k][0] for k in ("RecorderCallback.on_sample_end", "RecorderCallback.on_episode_start"))
    lines += ["", f"Callbacks together: {100 * callbacks / cpu:.2f}% of the env runners' main-thread CPU. "
              f"Writer actors: {100 * writer_s / (cpu + writer_s):.2f}% of runners' plus writers' CPU."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        benchdoc.write_section(f"Recorder CPU in live env runners, {args.env} {args.runners} runners {args.mode} "
                               "(scripts/recorder_cpu.py)", text)


if __name__ == "__main__":
    main()
