"""A recording on a three-node ray.cluster_utils.Cluster, then a gather; run in a subprocess by test_multinode.py.

The head holds the driver; each of two worker nodes has one CPU and one ``rec_runner`` resource, which pins
one env runner to it. Prints one JSON line of facts for the test to check.
"""

import json
import os
import subprocess
import sys

import ray
from ray.cluster_utils import Cluster
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from rllib_recorder.service.pool import writer_name
from tests.envs import CountingEnv
from tests.test_recording import ppo


def node_of(actor_name: str, namespace: str) -> str:
    actor = ray.get_actor(actor_name, namespace=namespace)
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def runner_nodes(algo) -> dict[int, str]:
    return dict(algo.env_runner_group.foreach_env_runner(
        lambda r: (r.worker_index, ray.get_runtime_context().get_node_id()), local_env_runner=False))


def record(out: str, cluster: Cluster, nodes: list) -> dict:
    """Records; after the first iteration runner 1's node leaves and a new node takes its place."""
    register_env("counting", lambda cfg: CountingEnv(cfg))
    config = (ppo(runners=2).env_runners(custom_resources_per_env_runner={"rec_runner": 1})
              .fault_tolerance(restart_failed_env_runners=True)
              .callbacks(RecorderCallback.configured(output_dir=out, num_writers=1, coalesce_rows=0)))
    algo = config.build_algo()
    results = [algo.train()]
    run_dir = results[-1]["recorder"]["run_dir"]
    first = runner_nodes(algo)
    lost = next(n for n in nodes if n.node_id == first[1])
    cluster.add_node(num_cpus=1, resources={"rec_runner": 1})
    cluster.remove_node(lost)
    for _ in range(6):  # RLlib notices the lost runner, then recreates it on the new node
        results.append(algo.train())
        if results[-1]["fault_tolerance"]["num_remote_worker_restarts"]:
            break  # recreated at the start of this iteration, and it sampled in it
    runners = runner_nodes(algo)
    with open(os.path.join(run_dir, "manifest.json")) as f:
        manifest = json.load(f)
    namespace = ray.get_runtime_context().namespace
    writers = {index: node_of(writer_name(manifest["run_id"], 0, int(index)), namespace)
               for index, node in manifest["writer_nodes"].items() if node["node_id"] != lost.node_id}
    algo.stop()
    return {"run_dir": run_dir, "first_runner_nodes": first, "runner_nodes": runners, "writer_actor_nodes": writers,
            "restarts": results[-1]["fault_tolerance"]["num_remote_worker_restarts"],
            "error_kinds": results[-1]["recorder"]["last_error"],
            "sampled": results[-1]["env_runners"]["num_env_steps_sampled_lifetime"],
            "errors": results[-1]["recorder"]["errors"]}


def gather(run_dir: str, target: str, address: str) -> str:
    """Gathers through the CLI as a real process, after leaving half a file behind as an interrupted gather would."""
    with open(os.path.join(run_dir, "manifest.json")) as f:
        manifest = json.load(f)
    name = sorted(manifest["files"])[0]
    os.makedirs(target)
    with open(os.path.join(target, "gather.json"), "w") as f:
        json.dump({"run_id": manifest["run_id"]}, f)
    with open(os.path.join(run_dir, name), "rb") as src, open(os.path.join(target, name + ".part"), "wb") as dst:
        dst.write(src.read(os.path.getsize(src.name) // 2))
    proc = subprocess.run([sys.executable, "-m", "rllib_recorder.cli", "gather", run_dir, "--to", target,
                           "--address", address], capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise SystemExit(f"gather failed: {proc.stdout}{proc.stderr[-2000:]}")
    return proc.stdout


if __name__ == "__main__":
    out, target = sys.argv[1], sys.argv[2]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={"rec_runner": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        facts = record(out, cluster, nodes)
        facts["head_node"] = ray.get_runtime_context().get_node_id()
        facts["gather_output"] = gather(facts["run_dir"], target, cluster.address)
        print(json.dumps(facts), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
