"""Several nodes: a real ray.cluster_utils.Cluster (head + two worker nodes, one replaced) in a subprocess, then gather."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rllib_recorder.commands.verify import verify_run
from rllib_recorder.read.run import open_run
from tests.helpers import own_cluster_env
from tests.integrity import check_run
from tests.test_gather import assert_same_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """Facts of one recording on a three-node cluster and its gather (the session's own Ray is not touched)."""
    tmp = tmp_path_factory.mktemp("cluster")
    with own_cluster_env() as env:
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tests", "cluster_script.py"), str(tmp / "rec"), str(tmp / "gathered")],
            capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
        )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    facts["gathered"] = str(tmp / "gathered")
    return facts


@pytest.mark.multinode
def test_every_writer_runs_on_the_node_of_its_runners(cluster_run):
    first = {int(k): v for k, v in cluster_run["first_runner_nodes"].items()}
    now = {int(k): v for k, v in cluster_run["runner_nodes"].items()}
    head = cluster_run["head_node"]
    assert len(set(first.values())) == 2 and head not in first.values()
    assert now[1] not in first.values() and now[2] == first[2]  # runner 1 was restarted on the new node
    assert cluster_run["restarts"] >= 1
    with open_run(cluster_run["run_dir"]) as run:
        manifest = run.manifest
        worker_of = {os.path.basename(f.path): f.worker_index for f in run.files}
    # node 0 is the driver's (head) node, then one per node that hosted runners, the new one included.
    writer_nodes = {k: v["node_id"] for k, v in manifest["writer_nodes"].items()}
    assert writer_nodes["0"] == head
    assert set(writer_nodes.values()) == {head, first[1], first[2], now[1]}
    alive = {k: v for k, v in writer_nodes.items() if v != first[1]}
    assert cluster_run["writer_actor_nodes"] == alive  # asked of the actors themselves
    # One file per (runner, node it ran on), each written on that node; the lost node's file is listed too.
    assert sorted(manifest["files"]) == sorted(worker_of)
    placed = {(worker_of[name], info["node_id"]) for name, info in manifest["files"].items()}
    assert placed == {(1, first[1]), (1, now[1]), (2, first[2])}
    assert all(info["node_ip"] and info["hostname"] for info in manifest["files"].values())
    # The only error counted is the lost node's writer, unreachable since.
    assert cluster_run["errors"] == 1


@pytest.mark.multinode
def test_every_row_of_every_node_reads_back_and_verifies(cluster_run):
    # value by value: (runner, episode, t) in every observation; nothing lost with the node, by RLlib's count
    counts = check_run(cluster_run["run_dir"], sampled=cluster_run["sampled"])
    assert {w for w, _, _ in counts["streams"]} == {1, 2}
    assert verify_run(cluster_run["run_dir"]) == []


@pytest.mark.multinode
def test_gather_collects_the_nodes_files_into_a_valid_run(cluster_run):
    output = cluster_run["gather_output"]
    for node_id in cluster_run["runner_nodes"].values():
        assert f"from node {node_id}" in output  # read by a task on the file's own node
    lost = cluster_run["first_runner_nodes"]["1"]
    assert f"from the run directory here (its node {lost}" in output  # gone, but readable on this machine
    assert "resumed at byte" in output  # the half file left behind was continued, not restarted
    gathered = cluster_run["gathered"]
    with open_run(cluster_run["run_dir"]) as run:
        assert sorted(os.listdir(gathered)) == ["manifest.json", *sorted(run.manifest["files"])]
    assert verify_run(gathered) == []
    check_run(gathered, sampled=cluster_run["sampled"])  # RLlib's count
    assert_same_run(cluster_run["run_dir"], gathered)
    with open_run(gathered) as run:
        assert all("node_id" not in info for info in run.manifest["files"].values())
        assert run.manifest["gathered_from"]["run_dir"] == cluster_run["run_dir"]
