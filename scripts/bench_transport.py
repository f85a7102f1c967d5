"""CPU per actor call that hands a chunk to a writer: inside the call (pickled, in pieces) or through the object store.

Ray carries an actor-call argument of up to max_direct_call_object_size (100 KiB by default) inside the call and
puts a bigger one into the object store, which also costs the raylet CPU: CPU that the recorder's own processes
(env runners, writers) never show. This measures both ways for real CartPole chunks of growing size, with the
writer's own ``append_pieces`` (unpickling included) and its ``append`` stubbed out (no HDF5): CPU of the calling
process, of the writer actor's process and of the raylet, per call, variants interleaved per repetition. It decides
``pool.INLINE_CHUNK_BYTES``, the size up to which a chunk goes inside the call.

    python scripts/bench_transport.py                     # writes its section of docs/BENCHMARKS.md
    python scripts/bench_transport.py --reps 1 --calls 50 --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402


def raylet_pid() -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "raylet":
                    return int(pid)
        except OSError:
            continue
    raise RuntimeError("no raylet process found")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[600, 1250, 2500, 5000, 10000, 20000],
                        help="CartPole steps per chunk")
    parser.add_argument("--calls", type=int, default=200, help="calls per variant and repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import gymnasium as gym
    import ray

    from bench_writer import chunks_of, episodes_from_env
    from rllib_recorder.pool import INLINE_CHUNK_BYTES, chunk_pieces
    from rllib_recorder.writer import RecordingWriter

    class Sink(RecordingWriter):
        """The writer's entry points with the HDF5 append stubbed out."""

        def __init__(self) -> None:  # no files
            pass

        def append(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {"rows": 0}

        def cpu(self) -> float:
            return time.process_time()

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    sink = ray.remote(Sink).options(num_cpus=0).remote()
    ray.get(sink.cpu.remote())
    raylet = raylet_pid()
    episodes = episodes_from_env(lambda: gym.make("CartPole-v1"), max(args.rows), 25)
    chunks = {rows: chunks_of(episodes[: rows // 25], rows)[0] for rows in args.rows}

    def one(chunk: Any, inline: bool) -> tuple[float, float, float]:
        refs = []
        c0, a0, r0 = time.process_time(), ray.get(sink.cpu.remote()), process_cpu(raylet)
        for seq in range(args.calls):
            if inline:  # pool.chunk_pieces without its size limit
                pieces = chunk_pieces(chunk, limit=1 << 62)
                refs.append(sink.append_pieces.remote(1, False, b"s" * 32, seq, None, *pieces))
            else:
                refs.append(sink.append.remote(1, False, b"s" * 32, seq, chunk, None))
            if len(refs) > 4:  # the outbox's window
                ray.get(refs.pop(0))
        ray.get(refs)
        c1, a1, r1 = time.process_time(), ray.get(sink.cpu.remote()), process_cpu(raylet)
        return tuple(1000 * (b - a) / args.calls for a, b in ((c0, c1), (a0, a1), (r0, r1)))

    results: dict[tuple[int, bool], list[tuple[float, float, float]]] = {}
    try:
        for rep in range(args.reps):
            for rows, chunk in chunks.items():
                for inline in ((False, True) if rep % 2 == 0 else (True, False)):
                    results.setdefault((rows, inline), []).append(one(chunk, inline))
                print(f"rep {rep}, {rows} rows: " + ", ".join(
                    f"{'inline' if i else 'object store'} {sum(results[rows, i][-1]):.2f} ms" for i in (False, True)),
                    flush=True)
    finally:
        ray.shutdown()
    lines = ["| rows per chunk | KiB of arrays | way | caller ms/call | writer ms/call | raylet ms/call "
             "| total ms/call | inline / object store (total) |", "|---|---|---|---|---|---|---|---|"]
    for rows, chunk in chunks.items():
        for inline in (False, True):
            values = results[rows, inline]
            ratio = [sum(a) / sum(b) for a, b in zip(values, results[rows, False])] if inline else None
            lines.append(
                f"| {rows} | {chunk.nbytes / 1024:.0f} | {'inside the call, pieces' if inline else 'object store'} "
                + "".join(f"| {benchdoc.cell([v[i] for v in values], '{:.2f}')} " for i in range(3))
                + f"| {benchdoc.cell([sum(v) for v in values], '{:.2f}')} "
                + f"| {benchdoc.cell(ratio) if ratio else ''} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        title = "Hand-off: inside the actor call or through the object store (scripts/bench_transport.py)"
        benchdoc.write_section(title, table + f"""

CPU per call, median (min) over {args.reps} repetitions of {args.calls} calls, at most 5 in flight. Chunks of
100 KiB or less go inside the call either way (Ray's own limit): both rows of a size measure the same path there.
`pool.INLINE_CHUNK_BYTES` = {INLINE_CHUNK_BYTES >> 10} KiB: chunks that pickle to at most this go inside the call.
""")


if __name__ == "__main__":
    main()
