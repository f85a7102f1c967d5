"""Ending a recording however the driver ends, not only through ``algo.stop()``.

Most RLlib scripts and notebooks never call ``algo.stop()``; they end, raise, get Ctrl-C or SIGTERM, or call
``ray.shutdown()`` first. Every open recording is registered here and closed (runners drained, files closed,
manifest finished) by the first of:

* ``algo.stop()`` / Tune stopping the trial (the algorithm's ``cleanup`` hook, see ``service/run``);
* ``ray.shutdown()`` called by the user (wrapped: the recording closes while the writers still run);
* interpreter exit (``atexit``; registered after Ray's own ``shutdown`` handler, so it runs first). An uncaught
  exception or KeyboardInterrupt is noted by ``sys.excepthook`` on the way, SIGTERM by a handler chained before
  Ray's (which turns it into ``sys.exit``), so the manifest says ``interrupted`` and why.

A driver killed with SIGKILL runs none of this: what the env runners had written to their spools stays there,
and ``rllib-recorder recover`` commits it.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
from typing import Any, Callable, Protocol

from rllib_recorder._rllib_compat import wrap_method

logger = logging.getLogger(__name__)


class Closable(Protocol):
    run_id: str

    def close_unstopped(self, ended_by: str, interrupted: bool) -> Any: ...


_LIVE: dict[str, Closable] = {}

_state: dict[str, Any] = {"installed": False, "why": None}

_lock = threading.RLock()


def register(run: Closable) -> None:
    """Keeps ``run`` to be closed when the driver ends (installs the hooks once per process)."""
    with _lock:
        _install()
        _LIVE[run.run_id] = run


def unregister(run: Closable) -> None:
    with _lock:
        _LIVE.pop(run.run_id, None)


def open_runs() -> list[Closable]:
    with _lock:
        return list(_LIVE.values())


def close_all(ended_by: str, interrupted: bool = False) -> None:
    """Closes every open recording of this process; never raises."""
    for run in open_runs():
        try:
            run.close_unstopped(ended_by, interrupted)
        except Exception:  # noqa: BLE001 - one recording's failure must not keep the others open
            logger.exception("rllib_recorder: closing the recording %s failed", run.run_id)
        finally:
            unregister(run)


def _at_exit() -> None:
    why = _state["why"]
    if why is None:
        close_all("the program ended without algo.stop()")
    else:
        close_all(why, interrupted=True)


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    import ray

    atexit.register(_at_exit)  # after ray's own atexit shutdown: runs before it
    previous_hook = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        if _state["why"] is None:
            _state["why"] = "KeyboardInterrupt" if issubclass(kind, KeyboardInterrupt) else \
                f"uncaught {kind.__name__}: {(str(value).splitlines() or [''])[0][:200]}"
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            _state["why"] = _state["why"] or "SIGTERM"
            if callable(previous_term):
                previous_term(signum, frame)  # ray's: sys.exit, then the atexit handlers run
            else:
                sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
    def close_first(original_shutdown: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown(*args: Any, **kwargs: Any) -> Any:
            if open_runs():
                close_all("ray.shutdown() before algo.stop()", interrupted=_state["why"] is not None)
            return original_shutdown(*args, **kwargs)
        return shutdown

    wrap_method(ray, "shutdown", close_first)
