"""The recorder's CPU inside live env runners, per function, without a profiler; and its writers' CPU.

Runs as ``bench_overhead.py`` samples (remote env runners, all at once, sample() then get_metrics()), with the
recorder's main functions wrapped, inside each env runner, by a timer of the calling thread's CPU time
(``time.thread_time``: two clock reads per call, no tracing of everything else as cProfile does). Prints, per
function, CPU per call, per sample and as a share of the env runners' main-thread CPU; then, per row, the writer
actors' CPU as a share of all CPU and what the sampler loses by both, against the budget the issue's targets leave
(2% for truncate_episodes, 5% for complete_episodes). Why not a micro-benchmark: the same conversion code measured on saved episodes in a
loop took 1/5 to 1/7 of its time here, where the runner's Python competes for the CPU's caches with torch,
the env and the other runners.

    python scripts/recorder_cpu.py --write          # all 10 rows of bench_overhead.py, into docs/BENCHMARKS.md
    python scripts/recorder_cpu.py --env cartpole --runners 4 --modes complete_episodes --seconds 15 --reps 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402
from bench_overhead import add_row_args, build, row_specs, writers_cpu, writers_cpu_since  # noqa: E402

# (module, class or None, function): the callbacks, then what they call. Functions imported by name into another
# module are wrapped where they are called from.
TARGETS = (
    ("rllib_recorder.callback", "RecorderCallback", "on_sample_end"),
    ("rllib_recorder.callback", "RecorderCallback", "on_episode_start"),
    ("rllib_recorder.record.runner", None, "episodes_to_chunk"),
    ("rllib_recorder.record.convert", None, "_start_state_columns"),
    ("rllib_recorder.record.convert", None, "encode_stream"),
    ("rllib_recorder.record.outbox", "Outbox", "add"),
    ("rllib_recorder.record.outbox", None, "encode_record"),
    ("rllib_recorder.format.spool", "SegmentWriter", "write"),
    ("rllib_recorder.record.envstate", "_Plan", "capture"),
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


# The budgets the targets leave the recorder: 1 - the ratio to no recording.
BUDGET = {"truncate_episodes": 0.02, "complete_episodes": 0.05}


def measure_row(env: str, runners: int, mode: str, seconds: float, reps: int, settings: str = "") -> dict[str, Any]:
    """One row: every rep's callbacks share of the runners' main-thread CPU and writers' share of all CPU, plus
    the per-function totals over all reps."""
    import ray

    ray.init(address="local", num_cpus=2 * runners + 1, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as out:
            algo = build(env, runners, mode, f"recorder:{settings}" if settings else "recorder", out)
            group = algo.env_runner_group
            group.foreach_env_runner(install_timers, local_env_runner=False)
            group.foreach_env_runner(lambda r: timed_sampling(r, 3.0), local_env_runner=False)  # warm up
            steps = samples = 0
            cpu_total = 0.0
            totals: dict[str, list[float]] = {}
            callbacks_share, writer_share = [], []
            for _ in range(reps):
                wcpu = writers_cpu(group)
                cpu = callbacks = 0.0
                for part in group.foreach_env_runner(lambda r: timed_sampling(r, seconds), local_env_runner=False):
                    steps, samples, cpu = steps + part["steps"], samples + part["samples"], cpu + part["cpu"]
                    for key, (spent, calls) in part["times"].items():
                        total = totals.setdefault(key, [0.0, 0])
                        total[0] += spent
                        total[1] += calls
                        if key in CALLBACKS:
                            callbacks += spent
                writer_s = writers_cpu_since(group, wcpu)
                cpu_total += cpu
                callbacks_share.append(callbacks / cpu)
                writer_share.append(writer_s / (cpu + writer_s))
            algo.stop()
    finally:
        ray.shutdown()
    return {"env": env, "runners": runners, "mode": mode, "steps": steps, "samples": samples, "cpu": cpu_total,
            "totals": totals, "callbacks": callbacks_share, "writer": writer_share}


CALLBACKS = ("RecorderCallback.on_sample_end", "RecorderCallback.on_episode_start")


def functions_table(row: dict[str, Any]) -> str:
    lines = [f"{row['env']}, {row['runners']} env runners, {row['mode']}: {row['steps']} steps in "
             f"{row['samples']} samples, {1e6 * row['cpu'] / row['steps']:.0f} us of runner main-thread CPU per step",
             "", "| function | calls | us per call | us per sample | % of runner CPU |", "|---|---|---|---|---|"]
    for key, (seconds, calls) in sorted(row["totals"].items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {key} | {calls} | {1e6 * seconds / max(1, calls):.1f} | "
                     f"{1e6 * seconds / row['samples']:.1f} | {100 * seconds / row['cpu']:.2f} |")
    return "\n".join(lines)


def sampler_cost(row: dict[str, Any], cpus: int) -> list[float]:
    """Per rep, what the sampler loses: the callbacks, plus the writers when the runners leave no core idle."""
    writer = row["writer"] if row["runners"] >= cpus else [0.0] * len(row["writer"])
    return [c + w for c, w in zip(row["callbacks"], writer)]


def _percent(shares: list[float]) -> str:
    return benchdoc.cell([100 * v for v in shares], "{:.2f}%")


def summary_table(rows: list[dict[str, Any]], cpus: int) -> str:
    lines = ["| env | runners | batch mode | runner CPU per step | callbacks | writer | cost to the sampler | budget |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = " (own core)" if r["runners"] < cpus else ""
        cost = sampler_cost(r, cpus)
        verdict = "within" if statistics.median(cost) <= BUDGET[r["mode"]] else "over"
        lines.append(f"| {r['env']} | {r['runners']} | {r['mode']} | {1e6 * r['cpu'] / r['steps']:.0f} us "
                     f"| {_percent(r['callbacks'])} | {_percent(r['writer'])}{own} | {_percent(cost)} "
                     f"| {100 * BUDGET[r['mode']]:.0f}%: {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_args(parser)
    parser.add_argument("--seconds", type=float, default=None, help="per rep (default: cartpole 15, breakout 25)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--settings", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                        help="recorder settings other than the defaults (e.g. coalesce_s=3)")
    parser.add_argument("--write", action="store_true", help="also write the tables into docs/BENCHMARKS.md")
    args = parser.parse_args()

    cpus = os.cpu_count() or 1
    rows = []
    for env, runners, mode in row_specs(args):
        seconds = args.seconds or (15.0 if env == "cartpole" else 25.0)
        rows.append(measure_row(env, runners, mode, seconds, args.reps, args.settings))
        print(functions_table(rows[-1]), "\n", flush=True)
    summary = summary_table(rows, cpus)
    print(summary)
    if args.write:
        benchdoc.write_section("Recorder CPU in live env runners (scripts/recorder_cpu.py)", summary + f"""

Each cell: median (min) over {args.reps} repetitions. `callbacks`: thread CPU of the recorder's callbacks
(`on_sample_end`, `on_episode_start`) as a share of the env runners' main-thread CPU. `writer`: the writer
actors' CPU as a share of the runners' main-thread CPU plus theirs; it includes the floor of any Ray actor
(~0.56-0.61% of this machine, `scripts/idle_actor_cpu.py`). `cost to the sampler`: the callbacks, plus the
writer when the runners leave no core idle (with fewer runners than the machine's {cpus} CPUs the writer runs
on an idle one). Indirect costs, such as cache misses the recorder causes in RLlib's code, are not in it.
`budget`: what the issue's targets leave the recorder (ratio 0.98 for truncate_episodes, 0.95 for
complete_episodes); the verdict compares the median. Where the callbacks' time goes, row by row:

""" + "\n\n".join(functions_table(r) for r in rows))


if __name__ == "__main__":
    main()
