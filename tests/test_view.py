"""`rllib-recorder view`'s server, without a browser: its JSON equals what open_run reads of real recorded runs,
frames are the stored bytes, pictures the env's own re-simulated, nothing outside the runs is served, nothing is
written into a run, a damaged file is named while the rest is shown; the command as a real process (URL first,
a warning for --host, Ctrl-C exits 0) and its bad input in one line."""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest
from click.testing import CliRunner

from rllib_recorder import open_run
from rllib_recorder.cli import main
from tests import hostile
from tests.view_runs import HOSTILE, get, get_json, hostile_run, served, typed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def both(recorded_cartpole, recorded_breakout):
    """A viewer over the session's CartPole and Breakout runs; their ids by path."""
    with served(recorded_cartpole, recorded_breakout) as server:
        ids = {path: run_id for run_id, path in server.catalog.scan().items()}
        yield server, ids


def first_finished(run_dir, decode=True):
    with open_run(run_dir) as run:
        return next(e for e in run.episodes(decode=decode) if e.is_done)


def test_the_runs_are_listed_with_open_runs_counts(both, recorded_cartpole, recorded_breakout):
    server, ids = both
    listed = {row["id"]: row for row in get_json(server, "/api/runs")["runs"]}
    assert set(listed) == set(ids.values()) and len(listed) == 2
    for path in (recorded_cartpole, recorded_breakout):
        row = listed[ids[path]]
        with open_run(path) as run:
            counts = run.counts()
            finished = sum(e.is_done for e in run.episodes(evaluation=None))
        assert (row["episodes"], row["env_steps"], row["finished"]) == (counts["episodes"], counts["env_steps"], finished)
        assert row["status"] == "finished" and not row["recording"] and row["damaged"] == []
        assert get_json(server, "/api/verdict", run=ids[path])["verdict"] == "sound"


def test_the_episode_table_pages_sorts_and_filters_every_episode(both, recorded_cartpole):
    server, ids = both
    run_id = ids[recorded_cartpole]
    with open_run(recorded_cartpole) as run:
        episodes = list(run.episodes(evaluation=None))
    by_return = sorted(episodes, key=lambda e: -e.episode_return)
    seen = []
    for offset in range(0, len(episodes), 7):
        page = get_json(server, "/api/episodes", run=run_id, sort="return", order="desc", offset=offset, limit=7)
        assert page["total"] == len(episodes)
        seen += page["rows"]
    assert sorted(r["eps_id"] for r in seen) == sorted(e.eps_id for e in episodes)
    assert [r["return"] for r in seen] == [e.episode_return for e in by_return]
    assert {r["eps_id"]: r["length"] for r in seen} == {e.eps_id: len(e) for e in episodes}
    finished = get_json(server, "/api/episodes", run=run_id, finished=1, limit=500)
    assert finished["total"] == sum(e.is_done for e in episodes) and all(r["end"] for r in finished["rows"])
    assert finished["best"]["return"] == by_return[0].episode_return
    assert get_json(server, "/api/episodes", run=run_id, evaluation="evaluation")["total"] == 0
    shortest = get_json(server, "/api/episodes", run=run_id, sort="length", order="asc", limit=1)["rows"][0]
    assert shortest["length"] == min(len(e) for e in episodes)


def test_an_episode_holds_every_stored_column_of_every_step(both, recorded_cartpole):
    server, ids = both
    episode = first_finished(recorded_cartpole)
    data = get_json(server, "/api/episode", run=ids[recorded_cartpole], file="worker-001.h5", episode=episode.eps_id)
    assert data["steps"] == len(episode) and data["timeline"] == "t" and len(data["tracks"]) == 1
    assert data["picture"] == {"kind": "simulated", "agent": "default_agent", "count": len(episode)}
    columns = {c["name"]: c for c in data["tracks"][0]["columns"]}
    np.testing.assert_array_equal(typed(columns["rewards"]["values"]), episode.rewards)
    np.testing.assert_array_equal(typed(columns["actions"]["values"]), episode.actions)
    np.testing.assert_array_equal(typed(columns["obs"]["values"]).reshape(-1, 4), episode.obs[:len(episode)])
    for key, values in episode.extra_model_outputs.items():
        stored = typed(columns[f"extra_model_outputs/{key}"]["values"])
        np.testing.assert_array_equal(stored.reshape(np.asarray(values).shape), values)
    np.testing.assert_array_equal(typed(columns["policy_lag"]["values"]), episode.policy_lag)
    assert data["tracks"][0]["infos"] == episode.infos


