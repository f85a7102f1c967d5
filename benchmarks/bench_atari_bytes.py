"""Atari bytes per step on disk, by what takes them, and the writer's CPU per step, for each frame encoding.

Part 1 (bytes): a real recorded PPO run per env and encoding: RLlib's Atari wrappers (84x84 grayscale, frameskip 4,
4 frames stacked), 2 env runners, default recorder settings, from a fresh policy ("young": Breakout's episodes end
at each lost life, about 30 steps; Pong's last a whole game, about 800). Each run records until ``--steps`` env
steps, then the bytes of its closed files are split into: the frames (steps/obs), the fragments' head and last
frames, the start states and infos (variable-length blobs), every other column, and HDF5's own structure (the
rest of the file). B/step is the whole files' bytes over the env steps stored.

Part 2 (writer CPU): the same real frames (one saved sequence of chunks per env, as the env runners send them:
uint8 codes, newest frames) appended by a RecordingWriter in this process, CPU seconds per step, median (min) of
``--reps`` repetitions; the env runner's work is the same for every encoding (the writer encodes).

    python benchmarks/bench_atari_bytes.py --write
    python benchmarks/bench_atari_bytes.py --envs breakout --steps 4000 --reps 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

ENVS = {"breakout": "ale_py:ALE/Breakout-v5", "pong": "ale_py:ALE/Pong-v5"}
ENCODINGS = {"frames as they are (2.x)": {"frame_delta": False}, "frame deltas (3.0, default)": {}}
PARTS = ("frames", "head + last frames", "start states", "infos", "other columns", "HDF5 structure")


def record(env: str, steps: int, settings: dict[str, Any], out: str) -> str:
    """A recorded PPO run of ``env`` until ``steps`` env steps; returns its run directory."""
    from rllib_recorder import RecorderCallback
    from rllib_recorder.commands.experiment import load_experiment
    from rllib_recorder.commands.train import build_config

    spec = load_experiment(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                        "breakout-ppo.yaml"), output_dir=out)
    spec.env = ENVS[env]
    spec.config.update(num_env_runners=2, train_batch_size=1000, minibatch_size=250)
    config = build_config(spec).callbacks(RecorderCallback.configured(output_dir=out, **settings))
    algo = config.build_algo()
    try:
        while True:
            result = algo.train()
            if result["env_runners"]["num_env_steps_sampled_lifetime"] >= steps:
                break
        run_dir = result["recorder"]["run_dir"]
    finally:
        algo.stop()
    return run_dir


def breakdown(run_dir: str) -> dict[str, Any]:
    """Bytes per part (PARTS), env steps and episodes of a finished run's files."""
    import h5py

    parts = dict.fromkeys(PARTS, 0)
    steps = episodes = 0
    for name in sorted(os.listdir(run_dir)):
        if not name.endswith(".h5"):
            continue
        path = os.path.join(run_dir, name)
        total, counted = os.path.getsize(path), 0
        with h5py.File(path, "r") as h5:
            datasets: list[Any] = []
            h5.visititems(lambda _, node: datasets.append(node) if isinstance(node, h5py.Dataset) else None)
            for d in datasets:
                leaf = d.name.rsplit("/", 1)[-1]
                if h5py.check_vlen_dtype(d.dtype) is not None or d.dtype.kind == "O":
                    size = int(sum(len(v) for v in d[()])) + d.id.get_storage_size()  # heap data + pointers
                    part = "start states" if leaf == "start_state" else "infos" if leaf == "infos" else "other columns"
                else:
                    size = d.id.get_storage_size()
                    part = ("frames" if d.name.endswith("/steps/obs") else
                            "head + last frames" if leaf in ("head_obs", "last_obs") else "other columns")
                parts[part] += size
                counted += size
            agent = h5["agents/default_agent"]
            steps += len(agent["steps/rewards"])
            episodes += int(np.count_nonzero(agent["fragments/t_start"][()] == 0))
        parts["HDF5 structure"] += total - counted
    return {"parts": parts, "steps": steps, "episodes": episodes, "total": sum(parts.values())}


def saved_chunks(env: str, steps: int) -> list[Any]:
    """Real frames of ``env`` under random actions, as chunks of about 200 steps as env runners send them."""
    from bench_writer import episodes_from_env

    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk

    episodes = episodes_from_env(lambda: make_atari_env(ENVS[env], 84, 4, {}), steps, 50, cut_at_end=True)
    options = ConvertOptions(encode_images=True, stack_frames=True)
    return [episodes_to_chunk(episodes[i:i + 4], options) for i in range(0, len(episodes), 4)]


def writer_cpu(chunks: list[Any], settings: dict[str, Any], work: str) -> float:
    """CPU seconds per step of a RecordingWriter appending ``chunks`` (and closing) in this process."""
    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.service.writer import RecordingWriter

    run_dir = tempfile.mkdtemp(dir=work)
    writer = RecordingWriter(run_dir, "bench", StorageOptions(**settings))
    start = time.process_time()
    for seq, chunk in enumerate(chunks):
        writer.append(1, False, b"b" * 32, seq, chunk)
    writer.close()
    seconds = time.process_time() - start
    shutil.rmtree(run_dir)
    return seconds / sum(c.env_steps for c in chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--steps", type=int, default=12_000, help="env steps each recorded run samples")
    parser.add_argument("--cpu-steps", type=int, default=3_000, help="steps of saved frames for the writer's CPU")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    work = tempfile.mkdtemp(prefix="bench_atari_bytes_")
    rows = []
    try:
        for env in args.envs:
            chunks = saved_chunks(env, args.cpu_steps)
            for label, settings in ENCODINGS.items():
                run = breakdown(record(env, args.steps, settings, os.path.join(work, f"{env}-{len(rows)}")))
                cpu = [writer_cpu(chunks, settings, work) for _ in range(args.reps)]
                rows.append({"env": env, "encoding": label, **run, "cpu": cpu})
                print(f"{env} {label}: {run['total'] / run['steps']:.0f} B/step over {run['steps']} steps, "
                      f"{run['episodes']} episodes; writer {np.median(cpu) * 1e6:.0f} us/step", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ray.shutdown()
    text = table(rows, args)
    print(text)
    if args.write:
        common.write_section("Atari bytes per step (benchmarks/bench_atari_bytes.py)", text)


def table(rows: list[dict[str, Any]], args: Any) -> str:
    head = ("| env | encoding | env steps (episodes, mean length) | **B/step** | " + " | ".join(PARTS)
            + " | writer CPU us/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        per = {p: r["parts"][p] / r["steps"] for p in PARTS}
        cpu = [c * 1e6 for c in r["cpu"]]
        lines.append(f"| {r['env']} | {r['encoding']} | {r['steps']:,} ({r['episodes']}, "
                     f"{r['steps'] / max(1, r['episodes']):.0f}) | **{r['total'] / r['steps']:.0f}** | "
                     + " | ".join(f"{per[p]:.0f}" for p in PARTS) + f" | {common.cell(cpu, '{:.0f}')} |")
    return "\n".join(lines) + (
        f"\n\nBytes: one recorded PPO run per row ({args.steps:,} env steps asked, 2 env runners, a fresh policy, "
        "default settings but the encoding), its closed files split by what holds them (B/step each). Writer CPU: "
        f"{args.cpu_steps:,} steps of saved real frames appended in process, median (min) of {args.reps}.\n")


if __name__ == "__main__":
    main()
