"""Chaos soak: a recorded PPO run on RLlib's defaults while a random recorder or RLlib process is SIGKILLed every
10-30 s, for as long as asked; the report is RLlib's count against the stored count, per env-runner incarnation.

The victims are drawn from every process of the run but the driver (which holds the learner here): the env
runners and the writer actor. RLlib's own
fault tolerance is left at its defaults (no ``fault_tolerance()`` call): a runner killed while the learner updates
is restarted by Ray without RLlib noticing, one killed in ``sample()`` is noticed and restored by RLlib.

    python tests/stress/chaos_soak.py --minutes 30 --out chaos-out

Not a test: it runs for half an hour. It writes ``chaos-out/chaos.json`` and prints the table for
docs/RELIABILITY.md. Exit 1 when ``verify`` finds a problem or the stored count falls short of RLlib's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", default="chaos-out")
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--min-gap", type=float, default=10.0)
    parser.add_argument("--max-gap", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--report", metavar="OUT", help="only (re)make the report of the soak whose --out was OUT")
    args = parser.parse_args()
    if args.report:
        with open(os.path.join(args.report, "chaos-run.json")) as f:
            meta = json.load(f)
        return summarize(meta.pop("run_dir"), meta, args.report)

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.tune.registry import register_env

    from rllib_recorder import RecorderCallback
    from rllib_recorder.commands.verify import verify_report
    from rllib_recorder.format.manifest import read_manifest
    from rllib_recorder.read.run import open_run
    from rllib_recorder.service.pool import writer_name
    from tests.envs import CountingEnv
    from tests.integrity import check_run

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    register_env("counting", lambda cfg: CountingEnv(cfg))
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    config = (PPOConfig().environment("counting", env_config={"obs_kind": "vector"})
              .env_runners(num_env_runners=args.runners, rollout_fragment_length=FRAGMENT_STEPS)
              .training(train_batch_size=80 * args.runners, minibatch_size=40, num_epochs=1)
              .callbacks(RecorderCallback.configured(output_dir=os.path.abspath(args.out))))
    algo = config.build_algo()
    result = algo.train()
    run_dir = result["recorder"]["run_dir"]
    run_id = read_manifest(run_dir)["run_id"]
    kills: list[dict] = []
    stop = threading.Event()

    def victims() -> list[tuple[str, int]]:
        out = []
        try:
            for index, pid in algo.env_runner_group.foreach_env_runner(
                    lambda r: (r.worker_index, os.getpid()), local_env_runner=False, timeout_seconds=10):
                out.append((f"env runner {index}", pid))
        except Exception:  # noqa: BLE001 - a runner down right now: the others are victims
            pass
        try:
            writer = ray.get_actor(writer_name(run_id, 0), namespace=ray.get_runtime_context().namespace)
            out.append(("writer", ray.get(writer.__ray_call__.remote(lambda self: os.getpid()), timeout=10)))
        except Exception:  # noqa: BLE001
            pass
        return out

    def killer() -> None:
        while not stop.wait(rng.uniform(args.min_gap, args.max_gap)):
            found = victims()
            if not found:
                continue
            what, pid = rng.choice(found)
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append({"at_s": round(time.monotonic() - started, 1), "what": what, "pid": pid})
                print(f"{kills[-1]['at_s']:7.1f} s  killed {what} (pid {pid})", flush=True)
                with open(os.path.join(args.out, "kills.json"), "w") as f:
                    json.dump(kills, f)
            except ProcessLookupError:
                pass

    started = time.monotonic()
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    iterations = 1
    while time.monotonic() - started < args.minutes * 60:
        result = algo.train()
        iterations += 1
    stop.set()
    thread.join()
    for _ in range(6):  # every runner back and sampling once more before the end
        result = algo.train()
        if result.get("fault_tolerance", {}).get("num_healthy_workers", args.runners) == args.runners:
            break
    result = algo.train()
    algo.stop()

    rllib_sampled = int(result["env_runners"]["num_env_steps_sampled_lifetime"])
    meta = {"minutes": args.minutes, "iterations": iterations, "kills": kills, "rllib_env_steps_sampled": rllib_sampled,
            "rllib_restarts_seen": result.get("fault_tolerance", {}).get("num_remote_worker_restarts")}
    with open(os.path.join(args.out, "chaos-run.json"), "w") as f:  # what the report below needs, kept first
        json.dump({"run_dir": run_dir, **meta}, f, indent=1)
    return summarize(run_dir, meta, args.out)


FRAGMENT_STEPS = 40  # rollout_fragment_length: a kill inside sample() may store one sample RLlib never got


def summarize(run_dir: str, meta: dict, out_dir: str) -> int:
    """Checks a soak's run (verify, every row against the env's code) against RLlib's count; writes chaos.json and
    prints the table for docs/RELIABILITY.md. Exit code 1 when verify finds a problem or a step is missing."""
    from rllib_recorder.commands.verify import verify_report
    from rllib_recorder.read.run import open_run
    from tests.integrity import check_run

    kills, rllib_sampled = meta["kills"], meta["rllib_env_steps_sampled"]
    report = verify_report(run_dir)
    # RLlib's count, and at most one sample per env-runner kill that its callback had (rollout_fragment_length)
    runner_kills = sum(1 for k in kills if not str(k["what"]).startswith("writer"))
    counts = check_run(run_dir, sampled=(rllib_sampled, rllib_sampled + FRAGMENT_STEPS * runner_kills))
    per_sender = []
    with open_run(run_dir) as run:
        stored = run.num_env_steps
        manifest = run.manifest
        for f in run.files:
            batches = f.batches()
            for sender in dict.fromkeys(batches["sender_id"].tolist()):
                mine = batches["sender_id"] == sender
                per_sender.append({"file": os.path.basename(f.path), "sender": sender.decode(),
                                   "stored": int(batches["env_steps"][mine].sum()),
                                   "sampled": int(batches["sender_env_steps_sampled"][mine].max())})
    out = {**meta, "env_steps_stored": stored, "runners": manifest.get("runners"), "senders": per_sender,
           "verify": report, "episodes_checked": sum(len(v) for v in counts["streams"].values())}
    with open(os.path.join(out_dir, "chaos.json"), "w") as f:
        json.dump(out, f, indent=1)
    by_kind: dict[str, int] = {}
    for k in kills:
        kind = "writer" if k["what"] == "writer" else "env runner"
        by_kind[kind] = by_kind.get(kind, 0) + 1
    seen = {k: v.get("incarnations") for k, v in (manifest.get("runners") or {}).items()}
    print(f"\n{meta['minutes']:g} min, {meta['iterations']} iterations, kills: {by_kind}; RLlib sampled {rllib_sampled}, "
          f"stored {stored}; verify: {report['problems'] or 'sound'}; {out['episodes_checked']} episodes checked; "
          f"incarnations the driver saw: {seen}; RLlib saw {out['rllib_restarts_seen']} restart(s)")
    print("| file | sender (incarnation) | sampled by it | stored |\n|---|---|---|---|")
    for s in per_sender:
        print(f"| {s['file']} | {s['sender'][:12]} | {s['sampled']} | {s['stored']} |")
    return 1 if report["problems"] or stored < rllib_sampled else 0


if __name__ == "__main__":
    sys.exit(main())
