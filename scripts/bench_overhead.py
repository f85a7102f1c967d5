"""Env-runner sampling throughput with and without recording (learner excluded).

Variants, built side by side and timed interleaved in the same run:
  none      plain PPO config
  recorder  + RecorderCallback with default settings
  rllib     + RLlib's built-in recorder, config.offline_data(output=...) (parquet through Ray Data, written inside
            sample(); episodes in complete_episodes mode, step rows otherwise; output_max_rows_per_file 100 episodes
            or 5000 rows, because RLlib's default rewrites its whole buffer on every call)

A timed block runs ``sample()`` then ``get_metrics()`` in a loop inside every env runner at once for --seconds, as
RLlib's training loop drives a runner (``synchronous_parallel_sample``), and counts env steps; throughput = steps /
wall time of the block. Ratios are variant / none of the same repetition. (Without ``get_metrics()`` a runner keeps
every sampled episode for its metrics, its memory grows by the frames, and the page faults of that growth decided
the Breakout ratios of the first runs: 1.22-1.36 "faster" with the recorder.)

Variants timed one after another differ here by more than the 2% the targets allow: this machine's CPU speed
swings by up to 1.9x from second to second (scripts/cpu_speed.py). This table compares with RLlib's recorder and
gives bytes on disk; scripts/bench_paired.py times none and the recorder in the same seconds, on balanced CPUs,
and is the one that resolves the targets.

    python scripts/bench_overhead.py                       # everything below, writes docs/BENCHMARKS.md + PNG
    python scripts/bench_overhead.py --env cartpole --runners 1 --modes truncate_episodes --reps 2 --seconds 3 --no-write
    # diagnostics: an A/A control, recorder settings side by side
    python scripts/bench_overhead.py --env cartpole --runners 4 --modes truncate_episodes --no-write --no-rllib \
        --control --alternative coalesce_s=4 compression=none
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402

VARIANTS = ("none", "recorder", "rllib")
# --control adds a second plain config, timed like the others: its ratio to "none" is what the machine's noise
# alone gives an A/A comparison (the same config against itself), the floor any ratio here is read against.
CONTROL = "control"
FRAGMENT = {"cartpole": 500, "breakout": 200}
ENV_IDS = {"cartpole": "CartPole-v1", "breakout": "ale_py:ALE/Breakout-v5"}


def add_row_args(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the benchmark's rows (env, env runner counts, batch modes); see row_specs."""
    parser.add_argument("--env", nargs="+", default=["cartpole", "breakout"], choices=list(ENV_IDS))
    parser.add_argument("--runners", nargs="+", type=int, default=None,
                        help="env runner counts (default: cartpole 1 2 4, breakout 1 2)")
    parser.add_argument("--modes", nargs="+", default=["truncate_episodes", "complete_episodes"],
                        choices=["truncate_episodes", "complete_episodes"])


