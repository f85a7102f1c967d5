"""Read throughput of a recorded run by every way there is to read it, each against plain h5py doing the same work.

The run is written by the recorder's own writer from real observations (ALE Breakout through RLlib's Atari
wrappers, 84x84x4 float32 frames as RLlib hands them over, stored as uint8 newest frames, frame deltas; CartPole-v1
vectors under random actions, replicated with fresh episode ids to reach the size). Each reader runs in a child
process of its own (its peak RSS is its own): it reads once to warm the caches (page cache, the probe's and the
reader's own), then ``--reps`` times, and reports the best and the median (the issue's method: best of 3 in one
process, warm cache); ``cold`` is its first read, timed on the clock and in CPU seconds of the process and of the
probe's child (a machine shared with other work moves the first, hardly the second).

Baselines, plain h5py with numpy written by hand, on the same columns as the readers they are compared with:
  h5py       the five columns obs, actions, rewards, terminateds, truncateds of every worker file, as stored
             (Breakout: uint8 newest frames and fragment heads, frame deltas as stored)
  h5py_all   every step column (what episodes() reads), and the fragments' infos
  h5py_f32   Breakout: the five columns plus docs/FORMAT.md's decode by hand: frame deltas undone, 84x84x4 stacks
             rebuilt, float32 = code * scale + offset (the physical limit for float32 stacks from this data)
  h5py_u8    Breakout: the same, the stacks left as uint8 codes (what decode=False gives)
  h5py_eps   CartPole: the five columns cut into episodes by hand from the episode index (views of one fragment's
             rows, concatenation across fragments and for the final observation), as a user of plain h5py would
Readers (ratio against the baseline in brackets):
  iter       run.iter_batches(BATCH, columns=the five) [CartPole: h5py; Breakout: h5py_f32]
  iter_probe the same, in a process to which this machine has vouched for no file (as for a copied or downloaded
             run: its files are probed in a child process first; format/sound_files.py) [h5py]
  iter_u8    the same with decode=False: frames as uint8 codes, stacks rebuilt [h5py_u8] (Breakout only)
  iter_next  the same as iter with next_obs and shuffle=True (a 64k-row buffer) [h5py / h5py_f32]
  episodes5  run.episodes(columns=the five) [CartPole: h5py_eps, and h5py in the notes; Breakout: h5py_f32]
  episodes   run.episodes(): every column, infos, policy lag [CartPole: h5py_all; Breakout: h5py_f32]
  episodes_u8  run.episodes(decode=False, columns=the five) (Breakout only) [h5py_u8]
  ray1/ray2  run.to_ray_dataset with 1 and 2 read tasks, iter_batches of the same size in the driver
  parquet    RLlib's parquet from `export --to rllib`, read by ray.data.read_parquet (2 CPUs)
  minari     Minari's loader on the `export --to minari` dataset, iterate_episodes

    python benchmarks/bench_read.py --env cartpole --steps 200000 --reps 3 --write
    python benchmarks/bench_read.py --env cartpole --steps 10000000 --reps 3 --readers h5py iter episodes5 --write
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

from rllib_recorder.format import sound_files  # noqa: E402

READERS = ("h5py", "h5py_all", "h5py_f32", "h5py_u8", "h5py_eps", "iter", "iter_probe", "iter_u8", "iter_next", "episodes5", "episodes", "episodes_u8",
           "ray1", "ray2", "parquet", "minari")
IMAGE_ONLY = ("iter_u8", "episodes_u8", "h5py_f32", "h5py_u8")
# The baseline each reader is compared with: plain h5py doing the same work (module docstring).
BASELINE = {"cartpole": {"iter": "h5py", "iter_probe": "h5py", "iter_next": "h5py", "episodes5": "h5py_eps", "episodes": "h5py_all"},
            "breakout": {"iter": "h5py_f32", "iter_probe": "h5py_f32", "iter_next": "h5py_f32", "episodes5": "h5py_f32", "iter_u8": "h5py_u8",
                         "episodes_u8": "h5py_u8", "episodes": "h5py_f32"}}
COLUMNS = ["obs", "actions", "rewards", "terminateds", "truncateds"]
OBS_BYTES = {"cartpole": 4 * 4, "breakout": 84 * 84 * 4 * 4}
# Rows per batch: a Breakout row is 113 KB of float32 frames as the reader gives them (256 rows: 29 MB).
BATCH = {"cartpole": 4096, "breakout": 256}


def make_run(env: str, gb: float, out: str, steps: int | None = None) -> str:
    """A run directory of one worker file holding at least ``gb`` GB of raw chunk bytes (CartPole: ``steps``
    env steps, if given)."""
    from bench_writer import chunks_of, episodes_from_env

    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.service.writer import RecordingWriter

    if env == "breakout":
        steps = int(gb * 1e9 / OBS_BYTES["breakout"]) + 200
        episodes = episodes_from_env(lambda: make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {}), steps, 200,
                                     cut_at_end=True)
        chunks = chunks_of(episodes, rows=200, stack_frames=True)
        copies = 1
    else:
        import gymnasium as gym

        chunks = chunks_of(episodes_from_env(lambda: gym.make("CartPole-v1"), min(steps or 200_000, 200_000), 25),
                           rows=2000)
        per_copy = sum(c.env_steps for c in chunks)
        copies = (-(-steps // per_copy) if steps else max(1, int(np.ceil(gb * 1e9 / sum(c.nbytes for c in chunks)))))
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


def read(reader: str, run_dir: str, aux: str, reps: int = 3) -> dict[str, Any]:
    """Reads the run one way in this process: once cold, then ``reps`` times warm; env steps and seconds of each."""
    import h5py  # noqa: F401 - every reader's imports before the clock starts (they cost 0.1-0.3 s)

    import_s = time.perf_counter()
    from rllib_recorder import open_run  # noqa: F401 - the package's face imports its reader when first asked
    import_s = time.perf_counter() - import_s
    if reader == "minari":
        import minari  # noqa: F401
    if reader in ("ray1", "ray2", "parquet"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    times = []
    cpu = _cpu_s()
    for _ in range(1 + reps):
        start = time.perf_counter()
        steps = read_once(reader, run_dir, aux)
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            from rllib_recorder.format import probe

            probe._PROBER._stop()  # a reading process's probe child lives on; stopped, its CPU seconds count
            cold_cpu = [after - before for after, before in zip(_cpu_s(), cpu)]
    return {"steps": steps, "cold_s": times[0], "cold_cpu_s": cold_cpu, "seconds": times[1:],
            "rss_mb": _peak_rss_mb(), "import_s": import_s}


def _cpu_s() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its children that ended."""
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def read_once(reader: str, run_dir: str, aux: str) -> int:
    """Reads the run once ``reader``'s way; returns the env steps read."""
    env = "breakout" if "breakout" in os.path.basename(run_dir) else "cartpole"
    batch_size = BATCH[env]
    steps = 0
    if reader.startswith("h5py"):
        return _plain(reader, run_dir)
    if reader in ("iter", "iter_probe", "iter_u8", "iter_next"):
        from rllib_recorder import open_run

        with open_run(run_dir) as run:
            columns = COLUMNS + (["next_obs"] if reader == "iter_next" else [])
            for batch in run.iter_batches(batch_size, columns=columns, shuffle=reader == "iter_next", seed=0,
                                          decode=reader != "iter_u8"):
                steps += len(batch["rewards"])
    elif reader in ("episodes", "episodes5", "episodes_u8"):
        from rllib_recorder import open_run

        with open_run(run_dir) as run:
            for episode in run.episodes(decode=reader != "episodes_u8",
                                        columns=None if reader == "episodes" else COLUMNS):
                steps += len(episode.rewards)  # one field made, as a consumer makes at least one
    elif reader in ("ray1", "ray2", "parquet"):
        import ray

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
    return steps


