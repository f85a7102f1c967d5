"""The tested range of Ray releases: the line outside it, and the error below what can record (issue: one line each)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _build(version: str, out: str, monkeypatch, capsys, **env: str) -> str:
    """Builds the callback twice (one line at most, whatever the count) with the installed Ray taken for
    ``version`` (as a fresh process would: the once-per-process flag cleared); returns what it printed."""
    import ray

    from rllib_recorder import RecorderCallback, _rllib_compat

    monkeypatch.setattr(ray, "__version__", version)
    monkeypatch.setattr(_rllib_compat, "_warned", False)
    monkeypatch.delenv("RLLIB_RECORDER_ANY_RAY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    RecorderCallback.configured(output_dir=out)
    RecorderCallback.configured(output_dir=out)
    return capsys.readouterr().err


@pytest.mark.compat
def test_the_installed_ray_is_in_the_tested_range_and_says_nothing(tmp_path, monkeypatch, capsys):
    import ray

    from rllib_recorder._rllib_compat import NEWEST_TESTED, OLDEST_TESTED, TESTED_RANGE, ray_release

    release = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    assert release(OLDEST_TESTED) <= ray_release() <= release(NEWEST_TESTED), ray.__version__
    assert TESTED_RANGE in open(os.path.join(ROOT, "pyproject.toml")).read()  # declared as tested
    assert "rllib_recorder" not in _build(ray.__version__, str(tmp_path), monkeypatch, capsys)


def test_a_newer_ray_gets_one_warning_line_naming_the_range_and_recording_goes_on(tmp_path, monkeypatch, capsys):
    lines = [line for line in _build("2.61.0", str(tmp_path), monkeypatch, capsys).splitlines()
             if "rllib_recorder" in line]
    assert len(lines) == 1, lines
    assert "ray 2.61.0" in lines[0] and "2.41.0 to 2.60.0" in lines[0] and "RLLIB_RECORDER_ANY_RAY=1" in lines[0]
    quiet = _build("2.61.0", str(tmp_path), monkeypatch, capsys, RLLIB_RECORDER_ANY_RAY="1")
    assert "rllib_recorder" not in quiet, quiet


def test_a_ray_too_old_to_record_is_one_error_line_when_the_config_is_built(tmp_path, monkeypatch, capsys):
    from rllib_recorder import RecorderError

    with pytest.raises(RecorderError) as info:
        _build("2.40.0", str(tmp_path), monkeypatch, capsys)
    message = str(info.value)
    assert message.startswith("ray 2.40.0 is older than any Ray") and "\n" not in message, message
    assert "pip install 'ray[rllib]>=2.41,<2.61'" in message