def row_specs(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(env, env runners, batch mode) of every row the flags of add_row_args chose, in the tables' order."""
    return [(env, runners, mode) for env in args.env
            for runners in args.runners or ([1, 2, 4] if env == "cartpole" else [1, 2]) for mode in args.modes]


def build(env: str, runners: int, mode: str, variant: str, out: str) -> Any:
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback

    config = (
        # One seed for every variant: the same initial policy and env seeds, so the variants play the same
        # episodes (untrained policies that differ play episodes of different lengths, and resets cost).
        PPOConfig().environment(env_name(env)).debugging(seed=0)
        .env_runners(num_env_runners=runners, batch_mode=mode, rollout_fragment_length=FRAGMENT[env])
        .training(train_batch_size=FRAGMENT[env] * runners, minibatch_size=FRAGMENT[env], num_epochs=1)
    )
    if variant in (*DIAGNOSTIC_VARIANTS, TOGGLED):
        config = config.callbacks(_diagnostic_recorders()[variant].configured(output_dir=out))
    elif variant.startswith("recorder"):
        config = config.callbacks(RecorderCallback.configured(output_dir=out, **recorder_settings(variant)))
    elif variant == "rllib":
        # RLlib records whole episodes only in complete_episodes mode; otherwise one row per step.
        episodes = mode == "complete_episodes"
        config = config.offline_data(output=out, output_write_episodes=episodes, output_write_remaining_data=True,
                                     output_max_rows_per_file=100 if episodes else 5000)
    return config.build_algo()


# Diagnostic variants (bench_paired.py --vs NAME): the recorder with part of its work left out
DIAGNOSTIC_VARIANTS = ("hollow", "recorder-discard", "recorder-hold", "recorder-nosend")
# The recorder with an off switch in each env runner (bench_paired.py --crossover), and the switch: an attribute
# of the env runner object, set between timed blocks by ``switch_recording``.
TOGGLED = "recorder-toggled"
RECORDING_OFF = "_bench_recording_off"


def switch_recording(runner: Any, on: bool) -> None:
    """Runs inside one env runner: the toggled recorder's callbacks work (``on``) or return at once."""
    setattr(runner, RECORDING_OFF, not on)


@functools.lru_cache(maxsize=None)
def _diagnostic_recorders() -> dict[str, type]:
    """The classes of DIAGNOSTIC_VARIANTS (made on first use: importing this module stays free of RLlib)."""
    from rllib_recorder import RecorderCallback
    from rllib_recorder.record.envstate import capture_state, sub_envs

    class HollowRecorder(RecorderCallback):
        """The recorder with its env-runner callbacks emptied: the writers are created and every env runner
        bound, but nothing is captured, converted or sent. What it costs is what the recorder costs besides
        its callbacks' work."""

        def on_episode_start(self, **kwargs: Any) -> None:
            pass

        def on_sample_end(self, **kwargs: Any) -> None:
            pass

    class DiscardingRecorder(RecorderCallback):
        """The recorder, but each start state is captured and thrown away at once (so none is stored): what
        a capture costs without holding it until the sample ends."""

        def on_episode_start(self, *, env: Any = None, env_index: int = 0, **kwargs: Any) -> None:
            envs = sub_envs(env) if env is not None else None
            if envs is not None:
                capture_state(envs[env_index])

    class PackingRecorder(RecorderCallback):
        """The recorder, but each start state, captured, held and packed as always, is left out of the chunk
        (an empty blob is sent): what packing costs without sending and storing the blobs."""

        def on_sample_end(self, **kwargs: Any) -> None:
            _leave_start_states_out()
            super().on_sample_end(**kwargs)

    class HoldingRecorder(RecorderCallback):
        """The recorder, but each start state, captured and held on its episode until the sample ends as always,
        is neither packed nor sent (an empty blob is sent): what holding the captures costs."""

        def on_sample_end(self, **kwargs: Any) -> None:
            _leave_start_states_out(pack=False)
            super().on_sample_end(**kwargs)

    class ToggledRecorder(RecorderCallback):
        """The recorder, but while its env runner's switch is off (``switch_recording``) its env-runner callbacks
        return at once, as the hollow recorder's: the same processes then sample as with no recording, but for
        the idle writers and one attribute read per callback (hollow measured 0.999 of none, stop 21)."""

        def on_episode_start(self, **kwargs: Any) -> None:
            if not getattr(kwargs.get("env_runner"), RECORDING_OFF, False):
                super().on_episode_start(**kwargs)

        def on_sample_end(self, **kwargs: Any) -> None:
            if not getattr(kwargs.get("env_runner"), RECORDING_OFF, False):
                super().on_sample_end(**kwargs)

    out = dict(zip(DIAGNOSTIC_VARIANTS, (HollowRecorder, DiscardingRecorder, HoldingRecorder, PackingRecorder)))
    out[TOGGLED] = ToggledRecorder
    for cls in out.values():
        cls.__module__ = __name__
    return out


def _leave_start_states_out(pack: bool = True) -> None:
    """In this env runner's process: conversion packs start states as always (or not, ``pack=False``), then puts
    empty ones in the chunk."""
    import numpy as np

    from rllib_recorder.record import convert

    if getattr(convert, "_start_states_left_out", False):
        return
    packed = convert._start_state_columns

    def empty_columns(episodes: Any) -> dict[str, Any]:
        if pack:
            packed(episodes)
        blobs = np.empty(len(episodes), dtype=object)
        for i in range(len(episodes)):
            blobs[i] = np.zeros(0, np.uint8)
        return {"start_state": blobs, "start_state_kind": np.array([""] * len(episodes), dtype=object)}

    convert._start_state_columns = empty_columns
    convert._start_states_left_out = True



def recorder_settings(variant: str) -> dict[str, Any]:
    """The recorder settings a variant name carries: "recorder" (defaults) or "recorder:key=value,key=value"."""
    import yaml

    _, _, spec = variant.partition(":")
    return {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in spec.split(",") if item)}


