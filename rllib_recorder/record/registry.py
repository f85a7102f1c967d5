"""Where an env runner that Ray restarted by itself finds its run: the binding, kept in Ray's GCS under the
runner's actor id.

RLlib 2.60 creates its env-runner actors with Ray's ``max_restarts``: a runner process that dies between two of
RLlib's calls is restarted by Ray, under the same actor id, before RLlib looks again, and RLlib never learns of
it (no ``on_env_runners_recreated``). The new process has a new recorder with no binding. So every bound runner
leaves its binding in Ray's key-value store (GCS), keyed by its actor id, and an unbound runner reads it at its
first sample: it records from its first sample, whoever brought it up. The value is the driver's own ``Binding``
(written by this package, inside this Ray cluster; never anything read from a recording).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)

NAMESPACE = "rllib_recorder"


def own_actor_id() -> str | None:
    """The calling process's actor id (hex), None outside an actor (the local env runner, a script)."""
    try:
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return None


def _key(actor_id: str) -> bytes:
    return f"binding/{actor_id}".encode()


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv if internal_kv._internal_kv_initialized() else None


def publish(binding: Any) -> None:
    """Leaves ``binding`` for later incarnations of the calling actor (nothing outside an actor)."""
    actor_id, kv = own_actor_id(), _kv()
    if actor_id is None or kv is None:
        return
    from ray import cloudpickle

    try:
        kv._internal_kv_put(_key(actor_id), cloudpickle.dumps(binding), overwrite=True, namespace=NAMESPACE)
    except Exception as e:  # noqa: BLE001 - the driver's per-result check binds a restarted runner then
        logger.warning("rllib_recorder: cannot leave the binding in Ray's GCS (%s: %s); a runner that Ray "
                       "restarts is bound at the next train result instead", type(e).__name__, e)


def lookup() -> Any:
    """The binding an earlier incarnation of the calling actor left, or None."""
    actor_id, kv = own_actor_id(), _kv()
    if actor_id is None or kv is None:
        return None
    try:
        data = kv._internal_kv_get(_key(actor_id), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - GCS briefly unreachable: looked up again at a later sample
        return None
    if not data:
        return None
    from ray import cloudpickle

    return cloudpickle.loads(data)


def withdraw() -> None:
    """Removes the calling actor's binding (its run has ended)."""
    actor_id, kv = own_actor_id(), _kv()
    if actor_id is None or kv is None:
        return
    try:
        kv._internal_kv_del(_key(actor_id), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - a leftover key is harmless: its run is closed, its writers gone
        pass
