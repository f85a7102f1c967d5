"""Optional dependencies: imported only when a feature needs them, naming the extra to install when missing."""

from __future__ import annotations

from typing import Any

from rllib_recorder.errors import ExportError


def require_extra(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"{module} is not installed; pip install 'rllib-recorder[export]'") from None
