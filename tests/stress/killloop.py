"""Kill loop: SIGKILL a process appending to a recorder file, again and again, and check every committed row.

A child process appends chunks to one worker file through the real writer (``RecordingWriter``) as fast
as it can, so nearly every kill lands in the middle of an append. After each kill the parent reopens the
file the way a restarted writer does (dropping uncommitted rows) and checks every committed row value by
value. The first damaged commit ends the variant's run. Rows encode their own index, and part of each row
is hash noise, so compressed chunk sizes vary and HDF5 rewrites tail chunks at new sizes (the case that
matters).

    python tests/stress/killloop.py --kills 300 --file-space none fsm
    python tests/stress/killloop.py --space          # no kills: file size (peak, final) per strategy and append size

Not a test: it runs for minutes and its answer is statistical. Results go in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rllib_recorder.errors import RecorderError  # noqa: E402
from rllib_recorder.format import append, commits, datasets, layout  # noqa: E402
from rllib_recorder.format.chunks import Chunk, Stream  # noqa: E402

AGENT = "default_agent"
WIDTH = 8


def expected_obs(first: int, n: int) -> np.ndarray:
    """Rows ``first..first+n``: column 0 is the row index, the rest hash noise of it."""
    rows = np.arange(first, first + n, dtype=np.uint64)
    out = np.empty((n, WIDTH), np.float32)
    out[:, 0] = rows
    for j in range(1, WIDTH):
        out[:, j] = ((rows * np.uint64(2654435761 + j)) % np.uint64(1 << 20)).astype(np.float32)
    return out


def make_chunk(first: int, n: int) -> Chunk:
    obs = expected_obs(first, n + 1)
    eps_id = f"{first:036d}".encode()
    steps = {
        "obs": obs[:n], "actions": np.arange(first, first + n, dtype=np.int64) % 2,
        "rewards": np.arange(first, first + n, dtype=np.float64),
        "terminateds": np.zeros(n, bool), "truncateds": np.zeros(n, bool),
        "eps_id": np.full(n, eps_id, dtype="S36"), "t": np.arange(n, dtype=np.int64),
        "weights_seq_no": np.zeros(n, np.int64),
    }
    fragments = {
        "eps_id": np.array([eps_id]), "num_rows": np.array([n]), "t_start": np.array([0]),
        "terminated": np.array([False]), "truncated": np.array([False]),
        "return": np.array([float(steps["rewards"].sum())]), "module_id": np.array([""], object),
        "has_last_obs": np.array([True]), "last_obs": obs[n:],
        "start_state": _object_array([np.zeros(0, np.uint8)]), "start_state_kind": np.array([""], object),
        "infos": np.array([json.dumps([{"row": first + i} for i in range(n + 1)])], object),
    }
    return Chunk(streams={AGENT: Stream(steps, fragments)}, env_steps=n, sampled_at_s=time.time())


def _object_array(items: list) -> np.ndarray:
    out = np.empty(len(items), object)
    out[:] = items
    return out


def child(run_dir: str, file_space: str, rows: int) -> None:
    from rllib_recorder.service.writer import RecordingWriter

    writer = RecordingWriter(run_dir, "killloop", datasets.StorageOptions(file_space=file_space))
    sender = os.urandom(8).hex().encode()
    h5 = writer._file((1, False))
    first = commits.read_commit(h5)["agents"].get(AGENT, (0, 0))[0]
    print("ready", flush=True)
    seq = 0
    while True:
        n = random.randint(1, rows)
        writer.append(1, False, sender, seq, make_chunk(first, n))
        first += n
        seq += 1


def check(path: str, file_space: str) -> tuple[int, str | None]:
    """Reopens like a restarted writer, then checks every committed row; (rows, problem or None)."""
    try:
        h5 = append.open_for_append(path, {"run_id": "killloop"}, file_space)
    except (RecorderError, OSError, KeyError, ValueError, RuntimeError) as e:  # what h5py raises on damage
        return -1, f"reopen failed: {type(e).__name__}: {e}"
    try:
        rows = commits.read_commit(h5)["agents"].get(AGENT, (0, 0))[0]
        if not rows:
            return 0, None
        steps = h5[f"agents/{AGENT}/steps"]
        obs = steps["obs"][:rows]
        bad = np.flatnonzero((obs != expected_obs(0, rows)).any(axis=1))
        if len(bad):
            return rows, f"{len(bad)} committed obs rows differ, first {bad[0]}"
        if not np.array_equal(steps["rewards"][:rows], np.arange(rows, dtype=np.float64)):
            return rows, "committed rewards differ"
        return rows, None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return -1, f"reading committed rows failed: {type(e).__name__}: {e}"
    finally:
        h5.close()


def run_variant(file_space: str, kills: int, rows: int, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix=f"killloop-{file_space}-") as run_dir:
        path = os.path.join(run_dir, layout.file_name(1))
        committed = 0
        problem = None
        done = 0
        max_size = 0
        for done in range(1, kills + 1):
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", run_dir, "--file-space", file_space, "--rows", str(rows)],
                stdout=subprocess.PIPE, text=True,
            )
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            max_size = max(max_size, os.path.getsize(path))
            committed, problem = check(path, file_space)
            if problem:
                kept = os.path.join(tempfile.gettempdir(), f"killloop-damaged-{file_space}-seed{seed}.h5")
                shutil.copyfile(path, kept)
                problem += f" (file kept: {kept})"
                break
            if done % 50 == 0:
                print(f"  {file_space}: {done} kills, {committed} committed rows intact", file=sys.stderr, flush=True)
        live = _sum_storage(path) if not problem else 0
        return {"file_space": file_space, "kills": done, "damaged": bool(problem), "problem": problem,
                "committed_rows": committed, "file_bytes": os.path.getsize(path), "max_file_bytes": max_size,
                "live_bytes": live}


def _sum_storage(path: str) -> int:
    """Bytes the datasets' chunks take (the rest of the file is metadata and dead space)."""
    import h5py

    with h5py.File(path, "r") as h5:
        return commits.datasets_bytes(h5)


