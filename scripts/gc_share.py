"""The garbage collector's share of a local env runner's CPU, with and without the recorder.

Builds PPO twice with the env runner in this process (num_env_runners=0, as scripts/profile_sampler.py), then
samples with each for --seconds per repetition, alternating, and times every collection (``gc.callbacks``).

    python scripts/gc_share.py --env cartpole --mode complete_episodes --reps 3 --seconds 10
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_sampler import build, sample_for, sampler_parser, start_ray  # noqa: E402


def main() -> None:
    parser = sampler_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import ray

    start_ray()
    state = {"seconds": 0.0, "collections": [0, 0, 0], "started": 0.0}

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            state["started"] = time.perf_counter()
        else:
            state["seconds"] += time.perf_counter() - state["started"]
            state["collections"][info["generation"]] += 1

    gc.callbacks.append(timer)
    with tempfile.TemporaryDirectory() as out:
        algos = {record: build(args.env, args.mode, record, out) for record in (False, True)}
        for rep in range(args.reps):
            for record, algo in algos.items():
                runner = algo.env_runner_group.local_env_runner
                runner.sample()
                runner.get_metrics()
                state.update(seconds=0.0, collections=[0, 0, 0])
                cpu0 = time.process_time()
                steps, elapsed = sample_for(runner, args.seconds)
                cpu = time.process_time() - cpu0
                print(f"rep {rep} {'recorder' if record else 'none':8s}: {steps / elapsed:.0f} "
                      f"steps/s, CPU {cpu / steps * 1e6:.0f} us/step, gc collections by generation "
                      f"{state['collections']}, {state['seconds'] * 1e3:.0f} ms ({state['seconds'] / cpu * 100:.2f}% "
                      "of the process's CPU)", flush=True)
        for algo in algos.values():
            algo.stop()
    gc.callbacks.remove(timer)
    ray.shutdown()


if __name__ == "__main__":
    main()
