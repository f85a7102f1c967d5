"""Writer ingest throughput (MB/s of raw observations) against the disk and a bare h5py loop, same run.

Data: real frames of ALE Breakout through RLlib's Atari wrappers (84x84x4 float32, as RLlib hands them to the
callback) and real CartPole-v1 vectors, cut into episodes and coalesced into chunks as the outbox sends them.
Rows, interleaved per repetition:
  disk             raw sequential write of the same number of bytes (4 MiB blocks, fsync at the end)
  bare h5py        obs only, appended to one chunked uncompressed dataset, flushed per chunk
  writer <codec>   RecordingWriter.append (every column, indexes, commit, flush) in this process
  actor            the same through a Ray writer actor, window of 4 chunks: ingest and ack latency p50/p99

    python benchmarks/bench_writer.py                 # writes its section of docs/BENCHMARKS.md
    python benchmarks/bench_writer.py --reps 1 --frames 256 --no-write
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def episodes_from_env(make_env: Callable[[], Any], steps: int, episode_len: int, seed: int = 0,
                      cut_at_end: bool = False) -> list[Any]:
    """Real observations from ``make_env`` under random actions, as numpy SingleAgentEpisodes of ``episode_len``
    steps; ``cut_at_end``: an episode also ends where the env's does (as RLlib's are: frame stacks then repeat
    their frames within an episode, as an env runner's do)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    env = make_env()
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    episodes, t_total = [], 0
    while t_total < steps:
        n = min(episode_len, steps - t_total)
        observations, actions, rewards, ended = [obs], [], [], False
        for _ in range(n):
            action = int(rng.integers(env.action_space.n))
            obs, reward, terminated, truncated, _ = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(float(reward))
            if terminated or truncated:
                obs, _ = env.reset()
                if cut_at_end:
                    ended = True
                    break
                observations[-1] = obs
        n = len(actions)
        episode = SingleAgentEpisode(
            observations=observations, actions=actions, rewards=rewards, infos=[{}] * (n + 1),
            extra_model_outputs={"action_logp": list(rng.normal(size=n).astype(np.float32)),
                                 "weights_seq_no": [0] * n},
            len_lookback_buffer=0, terminated=ended,
        )
        episode.to_numpy()
        episodes.append(episode)
        t_total += n
    return episodes


def chunks_of(episodes: list[Any], rows: int, stack_frames: bool = False) -> list[Any]:
    """Chunks of about ``rows`` steps; ``stack_frames``: image stacks as an env runner sends them (uint8 codes,
    newest frames)."""
    from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk

    options = ConvertOptions(encode_images=True, stack_frames=True) if stack_frames else None
    convert = (lambda batch: episodes_to_chunk(batch, options)) if options else episodes_to_chunk
    chunks, batch, n = [], [], 0
    for episode in episodes:
        batch.append(episode)
        n += len(episode)
        if n >= rows:
            chunks.append(convert(batch))
            batch, n = [], 0
    if batch:
        chunks.append(convert(batch))
    return chunks


def obs_bytes(chunks: list[Any]) -> int:
    return sum(c.streams["default_agent"].steps["obs"].nbytes for c in chunks)


