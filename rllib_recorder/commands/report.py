"""Reports for people: human units, a run's report and a folder's tree of runs (``info``, ``train``)."""

from __future__ import annotations

import os
from typing import Any, Iterable

UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(n: float | None) -> str:
    """``832 B``, ``1.8 MB``: decimal units, three significant digits."""
    if n is None:
        return "unknown"
    n, unit = float(n), 0
    while abs(n) >= 999.5 and unit < len(UNITS) - 1:
        n, unit = n / 1000, unit + 1
    return f"{int(n)} B" if unit == 0 else f"{_three(n)} {UNITS[unit]}"


def human_count(n: float | None) -> str:
    """``10,000`` (whole numbers with thousands separators)."""
    return "unknown" if n is None else f"{int(round(n)):,}"


def human_number(x: float | None, digits: int = 3) -> str:
    """``32.3``, ``0.871``, ``1.24 k``, ``12.3 M``: ``digits`` significant digits, SI prefixes from a thousand."""
    if x is None:
        return "unknown"
    for factor, prefix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= factor * 0.9995:
            return f"{_three(x / factor, digits)}{prefix}"
    return _three(x, digits)


def human_rate(x: float | None) -> str:
    """``12.3 k steps/s``."""
    return "unknown" if x is None else f"{human_number(x)} steps/s"


