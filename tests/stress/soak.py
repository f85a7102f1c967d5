"""Soak: record PPO CartPole with 2 env runners for a long time; sample runner and writer memory; verify at the end.

Usage: python tests/stress/soak.py --minutes 60 --out soak-out   (not part of CI; run it on a quiet machine)
Prints one line per sample and writes soak-out/soak.json with every sample and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("--sample-s", type=float, default=15.0, help="seconds between memory samples")
    parser.add_argument("--plot", metavar="SOAK_JSON", help="only draw docs/soak_memory.png from a soak.json")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                     "soak_memory.png"))
        return

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback
    from rllib_recorder.commands.verify import verify_run
    from rllib_recorder.service.pool import writer_name

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = os.path.abspath(args.out)
    config = (
        PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2)
        .callbacks(RecorderCallback.configured(output_dir=out))
    )
    algo = config.build_algo()
    samples, start, last_sample = [], time.time(), 0.0
    pids = None
    while time.time() - start < args.minutes * 60:
        recorder = algo.train()["recorder"]
        if pids is None:
            run_id = json.load(open(os.path.join(recorder["run_dir"], "manifest.json")))["run_id"]
            writer = ray.get_actor(writer_name(run_id, 0), namespace=ray.get_runtime_context().namespace)
            pids = {"writer": ray.get(writer.__ray_call__.remote(lambda self: os.getpid()))}
            for index, pid in algo.env_runner_group.foreach_env_runner(
                    lambda r: (r.worker_index, os.getpid()), local_env_runner=False):
                pids[f"runner{index}"] = pid
        if time.time() - last_sample >= args.sample_s:
            last_sample = time.time()
            row = {"t_s": round(last_sample - start, 1), "env_steps": recorder["env_steps_stored"],
                   "disk_mib": round(recorder["disk_bytes"] / 2**20, 2), "errors": recorder["errors"],
                   "sampler_wait_s": round(recorder["sampler_wait_s"], 3),
                   **{f"{k}_rss_mib": round(rss_mib(p), 1) for k, p in pids.items()}}
            samples.append(row)
            print(json.dumps(row), flush=True)
    run_dir = recorder["run_dir"]
    algo.stop()
    problems = verify_run(run_dir)
    half = samples[len(samples) // 2:]
    growth = {k: round(half[-1][k] - half[0][k], 1) for k in samples[0] if k.endswith("_rss_mib")} if half else {}
    verdict = {"run_dir": run_dir, "minutes": args.minutes, "samples": samples, "verify_problems": problems,
               "rss_growth_second_half_mib": growth}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    print(json.dumps({"verify_problems": problems, "rss_growth_second_half_mib": growth}))
    ray.shutdown()


def plot(soak_json: str, png: str) -> None:
    """RSS of every process and steps stored over the soak's time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(soak_json) as f:
        samples = json.load(f)["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, (mem, steps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key in sorted(k for k in samples[0] if k.endswith("_rss_mib")):
        mem.plot(minutes, [s[key] for s in samples], label=key.replace("_rss_mib", ""))
    mem.set_ylabel("RSS (MiB)")
    mem.legend()
    mem.set_title("Soak: PPO CartPole, 2 env runners, recorder defaults")
    steps.plot(minutes, [s["env_steps"] / 1000 for s in samples], color="black")
    steps.set_ylabel("env steps stored (thousands)")
    steps.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