def _plain(reader: str, run_dir: str) -> int:
    """Plain h5py and numpy by hand (the baselines of the module docstring); returns env steps read."""
    import h5py

    steps = 0
    for name in sorted(os.listdir(run_dir)):
        if not name.endswith(".h5"):
            continue
        with h5py.File(os.path.join(run_dir, name), "r") as f:
            group, frags = f["agents/default_agent/steps"], f["agents/default_agent/fragments"]
            if reader == "h5py_all":
                datasets: list[Any] = []
                group.visititems(lambda _, node: datasets.append(node) if isinstance(node, h5py.Dataset) else None)
                columns = {d.name: d[()] for d in datasets}
                if "infos" in frags:
                    frags["infos"][()]
            elif reader == "h5py_eps":
                _episodes_by_hand({c: group[c][()] for c in COLUMNS}, frags)
            else:
                columns = {c: group[c][()] for c in COLUMNS}
                if "frame_stack" in group["obs"].attrs:
                    columns["head_obs"] = frags["head_obs"][()]
                if reader in ("h5py_f32", "h5py_u8"):
                    columns["obs"] = _stacks_by_hand(group["obs"], frags, reader == "h5py_f32")
            steps += len(group["rewards"])
    return steps


def _episodes_by_hand(columns: dict[str, np.ndarray], frags: Any) -> list[dict[str, np.ndarray]]:
    """The five columns cut into episodes by hand from the episode index, as a user of plain h5py would: each
    fragment's rows as views, an episode of several fragments (and obs with its final observation) concatenated."""
    index = {k: frags[k][()] for k in ("eps_id", "first_row", "num_rows", "t_start", "has_last_obs")}
    last_obs = frags["last_obs"][()] if "last_obs" in frags else None
    parts: dict[bytes, list[int]] = {}
    for i, eps in enumerate(index["eps_id"].tolist()):
        parts.setdefault(eps, []).append(i)
    episodes = []
    firsts, nums, has_last = index["first_row"].tolist(), index["num_rows"].tolist(), index["has_last_obs"].tolist()
    for where in parts.values():
        where.sort(key=lambda i: index["t_start"][i])
        episode = {c: (v[firsts[where[0]]:firsts[where[0]] + nums[where[0]]] if len(where) == 1 else
                       np.concatenate([v[firsts[i]:firsts[i] + nums[i]] for i in where])) for c, v in columns.items()}
        if last_obs is not None and has_last[where[-1]]:
            episode["obs"] = np.concatenate([episode["obs"], last_obs[where[-1]:where[-1] + 1]])
        episodes.append(episode)
    return episodes


