"""Fan-in: how many env runners one writer serves, CartPole and Breakout.

The hand-off is the spool: each env runner (sender) writes every sample into its own spool files before
``sample()`` returns, and the writer on its node reads the spools and commits into one HDF5 file per runner
(docs/ARCHITECTURE.md). One writer (``SpoolWriter``, as the actor runs it, in this process) serves 1 .. 32 senders,
each a separate process writing through the real ``Outbox`` with real chunks (ALE Breakout frames through RLlib's
Atari wrappers, sent as uint8 newest frames as a runner sends them; CartPole-v1 vectors):

  capacity  the senders fill their spools first (a fixed total of env steps split among them); then the writer
            drains them on one core: env steps/s and MB/s raw (every column as sampled, Breakout's frames as the float32
            stacks they stand for) per writer CPU second, and the
            writer's CPU split (cProfile, a separate pass: spool reading and decoding, the HDF5 append by part)
  live      the senders replay their chunks paced at a real runner's production rate (measured on this machine:
            ``--runner-steps-per-s``) for ``--seconds``, the writer's thread running as in a run with default
            settings: commit latency p50/p99 (the chunk's ``written_at_s`` minus ``sampled_at_s``, which includes
            ``coalesce_s``) and the writer's CPU share
  sender    CPU microseconds per ``Outbox.add`` of one chunk, in the sender (what recording costs a runner)

From capacity: runners one writer serves = writer env steps per CPU second / a runner's production rate.

    python benchmarks/bench_fanin.py --write          # the table in docs/BENCHMARKS.md and docs/fanin.png
    python benchmarks/bench_fanin.py --env cartpole --senders 1 4 --seconds 5
    python benchmarks/bench_fanin.py --chart-only     # redraws docs/fanin.png from the table
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

# Env steps a real env runner of this machine produces per second (BENCHMARKS.md, the writer table's note:
# about 1.2k CartPole and 110 Breakout steps/s per runner); rows per chunk as a runner sends them.
PRODUCTION = {"cartpole": 1200.0, "breakout": 110.0}
CHUNK_ROWS = {"cartpole": 500, "breakout": 100}
CAPACITY_STEPS = {"cartpole": 400_000, "breakout": 6_000}
TARGET_RUNNERS = {"cartpole": 64, "breakout": 16}  # the issue's: one writer on one core serves at least these
SECTION = "Fan-in: env runners per writer (benchmarks/bench_fanin.py)"
CHART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fanin.png")


def draw_chart(rows: list[tuple[str, int, float]], path: str = CHART) -> None:
    """Runners one writer serves against senders, per env, with the targets: ``rows`` are (env, senders, runners)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for env, color in (("cartpole", "tab:blue"), ("breakout", "tab:orange")):
        points = sorted((n, r) for e, n, r in rows if e == env)
        if not points:
            continue
        ax.plot([n for n, _ in points], [r for _, r in points], marker="o", color=color, label=f"{env}")
        ax.axhline(TARGET_RUNNERS[env], color=color, linestyle=":", linewidth=1,
                   label=f"{env} target ({TARGET_RUNNERS[env]})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    senders = sorted({n for _, n, _ in rows})
    ax.set_xticks(senders, [str(n) for n in senders])
    ax.set_ylim(bottom=min([10.0] + [r / 2 for _, _, r in rows]))
    ax.set_xlabel("senders (env runners) feeding one writer")
    ax.set_ylabel("runners one writer serves\n(capacity per CPU s / production)")
    ax.set_title("Fan-in: one writer on one core", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def rows_from_doc() -> list[tuple[str, int, float]]:
    """(env, senders, runners served) from the table of docs/BENCHMARKS.md."""
    text = open(common.DOC).read()
    section = text[text.index(f"<!-- {SECTION}:start -->"):text.index(f"<!-- {SECTION}:end -->")]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in TARGET_RUNNERS and cells[1].isdigit():
            rows.append((cells[0], int(cells[1]), float(cells[4])))
    return rows


def make_chunks(env: str) -> list[Any]:
    """Real chunks as an env runner converts them for its outbox (Breakout: uint8 codes of the newest frames)."""
    from bench_writer import episodes_from_env

    from rllib_recorder.commands.envs import make_atari_env
    from rllib_recorder.config import RecorderConfig
    from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk

    config = RecorderConfig()
    options = ConvertOptions(config.record_infos, config.record_extra_model_outputs, config.encode_uint8,
                             config.stack_frames)
    if env == "breakout":
        episodes = episodes_from_env(lambda: make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {}), 1200, 200)
    else:
        import gymnasium as gym

        episodes = episodes_from_env(lambda: gym.make("CartPole-v1"), 20_000, 25)
    chunks, batch, rows = [], [], 0
    for episode in episodes:
        batch.append(episode)
        rows += len(episode)
        if rows >= CHUNK_ROWS[env]:
            chunks.append(episodes_to_chunk(batch, options))
            batch, rows = [], 0
    return chunks


def bytes_per_step(env: str) -> float:
    """Raw bytes per env step: every column as sampled (``Chunk.nbytes``: Breakout's frames as float32 stacks)."""
    chunks = make_chunks_cached(env)
    return sum(c.nbytes for c in chunks) / sum(c.env_steps for c in chunks)


def sender(run_dir: str, worker_index: int, env: str, steps: int, rate: float, seconds: float,
           out: Any) -> None:
    """One env runner's hand-off: the real Outbox writing real chunks into its spool."""
    from rllib_recorder.format.spool_files import SPOOL_DIR, SegmentWriter
    from rllib_recorder.record.outbox import Outbox

    chunks = make_chunks_cached(env)
    stem = f"worker-{worker_index:03d}"
    outbox = Outbox(SegmentWriter(os.path.join(run_dir, SPOOL_DIR, stem, uuid.uuid4().hex)), policy="block",
                    max_backlog_bytes=1 << 40)
    cpu, sent, start = 0.0, 0, time.time()
    i = 0
    while (sent < steps) if rate <= 0 else (time.time() - start < seconds):
        chunk = chunks[i % len(chunks)]
        i += 1
        if rate > 0:  # paced as a runner produces: this chunk is handed over when its steps are sampled
            due = start + sent / rate
            if due > time.time():
                time.sleep(due - time.time())
        chunk = _stamped(chunk, time.time())
        c0 = time.process_time()
        outbox.add(chunk)
        cpu += time.process_time() - c0
        sent += chunk.env_steps
    outbox.close()
    out.put((worker_index, sent, i, cpu))


_CHUNKS: dict[str, list[Any]] = {}


def make_chunks_cached(env: str) -> list[Any]:
    if env not in _CHUNKS:
        _CHUNKS[env] = make_chunks(env)
    return _CHUNKS[env]


def _stamped(chunk: Any, at: float) -> Any:
    from rllib_recorder.format.chunks import Chunk

    return Chunk(chunk.streams, chunk.env_steps, chunk.num_samples, at)


def run_senders(run_dir: str, env: str, n: int, steps: int, rate: float, seconds: float) -> list[tuple]:
    ctx = mp.get_context("fork")  # the chunks made once in the parent are shared
    out = ctx.Queue()
    procs = [ctx.Process(target=sender, args=(run_dir, i + 1, env, steps // n, rate, seconds, out)) for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def make_writer(run_dir: str, thread: bool) -> Any:
    from rllib_recorder.config import RecorderConfig
    from rllib_recorder.service.pool import SpoolWriter

    return SpoolWriter(run_dir, "bench-fanin", RecorderConfig(num_writers=1), thread=thread)


def committed(run_dir: str) -> tuple[int, np.ndarray]:
    """Env steps committed in the run's files, and every chunk's commit latency (written_at_s - sampled_at_s)."""
    steps, latencies = 0, []
    with open_run_dir(run_dir) as run:
        for f in run.files:
            b = f.batches()
            steps += int(b["env_steps"].sum())
            latencies.append(b["written_at_s"] - b["sampled_at_s"])
    return steps, np.concatenate(latencies) if latencies else np.zeros(0)


def open_run_dir(run_dir: str) -> Any:
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.read.run import open_run

    if not os.path.exists(os.path.join(run_dir, "manifest.json")):
        write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": "2.2", "run_id": "bench-fanin",
                                 "status": "finished", "algorithm": "PPO", "api_stack": "new", "env": "bench"})
    return open_run(run_dir)


def capacity(env: str, n: int, work: str, profile: bool) -> dict[str, Any]:
    run_dir = os.path.join(work, f"cap-{env}-{n}{'-prof' if profile else ''}")
    os.makedirs(run_dir)
    senders = run_senders(run_dir, env, n, CAPACITY_STEPS[env], 0.0, 0.0)
    sent = sum(s[1] for s in senders)
    writer = make_writer(run_dir, thread=False)
    profiler = cProfile.Profile() if profile else None
    c0, w0 = time.process_time(), time.perf_counter()
    if profiler:
        profiler.enable()
    writer.flush()
    writer.close()
    if profiler:
        profiler.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    steps, _ = committed(run_dir)
    if steps != sent:
        sys.exit(f"capacity {env} x{n}: committed {steps} of {sent} steps handed over")
    shutil.rmtree(run_dir, ignore_errors=True)
    result = {"steps": steps, "cpu_s": cpu, "wall_s": wall,
              "sender_us": 1e6 * sum(s[3] for s in senders) / max(1, sum(s[2] for s in senders))}
    if profiler:
        result["split"] = cpu_split(profiler)
    return result


def _drain(run_dir: str, writers: int, index: int) -> None:
    from rllib_recorder.config import RecorderConfig
    from rllib_recorder.service.pool import SpoolWriter

    writer = SpoolWriter(run_dir, "bench-fanin", RecorderConfig(num_writers=writers), writer_index=index,
                         thread=False)
    writer.flush()
    writer.close()


def pool(env: str, writers: int, n: int, work: str) -> dict[str, Any]:
    """``n`` senders fill their spools; then ``writers`` writer processes (each owning its share of the runners, as
    ``num_writers`` assigns them) drain them at once: env steps per wall second of the whole pool."""
    run_dir = os.path.join(work, f"pool-{env}-{writers}-{n}")
    os.makedirs(run_dir)
    sent = sum(s[1] for s in run_senders(run_dir, env, n, CAPACITY_STEPS[env], 0.0, 0.0))
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_drain, args=(run_dir, writers, i)) for i in range(writers)]
    w0 = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    wall = time.perf_counter() - w0
    steps, _ = committed(run_dir)
    if steps != sent:
        sys.exit(f"pool {env} x{writers}: committed {steps} of {sent} steps handed over")
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"steps": steps, "wall_s": wall}


