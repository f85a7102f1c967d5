"""`rllib-recorder gather` on one node: a real copy through Ray tasks, checked, resumable, with one-line errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from rllib_recorder.cli import main
from rllib_recorder.commands.gather import MARKER_NAME, gather_run
from rllib_recorder.commands.verify import verify_run
from rllib_recorder.format.manifest import read_manifest, write_manifest
from rllib_recorder.read.run import open_run


def assert_same_run(source: str, gathered: str) -> None:
    """Every episode of every file reads back the same, value by value."""
    with open_run(source) as a, open_run(gathered) as b:
        assert a.workers == b.workers and a.counts() == b.counts()
        for fa, fb in zip(a.files, b.files):
            for agent in fa.agents:
                assert fa.episode_ids(agent) == fb.episode_ids(agent)
                for eps_id in fa.episode_ids(agent):
                    ea, eb = fa.episode(eps_id, agent), fb.episode(eps_id, agent)
                    for column in ("obs", "actions", "rewards", "terminateds", "truncateds", "t", "weights_seq_no"):
                        np.testing.assert_array_equal(getattr(ea, column), getattr(eb, column))


def test_gather_copies_a_run_through_ray_and_the_copy_verifies(ray_session, recorded_cartpole, tmp_path):
    target = str(tmp_path / "gathered")
    source_manifest = read_manifest(recorded_cartpole)
    node_id = source_manifest["files"]["worker-001.h5"]["node_id"]
    assert node_id == ray_session.get_runtime_context().get_node_id()  # the file's node is alive: read by a task
    done = gather_run(recorded_cartpole, target)
    assert done["worker-001.h5"].startswith("copied ") and f"node {node_id}" in done["worker-001.h5"]
    assert sorted(os.listdir(target)) == ["manifest.json", "worker-001.h5"]
    manifest = read_manifest(target)
    assert manifest["run_id"] == source_manifest["run_id"]
    assert manifest["gathered_from"]["files"] == source_manifest["files"]
    assert manifest["files"]["worker-001.h5"]["bytes"] == os.path.getsize(os.path.join(recorded_cartpole, "worker-001.h5"))
    assert verify_run(target) == []
    assert_same_run(recorded_cartpole, target)
    assert gather_run(recorded_cartpole, target) == {"worker-001.h5": "already copied"}


def test_an_interrupted_gather_resumes_its_partial_file(ray_session, recorded_cartpole, tmp_path):
    target = str(tmp_path / "gathered")
    size = os.path.getsize(os.path.join(recorded_cartpole, "worker-001.h5"))
    pieces = []

    def interrupt(name, nbytes):
        pieces.append(nbytes)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gather_run(recorded_cartpole, target, progress=interrupt, piece_bytes=size // 8)
    part = os.path.join(target, "worker-001.h5.part")
    assert os.path.getsize(part) == 3 * (size // 8) and not os.path.exists(os.path.join(target, "manifest.json"))
    result = CliRunner().invoke(main, ["gather", recorded_cartpole, "--to", target])
    assert result.exit_code == 0, result.output
    assert f"resumed at byte {3 * (size // 8)}" in result.output
    assert not os.path.exists(part) and not os.path.exists(os.path.join(target, MARKER_NAME))
    assert CliRunner().invoke(main, ["verify", target]).exit_code == 0
    assert_same_run(recorded_cartpole, target)


def test_a_partial_file_that_does_not_match_is_copied_again(ray_session, recorded_cartpole, tmp_path):
    target = tmp_path / "gathered"
    target.mkdir()
    (target / MARKER_NAME).write_text(json.dumps({"run_id": read_manifest(recorded_cartpole)["run_id"]}))
    (target / "worker-001.h5.part").write_bytes(b"not the source's bytes" * 100)
    done = gather_run(recorded_cartpole, str(target))
    assert done["worker-001.h5"].startswith("copied ") and "resumed" not in done["worker-001.h5"]
    assert verify_run(str(target)) == []
    assert_same_run(recorded_cartpole, str(target))


def test_gather_errors_are_one_line_with_exit_2(ray_session, recorded_cartpole, tmp_path):
    def gather(run, target):
        result = CliRunner().invoke(main, ["gather", str(run), "--to", str(target)])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        return result.output

    assert "is not an rllib_recorder run" in gather(tmp_path, tmp_path / "out")
    other = tmp_path / "other"
    shutil.copytree(recorded_cartpole, other)
    manifest = read_manifest(str(other))
    write_manifest(str(other), {**manifest, "run_id": "another"})
    assert "already holds run another" in gather(recorded_cartpole, other)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    assert "is not empty and holds no run" in gather(recorded_cartpole, tmp_path / "junk")
    # A file on a node that left the cluster and is not readable here: name the node and the fix.
    gone = tmp_path / "gone"
    shutil.copytree(recorded_cartpole, gone)
    files = {**manifest["files"], "worker-002.node1.h5": {"node_id": "ab" * 28, "node_ip": "10.0.0.9",
                                                          "hostname": "lost-host"}}
    write_manifest(str(gone), {**manifest, "files": files})
    message = gather(gone, tmp_path / "out2")
    assert f"node {'ab' * 28} (10.0.0.9, lost-host)" in message and "ray start --address" in message
    assert "worker-002.node1.h5 is not here" in CliRunner().invoke(main, ["verify", str(gone)]).output


def test_format_doc_names_every_placement_field(ray_session, recorded_cartpole, tmp_path):
    target = str(tmp_path / "gathered")
    gather_run(recorded_cartpole, target)
    doc = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "FORMAT.md")).read()
    source, gathered = read_manifest(recorded_cartpole), read_manifest(target)
    names = {*source, *gathered, *gathered["gathered_from"], *source["writer_nodes"]["0"],
             *source["files"]["worker-001.h5"], *gathered["files"]["worker-001.h5"]}
    for name in names:
        assert f"`{name}`" in doc or f".{name}`" in doc or f'"{name}"' in doc, name


def test_a_file_whose_node_left_is_copied_from_here_when_readable(ray_session, recorded_cartpole, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(recorded_cartpole, run)
    manifest = read_manifest(str(run))
    files = {"worker-001.h5": {**manifest["files"]["worker-001.h5"], "node_id": "cd" * 28}}
    write_manifest(str(run), {**manifest, "files": files})
    result = CliRunner().invoke(main, ["gather", str(run), "--to", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"from the run directory here (its node {'cd' * 28}" in result.output
    assert verify_run(str(tmp_path / "out")) == []
    assert_same_run(recorded_cartpole, str(tmp_path / "out"))