def disk_write(path: str, nbytes: int) -> float:
    block = np.random.default_rng(0).integers(0, 256, size=4 << 20, dtype=np.uint8).tobytes()
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def bare_h5py(path: str, chunks: list[Any]) -> float:
    import h5py

    first = chunks[0].streams["default_agent"].steps["obs"]
    start = time.perf_counter()
    with h5py.File(path, "w") as f:
        rows = max(1, (64 << 10) // max(1, first[0].nbytes))
        dataset = f.create_dataset("obs", shape=(0,) + first.shape[1:], maxshape=(None,) + first.shape[1:],
                                   dtype=first.dtype, chunks=(rows,) + first.shape[1:])
        n = 0
        for chunk in chunks:
            obs = chunk.streams["default_agent"].steps["obs"]
            dataset.resize(n + len(obs), axis=0)
            dataset[n:] = obs
            n += len(obs)
            f.flush()
    return time.perf_counter() - start


def writer_run(run_dir: str, chunks: list[Any], storage: Any) -> tuple[float, int]:
    from rllib_recorder.service.writer import RecordingWriter

    writer = RecordingWriter(run_dir, "bench", storage)
    start = time.perf_counter()
    for seq, chunk in enumerate(chunks):
        writer.append(1, False, b"b" * 32, seq, chunk)
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed, benchdoc_dir_bytes(run_dir)


def actor_run(run_dir: str, chunks: list[Any], window: int = 4) -> tuple[float, list[float]]:
    """Appends ``chunks`` through a writer actor with ``window`` calls in flight; (seconds, ack latencies).

    Every acknowledgement is fetched and checked: a failed or duplicate append raises instead of being timed.
    """
    import ray

    from rllib_recorder.format import datasets
    from rllib_recorder.service.writer import RecordingWriter

    actor = ray.remote(RecordingWriter).options(num_cpus=0).remote(run_dir, "bench-actor", datasets.StorageOptions())
    ray.get(actor.stats.remote())
    refs = [ray.put(c) for c in chunks]  # the env runner's side of the copy is not timed here
    latencies, in_flight, rows = [], {}, 0

    def acknowledge() -> None:
        nonlocal rows
        done, _ = ray.wait(list(in_flight), num_returns=1)
        latencies.append(time.perf_counter() - in_flight.pop(done[0]))
        ack = ray.get(done[0])  # raises the writer's error, if any
        if ack["duplicate"]:
            raise RuntimeError(f"actor run: chunk {ack['seq']} was taken for a duplicate; use a fresh run_dir")
        rows += ack["rows"]

    start = time.perf_counter()
    for seq, ref in enumerate(refs):
        while len(in_flight) >= window:
            acknowledge()
        in_flight[actor.append.remote(1, False, b"a" * 32, seq, ref)] = time.perf_counter()
    while in_flight:
        acknowledge()
    elapsed = time.perf_counter() - start
    ray.get(actor.close.remote())
    ray.kill(actor)
    if rows != sum(c.agent_steps for c in chunks):
        raise RuntimeError(f"actor run stored {rows} rows of {sum(c.agent_steps for c in chunks)}")
    return elapsed, latencies


def benchdoc_dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=2048, help="Breakout steps (84x84x4 float32 each)")
    parser.add_argument("--vectors", type=int, default=200_000, help="CartPole steps")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import gymnasium as gym
    import ray

    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.format.datasets import StorageOptions

    inputs = {
        "Breakout 84x84x4": chunks_of(episodes_from_env(
            lambda: make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {}), args.frames, 200), rows=64),
        "CartPole 4 x f32": chunks_of(episodes_from_env(lambda: gym.make("CartPole-v1"), args.vectors, 500), rows=4096),
    }
    base = StorageOptions()
    codecs = {
        "writer gzip-1 (default)": base,
        "writer lzf": replace(base, compression="lzf"),
        "writer none": replace(base, compression="none"),
        "writer gzip-1, float32 kept": replace(base, encode_uint8=False),
    }
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    work = tempfile.mkdtemp(prefix="bench_writer_")
    results: dict[tuple[str, str], list[float]] = {}
    disk: dict[tuple[str, str], int] = {}
    latency: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps):
            for name, chunks in inputs.items():
                mb = obs_bytes(chunks) / 1e6
                steps = sum(c.agent_steps for c in chunks)
                # the disk's bandwidth, from a write large enough to measure it (at least 256 MB)
                disk_s = disk_write(os.path.join(work, "raw.bin"), max(256 << 20, int(mb * 1e6)))
                timings = {"disk (sequential write)": disk_s * mb * 1e6 / max(256 << 20, int(mb * 1e6)),
                           "bare h5py (obs only, no filter)": bare_h5py(os.path.join(work, "bare.h5"), chunks)}
                for codec, storage in codecs.items():
                    run_dir = os.path.join(work, f"w-{rep}-{codec}")
                    timings[codec], size = writer_run(run_dir, chunks, storage)
                    disk[(name, codec)] = size / steps
                    shutil.rmtree(run_dir)
                # a run directory per dataset: the two datasets' columns differ in shape
                elapsed, lat = actor_run(os.path.join(work, f"a-{rep}-{name.split()[0]}"), chunks)
                timings["actor, window 4 (default codec)"] = elapsed
                latency.setdefault(name, []).extend(lat)
                for row, seconds in timings.items():
                    results.setdefault((name, row), []).append(mb / seconds)
                print(f"rep {rep} {name}: " + ", ".join(f"{k} {mb / v:.0f} MB/s" for k, v in timings.items()),
                      flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    lines = ["| data | path | MB/s of raw obs | steps/s | vs disk | disk bytes/step (all columns) | ack p50 / p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for name, chunks in inputs.items():
        steps = sum(c.agent_steps for c in chunks)
        raw_step = sum(c.nbytes for c in chunks) / steps
        obs_mb = obs_bytes(chunks) / 1e6
        disk_mbs = results[(name, "disk (sequential write)")]
        for (data, row), values in results.items():
            if data != name:
                continue
            ratio = [v / d for v, d in zip(values, disk_mbs)]
            per_step = f"{disk[(name, row)]:.0f} ({raw_step / disk[(name, row)]:.1f}x smaller)" if (name, row) in disk else ""
            lat = ""
            if row.startswith("actor"):
                ms = np.array(latency[name]) * 1000
                lat = f"{np.percentile(ms, 50):.1f} / {np.percentile(ms, 99):.1f}"
            steps_s = [v / obs_mb * steps for v in values]
            lines.append(f"| {name} | {row} | {common.cell(values, '{:.0f}')} | {common.cell(steps_s, '{:.0f}')} "
                         f"| {common.cell(ratio, '{:.2f}')} "
                         f"| {per_step} | {lat} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        common.write_section("Writer ingest (benchmarks/bench_writer.py)", table + f"""

{args.frames} Breakout steps (raw obs {obs_bytes(inputs['Breakout 84x84x4']) / 1e6:.0f} MB, chunks of 64 steps) and
{args.vectors} CartPole steps (chunks of 4096 steps); {args.reps} repetitions, median (min). "vs disk" is the ratio to
the raw sequential write (256 MB, fsync) measured in the same repetition. Bytes/step count the whole file (all
columns, indexes), "x smaller" compares them with the raw arrays of all columns.
""")


if __name__ == "__main__":
    main()
