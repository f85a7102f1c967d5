"""The tested range of Ray releases: the line outside it, and the error below what can record (issue: one line each)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Builds the callback twice (one line at most, whatever the count) with the installed Ray taken for ``version``.
_CHILD = """
import sys
import ray
ray.__version__ = sys.argv[1]
from rllib_recorder import RecorderCallback
RecorderCallback.configured(output_dir=sys.argv[2])
RecorderCallback.configured(output_dir=sys.argv[2])
print("built")
"""


def _build(version: str, out: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "RLLIB_RECORDER_ANY_RAY"} | env
    return subprocess.run([sys.executable, "-c", _CHILD, version, out], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.compat
def test_the_installed_ray_is_in_the_tested_range_and_says_nothing(tmp_path):
    import ray

    from rllib_recorder._rllib_compat import NEWEST_TESTED, OLDEST_TESTED, TESTED_RANGE, ray_release

    release = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    assert release(OLDEST_TESTED) <= ray_release() <= release(NEWEST_TESTED), ray.__version__
    assert TESTED_RANGE in open(os.path.join(ROOT, "pyproject.toml")).read()  # declared as tested
    done = _build(ray.__version__, str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "built" and "rllib_recorder" not in done.stderr, done.stderr


def test_a_newer_ray_gets_one_warning_line_naming_the_range_and_recording_goes_on(tmp_path):
    done = _build("2.61.0", str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "built", done.stderr
    lines = [line for line in done.stderr.splitlines() if "rllib_recorder" in line]
    assert len(lines) == 1, done.stderr
    assert "ray 2.61.0" in lines[0] and "2.41.0 to 2.60.0" in lines[0] and "RLLIB_RECORDER_ANY_RAY=1" in lines[0]
    quiet = _build("2.61.0", str(tmp_path), RLLIB_RECORDER_ANY_RAY="1")
    assert quiet.returncode == 0 and "rllib_recorder" not in quiet.stderr, quiet.stderr


def test_a_ray_too_old_to_record_is_one_error_line_when_the_config_is_built(tmp_path):
    done = _build("2.40.0", str(tmp_path))
    assert done.returncode == 1 and "built" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rllib_recorder.errors.RecorderError: ray 2.40.0 is older than any Ray"), done.stderr
    assert "pip install 'ray[rllib]>=2.41,<2.61'" in last
