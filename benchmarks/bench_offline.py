"""Offline learning end to end: record PPO on CartPole until its mean return reaches a target, train BC straight
from the recording (the steps of its last policies: ``offline_input(min_policy_version=...)``), evaluate it, and
compare with the same BC on RLlib's parquet from ``export --to rllib`` (the same steps).

    python benchmarks/bench_offline.py --write
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def record(out: str, target: float, max_iterations: int) -> tuple[str, float, int, int]:
    """(run dir, PPO's last mean return, iterations, policy version at the end) of a PPO run recorded to ``target``."""
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback

    config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1)
              .training(lr=3e-4, num_epochs=6, vf_loss_coeff=0.01, train_batch_size=4000, minibatch_size=500)
              .callbacks(RecorderCallback.configured(output_dir=out)))
    algo = config.build_algo()
    try:
        for iteration in range(1, max_iterations + 1):
            result = algo.train()
            ret = result["env_runners"]["episode_return_mean"]
            print(f"PPO iteration {iteration}: return {ret:.1f}", flush=True)
            if ret >= target:
                break
        version = result["recorder"]["learner_version"]
        return result["recorder"]["run_dir"], ret, iteration, version
    finally:
        algo.stop()


def train_bc(offline: dict[str, Any], iterations: int, batch: int) -> dict[str, Any]:
    """BC on ``offline`` (offline_data kwargs) for ``iterations``; wall time, rows trained, evaluated return."""
    import gymnasium as gym
    from ray.rllib.algorithms.bc import BCConfig

    cartpole = gym.make("CartPole-v1")
    config = (BCConfig().environment("CartPole-v1", observation_space=cartpole.observation_space,
                                     action_space=cartpole.action_space)
              .offline_data(**offline).training(train_batch_size_per_learner=batch)
              .evaluation(evaluation_interval=iterations, evaluation_duration=20,
                          evaluation_duration_unit="episodes", evaluation_num_env_runners=1,
                          evaluation_config={"explore": False}))
    algo = config.build_algo()
    try:
        start = time.perf_counter()
        rows = 0
        for _ in range(iterations):
            result = algo.train()
            rows += int(result["learners"]["default_policy"]["num_module_steps_trained"])
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "rows": rows, "rows_per_s": rows / seconds,
                "return": result["evaluation"]["env_runners"]["episode_return_mean"]}
    finally:
        algo.stop()
        del algo
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=400.0, help="PPO's mean return to reach")
    parser.add_argument("--max-ppo-iterations", type=int, default=80)
    parser.add_argument("--last-versions", type=int, default=3, help="BC on the steps of the last N policies")
    parser.add_argument("--bc-iterations", type=int, default=80)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    import ray

    from rllib_recorder import offline_input, open_run

    # 3 logical CPUs on this 2-core machine: RLlib's parquet path (Ray 2.60's ListFiles task) waits for a CPU
    # the pre-learner and the evaluation runner hold on 2, forever (offline_input's read tasks reserve none)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    work = tempfile.mkdtemp(prefix="bench_offline_")
    try:
        run_dir, ppo_return, ppo_iterations, version = record(os.path.join(work, "rec"), args.target,
                                                             args.max_ppo_iterations)
        first = max(0, version - args.last_versions)
        with open_run(run_dir) as run:
            steps = sum(int((b["weights_seq_no"] >= first).sum()) for b in run.iter_batches(
                100_000, columns=["weights_seq_no"]))
            taken = [e for e in run.episodes() if e.weights_seq_no.min() >= first and e.is_done]
            episodes = len(taken)
            data_return = float(np.mean([e.episode_return for e in taken]))  # the recorded policies' return
        print(f"BC data: {steps:,} steps ({episodes} whole episodes, mean return {data_return:.1f}) of policy "
              f"versions {first}..{version}", flush=True)
        bc = train_bc(offline_input(run_dir, min_policy_version=first), args.bc_iterations, args.batch)
        print(f"BC from the recording: {bc}", flush=True)
        parquet = os.path.join(work, "parquet")
        subprocess.run([sys.executable, "-m", "rllib_recorder.cli", "export", run_dir, "--to", "rllib", "-o",
                        parquet], check=True, stdout=subprocess.DEVNULL)
        # the same steps from RLlib's own format: the export holds every step; its eps_id column is not a version,
        # so the parquet run trains on all of them (a fair read-speed comparison, a larger dataset)
        # read tasks reserve no CPU, as offline_input's: the evaluation runner and the pre-learner hold both
        bc_parquet = train_bc({"input_": [parquet], "dataset_num_iters_per_learner": 4,
                               "input_read_method_kwargs": {"num_cpus": 0, "concurrency": 2},
                               "map_batches_kwargs": {"concurrency": 1, "num_cpus": 1}},
                              args.bc_iterations, args.batch)
        print(f"BC from the parquet export: {bc_parquet}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    ratio = bc["return"] / data_return
    table = (
        "| | PPO (recorded) | BC from the recording | BC from RLlib's parquet export |\n|---|---|---|---|\n"
        f"| iterations | {ppo_iterations} | {args.bc_iterations} | {args.bc_iterations} |\n"
        f"| mean return (PPO: its last iteration's episodes; BC: 20 greedy evaluation episodes) | {ppo_return:.1f} "
        f"| {bc['return']:.1f} ({ratio:.2f} of the {data_return:.1f} of the recorded episodes it learned from; "
        f"target 0.80: {'met' if ratio >= 0.8 else 'missed'}) | {bc_parquet['return']:.1f} |\n"
        f"| wall time of BC's iterations | - | {bc['seconds']:.1f} s | {bc_parquet['seconds']:.1f} s |\n"
        f"| rows consumed per second | - | {bc['rows_per_s']:.0f} | {bc_parquet['rows_per_s']:.0f} |\n\n"
        f"BC trained on the {steps:,} steps ({episodes} whole episodes) of PPO's policy versions {first} to "
        f"{version} (`offline_input(run, min_policy_version={first})`), {args.bc_iterations} iterations of 4 "
        f"batches of {args.batch}; the parquet row reads every step of the export.\n")
    print(table)
    if args.write:
        common.write_section("Offline learning end to end (benchmarks/bench_offline.py)", table)


if __name__ == "__main__":
    main()