def space(file_space: str, rows: int, total_rows: int = 100_000) -> dict:
    """Appends ``total_rows`` in ``rows``-row chunks without kills; the file's peak and final size."""
    from rllib_recorder.service.writer import RecordingWriter

    with tempfile.TemporaryDirectory(prefix="killloop-space-") as run_dir:
        writer = RecordingWriter(run_dir, "space", datasets.StorageOptions(file_space=file_space))
        path = os.path.join(run_dir, layout.file_name(1))
        peak = first = 0
        for seq in range(max(1, total_rows // rows)):
            writer.append(1, False, b"s", seq, make_chunk(first, rows))
            first += rows
            peak = max(peak, os.path.getsize(path))
        stats = writer.close()
        return {"file_space": file_space, "append_rows": rows, "rows": first, "peak_bytes": peak,
                "final_bytes": os.path.getsize(path), "data_bytes": _sum_storage(path),
                "compactions": stats.get("compactions", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200, help="kills per variant (stops at the first damage)")
    parser.add_argument("--rows", type=int, default=50, help="largest chunk appended, in rows")
    parser.add_argument("--file-space", nargs="+", default=["none", "fsm"], choices=["none", "fsm"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--space", action="store_true", help="measure file growth without kills instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.space:
        for rows in (50, 500, 4096):
            for file_space in args.file_space:
                print(json.dumps(space(file_space, rows)), flush=True)
        return
    if args.child:
        child(args.child, args.file_space[0], args.rows)
        return
    for file_space in args.file_space:
        start = time.time()
        result = run_variant(file_space, args.kills, args.rows, args.seed)
        result["seconds"] = round(time.time() - start, 1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
