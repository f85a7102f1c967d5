"""The CPU an idle Ray actor costs: the floor under any writer actor's share, and what would lower it.

Starts Ray (2 CPUs), creates one ``num_cpus=0`` actor of each kind (sync, async, threaded) that does nothing,
and reads each actor process's CPU time and its threads' from /proc over --seconds (Linux only). Then the
ways tried to lower it, each an actor of its own measured in the same seconds:

* ``sync, main thread blocked``: a sync actor whose main thread sleeps in one long call. Ray's 10 ms
  ``CoreWorker.CheckSignal`` timer runs on the thread that executes a sync actor's tasks, so it cannot fire
  while a task runs: if the floor falls to ~0 here, the timer is the floor.
* ``nap chain T s``: a sync actor that keeps its main thread asleep between calls, in naps of T seconds, each
  nap submitting the next to the actor itself (``current_actor``) so that calls that arrive meanwhile run
  between two naps (they wait up to T). What each nap's actor call costs against the timer it silences.

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
    parser.add_argument("--naps", type=float, nargs="*", default=[0.1, 0.25, 0.5, 1.0],
                        help="nap lengths of the nap-chain actors (seconds)")
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

    @ray.remote(num_cpus=0)
    class Napper:
        def __init__(self, nap_s: float) -> None:
            self.nap_s, self.me = nap_s, None

        def pid(self) -> int:
            return os.getpid()

        def start(self) -> None:
            self.me = ray.get_runtime_context().current_actor
            self.me.nap.remote()

        @ray.method(enable_task_events=False)
        def nap(self) -> None:
            time.sleep(self.nap_s)
            self.me.nap.remote()

        def block(self, seconds: float) -> None:
            time.sleep(seconds)

    actors = {"sync": Sync.remote(), "async": Async.remote(), "threaded": Threaded.remote(),
              "sync, main thread blocked": Napper.remote(0.0)}
    for nap_s in args.naps:
        actors[f"nap chain {nap_s:g} s"] = Napper.remote(nap_s)
    pids = {kind: ray.get(actor.pid.remote()) for kind, actor in actors.items()}
    for kind, actor in actors.items():
        if kind.startswith("nap chain"):
            ray.get(actor.start.remote())
    actors["sync, main thread blocked"].block.remote(args.seconds + 30)
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
        print(f"{kind:26s} idle actor: {total / elapsed * 100:.2f}% of one CPU = {total / elapsed * 100 / cpus:.2f}% "
              f"of this {cpus}-CPU machine (threads: {threads})")
    ray.shutdown()


if __name__ == "__main__":
    main()
