"""What the benchmarks share: building PPO with or without the recorder on CartPole or Breakout, timing an env
runner's sampling, the writers' CPU, and writing a table into docs/BENCHMARKS.md with its command, date and machine."""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import shlex
import statistics
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOC = os.path.join(ROOT, "docs", "BENCHMARKS.md")

HEADER = """# Benchmarks

Every table below was written by the script named in its section, with the command, date, machine and versions
that made it. Throughputs are compared as ratios measured in the same run (variants interleaved, the machine is
noisy); each cell gives the median and, in brackets, the min over the repetitions. Re-run a script to refresh its
section; the others stay as they are.
"""


def machine() -> str:
    """One line: CPU count and model, memory, Python, Ray, h5py/HDF5, numpy versions."""
    import h5py
    import numpy as np
    import ray

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"ray {ray.__version__}, h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}), numpy {np.__version__}")


def min_median(values: Sequence[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def cell(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    low, mid = min_median(values)
    return f"{fmt.format(mid)} ({fmt.format(low)})"


def write_section(name: str, body: str) -> None:
    """Replaces (or appends) the section ``name`` of docs/BENCHMARKS.md with ``body``."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    section = (f"<!-- {name}:start -->\n## {name}\n\n`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
               f"\n\nMachine: {machine()}\n\n{body.strip()}\n<!-- {name}:end -->\n")
    text = open(DOC).read() if os.path.exists(DOC) else HEADER
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote section {name!r} of {DOC}")


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

    from rllib_recorder.commands.envs import make_atari_env

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


def build_local(env: str, mode: str, record: bool, out: str, **settings):
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback

    config = (
        PPOConfig().environment(env_name(env)).debugging(seed=0)
        .env_runners(num_env_runners=0, batch_mode=mode, rollout_fragment_length=FRAGMENT[env])
        .training(train_batch_size=FRAGMENT[env], minibatch_size=FRAGMENT[env], num_epochs=1)
    )
    if record:
        config = config.callbacks(RecorderCallback.configured(output_dir=out, **settings))
    return config.build_algo()


def start_ray() -> None:
    """Ray for a local env runner: 2 CPUs, no dashboard, workers' logs kept out of the output."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
