"""The viewer's JSON: runs, a run's charts and episode table, one episode's tracks, its frames and pictures; all
read through ``read/`` (docs/reference.md lists every endpoint and field)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from rllib_recorder.errors import RecorderError
from rllib_recorder.view import aggregates as agg
from rllib_recorder.view.catalog import Catalog, Handle, NotFound, guarded, run_stamps
from rllib_recorder.view.pictures import Simulations, episode_rows, frames
from rllib_recorder.view.steps import TRACK_COLUMNS, jsonable, obs_is_picture, track_json, typed

SORT_KEYS = ("end", "return", "length", "worker", "agent")
MAX_PAGE = 500


def runs_json(catalog: Catalog) -> dict[str, Any]:
    """Every run below the paths given, each with its summary (or why it can't be read)."""
    rows = [run_row(catalog, run_id) for run_id in sorted(catalog.scan())]
    return {"roots": [root.given for root in catalog.roots], "runs": rows}


def run_row(catalog: Catalog, run_id: str) -> dict[str, Any]:
    row = {"id": run_id, "group": catalog.group_of(run_id), "name": run_id.rsplit("/", 1)[-1]}
    try:
        with catalog.opened(run_id) as handle:
            return {**row, **summary(catalog, handle)}
    except (RecorderError, OSError, KeyError, ValueError) as e:
        return {**row, "error": " ".join(str(e).split()) or type(e).__name__}


def summary(catalog: Catalog, handle: Handle) -> dict[str, Any]:
    """What the runs page shows of a run (its status looked up every time: a driver can end without a write)."""
    if "summary" not in handle.memo:
        manifest = handle.run.manifest
        table, _ = agg.run_episodes(handle)
        files = agg.files_of(handle)
        done = table.done
        steps = 0
        for f, _ in agg.readable(handle):
            batches, _ = guarded(lambda: agg.file_batches(f, agg.opened_stamp(handle, f.path)))
            steps += int(batches["env_steps"].sum()) if batches else 0
        returns = table.ret[done]
        handle.memo["summary"] = {
            "algorithm": _text(manifest.get("algorithm")), "env": _text(manifest.get("env")),
            "trial": _text(manifest.get("trial_name") or manifest.get("trial")),
            "experiment": _text(manifest.get("experiment")), "env_steps": steps, "episodes": len(table.eps_id),
            "finished": int(done.sum()), "return_mean": jsonable(float(returns.mean())) if len(returns) else None,
            "disk_bytes": sum(i.disk_bytes for i in files), "files": len(files),
            "damaged": [i.name for i in files if i.error],
        }
    status = str(catalog.tools.status(handle.path, handle.run.manifest))
    return {**handle.memo["summary"], "status": status, "recording": status.startswith("recording")}


def verdict_json(catalog: Catalog, run_id: str, cache: dict[str, Any]) -> dict[str, Any]:
    """``verify``'s verdict on the run, made again only when its files changed."""
    path = catalog.path_of(run_id)
    stamps = run_stamps(path)
    known = cache.get(run_id)
    if known is not None and known[0] == stamps:
        return known[1]
    try:
        report = catalog.tools.verify(path)
    except (RecorderError, OSError, KeyError, ValueError) as e:
        out = {"verdict": "unreadable", "problems": [" ".join(str(e).split())], "notes": [], "summary": ""}
    else:
        verdict = "recording" if report.get("recording") else "not sound" if report["problems"] else "sound"
        out = {"verdict": verdict, "problems": report["problems"][:50], "notes": report["notes"][:50],
               "summary": report.get("summary") or "", "more_problems": max(0, len(report["problems"]) - 50)}
    cache[run_id] = (stamps, out)
    return out


def run_json(catalog: Catalog, run_id: str) -> dict[str, Any]:
    """A run: its summary, files, return and length curves, policy-lag histogram, rates, and the cursor the
    live stream continues from."""
    with catalog.opened(run_id) as handle:
        manifest = handle.run.manifest
        table, problems = agg.run_episodes(handle)
        files = agg.files_of(handle)
        lags = agg.run_lags(handle)
        rates, _ = guarded(lambda: catalog.tools.rates(handle.run, manifest.get("totals") or {}))
        return {
            "id": run_id, "name": run_id.rsplit("/", 1)[-1], **summary(catalog, handle),
            "api_stack": _text(manifest.get("api_stack")), "started_at": _text(manifest.get("started_at")),
            "finished_at": _text(manifest.get("finished_at")), "problems": problems,
            "worker_files": [{"name": i.name, "worker": i.worker, "evaluation": i.evaluation, "agents": i.agents,
                       "disk_bytes": i.disk_bytes, "error": i.error} for i in files],
            "curves": curves(table, files),
            "lags": {"lag": list(lags), "steps": list(lags.values())},
            "rates": {**{k: jsonable(v) for k, v in (rates or {}).items() if k != "unknown"},
                      "unknown": jsonable((rates or {}).get("unknown", {})),
                      **agg.step_series(handle, manifest.get("totals") or {})},
            "cursor": cursor(table, files),
        }


def series_name(info: agg.FileInfo, agent: str, multi_agent: bool) -> str:
    name = f"{'eval ' if info.evaluation else ''}worker {info.worker}"
    return f"{name} {agent}" if multi_agent else name


def curves(table: agg.RunTable, files: list[agg.FileInfo], rows: np.ndarray | None = None) -> list[dict[str, Any]]:
    """The finished episodes (of ``rows``, default all) as one series per file and agent: the run's env steps
    when each ended, its return and length."""
    done = table.done if rows is None else np.isin(np.arange(len(table.done)), rows) & table.done
    multi = len(set(table.agent.tolist())) > 1
    out = []
    for k, info in enumerate(files):
        for agent in info.agents:
            mine = np.flatnonzero(done & (table.file == k) & (table.agent == agent))
            if not len(mine):
                continue
            mine = mine[np.argsort(table.x[mine], kind="stable")]
            out.append({"name": series_name(info, agent, multi), "file": info.name, "agent": agent,
                        "evaluation": info.evaluation, "x": typed(table.x[mine]), "ret": typed(table.ret[mine]),
                        "length": typed(table.length[mine])})
    return out


def cursor(table: agg.RunTable, files: list[agg.FileInfo]) -> dict[str, int]:
    """Finished episodes per file and agent (``file NUL agent``): the live stream sends those after them."""
    out: dict[str, int] = {}
    done = table.done
    for k, info in enumerate(files):
        for agent in info.agents:
            out[f"{info.name}\0{agent}"] = int((done & (table.file == k) & (table.agent == agent)).sum())
    return out


def new_episodes(handle: Handle, known: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finished episodes after ``known`` (a ``cursor``, moved on here): as table rows, and as curve points."""
    table, _ = agg.run_episodes(handle)
    files = agg.files_of(handle)
    fresh = []
    for k, info in enumerate(files):
        for agent in info.agents:
            mine = np.flatnonzero(table.done & (table.file == k) & (table.agent == agent))  # in stored order
            key = f"{info.name}\0{agent}"
            fresh += mine[known.get(key, 0):].tolist()
            known[key] = len(mine)
    rows = np.array(sorted(fresh), np.int64)
    return [episode_row(table, files, int(i)) for i in rows], curves(table, files, rows) if len(rows) else []


def episode_row(table: agg.RunTable, files: list[agg.FileInfo], i: int) -> dict[str, Any]:
    end = "terminated" if table.terminated[i] else "truncated" if table.truncated[i] else ""
    return {"file": files[table.file[i]].name, "worker": int(table.worker[i]), "evaluation": bool(table.evaluation[i]),
            "agent": table.agent[i], "eps_id": table.eps_id[i], "length": int(table.length[i]),
            "return": jsonable(float(table.ret[i])), "end": end, "x": float(table.x[i])}


def episodes_json(catalog: Catalog, run_id: str, *, sort: str = "end", descending: bool = True, offset: int = 0,
                  limit: int = 50, finished: bool = False, evaluation: str = "all") -> dict[str, Any]:
    """One page of the run's episodes, sorted and filtered (``evaluation``: ``all``, ``training`` or
    ``evaluation``); ``best``: the finished training episode of highest return."""
    if sort not in SORT_KEYS:
        raise ValueError(f"sort by one of {', '.join(SORT_KEYS)}, not {sort!r}")
    if evaluation not in ("all", "training", "evaluation"):
        raise ValueError(f"evaluation is all, training or evaluation, not {evaluation!r}")
    with catalog.opened(run_id) as handle:
        table, _ = agg.run_episodes(handle)
        files = agg.files_of(handle)
        mask = table.done.copy() if finished else np.ones(len(table.done), bool)
        if evaluation != "all":
            mask &= table.evaluation == (evaluation == "evaluation")
        rows = np.flatnonzero(mask)
        key = {"end": table.x, "return": table.ret, "length": table.length, "worker": table.worker,
               "agent": table.agent}[sort][rows]
        # ties in stored order: by end, the newest first when descending
        order = np.lexsort((table.order[rows], table.file[rows], key)) if sort != "agent" else \
            np.argsort(key.astype(str), kind="stable")
        if descending:
            order = order[::-1]
        page = rows[order][max(0, offset):max(0, offset) + min(max(1, limit), MAX_PAGE)]
        trained = np.flatnonzero(table.done & ~table.evaluation)
        best = int(trained[np.argmax(table.ret[trained])]) if len(trained) else None
        return {"total": int(len(rows)), "offset": offset, "rows": [episode_row(table, files, int(i)) for i in page],
                "best": episode_row(table, files, best) if best is not None else None}


# Stored frames sent with an episode, from the step the page opens at: its first picture needs no second request.
FIRST_FRAMES = 8


def episode_json(catalog: Catalog, run_id: str, file: str, eps_id: str, t: int = 0) -> dict[str, Any]:
    """One episode of one file: every agent's track, and how its pictures are drawn (stored frames: with the
    ones of the steps from ``t`` on, on the episode's timeline)."""
    with catalog.opened(run_id) as handle:
        f = agg.worker_file(handle, file)
        if f is None:
            raise NotFound(f"run {run_id!r} has no readable file {file!r}")
        opened = agg.opened_stamp(handle, f.path)
        indexes = {a: agg.file_index(f, a, opened) for a in f.agents}
        agents = [a for a, index in indexes.items() if eps_id.encode() in index["eps_id"]]
        if not agents:
            raise NotFound(f"file {file!r} holds no episode {eps_id!r}")
        tracks, picture = [], None
        for agent in agents:
            drawn = picture is None and obs_is_picture(f, agent)
            episode = f.episode(eps_id, agent, indexes[agent], columns=TRACK_COLUMNS + ([] if drawn else ["obs"]))
            tracks.append(track_json(episode, with_obs=not drawn))
            if drawn:
                env_t = np.asarray(episode.env_t)[:len(episode)]
                k = int(np.searchsorted(env_t, t, "right")) - 1 if len(env_t) == len(episode) else t
                k = min(max(k, 0), max(len(episode) - 1, 0))
                first, _ = frames(f, agent, indexes[agent], eps_id, k, FIRST_FRAMES)
                picture = {"kind": "frames", "agent": agent, "count": len(episode),
                           "height": first.shape[1], "width": first.shape[2],
                           "channels": first.shape[3] if first.ndim == 4 else 1,
                           "first": {"start": k, "count": len(first), "b64": base64.b64encode(first.tobytes())
                                     .decode("ascii")}}
        picture = picture or _drawn_how(catalog, tracks)
        steps = max(track["steps"] for track in tracks)
        return {"run": run_id, "file": file, "worker": f.worker_index, "evaluation": f.is_evaluation,
                "eps_id": eps_id, "steps": steps, "timeline": "env_t" if any(t["x"] for t in tracks) else "t",
                "tracks": tracks, "picture": picture}


def _drawn_how(catalog: Catalog, tracks: list[dict[str, Any]]) -> dict[str, Any]:
    """An episode without stored pictures: re-simulated when it can be, else its observations as a strip chart."""
    if len(tracks) > 1:
        why = "a multi-agent episode is not re-simulated: its observations are drawn"
    elif catalog.tools.simulate is None:
        why = "re-simulation is not available here"
    elif not tracks[0]["start_state"]:
        why = ("no start state was stored for this episode (recorded with record_start_states=False, or the "
               "env's state can't be captured), so it can't be re-simulated: its observations are drawn")
    else:
        return {"kind": "simulated", "agent": tracks[0]["agent"], "count": tracks[0]["length"]}
    return {"kind": "obs", "agent": tracks[0]["agent"], "why": why}


def frames_bytes(catalog: Catalog, run_id: str, file: str, eps_id: str, agent: str, start: int,
                 count: int) -> tuple[bytes, dict[str, str]]:
    """The stored pictures of steps ``[start, start + count)`` as raw uint8, and headers naming their shape."""
    with catalog.opened(run_id) as handle:
        f = agg.worker_file(handle, file)
        index = agg.file_index(f, agent, agg.opened_stamp(handle, f.path)) if f and agent in f.agents else None
        if index is None or not episode_rows(index, eps_id):
            raise NotFound(f"no episode {eps_id!r} of agent {agent!r} in {file!r}")
        pictures, total = frames(f, agent, index, eps_id, start, count)
    height, width = pictures.shape[1:3]
    channels = pictures.shape[3] if pictures.ndim == 4 else 1
    return pictures.tobytes(), {"X-Frames-Start": str(start), "X-Frames-Count": str(len(pictures)),
                                "X-Frames-Total": str(total), "X-Frame-Height": str(height),
                                "X-Frame-Width": str(width), "X-Frame-Channels": str(channels)}


def picture_png(catalog: Catalog, simulations: Simulations, run_id: str, file: str, eps_id: str, t: int) -> bytes:
    """The env's picture at step ``t``, re-simulated from the episode's start state (``render``'s way)."""
    path = catalog.path_of(run_id)
    simulate = catalog.tools.simulate
    if simulate is None:
        raise NotFound("re-simulation is not available here")

    def start() -> Any:
        with catalog.opened(run_id) as handle:
            f = agg.worker_file(handle, file)
            if f is None or len(f.agents) != 1:
                raise RecorderError(f"no single-agent episode {eps_id!r} in {file!r}")
            episode = f.episode(eps_id, f.agents[0], columns=["actions", "rewards", "start_state"])
            return simulate(handle.run, episode)

    return simulations.picture((path, file, eps_id), t, start)


def _text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else str(value)
