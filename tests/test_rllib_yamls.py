"""Tune-style YAMLs as RLlib's tuned examples are written (old key names, grid searches, old result names in
``stop:``, negative thresholds): every problem listed at once with its fix, RLlib's renames translated with a note,
clear one-line limits, and a grid search that trains and records. The files are written here in the shape of Ray's
published ones (``rllib/tuned_examples/``), not copied from them: the corpus ``tests/data/rllib_tuned_example_shapes``
(its README says why) is checked whole, and a handful trains."""

from __future__ import annotations

import glob
import os
import re

import pytest
from click.testing import CliRunner

from rllib_recorder.cli import main

PENDULUM = """\
pendulum-ppo:
    env: Pendulum-v1
    run: PPO
    stop:
        episode_reward_mean: -400
        timesteps_total: 400000
    config:
        framework: tf2
        train_batch_size: 512
        vf_clip_param: 10.0
        num_workers: 1
        num_envs_per_worker: 2
        lambda: 0.1
        gamma: 0.95
        lr: 0.0003
        sgd_minibatch_size: 64
        num_sgd_iter: 6
        model:
            fcnet_activation: relu
"""

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "rllib_tuned_example_shapes")
CORPUS = sorted(glob.glob(os.path.join(CORPUS_DIR, "**", "*.yaml"), recursive=True))

# Why a file of the corpus is refused, by the wording of its problems (a file may have several).
REASONS = {
    "an algorithm RLlib 2.60 no longer has": r"is an algorithm RLlib 2\.60 no longer has",
    "an old key RLlib 2.60 refuses or ignores": r"is RLlib's old name of .*, which RLlib 2\.60 (refuses|ignores)",
    "a key RLlib 2.60 does not have": r"is not an RLlib (evaluation )?setting of",
    "RLlib's own validation refuses the config": r"RLlib refuses 'config:'",
    "framework: tf/tf2 (TensorFlow)": r"needs TensorFlow",
    "an env that needs MuJoCo (mujoco-py ids)": r"needs mujoco-py|needs the mujoco package",
    "an env or class RLlib 2.60 no longer ships, or unknown": r"unknown env|cannot be imported|is not an env class",
}


def corpus_outcome(result) -> tuple[bool, list[str]]:
    """(passes, the reasons it is refused) of ``train FILE --check``; asserts the promise of the check: exit 0 with
    'ok:', or exit 2 with every problem on a line of its own that says what to do, never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    if result.exit_code == 0:
        assert result.stdout.startswith("ok: "), result.stdout
        return True, []
    assert result.exit_code == 2 and not result.stdout, (result.exit_code, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    listed = [line[4:] for line in result.stderr.splitlines() if line.startswith("  - ")]
    problems = listed or [errors[0]]
    assert not listed or errors[0].endswith(f"{len(listed)} problems:"), result.stderr
    for problem in problems:  # each names what to do about it
        assert re.search(r"; |use |give |rename|add |install|write |fix", problem), problem
    reasons = [reason for reason, pattern in REASONS.items() if any(re.search(pattern, p) for p in problems)]
    assert reasons, problems  # every refusal is one of the reasons the guide's table counts
    return False, reasons


def _check(tmp_path, text: str, *args: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["train", str(path), "--check", *args])
    return result.exit_code, result.stdout, result.stderr


def test_every_problem_of_a_published_style_file_is_listed_at_once_with_its_fix(tmp_path):
    code, out, err = _check(tmp_path, PENDULUM)
    assert code == 2 and not out, (out, err)
    lines = err.strip().splitlines()
    assert lines[-4].startswith("error: ") and lines[-4].endswith("3 problems:"), err
    problems = lines[-3:]
    assert any("'config: framework:' tf2 needs TensorFlow" in p and "write 'framework: torch'" in p for p in problems)
    assert any("'config: num_envs_per_worker:' is RLlib's old name of 'num_envs_per_env_runner', which RLlib 2.60 "
               "refuses; rename it 'num_envs_per_env_runner'" in p for p in problems)
    assert any("'config: sgd_minibatch_size:' is RLlib's old name of 'minibatch_size', which RLlib 2.60 ignores; "
               "rename it 'minibatch_size'" in p for p in problems)
    notes = [line for line in lines if line.startswith("note: ")]  # RLlib maps these itself: translated, noted
    assert any("'config: num_sgd_iter:' is RLlib's old name of 'num_epochs'; taken as 'num_epochs: 6'" in n
               for n in notes)
    assert any("'config: num_workers:' is RLlib's old name of 'num_env_runners'" in n for n in notes)
    assert any("'stop: episode_reward_mean:'" in n and "stopping on 'env_runners/episode_return_mean'" in n
               for n in notes)
    assert any("'stop: timesteps_total:'" in n and "'num_env_steps_sampled_lifetime'" in n for n in notes)
    fixed = (PENDULUM.replace("tf2", "torch").replace("num_envs_per_worker", "num_envs_per_env_runner")
             .replace("sgd_minibatch_size", "minibatch_size"))
    code, out, err = _check(tmp_path, fixed)  # fixed once, it passes
    assert code == 0 and out.startswith("ok: ") and "env_runners/episode_return_mean -400" in out, (out, err)


def test_stop_takes_negative_numbers_and_warns_of_a_name_no_result_holds(tmp_path):
    text = PENDULUM.replace("framework: tf2", "framework: torch").replace("num_envs_per_worker", "num_envs_per_env_runner") \
        .replace("sgd_minibatch_size", "minibatch_size").replace(
            "        timesteps_total: 400000\n", "        env_runners/episode_retrun_mean: -1000\n")
    code, out, err = _check(tmp_path, text)
    assert code == 0, (out, err)
    assert "'stop: env_runners/episode_retrun_mean:' is not a name RLlib 2.60's results hold (nearest: " \
           "env_runners/episode_return_mean" in err
    code, out, err = _check(tmp_path, text.replace("-1000", "nan"))
    assert code == 2 and "must be a number" in err


@pytest.mark.parametrize("run, env, fix", [
    ("DDPG", "Pendulum-v1", "use SAC"),
    ("A2C", "CartPole-v1", "use PPO"),
    ("SAC", "HalfCheetah-v2", "needs mujoco-py"),
    ("SAC", "BipedalWalker-v3", "needs the Box2D package"),
])
def test_clear_limits_are_one_line_each(tmp_path, run, env, fix):
    import importlib.util

    if env.startswith("Bipedal") and importlib.util.find_spec("Box2D") is not None:
        pytest.skip("Box2D is installed here")
    code, out, err = _check(tmp_path, f"x:\n  run: {run}\n  env: {env}\n  stop: {{training_iteration: 1}}\n")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], err


_OUTCOMES: dict[tuple[str, bool], tuple[bool, list[str]]] = {}


def checked(path: str, rename: bool) -> tuple[bool, list[str]]:
    """``corpus_outcome`` of ``train path --check`` (with ``--rename-old-keys``), once per session."""
    if (path, rename) not in _OUTCOMES:
        args = ["train", path, "--check"] + (["--rename-old-keys"] if rename else [])
        _OUTCOMES[path, rename] = corpus_outcome(CliRunner().invoke(main, args))
    return _OUTCOMES[path, rename]


@pytest.mark.parametrize("path", CORPUS, ids=[os.path.relpath(p, CORPUS_DIR) for p in CORPUS])
def test_every_file_of_the_corpus_passes_or_is_refused_with_every_problem_listed(path):
    outcome, renamed = checked(path, False), checked(path, True)
    assert renamed[0] or "an old key RLlib 2.60 refuses or ignores" not in renamed[1]
    if outcome[0]:
        assert renamed[0]  # taking old names can't make a passing file fail


def test_the_guides_corpus_table_holds_what_the_check_says():
    """docs/guide.md's table of the corpus: its counts are what ``train --check`` answers today."""
    guide = open(os.path.join(os.path.dirname(CORPUS_DIR), "..", "..", "docs", "guide.md")).read()
    outcomes = {p: checked(p, False) for p in CORPUS}
    renamed = {p: checked(p, True) for p in CORPUS}
    passed = sum(ok for ok, _ in outcomes.values())
    assert f"{len(CORPUS)} files: {passed} pass as written, {sum(ok for ok, _ in renamed.values())} with " \
           "`--rename-old-keys`" in guide
    for reason in REASONS:
        count = sum(reason in reasons for _, reasons in outcomes.values())
        assert f"| {reason} | {count} |" in guide, (reason, count)


