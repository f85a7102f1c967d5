"""What ``rllib-recorder train`` shows while it trains: a live table of its trials on a terminal (a line per
result in a pipe), then a summary of each recorded run and the commands to try next."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.tune import Callback

from rllib_recorder.commands.report import compression_text, human_bytes, human_count, human_duration, human_number

COLUMNS = ("trial", "status", "iter", "env steps", "return mean", "stored", "on disk", "sampler wait", "errors",
           "time")


@dataclass
class TrialLine:
    """The latest of one trial, as the table shows it."""

    name: str
    status: str = "starting"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    result: dict[str, Any] = field(default_factory=dict)

    def final(self) -> None:
        """Takes steps, bytes and errors from the run's closed manifest: a train result is taken before the
        writers commit that iteration's samples, the manifest once all is committed."""
        from rllib_recorder.errors import RecorderError
        from rllib_recorder.format.manifest import read_manifest

        recorder = self.result.get("recorder")
        if not isinstance(recorder, dict) or not isinstance(recorder.get("run_dir"), str):
            return
        try:
            totals = read_manifest(recorder["run_dir"]).get("totals") or {}
        except RecorderError:
            return
        recorder.update({k: totals[k] for k in ("env_steps_stored", "disk_bytes", "errors") if k in totals})

    def cells(self, stop_iters: int | None) -> list[str]:
        r, recorder = self.result, self.result.get("recorder") or {}
        iteration = r.get("training_iteration")
        iters = "-" if iteration is None else f"{iteration}/{stop_iters}" if stop_iters else str(iteration)
        ret = episode_return(r)
        wait = recorder.get("sampler_wait_s")
        return [self.name, self.status, iters, _count(env_steps(r)), "-" if ret is None else human_number(ret),
                _count(recorder.get("env_steps_stored")),
                "-" if recorder.get("disk_bytes") is None else human_bytes(recorder["disk_bytes"]),
                "-" if wait is None else human_duration(wait), _count(recorder.get("errors")),
                human_duration((self.ended or time.monotonic()) - self.started)]


def env_steps(result: dict[str, Any]) -> int | None:
    """Env steps sampled so far (new and old API stack)."""
    runners = result.get("env_runners") or {}
    for value in (runners.get("num_env_steps_sampled_lifetime"), result.get("num_env_steps_sampled_lifetime"),
                  result.get("num_env_steps_sampled")):
        if isinstance(value, (int, float)):
            return int(value)
    return None


def episode_return(result: dict[str, Any]) -> float | None:
    runners = result.get("env_runners") or {}
    for value in (runners.get("episode_return_mean"), runners.get("episode_reward_mean")):
        if isinstance(value, (int, float)) and value == value:  # not NaN (no episode finished yet)
            return float(value)
    return None


def _count(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else human_count(value)


class TrainProgress(Callback):
    """A Tune callback (it runs in the driver) that keeps one ``TrialLine`` per trial and shows them.

    On a terminal a rich ``Live`` table redraws in place; elsewhere (a pipe, a CI log) every result is one
    plain line. Pickled with a Tuner's state, it keeps only its settings.
    """

    def __init__(self, stop: dict[str, Any], live: bool, echo: Callable[[str], None] = print) -> None:
        self.stop_iters = stop.get("training_iteration")
        self.live_wanted = live
        self.echo = echo
        self.trials: dict[str, TrialLine] = {}
        self._live: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"stop_iters": self.stop_iters}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__({"training_iteration": state["stop_iters"]}, live=False, echo=lambda line: None)

    def __enter__(self) -> "TrainProgress":
        if self.live_wanted:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(stderr=True), refresh_per_second=2, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for line in self.trials.values():
            line.final()
        if self._live is not None:
            self._live.update(self._table())
            self._live.stop()
            self._live = None

    def _line(self, trial: Any) -> TrialLine:
        name = str(trial)
        return self.trials.setdefault(name, TrialLine(name))

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._line(trial).status = "running"
        self._show()

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        line = self._line(trial)
        line.status, line.result = "running", result
        self._show(line)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._end(trial, "done")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._end(trial, "error")

    def _end(self, trial: Any, status: str) -> None:
        line = self._line(trial)
        line.status, line.ended = status, time.monotonic()
        self._show(line if status == "error" else None)

    def _show(self, line: TrialLine | None = None) -> None:
        if self._live is not None:
            self._live.update(self._table())
        elif line is not None:
            self.echo("  ".join(cell if head == "trial" or head == "status" and cell != "running" else
                                f"{head} {cell}" for head, cell in zip(COLUMNS, line.cells(self.stop_iters))
                                if head != "status" or cell != "running"))

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(box=None, pad_edge=False, header_style="bold")
        for head in COLUMNS:
            table.add_column(head, justify="left" if head in ("trial", "status") else "right", no_wrap=True)
        for line in self.trials.values():
            table.add_row(*line.cells(self.stop_iters))
        if not self.trials:
            table.add_row("starting Ray and the trial ...", *[""] * (len(COLUMNS) - 1))
        return table


def run_summary(run_dir: str) -> list[str]:
    """A few lines on a recorded run: where, what it holds, and whether ``verify`` finds it sound."""
    from rllib_recorder.commands.info import summarize
    from rllib_recorder.commands.verify import verify_report
    from rllib_recorder.errors import RecorderError

    shown = display_path(run_dir)
    try:
        s = summarize(run_dir)
        report = verify_report(run_dir)
    except RecorderError as e:
        return [f"recorded run: {shown}", f"  cannot be read: {' '.join(str(e).split())}"]
    ret = "" if s["return_mean"] is None else f" (return mean {human_number(s['return_mean'])})"
    ratio = f", {compression_text(s['disk_bytes'], s['raw_bytes'])}" if s.get("compression_ratio") else ""
    if report["problems"]:
        check = f"NOT sound: {report['problems'][0]} ('rllib-recorder verify {shown}' lists all)"
    else:
        check = "sound" + (f": {report['summary']}" if report["summary"] else "")
        if report["notes"]:
            check += f"; not stored: {report['notes'][0]}"
    return [f"recorded run: {shown}",
            f"  {s['status']}: {human_count(s['env_steps'])} env steps, {human_count(s['episodes_finished'])} "
            f"episodes{ret}, {s['files']} file(s), {human_bytes(s['disk_bytes'])} on disk{ratio}",
            f"  verify: {check}"]


def next_commands(run_dirs: list[str]) -> list[str]:
    """The commands to try next on what ``train`` recorded (re-simulation and export for single-agent runs)."""
    if not run_dirs:
        return []
    run = display_path(run_dirs[0])
    parent = display_path(os.path.dirname(run_dirs[0]))
    lines = [("rllib-recorder info " + parent, "every run of the experiment, as a table"),
             ("rllib-recorder info " + run, "one run in full: data, policy lag, rates")]
    if _single_agent_new_stack(run_dirs[0]):
        lines += [("rllib-recorder replay " + run + " --check", "re-simulate every episode from its start state"),
                  ("rllib-recorder export " + run + " --to rllib -o bc-data", "RLlib's offline format (BC, MARWIL, CQL)")]
    return ["next:"] + [f"  {command}  # {what}" for command, what in lines]


def _single_agent_new_stack(run_dir: str) -> bool:
    from rllib_recorder.errors import RecorderError
    from rllib_recorder.read.run import open_run

    try:
        with open_run(run_dir) as run:
            return run.manifest.get("api_stack") == "new" and all(
                agent == "default_agent" for f in run.files for agent in f.agents)
    except (RecorderError, OSError, KeyError):
        return False


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
