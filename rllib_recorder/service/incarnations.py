"""Every env-runner process of a run, however it came to exist, as the driver learns of it at each train result.

RLlib tells the driver of the runners it recreates (``on_env_runners_recreated``), but not of those that Ray
restarts by itself (actor ``max_restarts``, RLlib's default): RLlib never sees those fail. Ray's actor table does:
the same actor id, a new ``NumRestarts`` and pid. At each result the driver reads it for every remote runner
(one GCS query), counts each incarnation (also one that died before it reached a writer), and binds any runner
that is new or restarted since the last result, so that its node has writers. The runner itself has usually
bound already at its first sample (``record.registry``); binding twice is harmless.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from rllib_recorder.format import layout

logger = logging.getLogger(__name__)


def runner_key(worker_index: int, is_evaluation: bool) -> str:
    """``worker-001`` / ``eval-worker-002``: a runner's name in the manifest, its file's stem on the driver's node."""
    return layout.file_name(worker_index, is_evaluation)[: -len(".h5")]


class RunnerWatch:
    """The incarnations of every remote env runner, from Ray's actor table."""

    def __init__(self) -> None:
        # runner key -> {"actor_ids": [...], "incarnations": n, "restarts": n (Ray's, of the current actor),
        #                "pids": [...] (those seen), "state": Ray's actor state}
        self.runners: dict[str, dict[str, Any]] = {}
        self._pending: set[str] = set()  # restarted or new, not alive yet when last looked at

    def check(self, group: Any, is_evaluation: bool) -> list[int]:
        """Updates the counts of ``group``'s remote runners; returns the indices to bind now (new or restarted
        since the last check, and alive)."""
        actors = _actors_of(group)
        if not actors:
            return []
        table = _actor_table(list(actors.values()))
        to_bind = []
        for index, handle in sorted(actors.items()):
            actor_id = handle._actor_id.hex()
            info = table.get(actor_id)
            if info is None:
                continue
            key = runner_key(index, is_evaluation)
            restarts, state, pid = int(info.get("NumRestarts") or 0), str(info.get("State")), info.get("Pid")
            entry = self.runners.get(key)
            changed = False
            if entry is None or entry["actor_ids"][-1] != actor_id:  # first seen, or RLlib made a new actor
                entry = self.runners.setdefault(key, {"actor_ids": [], "incarnations": 0, "restarts": 0,
                                                      "pids": []})
                entry["actor_ids"].append(actor_id)
                entry["incarnations"] += 1 + restarts
                changed = bool(entry["pids"])  # a runner already known: recreated
            elif restarts > entry["restarts"]:  # Ray restarted it, perhaps more than once, since the last look
                entry["incarnations"] += restarts - entry["restarts"]
                changed = True
                logger.warning("rllib_recorder: Ray restarted env runner %s (%d time(s) so far, RLlib was not "
                               "told); its new process records on", key, restarts)
            entry["restarts"], entry["state"] = restarts, state
            if pid and pid not in entry["pids"]:
                entry["pids"].append(pid)
            if changed:
                self._pending.add(key)
            if key in self._pending and state == "ALIVE":
                self._pending.discard(key)
                to_bind.append(index)
        return to_bind

    def as_dict(self) -> dict[str, Any]:
        return {k: dict(v) for k, v in sorted(self.runners.items())}


def _actors_of(group: Any) -> dict[int, Any]:
    manager = getattr(group, "_worker_manager", None)
    try:
        return dict(manager.actors()) if manager is not None else {}
    except Exception:  # noqa: BLE001 - an RLlib without this (DeveloperAPI) accessor: RLlib's own hooks only
        return {}


def _actor_table(handles: list[Any]) -> dict[str, dict[str, Any]]:
    """Ray's actor-table rows of these actors, by actor id (hex); {} when the GCS can't be asked."""
    from ray._private import state

    try:
        if len(handles) <= 8:
            return {h._actor_id.hex(): state.actors(h._actor_id.hex()) for h in handles}
        wanted = {h._actor_id.hex() for h in handles}
        rows = state.actors(job_id=ray.JobID.from_hex(ray.get_runtime_context().get_job_id()))
        return {k: v for k, v in rows.items() if k in wanted}
    except Exception as e:  # noqa: BLE001 - counted at the next result instead
        logger.debug("rllib_recorder: reading Ray's actor table failed: %s", e)
        return {}
