"""The rllib-recorder command line: train a YAML experiment, show, verify, replay, export, plot and gather a run."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from rllib_recorder.commands.terminal import count_files, is_terminal, progress_bar
from rllib_recorder.config import is_uri, public_uri
from rllib_recorder.errors import RecorderError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Record RLlib experience into HDF5 files and work with the recordings."""


@main.command()
@click.argument("experiment", type=click.Path())  # a missing or bad file: one 'error:' line from load_experiment
@click.option("--stop-iters", type=int, default=None, help="Override stop: training_iteration.")
@click.option("--stop-timesteps", type=int, default=None, help="Override stop: num_env_steps_sampled_lifetime.")
@click.option("--output-dir", default=None, help="Override the recorder's output_dir.")
@click.option("--num-cpus", type=int, default=None, help="CPUs for ray.init (default: all).")
@click.option("-v", "--verbose", is_flag=True, help="Show Ray's, RLlib's and Tune's own output (logs, warnings, "
              "Tune's tables) instead of the progress table.")
@click.option("--check", is_flag=True, help="Only check the file: list every problem with its fix (exit 2), or "
              "say it would run (exit 0). Starts no Ray, writes nothing.")
@click.option("--num-env-runners", type=int, default=None, help="Override config: num_env_runners.")
@click.option("--rename-old-keys", is_flag=True, help="Take RLlib's old setting names (num_envs_per_worker, "
              "sgd_minibatch_size, ...) as their new ones, also where RLlib 2.60 itself would refuse or ignore "
              "them: a published experiment runs as written, each rename noted.")
def train(experiment: str, stop_iters: int | None, stop_timesteps: int | None, output_dir: str | None,
          num_cpus: int | None, verbose: bool, check: bool, num_env_runners: int | None,
          rename_old_keys: bool) -> None:
    """Train a Tune-style YAML EXPERIMENT with recording: a live table of its trials while it trains, then
    where each run was stored, what it holds and whether it verifies.

    The file is checked before Ray starts or anything is written: a bad file or setting gives one line
    'error: ...' and exit code 2. It resolves only RLlib's algorithms, registered or gymnasium envs, the
    recorder's Atari wrappers and the modules the file lists under 'register:'.

    \b
    Example (the run goes to recordings/<experiment>/<trial dir>; Tune's own files to recordings/_tune):
      rllib-recorder train configs/cartpole-ppo.yaml --stop-iters 1
      rllib-recorder train configs/cartpole-ppo.yaml --check
    """
    import time

    from rllib_recorder.commands.experiment import load_experiment
    from rllib_recorder.commands.experiment_check import check_experiment
    from rllib_recorder.commands.train import build_config, describe, run_experiment
    from rllib_recorder.errors import ConfigProblems

    started = time.monotonic()
    spec = None
    try:
        spec = load_experiment(experiment, stop_iters=stop_iters, stop_timesteps=stop_timesteps,
                               output_dir=output_dir)
        spec.rename_old_keys = rename_old_keys
        if num_env_runners is not None:
            spec.config.pop("num_workers", None)
            spec.config["num_env_runners"] = num_env_runners
        if check:
            check_experiment(spec)
            for note in spec.notes:
                click.echo(f"note: {note}", err=True)
            click.echo(f"ok: {experiment}: {describe(spec)}")
            return
        config = build_config(spec)  # every check before anything is shown, Ray starts or a file is written
        for note in spec.notes:
            click.echo(f"note: {note}", err=True)
        from rllib_recorder.commands.progress import TrainProgress, next_commands, run_summary

        click.echo(describe(spec))
        progress = TrainProgress(spec.stop, live=not verbose and is_terminal(), echo=click.echo)
        with progress:
            run_dirs = run_experiment(spec, num_cpus=num_cpus, echo=None, verbose=verbose,
                                      callbacks=None if verbose else [progress], config=config)
    except ConfigProblems as e:  # every problem of the file, each on its line with its fix: fixed once
        for note in spec.notes if spec is not None else ():
            click.echo(f"note: {note}", err=True)
        click.echo(f"error: {' '.join(e.headline.split())}:", err=True)
        for problem in e.problems:
            click.echo(f"  - {' '.join(problem.split())}", err=True)
        sys.exit(2)
    except RecorderError as e:  # as _guard: one line, exit 2
        for note in spec.notes if spec is not None and check else ():
            click.echo(f"note: {note}", err=True)
        click.echo(f"error: {' '.join(str(e).split())}", err=True)
        sys.exit(2)
    from rllib_recorder.commands.report import human_duration

    click.echo(f"\ntrained and recorded {len(run_dirs)} run(s) in {human_duration(time.monotonic() - started)}")
    for run_dir in run_dirs:
        for line in run_summary(run_dir):
            click.echo(line)
    for line in next_commands(run_dirs):
        click.echo(line)


