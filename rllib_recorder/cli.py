"""The rllib-recorder command line: the click group; its commands live in commands/cli_*.py by role."""

from __future__ import annotations

import click

from rllib_recorder.commands import cli_data, cli_inspect, cli_record, view


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Record RLlib experience into HDF5 files and work with the recordings."""


for _command in (cli_record.train,  # recording and training
                 cli_inspect.info, cli_inspect.verify, cli_inspect.replay, cli_inspect.render, cli_inspect.plot,
                 cli_data.export, cli_data.recover, cli_data.gather,  # moving data
                 view.view):  # the web viewer (rllib_recorder/view/)
    main.add_command(_command)


if __name__ == "__main__":
    main()