def test_frames_are_the_stored_uint8_frames_cut_by_step(both, recorded_breakout):
    server, ids = both
    episode = first_finished(recorded_breakout, decode=False)
    stored = episode.obs[:len(episode), ..., -1]  # the newest frame of each stored stack, as render draws it
    data = get_json(server, "/api/episode", run=ids[recorded_breakout], file="worker-001.h5", episode=episode.eps_id)
    picture = data["picture"]
    assert (picture["kind"], picture["count"], picture["height"], picture["width"], picture["channels"]) == \
        ("frames", len(episode), *stored.shape[1:], 1)
    assert "obs" not in {c["name"] for c in data["tracks"][0]["columns"]}  # drawn, not sent as values
    start = len(episode) // 3
    status, headers, body = get(server, "/api/frames", run=ids[recorded_breakout], file="worker-001.h5",
                                episode=episode.eps_id, agent="default_agent", start=start, count=40)
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    count = int(headers["X-Frames-Count"])
    assert count == min(40, len(episode) - start) and int(headers["X-Frames-Total"]) == len(episode)
    np.testing.assert_array_equal(np.frombuffer(body, np.uint8).reshape(count, *stored.shape[1:]),
                                  stored[start:start + count])


def test_a_picture_is_the_env_s_own_re_simulated_from_the_start_state(both, recorded_cartpole):
    from PIL import Image

    from rllib_recorder.commands.view import simulate

    server, ids = both
    episode = first_finished(recorded_cartpole)
    with open_run(recorded_cartpole) as run:
        expected = list(simulate(run, episode))
    for t in (0, len(episode) - 1):
        status, headers, body = get(server, "/api/picture", run=ids[recorded_cartpole], file="worker-001.h5",
                                    episode=episode.eps_id, t=t)
        assert status == 200 and headers["Content-Type"] == "image/png"
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(body))), expected[t])


