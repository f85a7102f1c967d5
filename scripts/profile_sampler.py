"""Where the recorder's time goes inside an env runner: cProfile of sample() with and without recording.

Builds PPO with the env runner in this process (num_env_runners=0) so the profiler sees the callbacks,
samples for --seconds with each variant (same seed, so the same episodes), and prints the recorder's
share of the sampling time and its most expensive functions.

    python scripts/profile_sampler.py --env cartpole --mode complete_episodes --seconds 10
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_overhead import FRAGMENT, env_name  # noqa: E402

RECORDER_ENTRY_POINTS = ("on_sample_end", "on_episode_start")


def build(env: str, mode: str, record: bool, out: str, **settings):
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


def sampler_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a local env runner's sampling (this script's and gc_share.py's): --env, --mode, --seconds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--env", default="cartpole", choices=sorted(FRAGMENT))
    parser.add_argument("--mode", default="complete_episodes", choices=["truncate_episodes", "complete_episodes"])
    parser.add_argument("--seconds", type=float, default=10.0)
    return parser


def start_ray() -> None:
    """Ray for a local env runner: 2 CPUs, no dashboard, workers' logs kept out of the output."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)


def sample_for(runner, seconds: float) -> tuple[int, float]:
    """Samples with ``runner`` for ``seconds`` as RLlib's training loop drives it: (env steps, wall seconds)."""
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += sum(len(e) for e in runner.sample())
        runner.get_metrics()  # as RLlib's training loop: releases the episodes kept for metrics
    return steps, time.perf_counter() - start


def profile(algo, seconds: float) -> tuple[int, float, pstats.Stats]:
    runner = algo.env_runner_group.local_env_runner
    runner.sample()  # warm up
    profiler = cProfile.Profile()
    profiler.enable()
    steps, elapsed = sample_for(runner, seconds)
    profiler.disable()
    return steps, elapsed, pstats.Stats(profiler)


def recorder_seconds(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative time of the recorder's callback entry points."""
    out = {}
    for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        if name in RECORDER_ENTRY_POINTS and "rllib_recorder" in path:
            out[name] = out.get(name, 0.0) + cumulative
    return out


def main() -> None:
    parser = sampler_parser(__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    import ray

    start_ray()
    with tempfile.TemporaryDirectory() as out:
        for record in (False, True):
            algo = build(args.env, args.mode, record, out)
            steps, elapsed, stats = profile(algo, args.seconds)
            print(f"\n== {'recorder' if record else 'none'}: {steps} steps in {elapsed:.1f} s "
                  f"({steps / elapsed:.0f} steps/s, profiled)")
            if record:
                spent = recorder_seconds(stats)
                for name, seconds in spent.items():
                    print(f"   {name}: {seconds:.3f} s = {100 * seconds / elapsed:.1f}% of sampling, "
                          f"{1e6 * seconds / steps:.1f} us/step")
                stats.stream = sys.stdout
                stats.sort_stats("cumulative").print_stats("rllib_recorder", args.top)
            algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
