"""Every snippet in the README and the user guide and every example in the CLI's help runs as written, as child
processes, on a real recording made by the README's own quick start in a fresh folder (this 2-CPU machine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from click.testing import CliRunner

from rllib_recorder import open_run
from rllib_recorder.cli import main
from tests.s3server import ACCESS_KEY, SECRET_KEY, S3Server

# The README's s3:// snippet reads credentials as pyarrow does, from the environment
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
GUIDE = open(os.path.join(ROOT, "docs", "guide.md")).read()
# The two set-up commands: CI runs them itself (.ci/run), so here the install and the test run are not repeated.
SETUP = ('pip install -e ".[dev]"', "python -m pytest -q")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order; blocks indented inside a list item are dedented."""
    return [(lang, textwrap.dedent(code)) for indent, lang, code in
            re.findall(r"^( *)```(\w+)\n(.*?)^\1```", text, re.M | re.S)]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: one per line (comments dropped), '&&' chains split."""
    commands = []
    for line in code.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            commands += [part.strip() for part in line.split("&&")]
    return commands


def run(command: str, cwd: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([cwd, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr, (command, proc.stderr[-3000:])
    return proc


def serve_and_stop(command: str, cwd: str) -> list[dict]:
    """``rllib-recorder view`` serves until Ctrl-C: started as written (a browser it opens is ``true``), asked for
    its runs at the URL it prints first, then stopped with SIGINT, which must end it with exit 0."""
    env = dict(os.environ, BROWSER="true", PYTHONPATH=os.pathsep.join([cwd, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (command, url, proc.stderr.read() if proc.poll() else "")
        with urllib.request.urlopen(url + "api/runs", timeout=300) as response:
            runs = json.loads(response.read())["runs"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, (command, out[-3000:], err[-3000:])
    assert runs and not any("error" in r for r in runs), (command, runs)
    return runs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh folder holding configs/, where the README's quick start has run as written: (folder, run)."""
    assert shutil.which("rllib-recorder"), "the quick start's command must be on PATH (pip install -e .)"
    folder = tmp_path_factory.mktemp("readme")
    shutil.copytree(os.path.join(ROOT, "configs"), folder / "configs")
    lang, code = fenced_blocks(README)[0]
    assert lang == "bash"
    commands = shell_commands(code)
    assert commands[0] == SETUP[0] and commands[2] == SETUP[0] and commands[3] == SETUP[1]
    assert commands[1] == "rllib-recorder train configs/cartpole-ppo.yaml"
    proc = run(commands[1], str(folder))
    run_dir = re.search(r"^recorded run: (\S+)$", proc.stdout, re.M).group(1)
    assert run_dir.startswith("recordings/cartpole-ppo/PPO_CartPole-v1_"), proc.stdout
    assert "verify: sound: all 10000 sampled env steps stored" in proc.stdout, proc.stdout
    assert len(proc.stdout.splitlines()) < 25 and proc.stderr == "", (proc.stdout, proc.stderr)
    return str(folder), run_dir, proc.stdout


def test_the_quick_start_shows_progress_and_a_summary_not_a_wall_of_logs(workspace):
    """What the quick start's `train` printed in a pipe, as the README shows it: no Ray/RLlib/Tune logs, warnings or
    tables; one line per result; then the run, what it holds, its verdict and the commands to try next."""
    folder, run_dir, stdout = workspace
    for noise in ("WARNING", "core_worker", "Trial status", "╭", "DeprecationWarning", "UserWarning"):
        assert noise not in stdout, (noise, stdout)
    lines = stdout.splitlines()
    assert lines[0] == "training PPO on CartPole-v1 until training_iteration 5; recording into recordings/cartpole-ppo"
    assert lines[0] in README  # the README's own text block starts with the same line
    progress = [line for line in lines if " iter " in line]
    assert [re.search(r"iter (\S+)", line).group(1) for line in progress] == [f"{i}/5" for i in range(1, 6)], stdout
    assert "env steps 2,000" in progress[0] and all("errors 0" in line for line in progress), stdout
    summary = lines[lines.index(next(line for line in lines if line.startswith("recorded run: "))) + 1:]
    assert summary[0].strip().startswith("finished: 10,000 env steps, "), stdout
    assert summary[1].strip() == "verify: sound: all 10000 sampled env steps stored (2 env runner incarnation(s))"
    assert summary[2] == "next:" and any(f"rllib-recorder info {run_dir}" in line for line in summary[3:]), stdout
    with open_run(os.path.join(folder, run_dir)) as run:
        assert run.manifest["env"] == "CartPole-v1" and run.num_env_steps == 10000
        assert run.manifest["rllib_counts"]["env_steps_sampled"] == 10000  # RLlib's own count, kept by the run


def substitute(command: str, run_dir: str, target: str, s3: S3Server | None = None) -> str:
    """The README's and help's placeholders: recordings/<run> is the run train printed; /data/<run> a new folder;
    s3://my-bucket/<prefix> a prefix on the test's own S3 server."""
    command = command.replace("/data/<run>", target).replace("recordings/<run>", run_dir)
    if s3 is not None:
        query = f"endpoint_override={s3.endpoint}&scheme=http&region=us-east-1"
        command = re.sub(r"s3://my-bucket/([\w-]+)(?=\")", lambda m: f"s3://runs/{m.group(1)}?{query}", command)
    return command


