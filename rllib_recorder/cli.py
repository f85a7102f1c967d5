"""The rllib-recorder command line: train a YAML experiment, show a run, verify it."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from rllib_recorder.errors import RecorderError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Record RLlib experience into HDF5 files and work with the recordings."""


@main.command()
@click.argument("experiment", type=click.Path(exists=True, dir_okay=False))
@click.option("--stop-iters", type=int, default=None, help="Override stop: training_iteration.")
@click.option("--stop-timesteps", type=int, default=None, help="Override stop: num_env_steps_sampled_lifetime.")
@click.option("--output-dir", default=None, help="Override the recorder's output_dir.")
@click.option("--num-cpus", type=int, default=None, help="CPUs for ray.init (default: all).")
def train(experiment: str, stop_iters: int | None, stop_timesteps: int | None, output_dir: str | None,
          num_cpus: int | None) -> None:
    """Train a Tune-style YAML EXPERIMENT with recording and print where it was stored.

    Example: rllib-recorder train configs/cartpole-ppo.yaml --stop-iters 2
    """
    from rllib_recorder.experiment import load_experiment, run_experiment

    try:
        spec = load_experiment(experiment, stop_iters=stop_iters, stop_timesteps=stop_timesteps,
                               output_dir=output_dir)
        run_dirs = run_experiment(spec, num_cpus=num_cpus, echo=click.echo)
    except RecorderError as e:
        raise click.ClickException(str(e)) from None
    for run_dir in run_dirs:
        click.echo(f"recorded run: {run_dir}")


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def info(run_dir: str, as_json: bool) -> None:
    """Summarise a recorded RUN_DIR: workers, steps, episodes, returns, size, lag.

    Example: rllib-recorder info recordings/PPO_CartPole-v1_20261130-120000_ab12cd
    """
    from rllib_recorder.inspect import summarize

    summary = _guard(lambda: summarize(run_dir))
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
        return
    for key, value in summary.items():
        click.echo(f"{key:>22}: {value}")


@main.command()
@click.argument("run_dir", type=click.Path())
def verify(run_dir: str) -> None:
    """Check a RUN_DIR: schema, row counts, sequence numbers, episode continuity. Exit 0 only if sound.

    Example: rllib-recorder verify recordings/PPO_CartPole-v1_20261130-120000_ab12cd
    """
    from rllib_recorder.inspect import verify_run

    problems = _guard(lambda: verify_run(run_dir))
    for problem in problems:
        click.echo(f"problem: {problem}")
    if problems:
        sys.exit(1)
    click.echo(f"ok: {run_dir} is sound")


@main.command()
@click.argument("run_dir", type=click.Path())
def recover(run_dir: str) -> None:
    """Make a RUN_DIR whose driver or writers were killed readable again, keeping every committed row.

    Drops rows no commit names, removes temporary files and marks the manifest 'recovered'.
    Example: rllib-recorder recover recordings/PPO_CartPole-v1_20261130-120000_ab12cd
    """
    from rllib_recorder.recover import recover_run

    report = _guard(lambda: recover_run(run_dir))
    for name, done in report["files"].items():
        click.echo(f"{name}: {done}")
    click.echo(f"recovered: {run_dir} holds {report['env_steps']} env steps, status {report['status']}")


def _guard(fn: Any) -> Any:
    try:
        return fn()
    except RecorderError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
if __name__ == "__main__":
    main()