def env_name(env: str) -> str:
    if env == "cartpole":
        return ENV_IDS[env]
    from ray.tune.registry import register_env

    from rllib_recorder.commands.experiment import make_atari_env

    creator = functools.partial(make_atari_env, ENV_IDS[env], 84, 4)
    register_env("bench-breakout", lambda cfg: creator(dict(cfg)))
    return "bench-breakout"


def timed_sampling(runner: Any, seconds: float, start_at: float | None = None) -> dict[str, float]:
    """Runs inside one env runner: sample() and get_metrics() in a loop for ``seconds``, as RLlib's training loop.

    get_metrics() releases the episodes the runner keeps for its metrics; without it the runner's memory grows
    by every sampled frame, and the page faults of that growth, not the recorder, set the pace. ``start_at``
    (a ``time.time()``): wait until then, so that runners timed together start together.
    """
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    import gc
    import resource

    steps = calls = 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    collections = [g["collections"] for g in gc.get_stats()]
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        steps += sum(len(e) for e in runner.sample())
        runner.get_metrics()
        calls += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {"steps": steps, "calls": calls, "elapsed": elapsed, "cpu": cpu, "rss": _rss(),
            # the process's page faults and context switches in the block (diagnostics)
            "minflt": now.ru_minflt - usage.ru_minflt, "sys": now.ru_stime - usage.ru_stime,
            "nvcsw": now.ru_nvcsw - usage.ru_nvcsw, "nivcsw": now.ru_nivcsw - usage.ru_nivcsw,
            **{f"gc{i}": g["collections"] - c for i, (g, c) in enumerate(zip(gc.get_stats(), collections))}}


def writer_cpu(runner: Any) -> dict[str, float]:
    """Runs inside one env runner: {its writer actor's name: CPU seconds of the writer's process so far}."""
    import ray

    from rllib_recorder.record.runner import recorder_for

    recorder = recorder_for(runner)
    name = recorder.writer_name()
    actor = ray.get_actor(name, namespace=recorder.binding.namespace)
    return {name: ray.get(actor.stats.remote())["cpu_s"]}


def writers_cpu_since(group: Any, before: dict[str, float]) -> float:
    """CPU seconds the group's writers used since ``before`` (a ``writers_cpu`` reading); a writer that was not
    there then counts from its start."""
    return sum(v - before.get(k, 0.0) for k, v in writers_cpu(group).items())


