"""The CPU an idle Ray actor costs: the floor under any writer actor's share.

Starts Ray (2 CPUs), creates one ``num_cpus=0`` actor of each kind (sync, async, threaded) that does nothing,
and reads each actor process's CPU time and its threads' from /proc over --seconds (Linux only).

    python scripts/idle_actor_cpu.py --seconds 40
"""

from __future__ import annotations

import argparse
import os
import time


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """{thread id: (name, CPU seconds)} of process ``pid``."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Sync:
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Async:
        async def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Threaded:
        def pid(self) -> int:
            return os.getpid()

    actors = {"sync": Sync.remote(), "async": Async.remote(), "threaded": Threaded.remote()}
    pids = {kind: ray.get(actor.pid.remote()) for kind, actor in actors.items()}
    time.sleep(5)  # past start-up
    before = {kind: thread_cpu(pid) for kind, pid in pids.items()}
    start = time.perf_counter()
    time.sleep(args.seconds)
    after = {kind: thread_cpu(pid) for kind, pid in pids.items()}
    elapsed = time.perf_counter() - start
    cpus = os.cpu_count() or 1
    for kind in pids:
        used = {tid: cpu - before[kind].get(tid, (name, 0.0))[1] for tid, (name, cpu) in after[kind].items()}
        total = sum(used.values())
        top = sorted(used.items(), key=lambda item: -item[1])[:3]
        threads = ", ".join(f"{after[kind][tid][0]} {cpu / elapsed * 100:.2f}%" for tid, cpu in top)
        print(f"{kind:9s} idle actor: {total / elapsed * 100:.2f}% of one CPU = {total / elapsed * 100 / cpus:.2f}% "
              f"of this {cpus}-CPU machine (threads: {threads})")
    ray.shutdown()


if __name__ == "__main__":
    main()
