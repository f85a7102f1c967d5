"""The counters every sender keeps of what it sampled and could not hand over, by cause, and how verify names each."""

from __future__ import annotations

from typing import Any

# Per-sender counters of steps that were sampled but not stored, and how ``verify`` names them.
CAUSES = {
    "env_steps_dropped": "dropped by back-pressure (the spool backlog was full: backpressure='drop', or 'block' "
                         "that gave up after drain_timeout_s)",
    "env_steps_failed": "failed to reach the spool (a full or unwritable disk)",
    "env_steps_unconvertible": "could not be converted (see the env runner's log)",
    "env_steps_unbound_dropped": "sampled before the runner was bound to a writer, past the 64 samples it holds",
    "env_steps_refused": "refused by the writer as data it can never store",
    "env_steps_lost_with_node": "lost with its node, which left while recording (the autoscaler, a spot "
                                "instance): the unsealed tail of its staged file and spool; the sealed segments "
                                "before it are at the target",
}

# Sender-side causes: the ones an env runner knows of itself (a writer's refusals are counted by the writer).
SENDER_CAUSES = tuple(k for k in CAUSES if k not in ("env_steps_refused", "env_steps_lost_with_node"))

DROP_CAUSES = {"backpressure_drop": "backpressure='drop'", "block_timeout": "backpressure='block' timed out",
               "writer_not_consuming": "the writer stopped consuming"}


def not_stored_by_sender(stats: dict[str, Any]) -> int:
    """Env steps a sender's own counters say it could not hand over (what batch rows carry, schema 2.1)."""
    return sum(int(stats.get(key) or 0) for key in SENDER_CAUSES)
