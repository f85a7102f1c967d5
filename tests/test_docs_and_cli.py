"""Docs name every stored field; the CLI works through click's runner and as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
from click.testing import CliRunner

from rllib_recorder import schema
from rllib_recorder.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_format_doc_names_every_field():
    doc = open(os.path.join(ROOT, "docs", "FORMAT.md")).read()
    for names in (schema.FILE_ATTRS, schema.BATCH_COLUMNS, schema.STEP_COLUMNS, schema.FRAGMENT_COLUMNS,
                  schema.ENCODING_ATTRS):
        for name in names:
            assert f"`{name}`" in doc, name


def test_format_doc_example_reads_a_real_episode(tmp_path, recorded_cartpole):
    doc = open(os.path.join(ROOT, "docs", "FORMAT.md")).read()
    code = re.search(r"## Reading one episode with plain h5py\n```python\n(.*?)```", doc, re.S).group(1)
    code = code.replace("recordings/<run>", recorded_cartpole)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[1].isdigit()


def test_format_doc_frame_stack_example_rebuilds_what_the_reader_gives_of_a_real_breakout_run(recorded_breakout):
    from rllib_recorder.reader import WorkerFile

    doc = open(os.path.join(ROOT, "docs", "FORMAT.md")).read()
    code = re.search(r"### Frame stacks.*?```python\n(.*?)```", doc, re.S).group(1)
    path = os.path.join(recorded_breakout, "worker-001.h5")
    reader = WorkerFile(path)
    try:
        with h5py.File(path, "r") as f:
            frags, steps = f["agents/default_agent/fragments"], f["agents/default_agent/steps"]
            assert steps["obs"].shape[1:] == (84, 84, 1) and steps["obs"].attrs["frame_stack"] == 4
            for i in range(len(frags["num_rows"])):
                scope = {"np": np, "frags": frags, "steps": steps, "i": i}
                exec(code, scope)
                first, n = int(frags["first_row"][i]), int(frags["num_rows"][i])
                want = reader.column("default_agent", "obs", slice(first, first + n))
                assert want.shape == (n, 84, 84, 4)
                assert np.array_equal(scope["obs"].astype(np.float32) / 128 - 1, want)
    finally:
        reader.close()


def test_info_and_verify_on_a_real_run(recorded_cartpole):
    runner = CliRunner()
    result = runner.invoke(main, ["info", recorded_cartpole, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["status"] == "finished" and summary["env_steps"] > 0 and summary["files"] == 1
    result = runner.invoke(main, ["verify", recorded_cartpole])
    assert result.exit_code == 0 and "is sound" in result.output


def test_verify_reports_a_gap_in_sequence_numbers(tmp_path, recorded_cartpole):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(recorded_cartpole, copy)
    with h5py.File(os.path.join(copy, "worker-001.h5"), "a") as f:
        seq = f["batches/seq"]
        seq[-1] = seq[-1] + 5
    result = CliRunner().invoke(main, ["verify", copy])
    assert result.exit_code == 1 and "gaps in sequence numbers" in result.output


def test_bad_paths_give_one_line_errors_and_exit_2(tmp_path):
    (tmp_path / "random.h5").write_bytes(os.urandom(100))
    for path, message in [(str(tmp_path / "missing"), "is not a directory"),
                          (str(tmp_path), "is not an rllib_recorder run")]:
        result = CliRunner().invoke(main, ["info", path])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


def test_train_runs_a_yaml_experiment_as_a_real_process(tmp_path):
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(
        "tiny:\n  run: PPO\n  env: CartPole-v1\n  stop: {training_iteration: 1}\n"
        "  config: {num_env_runners: 1, train_batch_size: 200, minibatch_size: 100, num_epochs: 1}\n"
        "  recorder: {num_writers: 1}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rllib_recorder.cli", "train", str(experiment), "--output-dir", str(tmp_path / "out"),
         "--num-cpus", "2"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = re.search(r"recorded run: (\S+)", proc.stdout).group(1)
    result = CliRunner().invoke(main, ["verify", run_dir])
    assert result.exit_code == 0, result.output
