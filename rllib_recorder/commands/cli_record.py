"""The command that records: train a YAML experiment with the recorder, and say where each run went."""

from __future__ import annotations

import sys

import click

from rllib_recorder.commands.terminal import is_terminal
from rllib_recorder.errors import RecorderError


@click.command()
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
    except RecorderError as e:  # as guard: one line, exit 2
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