def writers_cpu(group: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in group.foreach_env_runner(writer_cpu, local_env_runner=False):
        out.update(part)
    return out


def recorder_state(runner: Any) -> dict[str, float]:
    """Runs inside one env runner: the recorder's counters (wait time, samples, pending rows)."""
    from rllib_recorder.record.runner import recorder_for

    stats = recorder_for(runner).stats()
    return {k: stats.get(k, 0) for k in ("wait_s", "samples", "backlog_bytes")} | {"rss": _rss()}


def drain(runner: Any) -> float:
    """Runs inside one env runner: send what is held and wait for every ack; returns the time it took."""
    from rllib_recorder.record.runner import drain_env_runner

    start = time.perf_counter()
    drain_env_runner(runner, 120.0)
    return time.perf_counter() - start


def _rss() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024  # MiB


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_row(env: str, runners: int, mode: str, reps: int, seconds: float, work: str,
              build_order: tuple[str, ...] = VARIANTS, warmup: float = 3.0, settle: float = 1.0,
              control: bool = False, alternatives: tuple[str, ...] = ()) -> dict[str, Any]:
    extra = ((CONTROL,) if control else ()) + tuple(f"recorder:{a}" for a in alternatives)
    variants = tuple(v for v in VARIANTS if v in build_order) + extra
    algos = {}
    for variant in tuple(build_order) + extra:
        algos[variant] = build(env, runners, mode, variant,
                               os.path.join(work, f"{env}-{runners}-{mode}-{variant.replace(':', '-')}"))
    steps_total = defaultdict(int)
    # Warm up: env creation, first forward passes and, for the recorder, its first hand-off (held up to
    # coalesce_s = 2 s) with the file's creation; timed from the steady state on.
    for variant, algo in algos.items():
        parts = algo.env_runner_group.foreach_env_runner(lambda r: timed_sampling(r, warmup), local_env_runner=False)
        steps_total[variant] += sum(p["steps"] for p in parts)
    throughput: dict[str, list[float]] = defaultdict(list)
    ratio: dict[str, list[float]] = defaultdict(list)
    # CPU seconds per env step over the env runners' processes (+ the writers' for the recorder), none's over the
    # variant's: the throughput ratio a CPU-bound machine would see, from CPU time instead of wall time
    cpu_ratio: dict[str, list[float]] = defaultdict(list)
    # per recorder variant ("recorder" and its alternatives)
    writer_share: dict[str, list[float]] = defaultdict(list)
    writer_in_block: dict[str, list[float]] = defaultdict(list)
    waits: dict[str, list[float]] = defaultdict(list)
    drains: dict[str, list[float]] = defaultdict(list)
    rss: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        rep_tp, rep_cpu = {}, {}
        # one variant after another, each alone on the machine (bench_paired.py times them in the same seconds)
        for variant in order:
            # whatever the previous block left running (RLlib's Ray Data writes, the OS writing files back) ends
            # before this block starts, so that it is not charged to the next variant
            time.sleep(settle)
            group = algos[variant].env_runner_group
            recording = variant.startswith("recorder")
            if recording:
                before, wcpu = group.foreach_env_runner(recorder_state, local_env_runner=False), writers_cpu(group)
            parts = group.foreach_env_runner(lambda r: timed_sampling(r, seconds), local_env_runner=False)
            if len(parts) != runners:
                raise RuntimeError(f"{variant}: an env runner died during the timed block (see the log above)")
            steps = sum(p["steps"] for p in parts)
            steps_total[variant] += steps
            rep_tp[variant] = steps / max(p["elapsed"] for p in parts)
            cpu = sum(p["cpu"] for p in parts)
            if recording:
                # the writers' CPU while the env runners sampled, and in all: read after the drain below, so it
                # includes the backlog (their work goes on during sampling: a lower CPU priority for the writers,
                # nice 19 or SCHED_IDLE, moved none of it after the block)
                in_block = writers_cpu_since(group, wcpu)
                drains[variant].append(max(group.foreach_env_runner(drain, local_env_runner=False)))
                writer_s = writers_cpu_since(group, wcpu)
                writer_share[variant].append(writer_s / max(1e-9, cpu + writer_s))
                writer_in_block[variant].append(in_block / max(1e-9, cpu + in_block))
                cpu += writer_s
                after = group.foreach_env_runner(recorder_state, local_env_runner=False)
                samples = sum(a["samples"] - b["samples"] for a, b in zip(after, before))
                waits[variant].append(
                    1000 * sum(a["wait_s"] - b["wait_s"] for a, b in zip(after, before)) / max(1, samples))
                rss[variant].append(max(a["rss"] for a in after))
            rep_cpu[variant] = 1000 * cpu / max(1, steps)
        for variant in variants:
            throughput[variant].append(rep_tp[variant])
            ratio[variant].append(rep_tp[variant] / rep_tp["none"])
            cpu_ratio[variant].append(rep_cpu["none"] / rep_cpu[variant])
        print(f"  rep {rep}: " + ", ".join(f"{v} {rep_tp[v]:.0f} steps/s ({rep_tp[v] / rep_tp['none']:.3f}; "
                                          f"CPU {rep_cpu[v]:.2f} s/1k steps, {rep_cpu['none'] / rep_cpu[v]:.3f})"
                                          for v in variants)
              + "; writer % of CPU (in the block) " + ", ".join(
                  f"{v} {100 * w[-1]:.1f} ({100 * writer_in_block[v][-1]:.1f})" for v, w in writer_share.items()),
              flush=True)
    disk = {}
    for algo in algos.values():
        algo.stop()
    from rllib_recorder.read.reader import open_run

    stored, sampled, totals = {}, {}, {}
    for variant in variants:
        if not variant.startswith("recorder"):
            continue
        out = os.path.join(work, f"{env}-{runners}-{mode}-{variant.replace(':', '-')}")
        run_dir = next(d for d, _, files in os.walk(out) if "manifest.json" in files)
        with open_run(run_dir) as run:
            stored[variant], sampled[variant] = run.num_env_steps, steps_total[variant]
            if variant == "recorder":
                totals = run.manifest.get("totals", {})
        disk[variant] = dir_bytes(run_dir) / max(1, stored[variant])
    if "rllib" in variants:
        disk["rllib"] = dir_bytes(os.path.join(work, f"{env}-{runners}-{mode}-rllib")) / max(1, steps_total["rllib"])
    raw_per_step = totals.get("raw_bytes", 0) / max(1, stored["recorder"])
    return {
        "env": env, "runners": runners, "mode": mode, "throughput": throughput, "ratio": ratio,
        "cpu_ratio": cpu_ratio, "writer_share": writer_share, "writer_in_block": writer_in_block,
        "wait_ms": waits, "drain_s": drains, "rss_mib": rss, "disk_per_step": disk, "raw_per_step": raw_per_step,
        "stored": stored, "sampled": sampled,
    }


def table(rows: list[dict[str, Any]]) -> str:
    control = any(CONTROL in r["ratio"] for r in rows)
    # alternative recorder settings (--alternative): ratio, CPU ratio, writer share, wait and drain in one cell
    alts = list(dict.fromkeys(v for r in rows for v in r["ratio"] if v.startswith("recorder:")))
    lines = [
        "| env | runners | batch mode | none steps/s | recorder ratio | rllib ratio "
        + ("| control ratio (A/A) " if control else "") + "| recorder CPU ratio "
        "| rllib CPU ratio | writer % of CPU | writer % while sampling | recorder wait ms/sample "
        "| drain s | bytes/step recorder | bytes/step rllib | raw bytes/step | compression | runner RSS MiB |"
        + "".join(f" {a}: ratio; CPU ratio; writer % (while sampling); wait ms; drain s |" for a in alts),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if control else "")
        + "---|" * len(alts),
    ]
    for r in rows:
        disk = r["disk_per_step"]
        ctl = (f"| {benchdoc.cell(r['ratio'][CONTROL]) if CONTROL in r['ratio'] else ''} " if control else "")
        alt = "".join(
            f" {benchdoc.cell(r['ratio'][a])}; {benchdoc.cell(r['cpu_ratio'][a])}; "
            f"{benchdoc.cell([100 * w for w in r['writer_share'][a]], '{:.1f}')} "
            f"({benchdoc.cell([100 * w for w in r['writer_in_block'][a]], '{:.1f}')}); "
            f"{benchdoc.cell(r['wait_ms'][a], '{:.2f}')}; {max(r['drain_s'][a]):.2f} |"
            if a in r["ratio"] else " |" for a in alts)
        lines.append(
            f"| {r['env']} | {r['runners']} | {r['mode']} | {benchdoc.cell(r['throughput']['none'], '{:.0f}')} "
            f"| {benchdoc.cell(r['ratio']['recorder'])} | {_cell(r['ratio'], 'rllib')} {ctl}"
            f"| {benchdoc.cell(r['cpu_ratio']['recorder'])} | {_cell(r['cpu_ratio'], 'rllib')} "
            f"| {benchdoc.cell([100 * w for w in r['writer_share']['recorder']], '{:.1f}')} "
            f"| {benchdoc.cell([100 * w for w in r['writer_in_block']['recorder']], '{:.1f}')} "
            f"| {benchdoc.cell(r['wait_ms']['recorder'], '{:.2f}')} | {max(r['drain_s']['recorder']):.2f} "
            f"| {disk['recorder']:.0f} | {disk.get('rllib', float('nan')):.0f} | {r['raw_per_step']:.0f} "
            f"| {r['raw_per_step'] / max(1e-9, disk['recorder']):.1f}x | {max(r['rss_mib']['recorder']):.0f} |"
            + alt
        )
    return "\n".join(lines)


