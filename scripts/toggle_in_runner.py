"""What recording costs an env runner per step, direct and indirect, in one process: all of it, or start states.

Builds PPO with the recorder and the env runner in this process (num_env_runners=0, as profile_sampler.py),
pins the process to one CPU, and samples in alternating blocks (ABBA) of --block seconds with the part named
by --toggle on and off: ``start_states``, the capture of each episode's start state (the conversion and the
hand-off to the writer run in both), or ``recording``, the recorder's callbacks altogether. Compares the
process's CPU per env step, summed over each variant's blocks: besides the callbacks' own time, this sees what
they cost the code around them (caches). Alternating short blocks in one process on one CPU cancels most of
the drift of this machine's CPU speed. Only this process's main thread is pinned; Ray's processes (the
writer) are left to the scheduler.

    python scripts/toggle_in_runner.py --env cartpole --mode truncate_episodes --toggle recording
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_sampler import build, sampler_parser, start_ray  # noqa: E402


def main() -> None:
    parser = sampler_parser(__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="blocks per variant")
    parser.add_argument("--block", type=float, default=3.0, help="seconds per block")
    parser.add_argument("--cpu", type=int, default=1, help="the CPU this process is pinned to")
    parser.add_argument("--toggle", default="start_states", choices=["start_states", "recording"])
    args = parser.parse_args()
    import ray
    import torch

    from rllib_recorder import RecorderCallback
    from rllib_recorder.record import runner as runner_module

    # torch on one thread, as in Ray's workers: a second torch thread spin-waiting on the pinned CPU made every
    # step ten times as costly. Pinned after Ray started, so that Ray's processes (the writer) are not.
    torch.set_num_threads(1)
    start_ray()
    os.sched_setaffinity(0, {args.cpu})
    state = {"on": True}
    if args.toggle == "start_states":
        keep = runner_module.StartStates.keep
        runner_module.StartStates.keep = lambda self, *a, **kw: keep(self, *a, **kw) if state["on"] else None
    else:
        for name in ("on_sample_end", "on_episode_start"):
            method = getattr(RecorderCallback, name)
            setattr(RecorderCallback, name,
                    lambda self, *a, _method=method, **kw: _method(self, *a, **kw) if state["on"] else None)
    with tempfile.TemporaryDirectory() as out:
        algo = build(args.env, args.mode, True, out)
        env_runner = algo.env_runner_group.local_env_runner
        for _ in range(3):  # warm up
            env_runner.sample()
            env_runner.get_metrics()
        totals = {True: [0, 0.0], False: [0, 0.0]}
        pairs = []
        for block in range(2 * args.blocks):
            on = state["on"] = (block % 2 == 0) == (block // 2 % 2 == 0)  # ABBA: on, off, off, on, ...
            steps, cpu0, start = 0, time.process_time(), time.perf_counter()
            while time.perf_counter() - start < args.block:
                steps += sum(len(e) for e in env_runner.sample())
                env_runner.get_metrics()
            cpu = time.process_time() - cpu0
            totals[on][0] += steps
            totals[on][1] += cpu
            pairs.append((on, cpu / steps))
        per_step = {on: 1e6 * cpu / steps for on, (steps, cpu) in totals.items()}
        ratios = []
        for i in range(0, len(pairs), 2):
            (a_on, a), (_, b) = pairs[i], pairs[i + 1]
            ratios.append(b / a if a_on else a / b)  # off over on, per adjacent pair
        stored = stored_rows(algo)
        algo.stop()
    ray.shutdown()
    print(f"{args.env} {args.mode}, {args.blocks} blocks of {args.block:g} s per variant, pinned to CPU {args.cpu}")
    print(f"CPU per step: {args.toggle} on {per_step[True]:.1f} us, off {per_step[False]:.1f} us: "
          f"{args.toggle} costs {100 * (per_step[True] / per_step[False] - 1):.2f}% of the runner's CPU per step")
    print(f"adjacent pairs, off over on: median {statistics.median(ratios):.4f}, "
          f"min {min(ratios):.4f}, max {max(ratios):.4f}")
    print(f"steps: on {totals[True][0]}, off {totals[False][0]}; stored {stored}")


def stored_rows(algo) -> int:
    """Rows the local env runner's writer acknowledged, once everything held was sent (drained)."""
    from rllib_recorder.record.runner import recorder_for

    recorder = recorder_for(algo.env_runner_group.local_env_runner)
    recorder.drain(30.0)
    return recorder.outbox.stats.rows_acked


if __name__ == "__main__":
    main()
