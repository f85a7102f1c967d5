"""Completeness: what each env runner sampled against what the run's files hold, and why any difference.

Every env-runner incarnation (a *sender*) counts each ``on_sample_end`` payload before anything can fail, and
counts each step it could not hand over by cause. Its counters reach the writer with every spool record, the
manifest's ``totals.senders`` at the end, and (schema 2.1) every batch row it committed, so a run is accounted
from its manifest where the driver closed it and from its files alone where it did not (a driver killed, then
``recover``). ``verify`` prints the accounts; an unexplained difference is a problem, a counted one is named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from rllib_recorder.format.counters import CAUSES, DROP_CAUSES, SENDER_CAUSES


@dataclass
class Account:
    """One sender's steps: sampled, stored, and each counted cause of the difference."""

    sender: str  # "<file stem>/<sender id>"
    sampled: int = 0
    stored: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    known: bool = False  # its sampled count is known (from the manifest or 2.1 batch rows)
    unacked: str | None = None  # why its handed-over samples were still in the spool at stop
    detail: str | None = None  # e.g. the refusal's error, the drop causes

    @property
    def unexplained(self) -> int:
        return self.sampled - self.stored - sum(self.lost.values())


def accounts(manifest: dict[str, Any], files: Iterable[Any]) -> list[Account]:
    """One account per sender that sampled anything, from the manifest's totals and the files' batch rows."""
    totals = manifest.get("totals") if isinstance(manifest.get("totals"), dict) else {}
    senders = totals.get("senders") if isinstance(totals.get("senders"), dict) else {}
    leftovers = totals.get("spool_leftovers") if isinstance(totals.get("spool_leftovers"), dict) else {}
    by_id: dict[str, Account] = {}
    for key, stats in senders.items():
        if isinstance(stats, dict):
            account = by_id.setdefault(_sender_id(key), Account(key))
            account.sampled = max(account.sampled, int(stats.get("env_steps_sampled") or 0))
            account.known = "env_steps_sampled" in stats
            account.lost = {k: int(stats.get(k) or 0) for k in CAUSES if int(stats.get(k) or 0) > 0}
            account.detail = _detail(stats)
    for f in files:
        for sender, stored, sampled, not_stored in _file_counts(f):
            stem = os.path.basename(f.path)[:-len(".h5")]
            account = by_id.setdefault(sender, Account(f"{stem}/{sender}"))
            account.stored += stored
            account.sampled = max(account.sampled, sampled)
            account.known = account.known or sampled >= 0
            if not_stored > sum(account.lost.get(k, 0) for k in SENDER_CAUSES):  # file newer than the manifest
                account.lost = {"not_stored": not_stored}
    for key, why in leftovers.items():
        by_id.setdefault(_sender_id(key), Account(key)).unacked = str(why)
    _name_lost_nodes(manifest, by_id.values())
    return [a for _, a in sorted(by_id.items(), key=lambda kv: kv[1].sender) if a.sampled or a.stored or a.unacked]


def check(accounts_: list[Account], stored_total: int, ended: bool = True) -> tuple[list[str], list[str]]:
    """(problems, notes): unexplained gaps, unacknowledged samples and an empty run (once ``ended``) are
    problems."""
    problems, notes = [], []
    for a in accounts_:
        if a.unacked:
            problems.append(f"{a.sender}: samples handed over but not committed at stop ({a.unacked}); "
                            "'rllib-recorder recover' commits them")
            continue
        if not a.known:  # written before schema 2.1, or by hand: nothing to check it against
            continue
        if a.unexplained > 0:
            problems.append(f"{a.sender}: {a.unexplained} of {a.sampled} sampled env steps are neither stored nor "
                            "counted as lost (lost with a killed process, or a bug: please report it)")
        elif a.unexplained < 0:
            problems.append(f"{a.sender}: {a.stored} env steps stored but only {a.sampled} sampled")
        for cause, steps in sorted(a.lost.items()):
            why = CAUSES.get(cause, "counted as not stored by the env runner")
            notes.append(f"{a.sender}: {steps} of {a.sampled} sampled env steps not stored: {why}"
                         + (f" ({a.detail})" if a.detail else ""))
    if ended and stored_total == 0:
        problems.append("no env steps are stored in this run")
    return problems, notes


def rllib_gaps(manifest: dict[str, Any], accounts_: list[Account]) -> list[str]:
    """Problems where RLlib's own sampled count (kept in the manifest at every train result) exceeds what the run
    stored plus what it counted as not stored: steps that escaped the recorder's count altogether (an env-runner
    process that never recorded, say). Each names the runners it can: those with fewer incarnations reaching a
    writer than the driver saw in Ray's actor table."""
    iteration = (manifest.get("rllib_counts") or {}).get("training_iteration")
    return [f"unexplained gap: {gap} env steps RLlib sampled are neither stored nor counted ({what} runners: RLlib "
            f"sampled {rllib} by iteration {iteration}, {accounted} stored or counted" + (f"; {where}" if where else "")
            + ")" for what, gap, rllib, accounted, where in _rllib_gaps(manifest, accounts_)]


def unexplained_steps(manifest: dict[str, Any], accounts_: list[Account]) -> int:
    """Env steps RLlib sampled that the run neither stored nor counted (0 when RLlib's count is not kept)."""
    return sum(gap for _, gap, *_ in _rllib_gaps(manifest, accounts_))