@main.command()
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
        for line in _Guarded(follow_counts(path, interval)):
            click.echo(json.dumps(line) if as_json else report.live_line(line))
        return

    asked, path = path, _local(path)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        summary = _guard(lambda: summarize(path))
        if is_uri(asked):  # read from its durable target: named by its URI, not the local cache
            summary["run_dir"] = public_uri(asked)
        click.echo(json.dumps(summary, indent=2, default=str) if as_json else report.run_report(summary))
        return
    summary = _guard(lambda: summarize_folder(path))
    click.echo(json.dumps(summary, indent=2, default=str) if as_json else report.folder_report(summary))
    if summary["totals"]["unreadable"]:
        sys.exit(1)


@main.command()
@click.argument("run_dir", type=click.Path())
def verify(run_dir: str) -> None:
    """Check a RUN_DIR: schema, row counts, sequence numbers, episode continuity, and that every sampled env
    step is stored or counted as lost (by cause). Exit 0 only if sound.

    \b
    Example (recordings/<run>: the run directory train printed,
    <experiment>/<trial dir> below recordings):
      rllib-recorder verify recordings/<run>
    """
    shown, run_dir = run_dir, _local(run_dir)
    from rllib_recorder.commands.verify import verify_report

    with progress_bar() as bar:
        task = bar.add_task("verifying files", total=count_files(run_dir))
        report = _guard(lambda: verify_report(run_dir, progress=lambda n: bar.advance(task, n)))
    for problem in report["problems"]:
        click.echo(f"problem: {problem}")
    for note in report["notes"]:
        click.echo(f"not stored: {note}")
    if report["summary"]:
        click.echo(report["summary"])
    if report["problems"]:
        sys.exit(1)
    click.echo(f"ok: {public_uri(shown)} is sound" + (" (with the losses counted above)" if report["notes"] else ""))


@main.command()
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

    run_dir = _local(run_dir)

    def draw() -> dict:
        with open_run(run_dir) as run:
            return render_episode(run, output, eps_id=eps_id, best=best, worst=worst, env=env, scale=scale, fps=fps)

    done = _guard(draw)
    click.echo(f"wrote {done['output']}: episode {done['eps_id']} of env runner {done['worker_index']}, "
               f"{done['frames']} frames ({done['source']}), return {done['return']:g}")


@main.command()
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
    run_dir = _local(run_dir)
    from rllib_recorder.commands import replay as rp
    from rllib_recorder.read.run import open_run

    run = _guard(lambda: open_run(run_dir))
    with run:
        if check:
            with progress_bar() as bar:
                task = bar.add_task("re-simulating", total=_guard(lambda: run.counts()["agent_steps"]))
                report = _guard(lambda: rp.check_run(run, env, progress=lambda n: bar.advance(task, n)))
            for mismatch in report.mismatches or []:
                click.echo(f"mismatch: {mismatch}")
            if not report.ok:
                click.echo(f"FAILED: {len(report.mismatches)} of {report.episodes} episodes differ "
                           f"(env {report.env})")
                sys.exit(1)
            click.echo(f"ok: {report.episodes} episodes, {report.steps} steps re-simulated in {report.env}; all match")
            return
        sink = _guard(lambda: rp.load_callable(target)) if target else None
        records = _guard(lambda: rp.iter_episodes_and_batches(run, episodes))
        for item in _Guarded(records):
            if sink is not None:
                sink(item)
            else:
                record = rp.episode_record(item) if episodes else rp.batch_record(item)
                click.echo(json.dumps(record, default=str))


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--to", "target", type=click.Choice(["rllib", "minari"]), required=True, help="Output format.")
@click.option("-o", "--output", required=True, type=click.Path(), help="Output directory.")
@click.option("--dataset-id", default=None, help="Minari dataset id (default: rllib-recorder/<run directory name>-v0, "
              "characters other than letters, digits, '_' and '.' made '_').")
def export(run_dir: str, target: str, output: str, dataset_id: str | None) -> None:
    """Export a RUN_DIR for offline RL: RLlib's columnar parquet input, or a Minari dataset.

    \b
    Examples (recordings/<run>: the run directory train printed):
      rllib-recorder export recordings/<run> --to rllib -o bc-data
        then train BC on it: the README's example, BCConfig().offline_data(input_=["bc-data"], ...)
      rllib-recorder export recordings/<run> --to minari -o minari-data
        then: MINARI_DATASETS_PATH=minari-data python -c "import minari; print(minari.load_dataset(ID))"
        with the ID export printed
    """
    run_dir = _local(run_dir)
    from rllib_recorder.commands import export as ex
    from rllib_recorder.read.run import open_run

    run = _guard(lambda: open_run(run_dir))
    with run, progress_bar() as bar:
        task = bar.add_task(f"exporting to {target}", total=_guard(lambda: run.counts()["agent_steps"]))
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        if target == "rllib":
            files = _guard(lambda: ex.export_rllib(run, output, progress=advance))
            click.echo(f"wrote {len(files)} parquet file(s) to {output}; "
                       f"train with config.offline_data(input_={os.path.abspath(output)!r})")
        else:
            spaces = _guard(lambda: ex.recorded_spaces(run))
            dataset = _guard(lambda: ex.export_minari(run, output, dataset_id, spaces, progress=advance))
            click.echo(f"wrote minari dataset {dataset} to {output}; load with "
                       f"MINARI_DATASETS_PATH={os.path.abspath(output)} minari.load_dataset({dataset!r})")


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="PNG file to write.")
def plot(run_dir: str, output: str) -> None:
    """Plot a RUN_DIR: episode return against env steps per worker, and the policy-lag histogram.

    \b
    Example (recordings/<run>: the run directory train printed):
      rllib-recorder plot recordings/<run> -o run.png
    """
    run_dir = _local(run_dir)
    from rllib_recorder.commands.plot import check_output, plot_run
    from rllib_recorder.read.run import open_run

    _guard(lambda: check_output(output))
    with _guard(lambda: open_run(run_dir)) as run:
        summary = _guard(lambda: plot_run(run, output))
    episodes = ", ".join(f"{k}: {v}" for k, v in summary["episodes"].items())
    click.echo(f"wrote {output} (finished episodes {episodes}; policy lags {summary['lags']})")


