"""The commands that look at a run: info, verify, replay, render and plot."""

from __future__ import annotations

import json
import os
import sys

import click

from rllib_recorder.commands.cli_guard import Guarded, guard, local_run
from rllib_recorder.commands.terminal import count_files, progress_bar
from rllib_recorder.config import is_uri, public_uri


@click.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines (the same values, unrounded).")
@click.option("--follow", is_flag=True, help="Show a run's counts and rates as it records, until it ends.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between updates (--follow).")
def info(path: str, as_json: bool, follow: bool, interval: float) -> None:
    """Report on a recorded run: what it is, what it holds, its policy lag and rates. Pointed at any other
    folder (an output dir, a Tune experiment), list every run below it as a tree, with totals.

    \b
    Examples (recordings/<run>: the run directory train printed):
      rllib-recorder info recordings/<run>
      rllib-recorder info recordings
      rllib-recorder info recordings/<run> --json
      rllib-recorder info recordings/<run> --follow
    """
    from rllib_recorder.commands import report
    from rllib_recorder.commands.info import summarize, summarize_folder

    if follow:
        from rllib_recorder.commands.info import follow_counts

        if is_uri(path):
            click.echo("error: --follow reads a run where it records, not at its durable target: point it at the "
                       "run's staging directory (result['recorder']['run_dir'] on the node)", err=True)
            sys.exit(2)
        if interval <= 0:
            click.echo(f"error: --interval must be more than 0 seconds; it is {interval}", err=True)
            sys.exit(2)
        for line in Guarded(follow_counts(path, interval)):
            click.echo(json.dumps(line) if as_json else report.live_line(line))
        return

    asked, path = path, local_run(path)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        summary = guard(lambda: summarize(path))
        if is_uri(asked):  # read from its durable target: named by its URI, not the local cache
            summary["run_dir"] = public_uri(asked)
        click.echo(json.dumps(summary, indent=2, default=str) if as_json else report.run_report(summary))
        return
    summary = guard(lambda: summarize_folder(path))
    click.echo(json.dumps(summary, indent=2, default=str) if as_json else report.folder_report(summary))
    if summary["totals"]["unreadable"]:
        sys.exit(1)


@click.command()
@click.argument("run_dir", type=click.Path())
def verify(run_dir: str) -> None:
    """Check a RUN_DIR: schema, row counts, sequence numbers, episode continuity, and that every sampled env
    step is stored or counted as lost (by cause). Exit 0 only if sound.

    \b
    Example (recordings/<run>: the run directory train printed,
    <experiment>/<trial dir> below recordings):
      rllib-recorder verify recordings/<run>
    """
    shown, run_dir = run_dir, local_run(run_dir)
    from rllib_recorder.commands.verify import verify_report

    with progress_bar() as bar:
        task = bar.add_task("verifying files", total=count_files(run_dir))
        report = guard(lambda: verify_report(run_dir, progress=lambda n: bar.advance(task, n)))
    for problem in report["problems"]:
        click.echo(f"problem: {problem}")
    for note in report["notes"]:
        click.echo(f"not stored: {note}")
    if report["summary"]:
        click.echo(report["summary"])
    if report["problems"]:
        sys.exit(1)
    click.echo(f"ok: {public_uri(shown)} is sound" + (" (with the losses counted above)" if report["notes"] else ""))


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("--episodes", is_flag=True, help="Stream whole episodes (stitched) instead of stored batches.")
@click.option("--to", "target", default=None, metavar="MODULE:FUNCTION",
              help="Call this function with each Batch/Episode instead of printing JSON lines.")
@click.option("--env", default=None, help="Env for --check: a gymnasium id, '<id>-atari<dim>x<stack>' or "
              "'module:function' (default: the env in manifest.json).")
@click.option("--check", is_flag=True, help="Re-simulate each episode from its start state with its stored actions "
              "and compare observations and rewards step by step. Exit 0 only if all match.")