def human_duration(s: float | None) -> str:
    """``0.42 s``, ``12 s``, ``3 min 12 s``, ``2 h 5 min``."""
    if s is None:
        return "unknown"
    if s < 10:
        return "0 s" if s < 0.005 else f"{s:.2f} s" if s < 1 else f"{s:.1f} s"
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _three(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, without an exponent and without trailing zeros after the point."""
    if x == 0:
        return "0"
    whole = len(str(int(abs(x)))) if abs(x) >= 1 else 0
    decimals = max(0, digits - whole) if abs(x) >= 1 else digits
    text = f"{x:.{decimals}f}" if abs(x) >= 1 else f"{x:.{digits}g}"
    return text.rstrip("0").rstrip(".") if "." in text and "e" not in text else text


def _two_digits(x: float) -> str:
    """``x`` to 2 significant digits, without an exponent: ``1.2``, ``12``, ``260``, ``3100``."""
    text = f"{x:.2g}"
    return f"{float(text):.0f}" if "e" in text else text


def compression_text(disk: float | None, raw: float | None) -> str:
    """``1.2x smaller than the raw 975 kB``, or how much larger a (small) file is than its raw arrays."""
    if not disk or not raw:
        return "compression unknown"
    if raw >= disk:
        return f"{_two_digits(raw / disk)}x smaller than the raw {human_bytes(raw)}"
    return f"larger than the raw {human_bytes(raw)} (HDF5's own structure outweighs a small run's data)"


def _or_why(value: str | None, why: str | None) -> str:
    return value if value is not None else f"unknown ({why})" if why else "unknown"


def _section(title: str, rows: Iterable[tuple[str, str]]) -> list[str]:
    rows = list(rows)
    width = max((len(k) for k, _ in rows), default=0)
    return [title] + [f"  {k.ljust(width)}  {v}" for k, v in rows]


def run_report(summary: dict[str, Any]) -> str:
    """``info RUN``: sections of what a run is, what it holds, its policy lag and its rates."""
    why = summary.get("unknown", {})
    status = str(summary["status"])
    if summary.get("ended_by") and not status.startswith("recording"):
        status += f" ({summary['ended_by']})"
    what = f"{summary['algorithm'] or 'unknown algorithm'} on {summary['env'] or 'an unnamed env'}"
    if summary.get("api_stack"):
        what += f", {summary['api_stack']} API stack"
    nodes = summary.get("nodes") or []
    files = f"{summary['files']} file{'s' if summary['files'] != 1 else ''}"
    if nodes:
        files += f" on {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({', '.join(map(str, nodes[:4]))})"
    when = f"{_time(summary['started_at'])}"
    if summary.get("finished_at"):
        end = _time(summary["finished_at"])
        same_day = end[:10] == when[:10]
        when = (when.removesuffix(" UTC") if same_day and end.endswith(" UTC") else when) + \
            f" to {end[11:] if same_day else end} ({human_duration(summary.get('recording_s'))})"
    else:
        when += f", not finished ({why.get('finished_at', 'still recording')})"
    run = [("status", status), ("what", what)] + ([("Tune trial", str(summary["trial"]))] if summary.get("trial")
                                                   else []) + [("recorded", when), ("files", files)]
    returns = None
    if summary["return_mean"] is not None:
        returns = (f"return mean {human_number(summary['return_mean'])} (min {human_number(summary['return_min'])},"
                   f" max {human_number(summary['return_max'])})")
    episodes = f"{human_count(summary['episodes_finished'])} finished; " + _or_why(returns, why.get("return_mean"))
    disk = human_bytes(summary["disk_bytes"])
    disk += (f", {compression_text(summary['disk_bytes'], summary['raw_bytes'])}" if summary.get("compression_ratio")
             else f"; compression unknown ({why.get('compression_ratio', 'no raw size counted')})")
    lost = summary.get("env_steps_not_stored")
    not_stored = (f"unknown ({why.get('env_steps_not_stored')})" if lost is None else
                  "nothing: every sampled env step is stored" if lost == 0 else
                  f"{human_count(lost)} env steps (their causes: rllib-recorder verify)")
    if summary.get("env_steps_unexplained"):
        not_stored = (f"{human_count(summary['env_steps_unexplained'])} env steps RLlib sampled are neither stored "
                      f"nor counted: an unexplained gap (rllib-recorder verify names the runners)"
                      + ("" if not lost else f"; counted: {human_count(lost)}"))
    errors = summary.get("errors")
    data = [("env steps", human_count(summary["env_steps"])), ("episodes", episodes), ("on disk", disk),
            ("not stored", not_stored), ("errors", "none" if not errors else human_count(errors))]
    lag = summary["policy_lag"]
    if lag["steps"]:
        lag_rows = [("percentiles", f"p50 {lag['p50']}, p90 {lag['p90']}, p99 {lag['p99']}, max {lag['max']}"),
                    ("mean", f"{lag['mean']:.2f} over {human_count(lag['steps'])} steps"
                             + (f" ({human_count(lag['unknown'])} unknown)" if lag["unknown"] else "")),
                    ("histogram", ", ".join(f"{k}: {human_count(v)}" for k, v in list(lag["hist"].items())[:12])
                     + (", ..." if len(lag["hist"]) > 12 else ""))]
    else:
        lag_rows = [("lag", f"unknown for all {human_count(lag['unknown'])} steps ({why.get('policy_lag', '')})")]
    rates = summary["rates"]
    rate_rows = [(name, _rate_text(rates[key], what, why.get(key))) for name, key, what in (
        ("produced", "produced_steps_per_s", "sampled by the env runners"),
        ("stored", "stored_steps_per_s", "committed by the writers"),
        ("consumed", "consumed_steps_per_s", "handed to the learners to train on, each step once"))]
    delay = None if rates["write_delay_s_p50"] is None else (
        f"p50 {human_duration(rates['write_delay_s_p50'])}, max {human_duration(rates['write_delay_s_max'])} "
        "from sampled to committed")
    rate_rows.append(("write delay", _or_why(delay, why.get("write_delay_s_p50"))))
    lines = _section(f"Run {summary['run_dir']}", run) + [""] + _section("Data", data) + [""]
    lines += _section("Policy lag (learner version minus behaviour version, per env step)", lag_rows) + [""]
    lines += _section("Rates (env steps per second, whole run)", rate_rows)
    return "\n".join(lines)


def _rate_text(x: float | None, what: str, why: str | None) -> str:
    return _or_why(None, why) if x is None else f"{human_rate(x).ljust(16)}  {what}"


def _time(text: Any) -> str:
    """``2026-12-05 07:18:57 UTC`` from the manifest's ``2026-12-05T07:18:57+0000``."""
    if not isinstance(text, str) or "T" not in text:
        return str(text) if text is not None else "unknown"
    day, _, clock = text.partition("T")
    zone = clock[8:]
    return f"{day} {clock[:8]}" + (" UTC" if zone in ("+0000", "Z") else f" {zone}" if zone else "")


TREE_COLUMNS = ("status", "env steps", "episodes", "return", "on disk", "lag p50/p99/max", "produced/s",
                "stored/s", "consumed/s")


def folder_report(summary: dict[str, Any]) -> str:
    """``info FOLDER``: every run below a folder, as a tree grouped by the folder holding it, and totals."""
    rows = summary["runs"]
    table: list[tuple[str, list[str]]] = []  # a group's line and an unreadable run have one free-text cell
    groups = {g["path"]: g for g in summary["groups"]}
    for group_path in sorted(groups):
        group = groups[group_path]
        mine = [r for r in rows if r["group"] == group_path]
        indent = ""
        if group_path:
            kind = "Tune experiment, " if group["tune_experiment"] else ""
            table.append((f"{group_path}/", [f"({kind}{len(mine)} run{'s' if len(mine) != 1 else ''}, "
                                            f"{human_count(group['env_steps'])} env steps, "
                                            f"{human_bytes(group['disk_bytes'])})"]))
            indent = "  "
        for i, row in enumerate(mine):
            branch = ("└─ " if i == len(mine) - 1 else "├─ ") if group_path else ""
            name = indent + branch + os.path.basename(row["path"])
            if "error" in row:
                table.append((name, [f"unreadable: {row['error'][:160]}"]))
                continue
            lag = "/".join("-" if row[k] is None else str(row[k]) for k in ("lag_p50", "lag_p99", "lag_max"))
            table.append((name, [_short_status(row["status"]), human_count(row["env_steps"]),
                                 human_count(row["episodes_finished"]),
                                 "-" if row["return_mean"] is None else human_number(row["return_mean"]),
                                 human_bytes(row["disk_bytes"]), lag]
                          + ["-" if row[k] is None else human_number(row[k])
                             for k in ("produced_steps_per_s", "stored_steps_per_s", "consumed_steps_per_s")]))
    totals = summary["totals"]
    runs = totals["runs"]
    head = (f"{summary['folder'].rstrip('/')}/: {runs} run{'s' if runs != 1 else ''}, "
            f"{human_count(totals['env_steps'])} env steps, {human_bytes(totals['disk_bytes'])} on disk")
    if totals["status"]:
        head += " (" + ", ".join(f"{n} {s}" for s, n in totals["status"].items()) + ")"
    name_width = max([len("run")] + [len(name) for name, cells in table if len(cells) > 1])
    widths = [max([len(h)] + [len(cells[i]) for _, cells in table if len(cells) > 1])
              for i, h in enumerate(TREE_COLUMNS)]
    lines = [head, "  ".join(["run".ljust(name_width)] + [h.ljust(w) for h, w in zip(TREE_COLUMNS, widths)]).rstrip()]
    for name, cells in table:
        if len(cells) == 1:
            lines.append(f"{name}  {cells[0]}")
        else:
            lines.append("  ".join([name.ljust(name_width)] + [c.ljust(w) for c, w in zip(cells, widths)]).rstrip())
    if totals["unreadable"]:
        lines.append(f"{totals['unreadable']} run(s) could not be read: see above; 'rllib-recorder verify <run>' "
                     "tells more")
    if summary["indexed_but_missing"]:
        lines.append(f"listed in a recorder_index.json but missing: {', '.join(summary['indexed_but_missing'])}")
    lines.append("Rates are env steps per second over each whole run; '-' is not known yet, and "
                 "'rllib-recorder info <run>' says why and shows one run in full.")
    return "\n".join(lines)


def _short_status(status: Any) -> str:
    return "recording" if str(status).startswith("recording") else str(status)


def live_line(counts: dict[str, Any]) -> str:
    """One line of ``info --follow``."""
    rate = counts.get("stored_steps_per_s")
    return (f"{counts['status']}: {human_count(counts['env_steps'])} env steps"
            + (f" (+{human_rate(rate)})" if rate is not None else "")
            + f", {human_count(counts['episodes'])} episodes, {human_count(counts['batches'])} chunks, "
            f"{counts['files']} file(s), {human_bytes(counts['disk_bytes'])} on disk")
