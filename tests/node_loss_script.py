"""A node removed mid-run, as the autoscaler would, from a ray.cluster_utils.Cluster recording into s3://; run in a
subprocess by test_durable.py.

The head holds the driver; two worker nodes have one CPU and one ``rec_runner`` resource each, pinning one env
runner to each. After a few iterations runner 1's node is removed and its staged files (its disk) deleted; a new
node takes its place and RLlib recreates the runner there. Prints one JSON line of facts.
"""

import json
import os
import shutil
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from rllib_recorder.format import layout, segments, store
from tests.envs import CountingEnv, logged_steps
from tests.test_recording import ppo


def runner_nodes(algo) -> dict[int, str]:
    return dict(algo.env_runner_group.foreach_env_runner(
        lambda r: (r.worker_index, ray.get_runtime_context().get_node_id()), local_env_runner=False))


def _index_segments(target, stem: str) -> tuple[list[str], int]:
    """The segments the stream's index at the target names now, and the env steps they hold (the newest record's
    stream totals)."""
    import tempfile

    import h5py

    with tempfile.TemporaryDirectory() as tmp:
        target.get(f"{stem}.h5", os.path.join(tmp, "index.h5"))
        with h5py.File(os.path.join(tmp, "index.h5"), "r") as h5:
            records = json.loads(h5.attrs["segments"])["segments"]
    return [r["name"] for r in records], int(records[-1]["totals"]["env_steps"]) if records else 0


def _live_batches(path: str) -> int:
    """Batches the live (staged, unsealed) file commits now; 0 when there is none or it is being rewritten."""
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as h5:
            return int(json.loads(h5.attrs["commit"])["batches"])
    except (OSError, KeyError, ValueError):
        return 0


def _live_steps(path: str) -> int:
    """Env steps the live (staged, unsealed) file commits now."""
    import h5py

    with h5py.File(path, "r", locking=False) as h5:
        return int(json.loads(h5.attrs["commit"])["agents"]["default_agent"][0])


def main(uri: str, staging: str) -> dict:
    register_env("counting", lambda cfg: CountingEnv(cfg))
    step_log = os.path.join(staging, "..", "step-log")  # the envs' own log of their steps (on this one machine)
    os.makedirs(step_log)
    config = (ppo(runners=2).environment("counting", env_config={"obs_kind": "vector", "step_log": step_log})
              .env_runners(custom_resources_per_env_runner={"rec_runner": 1})
              .fault_tolerance(restart_failed_env_runners=True)
              .callbacks(RecorderCallback.configured(output_dir=uri, staging_dir=staging, run_name="lossy",
                                                     segment_s=1.0, coalesce_s=0.2)))
    algo = config.build_algo()
    results = [algo.train()]
    run_dir = results[-1]["recorder"]["run_dir"]  # its staging directory
    first = runner_nodes(algo)
    with open(os.path.join(run_dir, "manifest.json")) as f:
        manifest = json.load(f)
    tag = next(layout.node_tag(int(i)) for i, n in manifest["writer_nodes"].items() if n["node_id"] == first[1])
    stem = f"worker-001.{tag}"
    target = store.resolve(store.uri_join(uri, "lossy"))
    lost = next(n for n in NODES if n.node_id == first[1])
    cluster.add_node(num_cpus=1, resources={"rec_runner": 1})  # the node that takes its place joins first

    def tail() -> int:
        """Batches committed since the node's last seal, once the iteration's last commit is done: between
        iterations nothing samples, so nothing commits or seals until the node is gone."""
        time.sleep(3 * 0.2)  # coalesce_s, three times over
        return _live_batches(os.path.join(run_dir, f"{stem}.h5"))

    # until the node has a segment at the target, and rows committed since its last seal (its tail)
    while len(results) < 40 and (len(results) < 4 or target.size(f"{stem}.h5") is None or not tail()):
        results.append(algo.train())
    tail_steps = _live_steps(os.path.join(run_dir, f"{stem}.h5"))  # rows committed since its last seal
    # and what it sealed but had not uploaded yet (a loaded machine lets a segment wait for its upload)
    pending_steps = sum(_live_steps(path) for path in segments.sealed(run_dir, stem))
    sealed_before, uploaded_steps = _index_segments(target, stem)
    # the bound on the loss: what the node's runner took (the env's own log) less what is at the target
    not_uploaded = sum(n for (worker, _), n in logged_steps(step_log).items() if worker == 1) - uploaded_steps
    cluster.remove_node(lost)
    # its disk goes with it: the live file, its sealed segments not yet uploaded, the spool
    deleted = [p for p in (os.path.join(run_dir, f"{stem}.h5"), os.path.join(run_dir, ".segments", stem),
                           os.path.join(run_dir, ".spool", stem)) if os.path.exists(p)]
    for path in deleted:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    for _ in range(8):  # RLlib notices the lost runner, then recreates it on the new node
        results.append(algo.train())
        if results[-1]["fault_tolerance"]["num_remote_worker_restarts"]:
            break
    results.append(algo.train())
    algo.stop()
    return {"uri": store.uri_join(uri, "lossy"), "lost_node": first[1], "lost_stem": stem,
            "sealed_before_loss": sealed_before, "deleted": [os.path.relpath(p, run_dir) for p in deleted],
            "tail_steps": tail_steps, "pending_steps": pending_steps, "not_uploaded": not_uploaded,
            "step_log": os.path.abspath(step_log),
            "sampled": results[-1]["env_runners"]["num_env_steps_sampled_lifetime"],
            "restarts": results[-1]["fault_tolerance"]["num_remote_worker_restarts"]}


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        NODES = [cluster.add_node(num_cpus=1, resources={"rec_runner": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
