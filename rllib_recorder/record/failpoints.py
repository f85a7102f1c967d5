"""Fault injection for the project's own tests: a recorder that loses data on purpose, never by default.

``RLLIB_RECORDER_FAILPOINTS="drop_sample=N"`` makes every env runner process drop its N-th ``on_sample_end``
payload (1: the first) before anything counts it: the recorder then loses a chunk and forgets it, the failure a
completeness test must catch against RLlib's own count. Read once, when the module is imported (Ray's worker
processes inherit the driver's environment); unset, it costs one dict lookup per sample.
"""

from __future__ import annotations

import os

ENV_VAR = "RLLIB_RECORDER_FAILPOINTS"


def parse(text: str) -> dict[str, int]:
    """``"drop_sample=3,other=1"`` -> {"drop_sample": 3, "other": 1}; malformed entries are ignored."""
    points = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() and value.strip().isdigit():
            points[name.strip()] = int(value)
    return points


POINTS = parse(os.environ.get(ENV_VAR, ""))


def hit(name: str, count: int) -> bool:
    """Whether failpoint ``name`` fires at this ``count`` (1-based) of its event."""
    return POINTS.get(name) == count