def raw_get(server, target: str, host: str | None = None) -> int:
    """The status of a GET of ``target`` exactly as written (no client tidies its dots)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("GET", target, skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", host or f"127.0.0.1:{server.port}")
    connection.endheaders()
    status = connection.getresponse().status
    connection.close()
    return status


def test_nothing_outside_the_runs_is_served(both, recorded_cartpole, tmp_path):
    server, ids = both
    run_id = urllib.parse.quote(ids[recorded_cartpole], safe="")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the page")
    for target in ["/static/../../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/..%2f..%2fetc/passwd",
                   "//etc/passwd", f"/static/{secret}", "/static/../view/api.py", "/static/app.js/..", "/api/nope",
                   "/static/", "/static/api.py", "/manifest.json", f"/{run_id}/manifest.json",
                   "/api/run?run=..%2F..", f"/api/run?run={urllib.parse.quote(recorded_cartpole, safe='')}",
                   f"/api/run?run={urllib.parse.quote(str(tmp_path), safe='')}", "/api/run?run=%2Fetc",
                   f"/api/episode?run={run_id}&file=..%2Fmanifest.json&episode=x",
                   f"/api/episode?run={run_id}&file=%2Fetc%2Fpasswd&episode=x",
                   f"/api/frames?run={run_id}&file=worker-001.h5&episode=..%2F..&agent=default_agent",
                   f"/api/episode?run={run_id}%2F..%2F..&file=worker-001.h5&episode=x"]:
        assert raw_get(server, target) == 404, target
    assert raw_get(server, "/static/app.js") == 200 and raw_get(server, "/") == 200
    # a page elsewhere that reaches 127.0.0.1 through a name of its own (DNS rebinding) is not answered
    assert raw_get(server, "/api/runs", host=f"attacker.example:{server.port}") == 403


def test_every_page_file_ships_in_the_package_and_names_its_license():
    static = os.path.join(ROOT, "rllib_recorder", "view", "static")
    assert sorted(os.listdir(static)) == ["LICENSE.txt", "app.js", "chart.js", "index.html", "style.css"]
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert '"rllib_recorder.view" = ["static/*.html", "static/*.js", "static/*.css", "static/LICENSE.txt"]' in pyproject
    for name in ("app.js", "chart.js", "index.html", "style.css"):
        text = open(os.path.join(static, name)).read()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name  # nothing from the web
    assert "innerHTML" not in open(os.path.join(static, "app.js")).read() + open(os.path.join(static, "chart.js")).read()


def test_viewing_writes_nothing_into_a_run(recorded_breakout, tmp_path):
    run_dir = shutil.copytree(recorded_breakout, tmp_path / "exp" / "run")
    before = hostile.snapshot(str(tmp_path), [])
    mtimes = {p: os.stat(p).st_mtime_ns for p in before if os.path.isfile(p)}
    with served(tmp_path) as server:
        run_id = get_json(server, "/api/runs")["runs"][0]["id"]
        get_json(server, "/api/run", run=run_id)
        get_json(server, "/api/verdict", run=run_id)
        row = get_json(server, "/api/episodes", run=run_id)["rows"][0]
        get_json(server, "/api/episode", run=run_id, file=row["file"], episode=row["eps_id"])
        assert get(server, "/api/frames", run=run_id, file=row["file"], episode=row["eps_id"],
                   agent="default_agent", count=5)[0] == 200
    assert hostile.snapshot(str(tmp_path), []) == before
    assert {p: os.stat(p).st_mtime_ns for p in mtimes} == mtimes
    assert os.path.isdir(run_dir)


def test_a_damaged_file_is_named_and_the_rest_of_the_run_is_shown(recorded_cartpole, tmp_path):
    run_dir = shutil.copytree(recorded_cartpole, tmp_path / "run")
    shutil.copy(run_dir / "worker-001.h5", run_dir / "worker-002.h5")
    data = (run_dir / "worker-002.h5").read_bytes()
    (run_dir / "worker-002.h5").write_bytes(data[: len(data) // 2])  # cut short
    with open_run(recorded_cartpole) as run:
        episodes = run.counts()["episodes"]
    with served(run_dir) as server:
        (row,) = get_json(server, "/api/runs")["runs"]
        assert row["damaged"] == ["worker-002.h5"] and row["episodes"] == episodes
        run = get_json(server, "/api/run", run=row["id"])
        files = {f["name"]: f for f in run["worker_files"]}
        assert files["worker-001.h5"]["error"] is None and "worker-002.h5" in files["worker-002.h5"]["error"]
        assert get_json(server, "/api/episodes", run=row["id"])["total"] == episodes
        assert get_json(server, "/api/verdict", run=row["id"])["verdict"] in ("unreadable", "not sound")


def test_a_multi_agent_episode_is_one_track_per_agent_with_gaps(tmp_path):
    hostile_run(str(tmp_path))
    with served(tmp_path) as server:
        (row,) = get_json(server, "/api/runs")["runs"]
        assert row["id"] == f"{HOSTILE['experiment']}/PPO_hostile_00000" and row["env"] == HOSTILE["env"]
        assert row["algorithm"] == HOSTILE["algorithm"] and row["episodes"] == 2  # one per agent
        data = get_json(server, "/api/episode", run=row["id"], file="worker-001.h5", episode=HOSTILE["eps_id"])
    assert data["timeline"] == "env_t" and data["steps"] == 6
    tracks = {t["agent"]: t for t in data["tracks"]}
    assert set(tracks) == {HOSTILE["agent"], "b"}
    assert typed(tracks[HOSTILE["agent"]]["x"]).tolist() == [0, 2, 4]  # it did not act at 1, 3, 5
    assert typed(tracks["b"]["x"]).tolist() == [1, 3, 5]
    rewards = {c["name"]: c for c in tracks["b"]["columns"]}["rewards"]
    assert typed(rewards["values"]).tolist() == [2.0, 4.0, 6.0]
    assert tracks[HOSTILE["agent"]]["infos"][0] == {"note": HOSTILE["info"]}
    assert tracks[HOSTILE["agent"]]["module"] == HOSTILE["module"]
    assert data["picture"]["kind"] == "obs"  # observations as a strip chart: a multi-agent env is not re-simulated


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["view", str(tmp_path / "missing"), "--no-browser"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: ") and "is not a directory" in result.output
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        result = CliRunner().invoke(main, ["view", str(tmp_path), "--no-browser", "--port", taken.getsockname()[1]])
    finally:
        taken.close()
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "pick another --port" in result.output


@pytest.mark.parametrize("host", [None, "127.0.0.2"], ids=["default", "--host"])
def test_the_command_prints_its_url_first_serves_and_ctrl_c_exits_0(recorded_cartpole, host):
    argv = [sys.executable, "-m", "rllib_recorder.cli", "view", recorded_cartpole, "--no-browser"]
    proc = subprocess.Popen(argv + (["--host", host] if host else []), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith(f"http://{host or '127.0.0.1'}:") and url.endswith("/"), url
        port = int(url.rsplit(":", 1)[1].rstrip("/"))
        connection = http.client.HTTPConnection(host or "127.0.0.1", port, timeout=60)
        connection.request("GET", "/api/runs")
        runs = json.loads(connection.getresponse().read())["runs"]
        assert [r["episodes"] for r in runs] == [open_run(recorded_cartpole).counts()["episodes"]]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and out.strip().endswith("stopped")
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == (1 if host else 0), err
    if host:
        assert f"serving on {host}" in warnings[0] and "leave --host out" in warnings[0]