class _Guarded:
    """Iterates lazily read items, each read inside ``_guard`` (a damaged file gives a one-line error)."""

    def __init__(self, items: Any) -> None:
        self.items = iter(items)

    def __iter__(self) -> "_Guarded":
        return self

    def __next__(self) -> Any:
        return _guard(lambda: next(self.items))


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--publish", is_flag=True, help="A durable run's staging directory: also seal and upload what it "
              "holds to the target its manifest names (shown without this flag).")
def recover(run_dir: str, publish: bool) -> None:
    """Make a RUN_DIR whose driver or writers were killed readable again, keeping every committed row.

    Drops rows no commit names, removes temporary files and marks the manifest 'recovered'. On a node's staging
    directory of a run recorded to s3:// (or another durable target), --publish uploads what it holds there.

    \b
    Example (recordings/<run>: the run directory train printed):
      rllib-recorder recover recordings/<run>
    """
    from rllib_recorder.service.recover import recover_run

    with progress_bar() as bar:
        task = bar.add_task("recovering files", total=count_files(run_dir))
        report = _guard(lambda: recover_run(run_dir, progress=lambda n: bar.advance(task, n), publish=publish))
    for name, done in report["files"].items():
        click.echo(f"{name}: {done}")
    click.echo(f"recovered: {run_dir} holds {report['env_steps']} env steps, status {report['status']}")
    if "published" in report:
        click.echo(f"published: {report['published']['segments_uploaded']} segment(s) uploaded to {report['target']}")
    elif report.get("target"):
        click.echo(f"this is the staging directory of a run kept at {report['target']}: add --publish to upload what "
                   "it holds there")


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--to", "target", required=True, type=click.Path(file_okay=False), help="Directory to gather into.")
@click.option("--address", default=None, help="Ray cluster to read the nodes through (default: RAY_ADDRESS or "
              "the running local cluster; without one, files readable here are copied directly).")
def gather(run_dir: str, target: str, address: str | None) -> None:
    """Copy a RUN_DIR whose files sit on several nodes into one directory (--to), checked by size and sha256.

    Run it on the driver's machine while the cluster is up: each file is read by a Ray task on the node
    that wrote it and streamed here. Re-running it continues an interrupted gather.

    \b
    Example (recordings/<run>: the run directory train printed):
      rllib-recorder gather recordings/<run> --to /data/<run>
    """
    from rllib_recorder.commands.gather import connect_ray, gather_run, needs_cluster

    # the manifest is checked before Ray is joined; Ray only when some file is not readable here
    if _guard(lambda: needs_cluster(run_dir)) or address:
        _guard(lambda: connect_ray(address))
    with progress_bar() as bar:
        task = bar.add_task("gathering (bytes)", total=None)
        done = _guard(lambda: gather_run(run_dir, target, progress=lambda name, n: bar.advance(task, n)))
    for name, what in done.items():
        click.echo(f"{name}: {what}")
    click.echo(f"gathered: {target} holds the run's {len(done)} file(s); check it with 'rllib-recorder verify {target}'")


def _local(path: str) -> str:
    """A run at a durable target (``s3://...``): its local copy (segments fetched once, checked); else ``path``."""
    if not is_uri(path):
        return path
    from rllib_recorder.read.remote import local_copy

    return _guard(lambda: local_copy(path))


def _guard(fn: Any) -> Any:
    try:
        return fn()
    except RecorderError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (OSError, KeyError, ValueError) as e:  # h5py's errors on a damaged or truncated file
        click.echo(f"error: cannot read the run ({type(e).__name__}: {e}); "
                   "check it with 'rllib-recorder verify' or repair it with 'rllib-recorder recover'", err=True)
        sys.exit(2)


from rllib_recorder.commands.view import view as _view  # noqa: E402 - the command lives with its logic

main.add_command(_view)


if __name__ == "__main__":
    main()
