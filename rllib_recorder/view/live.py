"""The live stream of a run (server-sent events): at each commit the episodes finished since the page's cursor,
as table rows and curve points, and the run's counts; one last event when the run has ended."""

from __future__ import annotations

import time
from typing import Any, Callable

from rllib_recorder.read.follow import follow_files
from rllib_recorder.view import api
from rllib_recorder.view.catalog import Catalog

POLL_S = 0.5
# A comment line is sent at least this often, so that a page that went away is noticed (the write fails).
KEEPALIVE_S = 5.0


def stream(catalog: Catalog, run_id: str, known: dict[str, int], send: Callable[[str, Any], None], *,
           poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
           follow: Callable[..., Any] = follow_files) -> None:
    """Sends ``update`` events while run ``run_id`` records (``known``: the page's cursor, moved on with each),
    then ``end``; returns when the run has ended or ``send`` raises (the page went away)."""
    path = catalog.path_of(run_id)
    quiet_since = clock()
    status = None
    for changed, ended in follow(path, poll_s=poll_s):
        with catalog.opened(run_id) as handle:
            now = api.summary(catalog, handle)["status"]
            if changed or now != status:
                rows, points = api.new_episodes(handle, known)
                send("update", {"summary": api.summary(catalog, handle), "episodes": rows, "curves": points,
                                "cursor": known})
                status, quiet_since = now, clock()
        if ended:
            send("end", {"status": status})
            return
        if clock() - quiet_since >= KEEPALIVE_S:
            send("", None)
            quiet_since = clock()
