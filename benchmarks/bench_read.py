"""Read throughput of a recorded run of at least 1 GB raw, by every way there is to read it, and each reader's RSS.

The run is written by the recorder's own writer from real observations (ALE Breakout through RLlib's Atari
wrappers, 84x84x4 float32 frames as RLlib hands them over, stored as uint8 newest frames; CartPole-v1 vectors under
random actions, replicated with fresh episode ids to reach the size). Each reader runs in a fresh child process
(its peak RSS is its own), the readers take turns in every repetition:

  h5py       plain h5py reading every step column of the file chunk by chunk (the limit: disk + decompression)
  iter       run.iter_batches of obs, actions, rewards, terminateds, truncateds (4096 rows; Breakout 256)
  iter_u8    the same with decode=False: Atari frames as their stored uint8 codes, stacks rebuilt (Breakout only)
  iter_next  the same as iter with next_obs and shuffle=True (a 64k-row buffer)
  episodes   run.episodes(): stitched episodes (frame stacks rebuilt)
  episodes_u8  run.episodes(decode=False) (Breakout only)
  ray1/ray2  run.to_ray_dataset with 1 and 2 read tasks, iter_batches of the same size in the driver
  parquet    RLlib's parquet from `export --to rllib`, read by ray.data.read_parquet (2 CPUs)
  minari     Minari's loader on the `export --to minari` dataset, iterate_episodes

Throughput is env steps/s and MB/s of the raw observations those steps stand for (float32 stacks, as RLlib's
env runner held them; the u8 readers hand out a quarter of those bytes).

    python benchmarks/bench_read.py --env cartpole --reps 3 --write
    python benchmarks/bench_read.py --env breakout --reps 3 --write
"""

from __future__ import annotations

import argparse
import json
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

READERS = ("h5py", "iter", "iter_u8", "iter_next", "episodes", "episodes_u8", "ray1", "ray2", "parquet", "minari")
IMAGE_ONLY = ("iter_u8", "episodes_u8")
COLUMNS = ["obs", "actions", "rewards", "terminateds", "truncateds"]
OBS_BYTES = {"cartpole": 4 * 4, "breakout": 84 * 84 * 4 * 4}
# Rows per batch: a Breakout row is 113 KB of float32 frames as the reader gives them (256 rows: 29 MB).
BATCH = {"cartpole": 4096, "breakout": 256}


def make_run(env: str, gb: float, out: str) -> str:
    """A run directory of one worker file holding at least ``gb`` GB of raw chunk bytes."""
    from bench_writer import chunks_of, episodes_from_env

    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.service.writer import RecordingWriter

    if env == "breakout":
        steps = int(gb * 1e9 / OBS_BYTES["breakout"]) + 200
        chunks = chunks_of(episodes_from_env(lambda: make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {}), steps, 200),
                           rows=200)
        copies = 1
    else:
        import gymnasium as gym

        chunks = chunks_of(episodes_from_env(lambda: gym.make("CartPole-v1"), 200_000, 25), rows=2000)
        copies = max(1, int(np.ceil(gb * 1e9 / sum(c.nbytes for c in chunks))))
    run_dir = os.path.join(out, f"{env}-run")
    os.makedirs(run_dir)
    writer = RecordingWriter(run_dir, "bench-read", StorageOptions())
    seq = 0
    for copy in range(copies):
        for chunk in chunks:
            writer.append(1, False, b"r" * 32, seq, _fresh_ids(chunk, copy) if copies > 1 else chunk)
            seq += 1
    writer.close()
    raw = copies * sum(c.nbytes for c in chunks)
    write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": "2.1", "run_id": "bench-read",
                             "status": "finished", "algorithm": "PPO", "api_stack": "new",
                             "env": "CartPole-v1" if env == "cartpole" else "ale_py:ALE/Breakout-v5-atari84x4"})
    print(f"wrote {run_dir}: {raw / 1e9:.2f} GB raw, {sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir)) / 1e9:.2f} GB on disk", flush=True)
    return run_dir


def _fresh_ids(chunk: Any, copy: int) -> Any:
    """``chunk`` with its episode ids made unique to replica ``copy``."""
    from rllib_recorder.format.chunks import Chunk, Stream

    def ids(values: np.ndarray) -> np.ndarray:
        return np.array([v[:-4] + f"{copy:04d}".encode() for v in values], dtype=values.dtype)

    streams = {}
    for key, s in chunk.streams.items():
        streams[key] = Stream({**s.steps, "eps_id": ids(s.steps["eps_id"])},
                              {**s.fragments, "eps_id": ids(s.fragments["eps_id"])}, s.containers, s.encoded, s.stacked)
    return Chunk(streams, chunk.env_steps, chunk.num_samples, chunk.sampled_at_s)


