"""Sampling throughput with and without the recorder, timed in the same seconds on the same CPUs.

Why: this machine's CPUs change speed by up to 1.9x from one second to the next, and its two CPUs differ from
each other in the same second by 0.6-1.3x (``benchmarks/cpu_speed.py``). Variants timed one after another
(``bench_overhead.py``) therefore differ by more than the 2% the targets allow, and so do blocks of the same env
runners seconds apart with the recorder switched on and off (tried: an A/A ratio of 0.87-1.46 for adjacent 3 s
blocks). Here two algorithms, "none" (no recording) and "recorder" (default settings), sample at once, and a
driver thread moves their env runners' main threads between the CPUs every ``--tick`` seconds, so that at every
moment each CPU runs as many runners of one variant as of the other, and over a block each runner spends equal
time on each CPU. ``--vs control``: the second algorithm is a second plain config, and its ratio the noise floor
of this method (A/A). ``--vs rllib``: RLlib's own recorder (``offline_data(output=...)``, as in bench_overhead.py);
its Ray Data write tasks run in processes of their own that take CPU from both variants alike, so its paired
ratio leaves their CPU out: a comparison in RLlib's favour.

What pairing hides, and how it is put back. Both variants' runners share the CPUs equally, so the writers' CPU
is taken from both alike and the paired ratio leaves it out. The ratio judged against the targets charges it as
the recorder would pay it alone: when its runners leave no CPU idle (runners >= CPUs), the paired ratio times
(1 - the writers' share alone); that share is the writers' work per step over the runners' CPU per step plus
it, and Ray's floor for an actor (the writers' CPU per second with nothing sampled, measured for 3 s after each
block) over the machine's CPUs. With fewer runners than CPUs the writers run on an idle CPU: nothing is charged.

    python benchmarks/bench_paired.py --write                      # all 10 rows, into docs/BENCHMARKS.md
    python benchmarks/bench_paired.py --vs control --write          # the A/A control, its own section
    python benchmarks/bench_paired.py --env breakout --runners 1 --modes complete_episodes --vs rllib
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import (  # noqa: E402
    DIAGNOSTIC_VARIANTS,
    TOGGLED,
    add_row_args,
    build,
    dir_bytes,
    drain,
    recorder_state,
    row_specs,
    switch_recording,
    timed_sampling,
    writers_cpu,
    writers_cpu_since,
)

CPUS = os.cpu_count() or 1
SECONDS = {"cartpole": 20.0, "breakout": 30.0}


def runner_pid(runner: Any) -> int:
    return os.getpid()


def writer_pid(runner: Any) -> dict[str, int]:
    """Runs inside one env runner: {its writer actor's name: the writer's process id}."""
    import ray

    from rllib_recorder.record.runner import recorder_for

    recorder = recorder_for(runner)
    name = recorder.writer_name()
    actor = ray.get_actor(name, namespace=recorder.binding.namespace)
    return {name: ray.get(actor.__ray_call__.remote(
        lambda self: __import__("os").getpid()))}


class Rotation:
    """Moves the runners' main threads between the CPUs every ``tick`` s: runner j of variant v sits on CPU
    (v + j + t) % CPUS at tick t, so every CPU holds as many runners of each variant at every moment.

    ``shared`` processes (the writers), every thread of them, sit on CPU (t // 2) % CPUS: half of the time beside
    each variant's runners. Left alone, the scheduler tends to wake a writer on the CPU of the runner that called
    it, so it took its CPU from the recorder's runners only; alone, with fewer runners than CPUs, it would run on
    an idle CPU, and with more it takes from all runners alike."""

    def __init__(self, pids: list[list[int]], tick: float, shared: list[int] = ()) -> None:
        self.pids, self.tick, self.shared = pids, tick, list(shared)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Rotation":
        self._place(0)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        for pid in [p for pids in self.pids for p in pids]:
            _set_affinity(pid, set(range(CPUS)))
        for pid in self.shared:
            _set_process_affinity(pid, set(range(CPUS)))

    def _place(self, t: int) -> None:
        for v, pids in enumerate(self.pids):
            for j, pid in enumerate(pids):
                _set_affinity(pid, {(v + j + t) % CPUS})
        for pid in self.shared:
            _set_process_affinity(pid, {(t // 2) % CPUS})

    def _run(self) -> None:
        t = 1
        while not self._stop.wait(self.tick):
            self._place(t)
            t += 1


def _set_affinity(pid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(pid, cpus)
    except ProcessLookupError:  # a runner died; the block reports it
        pass


def _set_process_affinity(pid: int, cpus: set[int]) -> None:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in threads:
        _set_affinity(int(tid), cpus)


def idle_writer_cpu(group: Any, seconds: float = 3.0) -> float:
    """CPU seconds per second of the group's writers while nothing is sampled or sent: Ray's floor for an actor."""
    before, start = writers_cpu(group), time.perf_counter()
    time.sleep(seconds)
    return writers_cpu_since(group, before) / (time.perf_counter() - start)


COUNTERS = (("minflt", "page faults", 1), ("sys", "ms kernel CPU", 1000), ("nvcsw", "voluntary switches", 1),
            ("nivcsw", "involuntary switches", 1), ("gc0", "GC gen-0", 1), ("gc1", "gen-1", 1), ("gc2", "gen-2", 1))


@dataclass(frozen=True)
class RowSetup:
    """What every block of one row shares: the row, the variant timed against none, and how blocks are timed."""

    env: str
    runners: int
    mode: str
    seconds: float
    other: str
    tick: float
    warmup: float = 3.0
    settle: float = 1.0
    verbose: bool = False

    @property
    def names(self) -> tuple[str, str]:
        return ("none", self.other)


def process_counters(parts: list[dict[str, float]]) -> str:
    """The runners' page faults, kernel CPU, context switches and garbage collections per 1000 steps (--verbose)."""
    steps = sum(p["steps"] for p in parts)
    return "per 1000 steps: " + ", ".join(
        f"{1000 * scale * sum(p[key] for p in parts) / steps:.1f} {label}" for key, label, scale in COUNTERS)


def bench_row(setup: RowSetup, reps: int, work: str, fresh: bool = False, crossover: bool = False) -> dict[str, Any]:
    """Times ``reps`` blocks of none and ``setup.other`` together. ``fresh``: new algorithms (new env runner and
    writer processes) for every block, so that the repetitions also vary what a process keeps for its whole life
    (where its memory lies, which CPU caches it shares): one set of processes can be faster or slower than another
    by a few percent for as long as it lives, which repetitions with the same processes cannot show.
    ``crossover``: each repetition is two blocks in which the same two sets of processes take turns at recording
    (``_crossover_build``), so that what each set is faster or slower by cancels out."""
    other = setup.other
    row_dir = os.path.join(work, f"{setup.env}-{setup.runners}-{setup.mode}-{other.replace(':', '-')}")
    sampled: dict[str, int] = defaultdict(int)
    out: dict[str, list[float]] = defaultdict(list)
    if other.startswith("recorder") and not crossover:
        # WriterCharge drains the runners after each block with the stop-time drain, which closes their recorders:
        # a second block of the same algorithms would sample without recording (stored = sampled then read NO)
        fresh = True
    builds = [(b, [b]) for b in range(reps)] if fresh else [(0, list(range(reps)))]
    names, timed = (("A", "B"), _crossover_build) if crossover else (setup.names, _timed_build)
    for build_index, rep_indices in builds:
        outs = {v: os.path.join(row_dir, f"build-{build_index}", v.replace(':', '-')) for v in names}
        timed(setup, rep_indices, outs, sampled, out)
    if crossover:
        sampled[other] = sampled["A"] + sampled["B"]
    row: dict[str, Any] = {"env": setup.env, "runners": setup.runners, "mode": setup.mode, "other": other,
                           "reps": reps, "seconds": setup.seconds, "fresh": fresh, "crossover": crossover, **out}
    if other.startswith("recorder"):
        from rllib_recorder.read.run import open_run

        stored = raw = disk = 0
        for run_dir in (d for d, _, files in os.walk(row_dir) if "manifest.json" in files):
            with open_run(run_dir) as run:
                stored += run.num_env_steps
                raw += run.manifest.get("totals", {}).get("raw_bytes", 0)
            disk += dir_bytes(run_dir)
        row["stored"], row["bytes_per_step"], row["compression"] = stored, disk / max(1, stored), raw / max(1, disk)
        row["sampled"] = sampled[other]
    elif other == "rllib":
        row["bytes_per_step"] = sum(dir_bytes(os.path.join(row_dir, b, other)) for b in os.listdir(row_dir)) \
            / max(1, sampled[other])
    return row


class Together:
    """Algorithms whose env runners sample in the same seconds, moved between the CPUs (``Rotation``), with
    their writers; counts what each variant sampled into ``sampled`` (while ``counting`` says so)."""

    def __init__(self, setup: RowSetup, algos: dict[str, Any], sampled: dict[str, int],
                 recorders: tuple[str, ...]) -> None:
        self.setup, self.algos, self.sampled = setup, algos, sampled
        self.groups = {v: a.env_runner_group for v, a in algos.items()}
        self.counting = {v: True for v in algos}
        self.writers = sorted({pid for v in recorders  # the variants with our recorder, so with writers
                               for part in self.groups[v].foreach_env_runner(writer_pid, local_env_runner=False)
                               for pid in part.values()})

    def warm_up(self) -> None:
        """Env creation, first forward passes, the recorder's first hand-off and file: alone, then together."""
        warmup = self.setup.warmup  # (a lambda using self would ship the algorithms to the runners)
        for v, group in self.groups.items():
            self.sampled[v] += sum(p["steps"] for p in group.foreach_env_runner(
                lambda r: timed_sampling(r, warmup), local_env_runner=False))
        self.sample(self.setup.warmup, tuple(self.groups))

    def sample(self, block_s: float, order: tuple[str, ...]) -> dict[str, list[dict[str, float]]]:
        groups = self.groups
        pids = [groups[v].foreach_env_runner(runner_pid, local_env_runner=False) for v in order]
        start_at = time.time() + 1.0  # the calls reach the runners at different times; they start together
        with Rotation(pids, self.setup.tick, self.writers), \
                concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            futures = {v: pool.submit(groups[v].foreach_env_runner,
                                      lambda r: timed_sampling(r, block_s, start_at), local_env_runner=False)
                       for v in order}
            parts = {v: f.result() for v, f in futures.items()}
        for v, p in parts.items():
            if len(p) != self.setup.runners:
                raise RuntimeError(f"{v}: an env runner died during the block (see the log above)")
            if self.counting[v]:
                self.sampled[v] += sum(x["steps"] for x in p)
        return parts

    def record(self, v: str, on: bool) -> None:
        """Switches variant ``v``'s toggled recorder on or off in all its env runners (``switch_recording``);
        only what it samples while on is counted, as only that is stored."""
        self.groups[v].foreach_env_runner(lambda r: switch_recording(r, on), local_env_runner=False)
        self.counting[v] = on

    def stop(self) -> None:
        for algo in self.algos.values():
            algo.stop()


def _rates(parts: dict[str, list[dict[str, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's steps per second (each runner's own rate, summed: a runner finishing its last sample()
    after the others have stopped runs faster then, and that must not count for the others) and CPU per step."""
    rate = {v: sum(x["steps"] / x["elapsed"] for x in p) for v, p in parts.items()}
    cps = {v: sum(x["cpu"] for x in p) / sum(x["steps"] for x in p) for v, p in parts.items()}
    return rate, cps


class WriterCharge:
    """The recording variant's writers over one block: their CPU charged as the recorder would pay it alone,
    the sampler's wait for acks, the drain after the block."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.state0, self.wcpu0 = group.foreach_env_runner(recorder_state, local_env_runner=False), writers_cpu(group)
        self.start = time.perf_counter()

    def finish(self, setup: RowSetup, steps: int, cpu_per_step: float, ratio: float,
               out: dict[str, list[float]]) -> str:
        group = self.group
        out["drain_s"].append(max(group.foreach_env_runner(drain, local_env_runner=False)))
        writer_s = writers_cpu_since(group, self.wcpu0)
        block_s = time.perf_counter() - self.start
        floor = idle_writer_cpu(group)
        work_ps = max(0.0, writer_s - floor * block_s) / steps
        alone = (work_ps / (cpu_per_step + work_ps) + floor / CPUS) if setup.runners >= CPUS else 0.0
        out["charged"].append(ratio * (1 - alone))
        out["writer_alone"].append(alone)
        out["floor"].append(floor / CPUS)
        state1 = group.foreach_env_runner(recorder_state, local_env_runner=False)
        samples = sum(a["samples"] - b["samples"] for a, b in zip(state1, self.state0))
        out["wait_ms"].append(1000 * sum(a["wait_s"] - b["wait_s"] for a, b in zip(state1, self.state0))
                              / max(1, samples))
        return (f"; writers charged {100 * alone:.2f}% (floor {100 * floor / CPUS:.2f}%): "
                f"{out['charged'][-1]:.3f}; drain {out['drain_s'][-1]:.2f} s")


def _timed_build(setup: RowSetup, rep_indices: list[int], outs: dict[str, str], sampled: dict[str, int],
                 out: dict[str, list[float]]) -> None:
    """Builds none and ``setup.other``, warms them up, times the repetitions ``rep_indices`` into ``out`` (and the
    steps each variant sampled into ``sampled``), stops them."""
    other, names = setup.other, setup.names
    recording = other.startswith("recorder")
    pair = Together(setup, {v: build(setup.env, setup.runners, setup.mode, v, outs[v]) for v in names}, sampled,
                    (other,) if recording else ())
    try:
        pair.warm_up()
        for rep in rep_indices:
            order = names if rep % 2 == 0 else names[::-1]  # which variant starts on which CPU alternates too
            time.sleep(setup.settle)
            charge = WriterCharge(pair.groups[other]) if recording else None
            parts = pair.sample(setup.seconds, order)
            rate, cps = _rates(parts)
            ratio = rate[other] / rate["none"]
            out["none_rate"].append(rate["none"])
            out["ratio"].append(ratio)
            out["cpu_ratio"].append(cps["none"] / cps[other])
            line = (f"  rep {rep}: none {rate['none']:.0f}, {other} {rate[other]:.0f} steps/s: ratio {ratio:.3f}; "
                    f"CPU per step ratio {out['cpu_ratio'][-1]:.3f}")
            if setup.verbose:
                line += "".join(f"\n    {v}: {process_counters(parts[v])}" for v in names)
            if charge is not None:
                line += charge.finish(setup, sum(p["steps"] for p in parts[other]), cps[other], ratio, out)
            print(line, flush=True)
    finally:
        pair.stop()


def _crossover_build(setup: RowSetup, rep_indices: list[int], outs: dict[str, str], sampled: dict[str, int],
                     out: dict[str, list[float]]) -> None:
    """``--crossover``: two algorithms A and B, both with the toggled recorder, time each repetition as two
    blocks: A recording and B not, then B recording and A not (the order alternating between repetitions).
    Block 1's ratio is c * a / b * p and block 2's c * b / a / p, where a and b are what each set of processes is
    faster or slower by for its whole life and p what the first of the two places in ``Rotation`` is (A has it in
    both blocks; with one runner each, it was 2% slower in five blocks of six); their geometric mean is the
    recorder's ratio c without them.
    With ``--vs control`` neither ever records: the mean shows what is left of a / b."""
    recording = setup.other.startswith("recorder")
    pair = Together(setup, {v: build(setup.env, setup.runners, setup.mode, TOGGLED, outs[v]) for v in "AB"},
                    sampled, ("A", "B"))
    try:
        pair.warm_up()
        for v in pair.groups:
            pair.record(v, False)
        for rep in rep_indices:
            ratios, cpu_ratios, none_rates, block_out = [], [], [], defaultdict(list)
            line = f"  rep {rep}:"
            for on, off in (("A", "B"), ("B", "A")) if rep % 2 == 0 else (("B", "A"), ("A", "B")):
                if recording:
                    pair.record(on, True)
                time.sleep(setup.settle)
                charge = WriterCharge(pair.groups[on]) if recording else None
                parts = pair.sample(setup.seconds, ("A", "B"))  # places fixed: a first place's own bias cancels too
                rate, cps = _rates(parts)
                ratios.append(rate[on] / rate[off])
                cpu_ratios.append(cps[off] / cps[on])
                none_rates.append(rate[off])
                line += f" {on} on {rate[on]:.0f}, {off} off {rate[off]:.0f} steps/s ({ratios[-1]:.3f});"
                if charge is not None:
                    charge.finish(setup, sum(p["steps"] for p in parts[on]), cps[on], ratios[-1], block_out)
                    pair.record(on, False)
            ratio = statistics.geometric_mean(ratios)
            out["none_rate"].append(statistics.fmean(none_rates))
            out["ratio"].append(ratio)
            out["cpu_ratio"].append(statistics.geometric_mean(cpu_ratios))
            line += f" crossover ratio {ratio:.3f}; CPU per step ratio {out['cpu_ratio'][-1]:.3f}"
            if recording:  # the two blocks' writer charges, as one
                alone = statistics.fmean(block_out["writer_alone"])
                out["charged"].append(ratio * (1 - alone))
                out["writer_alone"].append(alone)
                out["floor"].append(statistics.fmean(block_out["floor"]))
                out["wait_ms"].append(statistics.fmean(block_out["wait_ms"]))
                out["drain_s"].append(max(block_out["drain_s"]))
                line += f"; writers charged {100 * alone:.2f}%: {out['charged'][-1]:.3f}"
            print(line, flush=True)
    finally:
        pair.stop()


def target(mode: str) -> float:
    return 0.98 if mode == "truncate_episodes" else 0.95


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| env | runners | batch mode | reps x s | none steps/s (paired) | variant | ratio, writers charged "
        "| target | paired ratio | CPU per step ratio | writers' share charged | of it Ray's actor floor "
        "| wait ms/sample | drain s | bytes/step | compression | stored = sampled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = (f"| {r['env']} | {r['runners']} | {r['mode']} | {r['reps']} x "
                f"{'2 x ' if r.get('crossover') else ''}{r['seconds']:.0f}"
                f"{', fresh' if r.get('fresh') else ''}{', crossover' if r.get('crossover') else ''} "
                f"| {common.cell(r['none_rate'], '{:.0f}')} | {r['other']} ")
        if not r["other"].startswith("recorder"):  # A/A control, or RLlib's recorder (its bytes per step)
            disk = f"{r['bytes_per_step']:.0f}" if "bytes_per_step" in r else "-"
            lines.append(head + f"| - | - | {common.cell(r['ratio'])} | {common.cell(r['cpu_ratio'])} "
                         f"| - | - | - | - | {disk} | - | - |")
            continue
        verdict = "met" if statistics.median(r["charged"]) >= target(r["mode"]) else "missed"
        lines.append(
            head + f"| **{common.cell(r['charged'])}** | {target(r['mode'])}: {verdict} "
            f"| {common.cell(r['ratio'])} | {common.cell(r['cpu_ratio'])} "
            f"| {common.cell([100 * w for w in r['writer_alone']], '{:.2f}')}% "
            f"| {common.cell([100 * w for w in r['floor']], '{:.2f}')}% "
            f"| {common.cell(r['wait_ms'], '{:.2f}')} | {max(r['drain_s']):.2f} | {r['bytes_per_step']:.0f} "
            f"| {r['compression']:.1f}x | {'yes' if r['stored'] == r['sampled'] else 'NO'} ({r['stored']}) |")
    return "\n".join(lines)


NOTE = """

Each cell: median (min) over the repetitions. `none steps/s (paired)`: no recording's throughput while the other
variant sampled too (each env runner's steps over its own elapsed time, summed). `paired ratio`: the variant's
throughput over none's in the same seconds. `CPU per step ratio`: none's runner CPU per step over the variant's
(runner processes only). `ratio, writers charged`: the paired ratio times (1 - `writers' share charged`), the
share of the CPU the writers would take from the runners alone (their work per step, and Ray's floor for an
actor as a share of the machine; nothing when the runners leave a CPU idle); judged against the target. Rows
with variant `control` (`--vs control`): a second plain config in place of the recorder, the noise floor of the
method. Rows with variant `rllib` (`--vs rllib`): RLlib's recorder in its place; its Ray Data writes run in
processes of their own whose CPU is not charged to it (in its favour).
`stored = sampled`: the steps in the recorder's files equal the steps its runners sampled (warm-up included).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_args(parser)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=None, help="block length (default: cartpole 20, breakout 30)")
    parser.add_argument("--tick", type=float, default=0.25, help="seconds between moves of the runners' CPUs")
    parser.add_argument("--vs", default="recorder",
                        choices=["recorder", "control", "rllib", *DIAGNOSTIC_VARIANTS],
                        help="what is timed against no recording: the recorder, a second plain config (A/A), "
                             "RLlib's recorder; diagnostics: ours with its env-runner callbacks emptied (hollow: "
                             "writers and binding only), or handling start states only in part (discard: "
                             "captured, thrown away; hold: captured, held; nosend: captured, held, packed)")
    parser.add_argument("--settings", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                        help="recorder settings other than the defaults (e.g. coalesce_s=4); never written to the docs")
    parser.add_argument("--write", action="store_true", help="write the table into docs/BENCHMARKS.md")
    parser.add_argument("--fresh", action="store_true",
                        help="new algorithms (new env runner and writer processes) for every repetition")
    parser.add_argument("--crossover", action="store_true",
                        help="two sets of processes take turns at recording in each repetition (two blocks), so "
                             "that what one set is faster or slower by for its whole life cancels out")
    parser.add_argument("--verbose", action="store_true",
                        help="print each variant's page faults, kernel CPU and context switches per 1000 steps")
    args = parser.parse_args()

    import ray

    ray.init(address="local", num_cpus=2 * max(args.runners or [4]) + 1, include_dashboard=False,
             log_to_driver=False)
    work = tempfile.mkdtemp(prefix="bench_paired_")
    rows = []
    try:
        for env, runners, mode in row_specs(args):
            seconds = args.seconds or SECONDS[env]
            print(f"{env}, {runners} runners, {mode}: {args.reps} x {seconds:.0f} s", flush=True)
            other = f"recorder:{args.settings}" if args.vs == "recorder" and args.settings else args.vs
            setup = RowSetup(env, runners, mode, seconds, other, args.tick, verbose=args.verbose)
            rows.append(bench_row(setup, args.reps, work, fresh=args.fresh, crossover=args.crossover))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    for r in rows:
        if r.get("stored", r.get("sampled")) != r.get("sampled"):
            print(f"LOST DATA: {r['env']} {r['runners']} {r['mode']}: sampled {r['sampled']}, stored {r['stored']}")
    if args.write and not args.settings:
        name = "Sampling overhead, paired" + ("" if args.vs == "recorder" else f" against {args.vs}") \
            + " (benchmarks/bench_paired.py)"
        common.write_section(name, table(rows) + NOTE)


if __name__ == "__main__":
    main()