def _stacks_by_hand(obs: Any, frags: Any, to_float: bool = True) -> np.ndarray:
    """docs/FORMAT.md's decode of a frame-stacked, frame-delta column, by hand: the stacks of every row, float32
    (``code * scale + offset``) or as uint8 codes."""
    newest = obs[()][..., 0]
    first, num = frags["first_row"][()], frags["num_rows"][()]
    heads, k = frags["head_obs"][()], int(obs.attrs["frame_stack"])
    every = int(obs.attrs.get("delta_key_rows", 0))
    out = np.empty(newest.shape + (k,), np.float32 if to_float else np.uint8)
    scale, offset = np.float32(obs.attrs["scale"]), np.float32(obs.attrs["offset"])
    for i, (a, n) in enumerate(zip(first.tolist(), num.tolist())):
        rows = newest[a:a + n]
        if every:
            for b in range(0, n, every):
                np.bitwise_xor.accumulate(rows[b:b + every], axis=0, out=rows[b:b + every])
        frames = np.concatenate([np.moveaxis(heads[i], -1, 0), rows])
        for j in range(k):
            if to_float:
                np.multiply(frames[j:j + n], scale, out=out[a:a + n, ..., j])
                out[a:a + n, ..., j] += offset
            else:
                out[a:a + n, ..., j] = frames[j:j + n]
    return out


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
    parser.add_argument("--gb", type=float, default=1.0, help="raw GB of the run (at least), unless --steps")
    parser.add_argument("--steps", type=int, default=None, help="CartPole: env steps of the run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--readers", nargs="+", default=list(READERS), choices=READERS)
    parser.add_argument("--write", action="store_true", help="write the section of docs/BENCHMARKS.md")
    parser.add_argument("--child", nargs=4, metavar=("READER", "RUN", "AUX", "REPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.env != "breakout":
        args.readers = [r for r in args.readers if r not in IMAGE_ONLY]
    if args.child:
        reader, run_dir, aux, reps = args.child
        print("RESULT " + json.dumps(read(reader, run_dir, aux, int(reps))))
        return
    needed = {BASELINE[args.env].get(r) for r in args.readers} - {None}
    args.readers = [r for r in READERS if r in set(args.readers) | needed]
    work = tempfile.mkdtemp(prefix="bench_read_")
    try:
        run_dir = make_run(args.env, args.gb, work, args.steps)
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
        results: dict[str, dict[str, Any]] = {}
        for reader in args.readers:
            env = dict(os.environ)
            if reader == "iter_probe":  # no file vouched for: the probe's child walks each file first
                env[sound_files.ENV] = os.path.join(work, "no-sound-records")
            proc = subprocess.run([sys.executable, __file__, "--child", reader, run_dir, aux.get(reader, "-"),
                                   str(args.reps)], capture_output=True, text=True, env=env)
            if proc.returncode:
                sys.exit(f"{reader} failed: {proc.stderr[-2000:]}")
            result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
            results[reader] = result
            print(f"{reader}: best {result['steps'] / min(result['seconds']):.0f} steps/s, cold "
                  f"{result['steps'] / result['cold_s']:.0f} ({_cold(result)}), {result['rss_mb']:.0f} MB RSS",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = _table(args.env, results, args.reps) + "".join(
        f"Export for {reader} (`rllib-recorder export --to {'rllib' if reader == 'parquet' else 'minari'}`): "
        f"{seconds:.0f} s.\n" for reader, seconds in export_s.items())
    print(table)
    if args.write:
        size = f"{results[next(iter(results))]['steps']:,} steps"
        common.write_section(f"Reading a run, {args.env}, {size} (benchmarks/bench_read.py)", table)


def _table(env: str, results: dict[str, dict[str, Any]], reps: int) -> str:
    lines = ["| reader | env steps/s: best (median) | MB/s of raw obs, best | vs its baseline (which), best "
             "(median) | cold read, env steps/s | cold read: ms (CPU ms: process + probe child) | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for reader, r in results.items():
        rates = [r["steps"] / t for t in r["seconds"]]
        best, median = max(rates), float(np.median(rates))
        base = BASELINE[env].get(reader)
        ratio = "-"
        if base in results:
            base_rates = [results[base]["steps"] / t for t in results[base]["seconds"]]
            ratio = f"**{best / max(base_rates):.2f}** ({median / float(np.median(base_rates)):.2f}), {base}"
        lines.append(f"| {reader} | {best:,.0f} ({median:,.0f}) | {best * OBS_BYTES[env] / 1e6:,.1f} | {ratio} "
                     f"| {r['steps'] / r['cold_s']:,.0f} | {_cold(r)} | {r['rss_mb']:.0f} |")
    steps = results[next(iter(results))]["steps"]
    return "\n".join(lines) + (f"\n\n{steps:,} env steps; each reader in a process of its own: one cold read, then "
                               f"{reps} warm ones (best and median of those).\n" + _cold_bound(env, results))


def _cold(r: dict[str, Any]) -> str:
    own, child = r["cold_cpu_s"]
    return f"{1e3 * r['cold_s']:,.0f} ({1e3 * own:,.0f} + {1e3 * child:,.0f})"


def _cold_bound(env: str, results: dict[str, dict[str, Any]]) -> str:
    """Issue 49's bound on a fresh process's read: at most twice plain h5py's cold read plus 30 ms."""
    base = results.get(BASELINE[env]["iter"])
    if base is None:
        return ""
    bound = 2 * base["cold_s"] + 0.030
    return "".join(
        f"Cold {reader}: {1e3 * results[reader]['cold_s']:,.0f} ms against a bound of {1e3 * bound:,.0f} ms (2 x "
        f"{BASELINE[env]['iter']}'s cold {1e3 * base['cold_s']:,.0f} ms + 30 ms): "
        f"{'met' if results[reader]['cold_s'] <= bound else 'NOT met'}.\n"
        for reader in ("iter", "iter_probe") if reader in results) + (
        f"Before the clock, every reader imported h5py and numpy, and `from rllib_recorder import open_run` "
        f"(the reader's modules: {1e3 * results['iter']['import_s']:,.0f} ms in iter's process).\n"
        if "iter" in results else "")


if __name__ == "__main__":
    main()
