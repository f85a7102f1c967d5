"""`render`: one recorded episode as a GIF or MP4: Atari from the stored frames (decoding back to them exactly),
other envs re-simulated from the start state (one picture per step), and its bad input in one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from rllib_recorder.cli import main
from rllib_recorder.read.run import open_run


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def gif_frames(path) -> list[np.ndarray]:
    image = Image.open(path)
    frames = []
    for i in range(image.n_frames):
        image.seek(i)
        frames.append(np.asarray(image.convert("L")))
    return frames


def first_finished(run_dir, decode=True):
    with open_run(run_dir) as run:
        return next(e for e in run.episodes(decode=decode) if e.is_done)


def test_a_breakout_gif_decodes_back_to_the_stored_frames_exactly(recorded_breakout, tmp_path):
    episode = first_finished(recorded_breakout, decode=False)
    out = tmp_path / "episode.gif"
    result = invoke("render", recorded_breakout, "--episode", episode.eps_id, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"episode {episode.eps_id}" in result.output and f"{len(episode)} frames (stored frames)" in result.output
    frames = gif_frames(out)
    assert len(frames) == len(episode)
    stored = episode.obs[:len(episode), ..., -1]  # the newest frame of each stored stack: uint8 codes
    height, width = stored.shape[1:]
    for i, picture in enumerate(frames):
        drawn = picture[:3 * height]  # above the caption band, scaled up 3 times by whole pixels
        assert drawn.shape == (3 * height, 3 * width)
        for dy in range(3):
            for dx in range(3):
                np.testing.assert_array_equal(drawn[dy::3, dx::3], stored[i], err_msg=f"frame {i}")
        assert picture[3 * height:].any()  # the caption is drawn under it


def test_a_cartpole_render_has_one_picture_per_step_as_gif_and_mp4(recorded_cartpole, tmp_path):
    episode = first_finished(recorded_cartpole)
    gif, mp4 = tmp_path / "episode.gif", tmp_path / "episode.mp4"
    for out in (gif, mp4):
        result = invoke("render", recorded_cartpole, "--episode", episode.eps_id, "-o", out)
        assert result.exit_code == 0, result.output
        assert f"{len(episode)} frames (re-simulated in CartPole-v1)" in result.output, result.output
    frames = gif_frames(gif)
    assert len(frames) == len(episode)
    assert all((a != b).any() for a, b in zip(frames, frames[1:]))  # the pole moves; the caption counts on
    import av

    with av.open(str(mp4)) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == len(episode) and decoded[0].shape[:2] == (frames[0].shape[0], frames[0].shape[1])


def test_best_and_worst_pick_the_finished_episodes_of_highest_and_lowest_return(recorded_cartpole, tmp_path):
    with open_run(recorded_cartpole) as run:
        returns = {e.eps_id: e.episode_return for e in run.episodes() if e.is_done}
    for flag, pick in (("--best", max), ("--worst", min)):
        result = invoke("render", recorded_cartpole, flag, "-o", tmp_path / f"{flag[2:]}.gif")
        assert result.exit_code == 0, result.output
        eps_id = result.output.split("episode ")[1].split()[0]
        assert returns[eps_id] == pick(returns.values()), (flag, result.output)


@pytest.mark.parametrize("args, says", [
    (["--best", "--worst"], "give one of --episode, --best and --worst"),
    (["--episode", "nope"], "episode 'nope' is not in run"),
    (["-o", "x.png"], "render writes a .gif or an .mp4"),
    (["-o", "/nonexistent/dir/x.gif"], "is not a writable directory"),
])
def test_bad_render_input_is_one_line_and_exit_2(recorded_cartpole, tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    if "-o" not in args:
        args = args + ["-o", "x.gif"]
    result = invoke("render", recorded_cartpole, *args)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and says in result.output, result.output


def test_mp4_without_pyav_is_one_line_naming_the_extra(recorded_cartpole, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed: its import fails
    result = invoke("render", recorded_cartpole, "-o", tmp_path / "x.mp4")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "pip install 'rllib-recorder[video]'" in result.output and not (tmp_path / "x.mp4").exists()
