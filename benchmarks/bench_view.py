"""How fast `rllib-recorder view` paints, in a real browser, on a 1M-step CartPole run and a 200k-step Breakout run.

The runs are written once by the recorder's own writer (``RecordingWriter``, default settings) from real env steps
under random actions, into ``--data`` (default ``~/.cache/rllib_recorder/bench_view``), and reused after:
  CartPole  200,000 real CartPole-v1 steps in 2 worker files, episodes as the env ended them, written 5 times
            with fresh episode ids: 1,000,000 steps, about 45,000 episodes.
  Breakout  40,000 real steps of ALE Breakout through RLlib's Atari wrappers (84x84x4 frame stacks), episodes as
            the env ended them but one per worker file that runs on for 10,000 steps across the env's own
            resets (its frames stacked as one stream), in fragments of 200 steps as an env runner samples
            them, written 5 times with fresh episode ids: 200,000 steps, ten 10,000-step episodes.
Policy versions advance every 4,000 steps, a third of the chunks sampled one version behind the learner.

The viewer runs as its own process (``rllib-recorder view DATA --no-browser``); Debian's chromium, headless through
Playwright, loads each page. Measured (each ``--reps`` times; the first load after the server started is
"cold", the others "warm", with the median of the warm ones):
  runs page     from navigation to the runs table painted (``window.__painted``: the page's own mark, set in the
                animation frame after it drew)
  run page      the same for each run's page: its four charts and its first page of episodes
  episode open  a 10,000-step Breakout episode from navigation to its first frame, every chart and the value
                table drawn
  scrubbing     pictures per second the page shows, each step's stored frame drawn before the next is asked
                for: stepping on from 0 (play), dragging the slider across the episode (37 steps a move), and
                jumping to random steps (frames streamed as each needs them)
  memory        the server's resident set after all of it, and its peak (VmRSS, VmHWM)

    python benchmarks/bench_view.py --write          # makes the runs the first time (about 10 minutes)
    python benchmarks/bench_view.py --reps 3 --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LONG_EPISODE = 10_000
FRAGMENT = 200
COPIES = 5
STEPS_PER_VERSION = 4000
STEPS_PER_S = 2000.0  # the pace the chunks' sampling times are spread at


def default_data() -> str:
    return os.environ.get("RLLIB_RECORDER_BENCH_DATA") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                       "rllib_recorder", "bench_view")


# ------------------------------------------------------------------------------------------------- the runs

def write_run(run_dir: str, env: str, chunks_by_worker: dict[int, list[Any]], copies: int) -> None:
    """Writes each worker's chunks ``copies`` times (fresh episode ids each time), interleaved by sampling time,
    with learner versions and behaviour versions as a run of ``STEPS_PER_VERSION`` steps per iteration has."""
    from bench_read import _fresh_ids

    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.service.writer import RecordingWriter

    os.makedirs(run_dir)
    writer = RecordingWriter(run_dir, os.path.basename(run_dir), StorageOptions())
    span = max(c.sampled_at_s for chunks in chunks_by_worker.values() for c in chunks) + 1.0
    base = time.time() - copies * span  # sampled before they are written, as a run's are
    order = sorted((base + copy * span + c.sampled_at_s, worker, i, copy)
                   for worker, chunks in chunks_by_worker.items() for i, c in enumerate(chunks)
                   for copy in range(copies))
    seqs: dict[int, int] = {}
    for at, worker, i, copy in order:
        chunk = chunks_by_worker[worker][i]
        chunk = _fresh_ids(chunk, copy) if copies > 1 else chunk
        version = int((at - base) * STEPS_PER_S) // STEPS_PER_VERSION
        writer.set_learner_version(version, at_s=at - 1e-3)
        behind = version - (1 if i % 3 == 0 and version else 0)
        chunk = dataclasses.replace(chunk, sampled_at_s=at, streams={
            key: dataclasses.replace(s, steps={**s.steps, "weights_seq_no": np.full(len(s.steps["rewards"]), behind)})
            for key, s in chunk.streams.items()})
        writer.append(worker, False, f"bench-view-{worker}".encode().ljust(32, b"-"), seqs.get(worker, 0), chunk)
        seqs[worker] = seqs.get(worker, 0) + 1
    writer.close()
    write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": "3.0", "run_id": os.path.basename(run_dir),
                             "status": "finished", "algorithm": "PPO", "api_stack": "new", "env": env,
                             "experiment": "bench-view"})


def cartpole_chunks(steps: int, workers: int = 2) -> dict[int, list[Any]]:
    """Real CartPole-v1 episodes under random actions, ended where the env ended them, in chunks of ~2,000 steps."""
    import gymnasium as gym
    from bench_writer import chunks_of, episodes_from_env

    out = {}
    for worker in range(1, workers + 1):
        episodes = episodes_from_env(lambda: gym.make("CartPole-v1"), steps // workers, 500, seed=worker,
                                     cut_at_end=True)
        chunks = chunks_of(episodes, rows=2000)
        t = 0.0
        for k, chunk in enumerate(chunks):
            chunks[k] = dataclasses.replace(chunk, sampled_at_s=t)
            t += chunk.env_steps / STEPS_PER_S * workers
        out[worker] = chunks
    return out


def breakout_stream(seed: int) -> Iterator[tuple[np.ndarray, int, float, bool]]:
    """(newest frame, action, reward, the env ended) of real Breakout steps under random actions, resetting the
    env where it ends; the frame is the one observed before the action."""
    from rllib_recorder.commands.envs import make_atari_env

    env = make_atari_env("ale_py:ALE/Breakout-v5", 84, 4, {})
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    while True:
        action = int(rng.integers(env.action_space.n))
        frame = obs[..., -1].copy()
        obs, reward, terminated, truncated, _ = env.step(action)
        ended = terminated or truncated
        yield frame, action, float(reward), ended
        if ended:
            obs, _ = env.reset()


def breakout_chunks(steps: int, workers: int = 2) -> dict[int, list[Any]]:
    """Each worker's share of real Breakout steps as an env runner sends them: episodes in fragments of
    ``FRAGMENT`` steps, ~1,000 steps a chunk; one episode of each worker runs on for ``LONG_EPISODE`` steps."""
    out = {}
    share = steps // workers
    for worker in range(1, workers + 1):
        stream = breakout_stream(seed=worker)
        chunks, batch, rows, done, t_s, long_pending = [], [], 0, 0, 0.0, True
        while done < share:
            long = long_pending and done >= share // 4
            long_pending = long_pending and not long
            frames, actions, rewards, ended = [], [], [], False
            while not ended and done + len(actions) < share:
                frame, action, reward, env_ended = next(stream)
                frames.append(frame)
                actions.append(action)
                rewards.append(reward)
                ended = len(actions) >= LONG_EPISODE if long else env_ended
            frames.append(next(stream)[0])  # the final observation
            done += len(actions)
            # ids end in four characters a copy replaces (bench_read._fresh_ids)
            for fragment in fragments_of(frames, actions, rewards, ended, f"w{worker}e{done:09d}----"):
                batch.append(fragment)
                rows += len(fragment)
                if rows >= 1000:
                    chunks.append(to_chunk(batch, t_s))
                    t_s += rows / STEPS_PER_S * workers
                    batch, rows = [], 0
        if batch:
            chunks.append(to_chunk(batch, t_s))
        out[worker] = chunks
    return out


def fragments_of(frames: list[np.ndarray], actions: list[int], rewards: list[float], ended: bool,
                 eps_id: str) -> Iterator[Any]:
    """An episode's steps as SingleAgentEpisode fragments of ``FRAGMENT`` steps: observations stack the 4 newest
    frames (filled with the first at the start, as RLlib's FrameStack does at a reset)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    padded = [frames[0]] * 3 + frames
    rng = np.random.default_rng(len(frames))
    n = len(actions)
    for start in range(0, n, FRAGMENT):
        stop = min(n, start + FRAGMENT)
        stacks = [np.stack(padded[t:t + 4], axis=-1) for t in range(start, stop + 1)]
        k = stop - start
        logits = rng.normal(size=(k, 4)).astype(np.float32)
        fragment = SingleAgentEpisode(
            id_=eps_id, observations=stacks, actions=actions[start:stop], rewards=rewards[start:stop],
            infos=[{}] * (k + 1), terminated=ended and stop == n, len_lookback_buffer=0, t_started=start,
            extra_model_outputs={"action_dist_inputs": list(logits), "action_logp": list(logits[:, 0]),
                                 "vf_preds": list(rng.normal(size=k).astype(np.float32)),
                                 "weights_seq_no": [0] * k})
        fragment.to_numpy()
        yield fragment


def to_chunk(fragments: list[Any], at: float) -> Any:
    from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk

    return episodes_to_chunk(fragments, ConvertOptions(encode_images=True, stack_frames=True), sampled_at_s=at)


def make_runs(data: str) -> dict[str, str]:
    """The two runs under ``data`` (made the first time; a run is complete once its manifest is written)."""
    runs = {"cartpole": os.path.join(data, "bench-view", "cartpole-1M"),
            "breakout": os.path.join(data, "bench-view", "breakout-200k")}
    for name, run_dir in runs.items():
        if os.path.exists(os.path.join(run_dir, "manifest.json")):
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.monotonic()
        if name == "cartpole":
            write_run(run_dir, "CartPole-v1", cartpole_chunks(200_000), COPIES)
        else:
            write_run(run_dir, "ale_py:ALE/Breakout-v5-atari84x4", breakout_chunks(40_000), COPIES)
        print(f"wrote {run_dir} in {time.monotonic() - started:.0f} s", flush=True)
    return runs


# ---------------------------------------------------------------------------------------------- measuring

class Viewer:
    """``rllib-recorder view DATA`` as its own process."""

    def __init__(self, data: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rllib_recorder.cli", "view", data, "--no-browser"],
                                     cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise RuntimeError(f"the viewer did not start: {self.url} {self.proc.stderr.read()}")

    def memory_mb(self) -> tuple[float, float]:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{self.proc.pid}/status"))
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        self.proc.send_signal(2)
        self.proc.wait(timeout=60)


def paint_ms(page: Any, url: str, ready: str) -> float:
    """Milliseconds from navigation to the page's own painted mark."""
    page.goto(url)
    page.wait_for_selector(f"body[data-ready={ready}]", state="attached", timeout=120_000)
    return float(page.evaluate("() => window.__painted"))


def scrub(page: Any, steps: int, stride: int, jumps: int) -> tuple[float, float, float]:
    """Pictures per second, each step's stored frame drawn before the next step is asked for: stepping on from 0
    (play), dragging the slider across the episode (``stride`` steps a move: a 10k-step episode on a slider a
    few hundred pixels wide), and jumping to random steps (the worst case: every jump fetches its frames)."""
    return tuple(page.evaluate("""async ([steps, stride, jumps]) => {
        const v = window.viewer;
        const rate = async (positions) => {
            const t0 = performance.now();
            for (const t of positions) await v.seek(t);
            return positions.length / (performance.now() - t0) * 1000;
        };
        await v.seek(0);
        const on = await rate(Array.from({length: steps}, (_, t) => t + 1));
        const across = await rate(Array.from({length: Math.floor(v.steps / stride)}, (_, k) => k * stride));
        let seed = 1;
        const random = () => { seed = (seed * 16807) % 2147483647; return seed % v.steps; };
        return [on, across, await rate(Array.from({length: jumps}, random))];
    }""", [steps, stride, jumps]))


def measure(data: str, runs: dict[str, str], reps: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from rllib_recorder import open_run

    with open_run(runs["breakout"]) as run:
        long = next(e for e in run.episodes(columns=["rewards"]) if len(e) == LONG_EPISODE)
        long_file = next(os.path.basename(f.path) for f in run.files if f.worker_index == long.worker_index)
    root = os.path.join(data)
    ids = {name: os.path.relpath(path, root) for name, path in runs.items()}
    viewer = Viewer(root)
    out: dict[str, list[float]] = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            base = viewer.url
            pages = [("runs page", base, "runs")] + [
                (f"{name} run page", base + "?" + urllib.parse.urlencode({"run": run_id}), "run")
                for name, run_id in ids.items()] + [
                ("10k-step Breakout episode open", base + "?" + urllib.parse.urlencode(
                    {"run": ids["breakout"], "file": long_file, "episode": long.eps_id}), "episode")]
            for rep in range(reps):
                for name, url, ready in pages:
                    out.setdefault(name, []).append(paint_ms(page, url, ready))
            page.goto(pages[-1][1])  # a fresh episode page: nothing of it fetched yet
            page.wait_for_selector("body[data-ready=episode]", state="attached", timeout=120_000)
            on, across, jump = scrub(page, 2000, 37, 200)
            out["scrub on"], out["scrub across"], out["scrub jumps"] = [on], [across], [jump]
            browser.close()
        out["rss"], out["peak"] = [viewer.memory_mb()[0]], [viewer.memory_mb()[1]]
    finally:
        viewer.stop()
    return out


def table(results: dict[str, list[float]], runs: dict[str, str]) -> str:
    from rllib_recorder import open_run

    sizes = []
    for name, path in runs.items():
        with open_run(path) as run:
            counts = run.counts()
        disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        sizes.append(f"{name}: {counts['env_steps']:,} env steps, {counts['episodes']:,} episodes, "
                     f"{len(run.files)} files, {disk / 1e6:,.0f} MB")
    rows = ["| page | target | cold (first load) | warm (median) |", "|---|---|---|---|"]
    targets = {"runs page": "< 1 s", "cartpole run page": "< 1 s", "breakout run page": "< 1 s",
               "10k-step Breakout episode open": "< 300 ms"}
    for name, target in targets.items():
        values = results[name]
        warm = statistics.median(values[1:]) if len(values) > 1 else values[0]
        rows.append(f"| {name} | {target} | {values[0]:.0f} ms | {warm:.0f} ms |")
    rows += ["", "| scrubbing (10k-step Breakout episode) | target | steps/s |", "|---|---|---|",
             f"| stepping on from step 0 (play) | ≥ 60 | {results['scrub on'][0]:.0f} |",
             f"| dragging the slider across the episode (37 steps a move) | ≥ 60 | {results['scrub across'][0]:.0f} |",
             f"| jumping to random steps (each fetches its frames) | | {results['scrub jumps'][0]:.0f} |",
             "", f"Server memory after all of it: {results['rss'][0]:.0f} MB resident, peak {results['peak'][0]:.0f} MB.",
             "", "Runs: " + "; ".join(sizes) + "."]
    return "\n".join(rows)


METHOD = """How fast `rllib-recorder view` paints in a real browser, on a 1 M-step CartPole run and a 200 k-step Breakout
run. The runs are written by the recorder's own writer (`RecordingWriter`, default settings: frame stacks as newest
frames, frame deltas, gzip) from real env steps under random actions, not recorded by PPO (that would take hours on
this machine): 200,000 CartPole-v1 steps in 2 worker files written 5 times with fresh episode ids; 40,000 ALE
Breakout steps through RLlib's Atari wrappers in fragments of 200 steps, one episode per worker file running on for
10,000 steps across the env's own resets, written 5 times. The viewer runs as its own process; Debian's chromium,
headless through Playwright, loads each page, and the time is from navigation to the page's own painted mark (set
in the animation frame after it drew: the runs table; a run's four charts and first page of episodes; an
episode's first frame, every chart and the value table). Cold: the first load after the server printed its URL
(from then on it reads the runs page's data and verify's verdicts in the background); warm: the median of the
later loads (the browser keeps the page's files by their content hash). Scrubbing: each step's stored frame drawn
before the next step is asked for.

No web framework and no chart library: the standard library's `ThreadingHTTPServer` and the page's own canvas
charts meet every target below, so neither is taken on."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=default_data(), help="where the two runs are made and kept")
    parser.add_argument("--reps", type=int, default=5, help="loads of each page (the first is cold)")
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=False,
                        help="write the table into docs/BENCHMARKS.md")
    args = parser.parse_args()
    runs = make_runs(args.data)
    load_before = os.getloadavg()[0]
    results = measure(args.data, runs, args.reps)
    body = table(results, runs) + (f"\n\nLoad average (1 min) {load_before:.1f} before and {os.getloadavg()[0]:.1f} after "
                                   f"the measurements, on {os.cpu_count()} CPUs" + (
                                       ": other jobs were running, so these figures are upper bounds" if max(
                                           load_before, os.getloadavg()[0]) > 0.5 * (os.cpu_count() or 1) else "")
                                   + ".")
    print(body)
    if args.write:
        common.write_section("Viewer: paint times, scrubbing, memory (benchmarks/bench_view.py)",
                             METHOD + "\n\n" + body)


if __name__ == "__main__":
    main()
