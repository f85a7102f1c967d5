"""Writer CPU per append against the append's size, the chunk-row limit of small columns and the column layout.

Every append recompresses the partial last HDF5 chunk of each compressed column of a file's ~35, so a column of
small rows (CartPole's rewards, t, ...) costs work in proportion to its chunk, not to the rows appended: this is
what ``datasets.MAX_CHUNK_ROWS`` bounds, and why the index tables, which get a few rows per append, are stored
unfiltered (layout "selective"; "all-gzip" compresses every column, as before 2026-12-02). Data: real CartPole-v1 vectors in 25-step episodes with an action_logp column,
appended through ``RecordingWriter.append`` (every column, indexes, commit, flushes) in this process; CPU time of
this process per append. 600 rows is what one of 4 env runners hands over per 2 s (coalesce_s) here, 2400 one
runner alone. Variants interleaved per repetition.

    python benchmarks/bench_append.py                  # writes its section of docs/BENCHMARKS.md
    python benchmarks/bench_append.py --reps 1 --steps 20000 --no-write
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

# Column layouts: "selective" (this version: index tables and incompressible step columns unfiltered) and
# "all-gzip" (every column gzip, as before 2026-12-02), by the schema constants that decide it.
LAYOUTS = {"selective": {}, "all-gzip": {"INDEX_PLAIN_ROW_BYTES": 0, "MIN_COMPRESSION_RATIO": 0.0}}


def run(work: str, chunks: list, max_chunk_rows: int, layout: str = "selective") -> tuple[float, int]:
    """(CPU seconds of every append after the first, file bytes) writing ``chunks`` with this chunk-row limit."""
    from rllib_recorder.format import datasets
    from rllib_recorder.service.writer import RecordingWriter

    changes = {"MAX_CHUNK_ROWS": max_chunk_rows, **LAYOUTS[layout]}
    saved = {k: getattr(datasets, k) for k in changes}
    for k, v in changes.items():
        setattr(datasets, k, v)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        writer = RecordingWriter(work, "bench", datasets.StorageOptions())
        writer.append(1, False, b"b" * 32, 0, chunks[0])  # creates the columns
        start = time.process_time()
        for seq, chunk in enumerate(chunks[1:], 1):
            writer.append(1, False, b"b" * 32, seq, chunk)
        cpu = time.process_time() - start
        writer.close()
    finally:
        for k, v in saved.items():
            setattr(datasets, k, v)
    return cpu, sum(os.path.getsize(os.path.join(work, f)) for f in os.listdir(work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60_000, help="CartPole steps per variant")
    parser.add_argument("--rows", type=int, nargs="+", default=[300, 600, 2400], help="rows per append")
    parser.add_argument("--limits", type=int, nargs="+", default=[4096, 1024, 512], help="MAX_CHUNK_ROWS values")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="column layouts: selective (this version) and all-gzip (every column compressed)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import gymnasium as gym
    from bench_writer import chunks_of, episodes_from_env

    from rllib_recorder.format import datasets

    episodes = episodes_from_env(lambda: gym.make("CartPole-v1"), args.steps, 25)
    data = {rows: chunks_of(episodes, rows) for rows in args.rows}
    work = tempfile.mkdtemp(prefix="bench_append_")
    cpu: dict[tuple[int, int, str], list[float]] = {}
    size: dict[tuple[int, int, str], int] = {}
    try:
        for rep in range(args.reps):
            for rows, chunks in data.items():
                for limit in args.limits:
                    for layout in args.layouts:
                        key = rows, limit, layout
                        seconds, size[key] = run(os.path.join(work, "w"), chunks, limit, layout)
                        cpu.setdefault(key, []).append(1000 * seconds / (len(chunks) - 1))
                print(f"rep {rep}, {rows} rows/append: " + ", ".join(
                    f"limit {k[1]} {k[2]} {v[-1]:.2f} ms" for k, v in cpu.items() if k[0] == rows), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["| rows per append | chunk-row limit | column layout | writer CPU ms per append | us per step "
             "| bytes per step on disk |", "|---|---|---|---|---|---|"]
    for (rows, limit, layout), values in cpu.items():
        default = " (default)" if limit == datasets.MAX_CHUNK_ROWS else ""
        lines.append(f"| {rows} | {limit}{default} | {layout} | {common.cell(values, '{:.2f}')} "
                     f"| {common.cell([1000 * v / rows for v in values], '{:.2f}')} "
                     f"| {size[rows, limit, layout] / args.steps:.1f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        common.write_section("Writer: cost of one append (benchmarks/bench_append.py)", table + f"""

{args.steps} CartPole steps per variant, {args.reps} repetitions, median (min) of the CPU time per append (the first
append, which creates the columns, not counted). Bytes per step: the whole file after closing (all columns,
indexes; compaction included). Layout "selective": the index tables' small-row columns unfiltered, step columns
gzip unless their first rows compress less than 1.25x (this version); "all-gzip": every column gzip.
""")


if __name__ == "__main__":
    main()
