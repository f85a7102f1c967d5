"""The commands that move a run's data: export it for offline RL, recover it after a kill, gather it from nodes."""

from __future__ import annotations

import os

import click

from rllib_recorder.commands.cli_guard import guard, local_run
from rllib_recorder.commands.terminal import count_files, progress_bar


@click.command()
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
    run_dir = local_run(run_dir)
    from rllib_recorder.commands import export as ex
    from rllib_recorder.read.run import open_run

    run = guard(lambda: open_run(run_dir))
    with run, progress_bar() as bar:
        task = bar.add_task(f"exporting to {target}", total=guard(lambda: run.counts()["agent_steps"]))
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        if target == "rllib":
            files = guard(lambda: ex.export_rllib(run, output, progress=advance))
            click.echo(f"wrote {len(files)} parquet file(s) to {output}; "
                       f"train with config.offline_data(input_={os.path.abspath(output)!r})")
        else:
            spaces = guard(lambda: ex.recorded_spaces(run))
            dataset = guard(lambda: ex.export_minari(run, output, dataset_id, spaces, progress=advance))
            click.echo(f"wrote minari dataset {dataset} to {output}; load with "
                       f"MINARI_DATASETS_PATH={os.path.abspath(output)} minari.load_dataset({dataset!r})")


@click.command()
@click.argument("run_dir", type=click.Path())
@click.option("--publish", is_flag=True, help="A durable run's staging directory: also seal and upload what it "
              "holds to the target its manifest names (shown without this flag).")
def recover(run_dir: str, publish: bool) -> None:
    """Make a RUN_DIR whose driver or writers were killed readable again, keeping every committed row.

    Drops rows no commit names, removes temporary files and marks the manifest 'recovered'. On a node's staging
    directory of a run recorded to s3:// (or another durable target), --publish uploads what it holds there.
    Run it as soon as the driver has died: while Ray ends the dead driver's writers and env runners (a few
    seconds), it says so and waits for them, at most 30 s. A run whose driver still runs is refused.

    \b
    Example (recordings/<run>: the run directory train printed):
      rllib-recorder recover recordings/<run>
    """
    from rllib_recorder.service.recover import recover_run

    with progress_bar() as bar:
        task = bar.add_task("recovering files", total=count_files(run_dir))
        report = guard(lambda: recover_run(run_dir, progress=lambda n: bar.advance(task, n), publish=publish,
                                           say=lambda line: click.echo(line, err=True)))
    for name, done in report["files"].items():
        click.echo(f"{name}: {done}")
    click.echo(f"recovered: {run_dir} holds {report['env_steps']} env steps, status {report['status']}")
    if "published" in report:
        click.echo(f"published: {report['published']['segments_uploaded']} segment(s) uploaded to {report['target']}")
    elif report.get("target"):
        click.echo(f"this is the staging directory of a run kept at {report['target']}: add --publish to upload what "
                   "it holds there")


@click.command()
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
    if guard(lambda: needs_cluster(run_dir)) or address:
        guard(lambda: connect_ray(address))
    with progress_bar() as bar:
        task = bar.add_task("gathering (bytes)", total=None)
        done = guard(lambda: gather_run(run_dir, target, progress=lambda name, n: bar.advance(task, n)))
    for name, what in done.items():
        click.echo(f"{name}: {what}")
    click.echo(f"gathered: {target} holds the run's {len(done)} file(s); check it with 'rllib-recorder verify {target}'")