# A handful of the corpus trains for one iteration, small overrides only (as the guide shows): each run recorded
# and verified. (file, extra arguments, YAML text replaced to keep the iteration small on 2 CPUs; the grid's
# trials sample in their own process, with no env-runner actor to start each time). An asynchronous algorithm
# through Tune is IMPALA's multi-agent file here (APPO is IMPALA's subclass; APPO alone is checked against RLlib's
# count in test_errors_and_tune.py).
TRAINED = {
    "ppo/cartpole-ppo.yaml": ([], {}),  # the old API stack
    "ppo/cartpole-ppo-grid-search-example.yaml": (["--rename-old-keys", "--num-env-runners", "0"], {
        "        num_env_runners: 2\n": "        num_env_runners: 2\n        train_batch_size: 512\n",
        "[128, 256, 512]": "[256, 512]"}),  # a grid of 2 x 2 trials, not 2 x 3
    "dqn/cartpole-dqn.yaml": (["--verbose"], {}),  # and train --verbose: Ray's, RLlib's and Tune's own output
    "impala/multi-agent-cartpole-impala.yaml": ([], {"        num_gpus: 0\n": "        num_gpus: 0\n        num_learners: 0\n"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINED))
def test_a_handful_of_the_corpus_trains_one_iteration_records_and_verifies(ray_session, tmp_path, monkeypatch,
                                                                           name):
    extra, smaller = TRAINED[name]
    text = open(os.path.join(CORPUS_DIR, name)).read()
    for old, new in smaller.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / os.path.basename(name)
    path.write_text(text)
    monkeypatch.chdir(tmp_path)
    runners = [] if "--num-env-runners" in extra else ["--num-env-runners", "1"]
    result = CliRunner().invoke(main, ["train", str(path), "--stop-iters", "1", *runners,
                                       "--output-dir", str(tmp_path / "rec"), *extra])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    runs = int(re.search(r"trained and recorded (\d+) run", result.stdout).group(1))
    assert runs == (4 if "grid" in name else 1), result.stdout  # the grid: 2 x 2 trials, each recorded
    assert result.stdout.count("verify: sound: all ") == runs, result.stdout
    if "--verbose" in extra:  # Tune's own table beside the summary (the quiet default: tests/test_readme.py)
        assert "Trial status" in result.stdout and "recorded run: " in result.stdout, result.stdout[-3000:]
    if "grid" in name:  # the old names taken as the new ones, the grid handed to Tune
        assert "num_epochs=4" in result.stdout and "minibatch_size=512" in result.stdout, result.stdout