def check_output(command: str, proc: subprocess.CompletedProcess) -> None:
    """What a documented command, run as written, must print, wherever it is documented."""
    if command.startswith("rllib-recorder replay") and "--check" in command:
        assert "all match" in proc.stdout, proc.stdout
    if command.startswith("rllib-recorder train") and "--check" in command:
        assert proc.stdout.startswith("ok: configs/cartpole-ppo.yaml"), proc.stdout
    if command.split()[1] in ("verify", "recover", "replay", "export", "gather", "info"):
        assert proc.stderr == "", (command, proc.stderr)  # in a pipe: no progress bar, nothing extra


# The README's and the guide's commands that ran as written (before any placeholder was filled): a help example
# that is one of them word for word has run already, and is not run again.
RAN_AS_WRITTEN: set[str] = set()


def test_readme_and_guide_snippets_run_as_written(workspace, s3):
    folder, run_dir, _ = workspace
    blocks = fenced_blocks(README)[1:] + fenced_blocks(GUIDE)  # the guide's export snippet trains on README's export
    done = []
    for lang, code in blocks:
        if lang == "bash":
            for command in shell_commands(code):
                assert command.startswith("rllib-recorder "), command
                done.append(command.split()[1])
                if command.startswith("rllib-recorder view"):
                    serve_and_stop(substitute(command, run_dir, "gathered"), folder)
                    RAN_AS_WRITTEN.add(command)
                    continue
                proc = run(substitute(command, run_dir, "gathered"), folder)
                if command.startswith("rllib-recorder verify"):
                    assert "is sound" in proc.stdout
                check_output(command, proc)
                RAN_AS_WRITTEN.add(command)
        elif lang == "text":  # what a command prints, not a command
            continue
        elif lang == "python":
            with open(os.path.join(folder, "snippet.py"), "w") as f:
                f.write(substitute(code, run_dir, "gathered", s3))
            proc = run(f"{sys.executable} snippet.py", folder, env=S3_CREDENTIALS)
            done.append("python")
            if "open_run" in code:  # the reader printed what the recorder stored
                assert "Episode(eps_id=" in proc.stdout and "Run(" in proc.stdout, proc.stdout[-2000:]
            if "storage_path" in code:  # Tune and the recorder on S3: the run read back from the store
                assert "status='finished'" in proc.stdout and "Run('s3://runs/recordings/PPO_" in proc.stdout, proc.stdout
            if "BCConfig" in code:  # BC trained (on the export, or on the run itself) and printed a finite loss
                assert 0 < float(proc.stdout.split()[-1]) < 10, proc.stdout[-2000:]
    # every command of the Then: block, the two Python snippets, and the several-nodes block
    assert sorted(set(done)) == ["export", "gather", "info", "plot", "python", "recover", "render", "replay", "train",
                                 "verify", "view"]
    assert os.path.getsize(os.path.join(folder, "best.gif")) > 0
    # README's own code, its several-nodes code (Tune and the recorder on S3), the guide's offline training and
    # export BC
    assert done.count("python") == 4
    assert os.path.isfile(os.path.join(folder, "run.png")) and os.listdir(os.path.join(folder, "bc-data"))


def help_examples() -> list[str]:
    commands = []
    # as a user goes: train first (the others read what it recorded)
    for name in sorted(main.commands, key=lambda n: (n != "train", n)):
        text = CliRunner().invoke(main, [name, "--help"]).output
        commands += [line.strip() for line in text.splitlines() if line.strip().startswith("rllib-recorder ")]
    return commands


def test_every_help_example_runs_as_written(workspace, recorded_breakout, tmp_path):
    # a folder of its own (the README's snippets wrote bc-data, minari-data, ... already), the same run
    workspace_dir, run_dir, _ = workspace
    run_dir = os.path.join(workspace_dir, run_dir)
    folder = str(tmp_path)
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
    os.makedirs(os.path.join(folder, "mypkg"), exist_ok=True)
    with open(os.path.join(folder, "mypkg", "__init__.py"), "w"):
        pass
    with open(os.path.join(folder, "mypkg", "sink.py"), "w") as f:  # the user's own function for replay --to
        f.write("def consume(item):\n    print(type(item).__name__, len(item))\n")
    examples = help_examples()
    assert {e.split()[1] for e in examples} == set(main.commands), examples  # every command shows one
    for i, example in enumerate(examples):
        if example in RAN_AS_WRITTEN:
            continue
        run_here = recorded_breakout if "Breakout" in example else run_dir
        if example.startswith("rllib-recorder view"):
            serve_and_stop(substitute(example, run_here, str(tmp_path / f"gathered-{i}")), folder)
            continue
        proc = run(substitute(example, run_here, str(tmp_path / f"gathered-{i}")), folder)
        if "--to mypkg.sink:consume" in example:
            assert proc.stdout.startswith("Episode "), proc.stdout[:500]
        if example.startswith("rllib-recorder render"):
            assert os.path.getsize(os.path.join(folder, example.split("-o ")[1].split()[0])) > 0, proc.stdout
        check_output(example, proc)