def read(reader: str, run_dir: str, aux: str) -> dict[str, Any]:
    """Reads the run one way (in this process); returns env steps read and seconds."""
    batch_size = BATCH["breakout" if "breakout" in os.path.basename(run_dir) else "cartpole"]
    import h5py  # noqa: F401 - every reader's imports before the clock starts (they cost 0.1-0.3 s)

    import rllib_recorder  # noqa: F401
    if reader == "minari":
        import minari  # noqa: F401
    start = time.perf_counter()
    steps = 0
    if reader == "h5py":
        import h5py

        path = os.path.join(run_dir, "worker-001.h5")
        with h5py.File(path, "r") as f:
            group = f["agents/default_agent/steps"]
            for name in group:
                dataset = group[name]
                if not isinstance(dataset, h5py.Dataset):
                    continue
                for part in dataset.iter_chunks():
                    dataset[part]
            steps = len(group["rewards"])
    elif reader in ("iter", "iter_u8", "iter_next"):
        from rllib_recorder import open_run

        with open_run(run_dir) as run:
            columns = COLUMNS + (["next_obs"] if reader == "iter_next" else [])
            for batch in run.iter_batches(batch_size, columns=columns, shuffle=reader == "iter_next", seed=0,
                                          decode=reader != "iter_u8"):
                steps += len(batch["rewards"])
    elif reader in ("episodes", "episodes_u8"):
        from rllib_recorder import open_run

        with open_run(run_dir) as run:
            for episode in run.episodes(decode=reader == "episodes"):
                steps += len(episode)
    elif reader in ("ray1", "ray2", "parquet"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        start = time.perf_counter()
        if reader == "parquet":
            dataset = ray.data.read_parquet(aux)
        else:
            from rllib_recorder import open_run

            with open_run(run_dir) as run:
                total = run.num_env_steps
                dataset = run.to_ray_dataset(rows_per_task=-(-total // (1 if reader == "ray1" else 2)))
        for batch in dataset.iter_batches(batch_size=batch_size, batch_format="numpy"):
            steps += len(batch["rewards"])
    elif reader == "minari":
        import minari

        os.environ["MINARI_DATASETS_PATH"] = aux
        dataset = minari.load_dataset("rllib-recorder/bench-v0")
        for episode in dataset.iterate_episodes():
            steps += len(episode.rewards)
    seconds = time.perf_counter() - start
    return {"steps": steps, "seconds": seconds, "rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=("cartpole", "breakout"), default="cartpole")
    parser.add_argument("--gb", type=float, default=1.0, help="raw GB of the run (at least)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--readers", nargs="+", default=list(READERS), choices=READERS)
    parser.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    parser.add_argument("--child", nargs=3, metavar=("READER", "RUN", "AUX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.env != "breakout":
        args.readers = [r for r in args.readers if r not in IMAGE_ONLY]
    if args.child:
        print("RESULT " + json.dumps(read(*args.child)))
        return
    work = tempfile.mkdtemp(prefix="bench_read_")
    try:
        run_dir = make_run(args.env, args.gb, work)
        aux = {"parquet": os.path.join(work, "parquet"), "minari": os.path.join(work, "minari")}
        cli = [sys.executable, "-m", "rllib_recorder.cli", "export", run_dir]
        exports = {"parquet": ["--to", "rllib", "-o", aux["parquet"]],
                   "minari": ["--to", "minari", "-o", aux["minari"], "--dataset-id", "rllib-recorder/bench-v0"]}
        export_s = {}
        for reader, options in exports.items():
            if reader in args.readers:
                start = time.perf_counter()
                subprocess.run(cli + options, check=True, stdout=subprocess.DEVNULL)
                export_s[reader] = time.perf_counter() - start
                print(f"export for {reader}: {export_s[reader]:.0f} s", flush=True)
        results: dict[str, list[dict[str, Any]]] = {r: [] for r in args.readers}
        for rep in range(args.reps):
            for reader in args.readers:
                proc = subprocess.run([sys.executable, __file__, "--child", reader, run_dir, aux.get(reader, "-")],
                                      capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{reader} failed: {proc.stderr[-2000:]}")
                result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
                results[reader].append(result)
                print(f"rep {rep} {reader}: {result['steps'] / result['seconds']:.0f} steps/s, "
                      f"{result['rss_mb']:.0f} MB RSS", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = _table(args.env, results) + "".join(
        f"Export for {reader} (`rllib-recorder export --to {'rllib' if reader == 'parquet' else 'minari'}`): "
        f"{seconds:.0f} s.\n" for reader, seconds in export_s.items())
    print(table)
    if args.write:
        common.write_section(f"Reading a run, {args.env} (benchmarks/bench_read.py)", table)


def _table(env: str, results: dict[str, list[dict[str, Any]]]) -> str:
    limit = np.median([r["steps"] / r["seconds"] for r in results.get("h5py", [])] or [np.nan])
    lines = ["| reader | env steps/s | MB/s of raw obs | vs plain h5py | peak RSS MB |", "|---|---|---|---|---|"]
    for reader, runs in results.items():
        rates = [r["steps"] / r["seconds"] for r in runs]
        mbs = [rate * OBS_BYTES[env] / 1e6 for rate in rates]
        lines.append(f"| {reader} | {common.cell(rates, '{:.0f}')} | {common.cell(mbs, '{:.1f}')} "
                     f"| {np.median(rates) / limit:.2f} | {max(r['rss_mb'] for r in runs):.0f} |")
    steps = results[next(iter(results))][0]["steps"]
    return "\n".join(lines) + f"\n\n{steps:,} env steps; each cell median (min) over the repetitions.\n"


if __name__ == "__main__":
    main()
