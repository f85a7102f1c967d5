"""`rllib-recorder view`: the click command that serves the local web viewer (``rllib_recorder/view/``), and what
it hands the viewer from the other commands (finding runs, status, verify, rates, re-simulation)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Iterator

import click

DEFAULT_HOST = "127.0.0.1"


def tools() -> Any:
    """The viewer's ``Tools``: ``info``'s way of finding runs and rates, ``verify``'s status and report, and
    ``render``'s re-simulation."""
    from rllib_recorder.commands.info import find_runs, run_rates
    from rllib_recorder.commands.verify import run_status, verify_report
    from rllib_recorder.view.catalog import Tools

    return Tools(find_runs=find_runs, status=run_status, verify=verify_report, rates=run_rates, simulate=simulate)


def simulate(run: Any, episode: Any) -> Iterator[Any]:
    """The env's ``rgb_array`` picture of each step of ``episode``, re-simulated from its start state as
    ``render`` does (the env found by ``replay --check``'s rules: nothing a recording names is imported)."""
    from rllib_recorder.commands.render import simulated_frames
    from rllib_recorder.commands.replay import env_factory_rendering

    name, make_env = env_factory_rendering(run)
    return simulated_frames(episode, make_env, name)


def serve(paths: list[str], host: str, port: int, poll_s: float | None = None) -> Any:
    """A ``ViewServer`` bound to ``host:port`` over the runs at or below ``paths`` (not serving yet)."""
    from rllib_recorder.view.catalog import Catalog
    from rllib_recorder.view.server import ViewServer

    catalog = Catalog(list(paths), tools())
    try:
        return ViewServer(catalog, host, port, **({"poll_s": poll_s} if poll_s else {}))
    except OSError as e:
        catalog.close()
        from rllib_recorder.errors import RecorderError

        raise RecorderError(f"cannot serve on {host}:{port} ({e.strerror or e}); pick another --port, or leave it "
                            "out for a free one") from None


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="Port to serve on (default: a free one).")
@click.option("--host", default=None, help="Address to serve on (default 127.0.0.1: this machine only). Any other "
              "address lets every machine that reaches it read your recordings: a warning says so.")
@click.option("--no-browser", is_flag=True, help="Print the URL only; do not open a browser.")
def view(paths: tuple[str, ...], port: int, host: str | None, no_browser: bool) -> None:
    """Browse the runs at PATHS in a web page on this machine: each run's status, steps, episodes, returns and
    verify's verdict; a run's curves, policy lag, rates and episodes, live while it records; an episode step by
    step, its picture (Atari: the stored frames; other envs re-simulated from the start state) in step with its
    actions, rewards and model outputs. PATHS take what info takes: a run, a folder of runs, or a run's URI.

    Prints the URL first, opens it in a browser (unless --no-browser) and serves until Ctrl-C. It only reads:
    nothing is written into a run.

    \b
    Examples (recordings/<run>: the run directory train printed):
      rllib-recorder view recordings
      rllib-recorder view recordings/<run> --no-browser --port 0
    """
    from rllib_recorder.commands.cli_guard import guard

    server = guard(lambda: serve(list(paths), host or DEFAULT_HOST, port))
    click.echo(server.url)
    if host is not None and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: serving on {host}: every machine that can reach this one on port {server.port} can "
                   "read these recordings; leave --host out to keep them on this machine", err=True)
    runs = len(server.catalog.scan())
    click.echo(f"serving {runs} run(s) below {', '.join(paths)}; Ctrl-C stops")
    server.warm()
    if not no_browser:
        import webbrowser

        threading.Thread(target=webbrowser.open, args=(server.url,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (in '&')
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.catalog.close()
    click.echo("stopped")
    # The viewer only reads, so nothing is left to flush. Its daemon threads (live streams, a request, the warm-up)
    # may be inside HDF5 right now: ending the interpreter normally would stop them there, which can abort or hang
    # the process (a thread stopped holding HDF5's lock); so the process ends here, at once, with exit code 0.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
