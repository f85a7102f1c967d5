"""Plotting a run: episode return against env steps per worker, and the policy-lag histogram."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import numpy as np

from rllib_recorder.errors import ExportError
from rllib_recorder.extras import require_extra
from rllib_recorder.read.run import Run
from rllib_recorder.read.worker_file import WorkerFile


def episode_returns(f: WorkerFile, agent: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps stored by the worker when each finished episode ended, its return), from the episode index only."""
    frags = f.fragments(agent)
    totals: dict[bytes, float] = defaultdict(float)
    for eps, ret in zip(frags["eps_id"].tolist(), frags["return"].tolist()):
        totals[eps] += ret
    done = np.flatnonzero(frags["terminated"] | frags["truncated"])
    ends = frags["first_row"][done] + frags["num_rows"][done]
    order = np.argsort(ends, kind="stable")
    return ends[order], np.array([totals[e] for e in frags["eps_id"][done][order].tolist()], dtype=np.float64)


def policy_lags(f: WorkerFile, agent: str) -> np.ndarray:
    """Per step with known versions: the learner's version stored with its chunk minus the version that acted."""
    lags = f.policy_lag(agent)
    return lags[lags >= 0]


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def check_output(out_path: str) -> None:
    """ExportError (one line) unless ``out_path`` is a file to write a figure to: a known extension, in a
    directory that exists."""
    extension = os.path.splitext(out_path)[1].lower().lstrip(".")
    if extension not in PLOT_FORMATS:
        raise ExportError(f"cannot plot to {out_path!r}: name a {', '.join('.' + f for f in PLOT_FORMATS)} file, "
                          "e.g. -o run.png")
    folder = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(folder):
        raise ExportError(f"cannot plot to {out_path!r}: directory {folder} does not exist; create it first")


def plot_run(run: Run, out_path: str) -> dict[str, Any]:
    """Writes the figure to ``out_path`` (PNG); returns what was plotted (episodes per worker, lag counts)."""
    require_extra("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ret, ax_lag) = plt.subplots(1, 2, figsize=(12, 4.5))
    summary: dict[str, Any] = {"episodes": {}, "lags": {}}
    all_lags = []
    for f in run.files_of(False):
        for agent in f.agents:
            x, y = episode_returns(f, agent)
            label = f"worker {f.worker_index}" + ("" if agent == "default_agent" else f" {agent}")
            ax_ret.plot(x, y, marker=".", label=label)
            summary["episodes"][label] = len(x)
            all_lags.append(policy_lags(f, agent))
    lags = np.concatenate(all_lags) if all_lags else np.zeros(0, np.int64)
    if not summary["episodes"]:
        plt.close(fig)
        raise ExportError(f"run {run.path} holds no worker data to plot")
    ax_ret.set(xlabel="env steps stored by the worker", ylabel="episode return", title="Episode return")
    ax_ret.legend(fontsize="small")
    bins = np.arange(lags.min(), lags.max() + 2) - 0.5 if len(lags) else 1
    ax_lag.hist(lags, bins=bins)
    ax_lag.set(xlabel="policy lag per step (learner version - behaviour version)", ylabel="steps",
               title=f"Policy lag ({len(lags)} steps with known versions)")
    ax_lag.xaxis.get_major_locator().set_params(integer=True)
    # names from the manifest are text, never mathtext ('$...$' in a hostile env name must not be parsed)
    fig.suptitle(f"{run.manifest.get('algorithm')} on {str(run.manifest.get('env'))[:120]}", parse_math=False)
    fig.tight_layout()
    try:
        fig.savefig(out_path, dpi=100)
    except OSError as e:
        raise ExportError(f"cannot write {out_path} ({e.strerror or e}); choose a writable path") from None
    finally:
        plt.close(fig)
    values, counts = np.unique(lags, return_counts=True)
    summary["lags"] = {int(v): int(c) for v, c in zip(values, counts)}
    return summary
