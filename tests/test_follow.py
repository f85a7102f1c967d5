"""Following a live run from other processes: the user's training script records while this test follows it with
``run.follow()`` and ``rllib-recorder info --follow`` watches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from rllib_recorder import open_run
from rllib_recorder.format.manifest import read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_follower_sees_every_chunk_and_every_episode_exactly_once_while_the_run_records(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tests.user_program", "long", str(tmp_path / "rec")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        run_dir = json.loads(proc.stdout.readline())["run_dir"]  # after the first iteration: the run records
        watcher = subprocess.Popen([sys.executable, "-m", "rllib_recorder.cli", "info", run_dir, "--follow",
                                    "--interval", "0.5", "--json"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        with open_run(run_dir) as run:
            episodes, live = [], []

            def follow_episodes() -> None:
                for episode in run.follow(episodes=True, poll_s=0.2, timeout_s=300):
                    episodes.append((episode.worker_index, episode.agent_id, episode.eps_id, len(episode)))

            thread = threading.Thread(target=follow_episodes)
            thread.start()
            chunks = []
            for batch in run.follow(poll_s=0.2, timeout_s=300):
                chunks.append((batch.worker_index, batch.row, batch.info["env_steps"]))
                live.append(read_manifest(run_dir)["status"] == "running")
            ended = read_manifest(run_dir)["status"]  # follow() returns once the run has ended and all is read
            thread.join(timeout=300)
        assert proc.wait(timeout=120) == 0
        shown = [json.loads(line) for line in watcher.communicate(timeout=120)[0].splitlines()]
    finally:
        proc.kill()
        watcher.kill()
    # info --follow: counts as the run records, then its end; env steps never go back
    assert shown[0]["status"] == "recording" and shown[-1]["status"] == "finished", shown
    steps = [line["env_steps"] for line in shown]
    assert steps == sorted(steps) and len(shown) >= 3
    # it followed while the run recorded, and to its end (its last chunk may come before or after the run is marked
    # finished: the end is what stops it)
    assert any(live) and ended == "finished", (live, ended)
    with open_run(run_dir) as run:
        stored = [(f.worker_index, row, int(steps)) for f in run.files
                  for row, steps in enumerate(f.batches()["env_steps"].tolist())]
        every = [(e.worker_index, e.agent_id, e.eps_id, len(e)) for e in run.episodes()]
        total = run.num_env_steps
    assert sorted(chunks) == sorted(stored) and len(set(chunks)) == len(chunks)
    assert sorted(episodes) == sorted(every) and len(set(episodes)) == len(episodes)
    assert sum(n for _, _, n in chunks) == sum(n for *_, n in episodes) == total == steps[-1] > 0
    print(f"followed {len(chunks)} chunks and {len(episodes)} episodes ({total} env steps), "
          f"{sum(live)} chunks while the run recorded")