def replay(run_dir: str, episodes: bool, target: str | None, env: str | None, check: bool) -> None:
    """Stream a RUN_DIR's batches (or --episodes) in recorded order, or re-simulate it (--check).

    \b
    Examples (recordings/<run>: the run directory train printed):
      rllib-recorder replay recordings/<run> | head
      rllib-recorder replay recordings/<run> --episodes --to mypkg.sink:consume
      rllib-recorder replay recordings/<run> --check
      rllib-recorder replay recordings/<run> --check --env ale_py:ALE/Breakout-v5-atari84x4
    """
    run_dir = local_run(run_dir)
    from rllib_recorder.commands import replay as rp
    from rllib_recorder.read.run import open_run

    run = guard(lambda: open_run(run_dir))
    with run:
        if check:
            with progress_bar() as bar:
                task = bar.add_task("re-simulating", total=guard(lambda: run.counts()["agent_steps"]))
                report = guard(lambda: rp.check_run(run, env, progress=lambda n: bar.advance(task, n)))
            for mismatch in report.mismatches or []:
                click.echo(f"mismatch: {mismatch}")
            if not report.ok:
                click.echo(f"FAILED: {len(report.mismatches)} of {report.episodes} episodes differ "
                           f"(env {report.env})")
                sys.exit(1)
            click.echo(f"ok: {report.episodes} episodes, {report.steps} steps re-simulated in {report.env}; all match")
            return
        sink = guard(lambda: rp.load_callable(target)) if target else None
        records = guard(lambda: rp.iter_episodes_and_batches(run, episodes))
        for item in Guarded(records):
            if sink is not None:
                sink(item)
            else:
                record = rp.episode_record(item) if episodes else rp.batch_record(item)
                click.echo(json.dumps(record, default=str))


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("-o", "--output", required=True, help="The file to write: NAME.gif (Pillow) or NAME.mp4 (PyAV, "
              "pip install 'rllib-recorder[video]').")
@click.option("--episode", "eps_id", default=None, help="The episode id to draw (default: the first finished one).")
@click.option("--best", is_flag=True, help="Draw the finished episode with the highest return.")
@click.option("--worst", is_flag=True, help="Draw the finished episode with the lowest return.")
@click.option("--env", default=None, help="Env to re-simulate a non-image run in (as for replay --check; default: "
              "the env in manifest.json).")
@click.option("--scale", type=int, default=None, help="Whole-pixel scale of each picture (default: 3 for stored "
              "frames, 1 for an env's own render).")
@click.option("--fps", type=int, default=15, show_default=True, help="Pictures per second.")
def render(run_dir: str, output: str, eps_id: str | None, best: bool, worst: bool, env: str | None,
           scale: int | None, fps: int) -> None:
    """Draw one episode of RUN_DIR as a GIF or MP4 you can watch, each picture captioned with the episode, step,
    reward so far and policy version.

    Image observations (Atari) are drawn from the stored frames themselves; other envs are re-simulated from the
    episode's start state with its stored actions and drawn by the env's rgb_array render (the env found as for
    replay --check: nothing a recording names is imported or run).

    \b
    Example:
      rllib-recorder render recordings/<run> --best -o best.gif
    """
    if sum((eps_id is not None, best, worst)) > 1:
        click.echo("error: give one of --episode, --best and --worst", err=True)
        sys.exit(2)
    if scale is not None and not 1 <= scale <= 16 or not 1 <= fps <= 120:
        click.echo("error: --scale takes 1 to 16 and --fps 1 to 120", err=True)
        sys.exit(2)
    from rllib_recorder.commands.render import render_episode
    from rllib_recorder.read.run import open_run

    run_dir = local_run(run_dir)

    def draw() -> dict:
        with open_run(run_dir) as run:
            return render_episode(run, output, eps_id=eps_id, best=best, worst=worst, env=env, scale=scale, fps=fps)

    done = guard(draw)
    click.echo(f"wrote {done['output']}: episode {done['eps_id']} of env runner {done['worker_index']}, "
               f"{done['frames']} frames ({done['source']}), return {done['return']:g}")


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="PNG file to write.")
def plot(run_dir: str, output: str) -> None:
    """Plot a RUN_DIR: episode return against env steps per worker, and the policy-lag histogram.

    \b
    Example (recordings/<run>: the run directory train printed):
      rllib-recorder plot recordings/<run> -o run.png
    """
    run_dir = local_run(run_dir)
    from rllib_recorder.commands.plot import check_output, plot_run
    from rllib_recorder.read.run import open_run

    guard(lambda: check_output(output))
    with guard(lambda: open_run(run_dir)) as run:
        summary = guard(lambda: plot_run(run, output))
    episodes = ", ".join(f"{k}: {v}" for k, v in summary["episodes"].items())
    click.echo(f"wrote {output} (finished episodes {episodes}; policy lags {summary['lags']})")