def _cell(values: dict[str, list[float]], variant: str) -> str:
    return benchdoc.cell(values[variant]) if values.get(variant) else "-"


def chart(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['env']}\n{r['runners']}r {r['mode'].split('_')[0]}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    for i, variant in enumerate(v for v in ("recorder", "rllib") if all(v in r["ratio"] for r in rows)):
        ax.bar(x + (i - 0.5) * 0.35, [np.median(r["ratio"][variant]) for r in rows], 0.35, label=variant)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.98, color="g", lw=0.8, ls="--", label="0.98 target")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("sampling throughput / no recording (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_args(parser)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=None, help="timed block (default: cartpole 6, breakout 12)")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="untimed sampling per variant before the first block (covers the first hand-off)")
    parser.add_argument("--control", action="store_true",
                        help="also time a second plain config (A/A: the noise floor of the ratios)")
    parser.add_argument("--alternative", nargs="+", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also time the recorder with these settings, one variant each (e.g. coalesce_s=4)")
    parser.add_argument("--settle", type=float, default=1.0, help="idle seconds before each timed block")
    parser.add_argument("--build-order", nargs=3, default=list(VARIANTS), choices=VARIANTS,
                        help="order in which the variants' algorithms are built (timing order rotates anyway)")
    parser.add_argument("--no-rllib", action="store_true", help="leave RLlib's recorder out (diagnostics)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()

    import ray

    # a CPU for every env runner of every variant (each reserves one, built side by side) and one for RLlib's
    # Ray Data writes: with fewer, the rllib variant's write waits forever for a CPU the idle runners hold
    build_order = tuple(v for v in args.build_order if not (args.no_rllib and v == "rllib"))
    variants = len(build_order) + int(args.control) + len(args.alternative)
    ray.init(address="local", num_cpus=variants * max(args.runners or [4]) + 1, include_dashboard=False,
             log_to_driver=False)
    work = tempfile.mkdtemp(prefix="bench_overhead_")
    rows = []
    try:
        for env, runners, mode in row_specs(args):
            seconds = args.seconds or (6.0 if env == "cartpole" else 12.0)
            print(f"{env}, {runners} runners, {mode}, {args.reps} x {seconds:.0f} s per variant", flush=True)
            rows.append(bench_row(env, runners, mode, args.reps, seconds, work, build_order,
                                  args.warmup, args.settle, args.control, tuple(args.alternative)))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    for r in rows:  # lossless: every sampled step was stored
        for variant, stored in r["stored"].items():
            if stored != r["sampled"][variant]:
                print(f"LOST DATA: {r['env']} {r['runners']} {r['mode']} {variant}: "
                      f"sampled {r['sampled'][variant]}, stored {stored}")
    if not args.no_write:
        png = os.path.join(benchdoc.ROOT, "docs", "bench_overhead.png")
        chart(rows, png)
        benchdoc.write_section("Sampling overhead (scripts/bench_overhead.py)", table(rows) + f"""

Ratios: env-runner sampling throughput (env steps/s, learner excluded) over no recording, same repetition.
{"Control ratio (A/A, `--control`): a second config without recording, timed like the others, over no recording: what noise alone gives." + chr(10) if args.control else ""}CPU ratios: CPU seconds per env step of no recording over the variant's, same repetition, counting the env
runners' processes and, for the recorder, its writer actors' (`writer % of CPU`: their share): the throughput
ratio a CPU-bound machine would see, from CPU time instead of wall time (on this machine it is about as noisy:
the CPU time one step takes varies too). `writer % while sampling`: the writers' share counting only the CPU
they got during the timed block; the rest went to the drain after it.
`wait ms/sample`: time the sampler waited for the recorder's window per `on_sample_end`. `drain s`: after a timed
block, the time until every held and in-flight chunk was acknowledged (the writers' backlog). `raw bytes/step`:
the recorded arrays before compression. Chart: `docs/bench_overhead.png`.

![sampling overhead](bench_overhead.png)
""")


if __name__ == "__main__":
    main()
