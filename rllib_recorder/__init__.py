"""rllib_recorder: keep every experience RLlib's env runners sample, in per-runner HDF5 files."""

from rllib_recorder.config import RecorderConfig  # noqa: E402
from rllib_recorder.errors import (  # noqa: E402
    ConfigError,
    ConversionError,
    ExportError,
    GatherError,
    OutputDirError,
    RecorderError,
    ReplayError,
    SchemaError,
    WriterError,
)
from rllib_recorder.version import __version__  # noqa: E402

__all__ = [
    "RecorderCallback",
    "RecorderConfig",
    "RecorderError",
    "ConfigError",
    "ConversionError",
    "OutputDirError",
    "SchemaError",
    "ReplayError",
    "ExportError",
    "GatherError",
    "WriterError",
    "open_run",
    "offline_input",
    "__version__",
]


def __getattr__(name: str):
    # RLlib is heavy to import: load the callback and reader only when asked for.
    if name == "RecorderCallback":
        from rllib_recorder.callback import RecorderCallback

        return RecorderCallback
    if name == "offline_input":
        from rllib_recorder.read.offline import offline_input

        return offline_input
    if name == "open_run":
        from rllib_recorder.read.run import open_run

        return open_run
    raise AttributeError(f"module 'rllib_recorder' has no attribute {name!r}")
