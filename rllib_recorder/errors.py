"""The RecorderError family: every error the library raises on purpose."""


class RecorderError(Exception):
    """Base class for every error rllib_recorder raises on purpose."""


class ConfigError(RecorderError, ValueError):
    """A recorder setting is invalid; the message names the field, the value and the fix."""


class ConfigProblems(ConfigError):
    """Several problems in one file, each one line with its fix (``problems``), listed at once."""

    def __init__(self, headline: str, problems: list[str]) -> None:
        super().__init__(f"{headline}:\n" + "\n".join(f"  - {p}" for p in problems))
        self.headline, self.problems = headline, problems


class OutputDirError(RecorderError, OSError):
    """The output directory cannot be used (unwritable, or it holds another run)."""


class SchemaError(RecorderError):
    """A file does not follow the rllib_recorder format, or has an unknown schema version."""


class ConversionError(RecorderError):
    """Sampled data could not be converted into a columnar chunk."""


class WriterError(RecorderError):
    """A writer actor failed to store a chunk."""


class ReplayError(RecorderError):
    """A recorded episode cannot be re-simulated (no start state, or an env that does not fit)."""


class ExportError(RecorderError):
    """A run cannot be exported to the asked format."""


class GatherError(RecorderError):
    """A run cannot be gathered into one directory (a node is gone, the target holds another run, ...)."""
