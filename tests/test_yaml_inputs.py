"""`rllib-recorder train` on bad YAML: one line `error: ...`, exit 2, no traceback, nothing written, no Ray.

Each bad file runs the real CLI as a child process in an empty directory, with Ray's and Python's temp dirs
inside it (a started Ray would leave its session dir there). The hypothesis test feeds hostile documents to
``load_experiment`` and ``check_experiment`` in this process: each is accepted or refused with one ConfigError
line; nothing is written, no process spawned, no module imported that the file does not list in ``register:``.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rllib_recorder.commands.experiment import load_experiment
from rllib_recorder.commands.experiment_check import check_experiment
from rllib_recorder.errors import ConfigError, RecorderError
from tests import hostile_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = "x:\n  run: PPO\n  env: CartPole-v1\n  stop: {training_iteration: 1}\n"

BAD = {
    "syntax_error": ("x:\n  run: PPO\n  env: [CartPole-v1\n", "not valid YAML at line 4"),
    "tab_indent": ("x:\n\trun: PPO\n", "not valid YAML at line 2, column 1"),
    "list_at_top": ("- run: PPO\n  env: CartPole-v1\n", "must hold exactly one experiment"),
    "two_experiments": (GOOD + "y:\n  run: PPO\n", "must hold exactly one experiment"),
    "empty_file": ("", "it holds null"),
    "not_utf8": (b"x:\n  run: P\xff\xfeO\n", "not valid YAML: unacceptable character"),
    "python_tag": ("x: !!python/object/apply:os.system ['touch PWNED']\n", "could not determine a constructor"),
    "body_a_string": ("x: PPO\n", "experiment 'x' must be a mapping with 'run:'"),
    "unknown_experiment_setting": (GOOD + "  num_samples: 4\n", "unknown setting 'num_samples'"),
    "misspelt_experiment_setting": (GOOD + "  recoder: {}\n", "unknown setting 'recoder' (did you mean 'recorder'?)"),
    "no_run": ("x:\n  env: CartPole-v1\n", "has no 'run:'"),
    "run_a_list": ("x:\n  run: [PPO]\n  env: CartPole-v1\n", "'run:' must name an RLlib algorithm"),
    "unknown_algorithm": ("x:\n  run: PPOO\n  env: CartPole-v1\n", "unknown algorithm 'run: PPOO' (did you mean 'PPO'?)"),
    "tune_script_trainable": ("x:\n  run: script\n  env: CartPole-v1\n", "unknown algorithm 'run: script'"),
    "recorder_a_list": (GOOD + "  recorder: [output_dir, recordings]\n", "'recorder:' must be a mapping"),
    "unknown_recorder_setting": (GOOD + "  recorder: {num_writer: 2}\n", "(did you mean 'num_writers'?)"),
    "recorder_wrong_type": (GOOD + "  recorder: {num_writers: two}\n", "invalid recorder setting num_writers='two'"),
    "run_name_a_number": (GOOD + "  recorder: {run_name: 5}\n", "invalid recorder setting run_name=5"),
    "stop_a_list": (GOOD.replace("{training_iteration: 1}", "[training_iteration, 1]"), "'stop:' must be a mapping"),
    "stop_value_text": (GOOD.replace("1}", "five}"), "'stop: training_iteration:' must be a number"),
    "config_a_list": (GOOD + "  config: [num_env_runners, 1]\n", "'config:' must be a mapping"),
    "unknown_rllib_setting": (GOOD + "  config: {num_env_runner: 1}\n",
                              "'config: num_env_runner:' is not an RLlib setting of PPO "
                              "(did you mean 'num_env_runners'?)"),
    "old_rllib_setting": (GOOD + "  config: {num_rollout_workers: 1}\n", "is RLlib's old name of 'num_env_runners', which RLlib 2.60 refuses; rename it 'num_env_runners'"),
    "unknown_evaluation_setting": (GOOD + "  config: {evaluation_intervall: 1}\n",
                                   "(did you mean 'evaluation_interval'?)"),
    "number_as_yaml_text": (GOOD + "  config: {lr: 1e-3}\n", "YAML reads 1e-3 as text: write 0.001"),
    "bool_a_number": (GOOD + "  config: {explore: 1}\n", "'config: explore:' must be true or false"),
    "env_config_a_string": (GOOD + "  config: {env_config: num_agents=2}\n", "'config: env_config:' must be a mapping"),
    "rllib_refuses_a_value": (GOOD + "  config: {train_batch_size: 100, minibatch_size: 5000}\n",
                              "RLlib refuses 'config:' for PPO"),
    "multiagent_unknown_policy": (GOOD + "  config: {multiagent: {policies: [p0], policy_mapping_fn: {0: p1}}}\n",
                                  "maps to policy 'p1', which 'policies:' does not list"),
    "unknown_env": ("x:\n  run: PPO\n  env: CartPol-v1\n", "unknown env 'env: CartPol-v1' (did you mean 'CartPole-v1'?)"),
    "env_a_mapping": ("x:\n  run: PPO\n  env: {id: CartPole-v1}\n", "'env:' must be a gymnasium id"),
    "ale_id_without_module": ("x:\n  run: PPO\n  env: ALE/Breakout-v5\n", "write 'ale_py:ALE/Breakout-v5'"),
    "unknown_ale_env": ("x:\n  run: PPO\n  env: ale_py:ALE/Breakot-v5\n  atari_wrappers: {dim: 84}\n",
                        "(did you mean 'ALE/Breakout-v5'?)"),
    "atari_option_unknown": ("x:\n  run: PPO\n  env: ale_py:ALE/Breakout-v5\n  atari_wrappers: {dim: 84, stack: 4}\n",
                             "unknown 'atari_wrappers:' setting 'stack'"),
    "env_os_system": ("x:\n  run: PPO\n  env: os:system\n", "would import module 'os', which the file does not list"),
    "env_os_system_registered": ("x:\n  run: PPO\n  env: os:system\n  register: [os]\n", "is not an env class"),
    "env_popen_registered": ("x:\n  run: PPO\n  env: subprocess:Popen\n  register: [subprocess]\n",
                             "is not an env class"),
    "env_class_path_os_system": ("x:\n  run: PPO\n  env: os.system\n", "would import module 'os'"),
    "callbacks_class_path": (GOOD + "  config: {callbacks: os.system}\n",
                             "'os.system' would be imported by RLlib from module 'os'"),
    "custom_model_class_path": (GOOD + "  config: {model: {custom_model: evil.Model}}\n",
                                "would be imported by RLlib from module 'evil'"),
    "register_a_string": (GOOD + "  register: ale_py\n", "'register:' must be a list of module names"),
    "register_missing_module": (GOOD + "  register: [no_such_module_xyz]\n", "'register:' cannot import"),
}


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in files + dirs)


def _train(tmp_path, data, *extra):
    """Runs `python -m rllib_recorder.cli train exp.yaml` in tmp_path; returns (proc, files before, files after)."""
    path = tmp_path / "exp.yaml"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, RAY_TMPDIR=str(temp), TMPDIR=str(temp), PYTHONDONTWRITEBYTECODE="1")
    before = _listing(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "rllib_recorder.cli", "train", "exp.yaml", *extra],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    return proc, before, _listing(tmp_path)


def _assert_one_line_error(proc, before, after, message):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout and not proc.stdout
    assert "Ray" not in proc.stderr.replace("RLlib", "")  # no "Started a local Ray instance"
    assert after == before  # no recordings dir, no Tune dir, no Ray session dir, no PWNED


# A few as real child processes (the first thing a user meets, the two that would run or import something, one
# RLlib itself refuses, and one that needs a fresh process); the rest through click's runner in this process,
# where ray.init and Tune are made to fail if anything reaches them.
CHILD = ["syntax_error", "python_tag", "env_os_system", "rllib_refuses_a_value",
         "ale_id_without_module"]  # in a fresh process: here ale_py may have registered its ids already


@pytest.mark.parametrize("name", CHILD)
def test_train_on_a_bad_yaml_says_one_line_and_exits_2_before_anything(tmp_path, name):
    data, message = BAD[name]
    _assert_one_line_error(*_train(tmp_path, data), message)


def _train_in_process(tmp_path, monkeypatch, data):
    """``train exp.yaml`` through click's runner in tmp_path, where ray.init and Tune fail if anything reaches them;
    asserts one ``error:`` line and exit 2, and returns that line."""
    import ray
    import ray.tune
    from click.testing import CliRunner

    from rllib_recorder.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(ray.tune, "Tuner", no_ray)  # the test session's Ray may be up already
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.yaml").write_bytes(data if isinstance(data, bytes) else data.encode())
    result = CliRunner().invoke(main, ["train", "exp.yaml"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not result.stdout, result.stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(set(BAD) - set(CHILD)))
def test_train_in_process_on_a_bad_yaml_says_one_line_and_never_starts_ray(tmp_path, monkeypatch, name):
    data, message = BAD[name]
    assert message in _train_in_process(tmp_path, monkeypatch, data)
    assert _listing(tmp_path) == ["exp.yaml"]


def test_train_on_a_missing_file_says_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rllib_recorder.cli", "train", "nope.yaml"], capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    _assert_one_line_error(proc, [], _listing(tmp_path), "cannot read 'nope.yaml'")


def test_train_checks_the_command_line_overrides_too(tmp_path):
    _assert_one_line_error(*_train(tmp_path, GOOD, "--output-dir", ""), "invalid recorder setting output_dir=''")


def test_an_env_module_not_listed_in_register_is_never_imported(tmp_path, monkeypatch):
    sentinel = hostile_yaml.SENTINEL
    (tmp_path / f"{sentinel}.py").write_text(hostile_yaml.SENTINEL_SOURCE)
    # as a user runs it, in a child process whose working directory holds the module
    _assert_one_line_error(*_train(tmp_path, f"x:\n  run: PPO\n  env: {sentinel}:Env\n"),
                           f"would import module '{sentinel}'")
    (tmp_path / "temp").rmdir()
    # the other spellings in this process, the module importable from here too
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for data, message in ((f"x:\n  run: PPO\n  env: {sentinel}.Env\n", f"would import module '{sentinel}'"),
                          (f"x:\n  run: PPO\n  env: {sentinel}:Env-v0\n", f"would import module '{sentinel}'"),
                          (GOOD + f"  config: {{callbacks: {sentinel}.Callbacks}}\n", "would be imported by RLlib")):
        assert message in _train_in_process(tmp_path, monkeypatch, data)
    assert sentinel not in sys.modules and not (tmp_path / hostile_yaml.SENTINEL_MARK).exists()


def test_a_module_the_file_lists_in_register_is_imported(tmp_path, monkeypatch):
    (tmp_path / f"{hostile_yaml.SENTINEL}.py").write_text(hostile_yaml.SENTINEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.yaml").write_text(f"x:\n  run: PPO\n  env: {hostile_yaml.SENTINEL}:Env\n"
                                       f"  register: [{hostile_yaml.SENTINEL}]\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    try:
        spec = load_experiment("exp.yaml")
        assert not (tmp_path / hostile_yaml.SENTINEL_MARK).exists()  # loading imports nothing
        assert check_experiment(spec).env == "Env"  # the class, registered with Tune under the name the file gives
        assert (tmp_path / hostile_yaml.SENTINEL_MARK).exists()
    finally:
        sys.modules.pop(hostile_yaml.SENTINEL, None)
    assert _listing(tmp_path) == sorted([f"{hostile_yaml.SENTINEL}.py", hostile_yaml.SENTINEL_MARK, "exp.yaml"])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_every_shipped_config_passes_the_checks_and_writes_nothing(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    spec = load_experiment(path)
    check_experiment(spec)
    assert spec.recorder.output_dir == str(tmp_path / "recordings") and _listing(tmp_path) == []


def test_the_env_can_be_the_recorders_atari_wrapper_name(tmp_path):
    (tmp_path / "exp.yaml").write_text("x:\n  run: PPO\n  env: ale_py:ALE/Breakout-v5-atari84x4\n")
    spec = load_experiment(str(tmp_path / "exp.yaml"))
    assert (spec.env, spec.atari_wrappers) == ("ale_py:ALE/Breakout-v5", {"dim": 84, "framestack": 4})
    assert check_experiment(spec).env == "ale_py:ALE/Breakout-v5-atari84x4"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    logging.disable(logging.WARNING)  # RLlib's notes on accepted configs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hostile_yaml.Harness(str(tmp_path_factory.mktemp("hostile"))) as h:
            yield h
    logging.disable(logging.NOTSET)


def test_the_harness_sees_a_spawned_process_a_written_file_and_an_imported_sentinel(harness, monkeypatch):
    import importlib

    for misdeed in (lambda spec: os.system("true"), lambda spec: open("written", "w").close(),
                    lambda spec: importlib.import_module(hostile_yaml.SENTINEL), lambda spec: {}["x"]):
        monkeypatch.setattr(harness, "check", misdeed)
        assert harness.examine(GOOD.encode())[0] == "violation"
        harness.reset()
    monkeypatch.undo()
    assert harness.examine(GOOD.encode()) == ("accepted", "")


@settings(max_examples=500, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False))
def test_hostile_yaml_is_accepted_or_refused_in_one_line_and_never_runs_anything(harness, rng):
    data = hostile_yaml.document(rng)
    outcome, detail = harness.examine(data)
    event(outcome)
    if outcome == "violation":
        harness.reset()
    assert outcome in ("accepted", "error"), f"{detail}\ndocument: {data[:500]!r}"
    assert issubclass(ConfigError, RecorderError)