POOL_SECTION = "Fan-in: a pool of writers (benchmarks/bench_fanin.py --pool)"


def pool_table(env_names: list[str], work: str, reps: int, n: int = 16) -> str:
    lines = [f"| env | writers | env steps/s, median (min) of {reps} | MB/s raw | scaling |", "|---|---|---|---|---|"]
    for env in env_names:
        make_chunks_cached(env)
        raw = bytes_per_step(env)
        base = None
        for writers in (1, 2):
            rates = [r["steps"] / r["wall_s"] for r in (pool(env, writers, n, work) for _ in range(reps))]
            med, low = float(np.median(rates)), float(min(rates))
            base = base or med
            lines.append(f"| {env} | {writers} | {med:,.0f} ({low:,.0f}) | {med * raw / 1e6:.1f} | {med / base:.2f}x |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def cpu_split(profiler: cProfile.Profile) -> dict[str, float]:
    """Share of the writer's CPU by part, from the functions' own time."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    parts = {"spool read + decode": ("spool.py", "spool_reader.py", "spool_files.py", "ingest.py"),
             "chunk concat (coalesce)": ("chunks.py",),
             "HDF5 write + compression": ("h5py", "open_columns.py", "datasets.py", "append.py", "commits.py"),
             "numpy": ("numpy",)}
    total = sum(v[2] for v in stats.values())
    out = {k: 0.0 for k in parts}
    out["other"] = 0.0
    for (path, _, name), v in stats.items():
        part = next((k for k, keys in parts.items() if any(key in path for key in keys)), None)
        if part is None and path == "~":  # builtins: attribute them by name
            part = ("HDF5 write + compression" if "h5" in name or "write" in name or "flush" in name
                    else "spool read + decode" if "read" in name or "frombuffer" in name or "crc" in name
                    else "numpy" if "numpy" in name or "method" in name else None)
        out[part or "other"] += v[2]
    return {k: v / total for k, v in out.items()}


def live(env: str, n: int, work: str, seconds: float, rate: float) -> dict[str, Any]:
    run_dir = os.path.join(work, f"live-{env}-{n}")
    os.makedirs(run_dir)
    writer = make_writer(run_dir, thread=True)
    c0 = time.process_time()
    w0 = time.perf_counter()
    senders = run_senders(run_dir, env, n, 0, rate, seconds)
    writer.flush()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    writer.close()
    steps, latencies = committed(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"steps": steps, "sent": sum(s[1] for s in senders), "cpu_share": cpu / wall,
            "p50": float(np.percentile(latencies, 50)), "p99": float(np.percentile(latencies, 99))}


POOL_NOTE = """16 senders fill their spools first (the capacity pass's steps); then the writers drain them at once, each in
its own process owning the runners `num_writers` assigns it, on this machine's 2 cores and one disk. Wall seconds
for the whole pool. Scaling: env steps/s against one writer's. With 2 cores, 2 writers is as far as this machine
goes; past it, the disk's bandwidth (the writers' MB/s of segment bytes, a few MB/s here, far below the disk's)
is not what binds first: the writers' CPU is."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", nargs="+", default=["cartpole", "breakout"])
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each live pass")
    parser.add_argument("--reps", type=int, default=2, help="capacity passes per sender count")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--chart-only", action="store_true", help="redraw docs/fanin.png from the written table")
    parser.add_argument("--pool", action="store_true", help="1 and 2 writers draining 16 senders' spools at once")
    args = parser.parse_args()
    if args.pool:
        work = tempfile.mkdtemp(prefix="bench_fanin_")
        try:
            body = pool_table(args.env, work, max(args.reps, 3))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(body)
        if args.write:
            common.write_section(POOL_SECTION, body + "\n\n" + POOL_NOTE)
        return
    if args.chart_only:
        draw_chart(rows_from_doc())
        return
    work = tempfile.mkdtemp(prefix="bench_fanin_")
    lines, served = [], []
    try:
        for env in args.env:
            make_chunks_cached(env)  # once, before the senders fork
            raw = bytes_per_step(env)
            for n in args.senders:
                caps = [capacity(env, n, work, profile=False) for _ in range(args.reps)]
                rates = [c["steps"] / c["cpu_s"] for c in caps]
                lv = live(env, n, work, args.seconds, PRODUCTION[env])
                serves = np.median(rates) / PRODUCTION[env]
                served.append((env, n, float(serves)))
                line = (f"| {env} | {n} | {common.cell(rates, '{:.0f}')} | {np.median(rates) * raw / 1e6:.0f} | "
                        f"{serves:.0f} | {lv['p50']:.2f} / {lv['p99']:.2f} | {100 * lv['cpu_share']:.0f}% | "
                        f"{np.median([c['sender_us'] for c in caps]):.0f} |")
                print(line, flush=True)
                lines.append(line)
            split = capacity(env, 8, work, profile=True)["split"]
            lines.append(f"| {env} | CPU split, 8 senders (cProfile) | "
                         + ", ".join(f"{k} {100 * v:.0f}%" for k, v in split.items()) + " | | | | | |")
            print(lines[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = ("| env | senders | writer env steps per CPU s | MB/s raw per CPU s | runners one writer serves | "
             "live commit latency p50 / p99 s | live writer CPU | sender CPU us per chunk |\n"
             "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n"
             f"Runners served: the writer's capacity over a runner's production on this machine "
             f"({PRODUCTION['cartpole']:.0f} CartPole, {PRODUCTION['breakout']:.0f} Breakout steps/s). Live: each "
             f"sender paced at that rate for {args.seconds:.0f} s, default settings (latency includes coalesce_s = "
             f"2 s). Chunks of {CHUNK_ROWS['cartpole']} CartPole / {CHUNK_ROWS['breakout']} Breakout rows.\n")
    print(table)
    if args.write:
        common.write_section(SECTION, table)
        draw_chart(served)


if __name__ == "__main__":
    main()
