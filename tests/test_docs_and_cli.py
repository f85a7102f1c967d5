"""Docs name every stored field; the CLI works through click's runner and as a real process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import h5py
from click.testing import CliRunner

from rllib_recorder.cli import main
from rllib_recorder.format import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_format_doc_names_every_field():
    doc = open(os.path.join(ROOT, "docs", "FORMAT.md")).read()
    for names in (layout.FILE_ATTRS, layout.BATCH_COLUMNS, layout.STEP_COLUMNS, layout.FRAGMENT_COLUMNS,
                  layout.ENCODING_ATTRS, layout.DELTA_ATTRS):
        for name in names:
            assert f"`{name}`" in doc, name


def test_info_and_verify_on_a_real_run(recorded_cartpole):
    runner = CliRunner()
    result = runner.invoke(main, ["info", recorded_cartpole, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["status"] == "finished" and summary["env_steps"] > 0 and summary["files"] == 1
    result = runner.invoke(main, ["verify", recorded_cartpole])
    assert result.exit_code == 0 and "is sound" in result.output


def test_info_writes_the_compression_ratio_without_an_exponent(recorded_breakout):
    from rllib_recorder.commands.report import compression_text

    assert compression_text(58.2e6 / 258.3, 58.2e6) == "260x smaller than the raw 58.2 MB"
    assert compression_text(1e6, 1.23e6).startswith("1.2x smaller")
    assert compression_text(1e6, 12.4e6).startswith("12x smaller")
    assert compression_text(1e6, 99.7e6).startswith("100x smaller")
    assert compression_text(1e6, 3149e6).startswith("3100x smaller")
    result = CliRunner().invoke(main, ["info", recorded_breakout])  # Atari frames: over 100x
    assert result.exit_code == 0, result.output
    ratio = re.search(r", (\S+)x smaller than the raw ", result.output).group(1)
    assert re.fullmatch(r"[1-9]\d+", ratio) and int(ratio) >= 100, result.output  # "140x", not "1.4e+02x"


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


def test_long_commands_show_a_progress_bar_on_a_terminal(recorded_cartpole):
    import pty

    for argv, bar in ((["verify", recorded_cartpole], "verifying files"),
                      (["replay", recorded_cartpole, "--check"], "re-simulating")):
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "rllib_recorder.cli", *argv], stdin=follower,
                                stdout=follower, stderr=follower, env=dict(os.environ, TERM="xterm", COLUMNS="120"))
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        os.close(leader)
        assert proc.wait(timeout=120) == 0, shown[-2000:]
        assert bar.encode() in shown, shown[-2000:]