def _rllib_gaps(manifest: dict[str, Any], accounts_: list[Account]) -> list[tuple[str, int, int, int, str]]:
    counts = manifest.get("rllib_counts") if isinstance(manifest.get("rllib_counts"), dict) else {}
    out = []
    for what, key, evaluation in (("training", "env_steps_sampled", False),
                                  ("evaluation", "evaluation_env_steps_sampled", True)):
        rllib = counts.get(key)
        if not isinstance(rllib, (int, float)) or isinstance(rllib, bool) or rllib <= 0:
            continue
        mine = [a for a in accounts_ if a.sender.startswith("eval-") == evaluation]
        accounted = sum(a.stored + sum(a.lost.values()) for a in mine)
        if int(rllib) > accounted:
            out.append((what, int(rllib) - accounted, int(rllib), accounted, _runners_short(manifest, mine, evaluation)))
    return out


def _runners_short(manifest: dict[str, Any], accounts_: list[Account], evaluation: bool) -> str:
    """The runners whose incarnations (as the driver saw them in Ray's actor table) did not all reach a writer."""
    runners = manifest.get("runners") if isinstance(manifest.get("runners"), dict) else {}
    reached: dict[str, int] = {}
    for a in accounts_:
        stem = a.sender.rsplit("/", 1)[0].split(".")[0]  # worker-001(.node1)/<sender> -> worker-001
        reached[stem] = reached.get(stem, 0) + 1
    short = []
    for key, entry in sorted(runners.items()):
        if not isinstance(entry, dict) or key.startswith("eval-") != evaluation:
            continue
        seen = int(entry.get("incarnations") or 0)
        if reached.get(key, 0) < seen:
            short.append(f"{key}: {reached.get(key, 0)} of its {seen} incarnation(s) reached a writer")
    return ", ".join(short)


def incarnations(manifest: dict[str, Any], accounts_: list[Account]) -> int:
    """Env-runner incarnations: those that reached a writer, or as many as the driver saw, if more."""
    runners = manifest.get("runners") if isinstance(manifest.get("runners"), dict) else {}
    seen = sum(int(e.get("incarnations") or 0) for e in runners.values() if isinstance(e, dict))
    return max(seen, len([a for a in accounts_ if a.known]))


def summary_line(accounts_: list[Account], manifest: dict[str, Any] | None = None) -> str | None:
    """`all N sampled steps stored`, or how many of them are (None when nothing was accounted); with the manifest,
    the incarnations the driver saw and RLlib's count where it exceeds the recorder's."""
    runners = incarnations(manifest, accounts_) if manifest is not None else 0
    accounts_ = [a for a in accounts_ if a.known]
    if not accounts_:
        return None
    sampled, stored = sum(a.sampled for a in accounts_), sum(a.stored for a in accounts_)
    runners = max(runners, len(accounts_))
    unexplained = unexplained_steps(manifest, accounts_) if manifest is not None else 0
    if unexplained:
        return (f"{stored} of {sampled + unexplained} sampled env steps stored, by RLlib's count ({runners} env "
                "runner incarnation(s))")
    if stored == sampled and not any(a.lost for a in accounts_):
        return f"all {sampled} sampled env steps stored ({runners} env runner incarnation(s))"
    return f"{stored} of {sampled} sampled env steps stored ({runners} env runner incarnation(s))"


def _name_lost_nodes(manifest: dict[str, Any], accounts_: Iterable[Account]) -> None:
    """A durable run whose node left (``lost_nodes``): the gap of each sender whose file was staged there is that
    node's unsealed tail, named as such (its sampled count is as of the last train result before the loss)."""
    lost = manifest.get("lost_nodes") if isinstance(manifest.get("lost_nodes"), list) else []
    if not lost or not manifest.get("target"):
        return
    from rllib_recorder.format.manifest import place_files

    nodes = manifest.get("writer_nodes") if isinstance(manifest.get("writer_nodes"), dict) else {}
    for account in accounts_:
        stem = account.sender.rsplit("/", 1)[0]
        node = place_files([f"{stem}.h5"], nodes).get(f"{stem}.h5") or {}
        if node.get("node_id") in lost and account.unexplained > 0:
            account.lost["env_steps_lost_with_node"] = account.unexplained
            account.detail = f"node {node['node_id'][:12]}"


def _sender_id(key: str) -> str:
    return str(key).rsplit("/", 1)[-1]


def _detail(stats: dict[str, Any]) -> str | None:
    parts = []
    causes = stats.get("drop_causes")
    if isinstance(causes, dict) and causes:
        parts += [f"{DROP_CAUSES.get(c, c)}: {n} steps" for c, n in sorted(causes.items())]
    if stats.get("refused_error"):
        parts.append(f"refused: {stats['refused_error']}")
    return "; ".join(parts) or None


def _file_counts(f: Any) -> list[tuple[str, int, int, int]]:
    """Per sender of one file: (sender id, env steps stored, newest sampled counter (-1: unknown), newest
    not-stored counter)."""
    if not f.commit["batches"]:
        return []
    batches = f.batches()
    if "sender_id" not in batches:
        return []
    out = []
    ids = batches["sender_id"]
    for sender in np.unique(ids):
        mine = ids == sender
        sampled = int(batches["sender_env_steps_sampled"][mine].max()) if "sender_env_steps_sampled" in batches else -1
        not_stored = int(batches["sender_env_steps_not_stored"][mine].max()) \
            if "sender_env_steps_not_stored" in batches else 0
        out.append((sender.decode(), int(batches["env_steps"][mine].sum()), sampled, max(not_stored, 0)))
    return out
