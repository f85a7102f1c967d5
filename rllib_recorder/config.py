"""RecorderConfig: the one frozen, validated settings object of a recording."""

from __future__ import annotations

import dataclasses
import difflib
import os
import reprlib
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from rllib_recorder.errors import ConfigError, OutputDirError

BACKPRESSURE_POLICIES = ("block", "drop")
COMPRESSIONS = ("gzip", "lzf", "none")


@dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """Settings of one recording; validated once, when built.

    Attributes:
        output_dir: Directory under which each run gets its own sub-directory: a local path, or a
            durable target as Tune's ``storage_path`` takes it (``s3://bucket/prefix``, ``gs://...``,
            ``abfs://...``; S3 options as URI query, e.g. ``?endpoint_override=host:port``). A target is
            written through a local staging directory, in sealed segments (docs/guide.md, "Several nodes").
        storage_filesystem: A ``pyarrow.fs.FileSystem`` that ``output_dir`` is a path in (Tune's
            ``storage_filesystem``): credentials and endpoints of your own.
        staging_dir: Where writers stage a durable target's files on each node (default: the temp dir's
            ``rllib_recorder_staging``). Set with a local ``output_dir`` on a shared file system, it
            makes that directory a durable target too.
        segment_bytes: A staged file is sealed into a segment and uploaded once it holds this many bytes...
        segment_s: ... or once it is this many seconds old: what a lost node can lose at most.
        max_upload_backlog_bytes: Sealed segments a writer keeps while the target refuses them (retried
            with backoff); past it the writer stops taking chunks and ``backpressure`` applies (0: as soon
            as one segment waits).
        stop_upload_timeout_s: How long stopping the algorithm waits for a durable target that refuses uploads
            (the store down): past it, stop returns and what is left stays staged, with one line naming the
            ``rllib-recorder recover STAGING --publish`` command that completes the run (also in the manifest's
            ``publish_pending``). A request in flight may add the store client's own timeout.
        check_uploads: Read every uploaded segment back and compare its SHA-256 before the local copy goes
            (always: its size).
        run_name: Name of the run directory; default: ``<algo>-<env>-<time>-<id>``
            (the trial name under Tune).
        num_writers: Writer actors in the pool; env runner k writes through
            writer ``k % num_writers``.
        max_backlog_bytes: Bound on each env runner's spool: bytes handed over that its writer
            has not committed yet. When full, ``backpressure`` decides.
        backpressure: ``"block"`` (the sampler waits for the writer, the time counted, at most
            ``drain_timeout_s``, and not at all once the writer's heartbeat has stopped: such a
            sample is dropped and counted) or ``"drop"`` (the new sample is dropped and counted).
        coalesce_rows: The writer commits an env runner's samples together once this many rows
            are waiting, so that small samples do not cost one HDF5 append each. ``0`` commits
            every sample on its own. (Every sample leaves the env runner at once, whatever this is.)
        coalesce_s: ... and at the latest this many seconds after the oldest waiting sample
            was sampled, whether or not another sample follows.
        coalesce_bytes: ... or once the waiting arrays reach this many bytes (images; as handed over,
            e.g. an Atari sample's uint8 newest frames, not the float32 stacks they stand for).
        compression: HDF5 filter for step columns: ``gzip``, ``lzf`` or ``none`` (a column
            whose first rows compress less than 1.25x is stored unfiltered).
        compression_level: gzip level, 0-9.
        hdf5_chunk_bytes: Target size of one HDF5 chunk of a column (at most 1024 rows).
        encode_uint8: Store float32 image columns that hold exact uint8 values scaled
            (RLlib's Atari frames: ``u8 / 128 - 1``; or ``u8 * float32(1/255)``; frames
            divided by 255 in float32 round differently and stay float32) as uint8 plus the
            scale, checked on every chunk in the env runner, which then sends the uint8
            codes (a quarter of the bytes through Ray's object store); a chunk that is not
            exact is sent as float32 and turns the column back into float32. ``False``
            stores floats as they are.
        stack_frames: Store observations that stack the latest K frames on their last axis
            (RLlib's Atari wrappers: 84x84x4), each row repeating K - 1 frames of the row
            before, as each row's newest frame plus the older frames of each fragment's first
            row: a quarter of the bytes to send, compress and store. Checked on every chunk in
            the env runner; a column whose rows do not repeat their frames is stored as full
            stacks. The reader rebuilds the stacks; plain h5py sees one frame per row (see
            docs/FORMAT.md). ``False`` stores full stacks.
        frame_delta: Store image columns of uint8 codes (Atari frames) as each row XOR the
            row before it, but for the first row of every fragment and every 128th row of one
            (schema 3.0): lossless, about half the bytes on disk, decoded by the reader (plain
            h5py: a few lines of numpy, docs/FORMAT.md), and start states of more than 1 KiB
            as the XOR of an earlier one alike. Done by the writer, not the env runner.
            ``False`` stores the frames and the start states as they are.
        record_infos: Store env infos (JSON); ``False`` drops them.
        record_extra_model_outputs: Store action log-probs, distribution inputs,
            value predictions and other extra model outputs.
        record_evaluation: Record evaluation env runners into ``eval-`` files.
        record_start_states: Capture each episode's start state (new API stack, classic
            control and ALE envs) so ``replay --check`` can re-simulate it.
        fail_on_error: Raise (and stop training) at the next train result when
            any recorder error happened; by default errors are only counted.
        fsync: ``os.fsync`` each file after each commit (survives an OS crash, not only a
            process kill; slower).
        drain_timeout_s: How long stopping the algorithm waits for env runners and writers to
            close, and the longest a blocked sampler waits.
        writer_max_restarts: Ray restarts of a crashed writer actor (-1: unlimited).
        omit_env_config_keys: Keys of the env's ``env_config`` the manifest leaves out (tokens,
            passwords, paths); the manifest keeps the rest of ``env_config`` verbatim and names the
            omitted keys in ``env_config_omitted``.
    """

    output_dir: str = "recordings"
    storage_filesystem: Any = None
    staging_dir: str | None = None
    segment_bytes: int = 64 << 20
    segment_s: float = 120.0
    max_upload_backlog_bytes: int = 4 << 30
    stop_upload_timeout_s: float = 30.0
    check_uploads: bool = True
    run_name: str | None = None
    num_writers: int = 1
    max_backlog_bytes: int = 256 << 20
    backpressure: str = "block"
    coalesce_rows: int = 4096
    coalesce_s: float = 2.0
    coalesce_bytes: int = 8 << 20
    compression: str = "gzip"
    compression_level: int = 1
    hdf5_chunk_bytes: int = 64 << 10
    encode_uint8: bool = True
    stack_frames: bool = True
    frame_delta: bool = True
    record_infos: bool = True
    record_extra_model_outputs: bool = True
    record_evaluation: bool = True
    record_start_states: bool = True
    fail_on_error: bool = False
    fsync: bool = False
    drain_timeout_s: float = 120.0
    writer_max_restarts: int = -1
    omit_env_config_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_type(self)
        keys = self.omit_env_config_keys
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            _fail("omit_env_config_keys", keys, "give a list of env_config key names, e.g. ['api_token']")
        object.__setattr__(self, "omit_env_config_keys", tuple(keys))
        _check_int(self, "num_writers", 1, "use at least one writer actor")
        _check_int(self, "max_backlog_bytes", 1 << 20, "allow at least 1 MiB (1048576) of spool per env runner")
        _check_int(self, "coalesce_rows", 0, "use 0 to send every sample at once")
        _check_int(self, "coalesce_bytes", 0, "use 0 to ignore the size of held samples")
        _check_int(self, "compression_level", 0, "gzip levels are 0-9", high=9)
        _check_int(self, "hdf5_chunk_bytes", 1024, "use at least 1024 bytes per HDF5 chunk")
        _check_int(self, "writer_max_restarts", -1, "use -1 for unlimited restarts")
        _check_choice(self, "backpressure", BACKPRESSURE_POLICIES)
        _check_choice(self, "compression", COMPRESSIONS)
        if not self.coalesce_s >= 0:  # also NaN
            _fail("coalesce_s", self.coalesce_s, "use a number of seconds >= 0")
        if not self.drain_timeout_s > 0:
            _fail("drain_timeout_s", self.drain_timeout_s, "use a number of seconds > 0")
        if not self.stop_upload_timeout_s >= 0:
            _fail("stop_upload_timeout_s", self.stop_upload_timeout_s, "use a number of seconds >= 0")
        if not str(self.output_dir).strip() or "\0" in self.output_dir:
            _fail("output_dir", self.output_dir, "name a directory, e.g. 'recordings'")
        # Relative to where the user started the program, resolved now, in the process that makes the config:
        # Tune changes a trial's working dir to its trial dir before the recorder starts in it.
        if not is_uri(self.output_dir) and self.storage_filesystem is None:  # a path in that file system as given
            object.__setattr__(self, "output_dir", absolute_output_dir(self.output_dir))
        if self.staging_dir is not None:
            object.__setattr__(self, "staging_dir", absolute_output_dir(self.staging_dir))
        _check_int(self, "segment_bytes", 1 << 20, "seal segments of at least 1 MiB (1048576)")
        _check_int(self, "max_upload_backlog_bytes", 0, "use 0 to stop taking chunks while any segment waits")
        if not self.segment_s > 0:
            _fail("segment_s", self.segment_s, "use a number of seconds > 0")
        fs = self.storage_filesystem
        if fs is not None and not all(hasattr(fs, m) for m in ("open_output_stream", "get_file_info", "move")):
            _fail("storage_filesystem", fs, "pass a pyarrow.fs.FileSystem, e.g. pyarrow.fs.S3FileSystem(...)")
        if self.run_name is not None and (not self.run_name.strip() or os.sep in self.run_name or "/" in self.run_name
                                          or "\0" in self.run_name or self.run_name in (".", "..")):
            _fail("run_name", self.run_name, "use a plain directory name without '/'")

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any] | None) -> "RecorderConfig":
        """Builds a config from a mapping (e.g. a YAML ``recorder:`` block)."""
        settings = dict(settings or {})
        if isinstance(settings.get("storage_filesystem"), str):  # a manifest names it by type only
            settings.pop("storage_filesystem")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted((k for k in settings if k not in known), key=repr)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1) if isinstance(unknown[0], str) else []
            raise ConfigError(
                f"unknown recorder setting {_short.repr(unknown[0])}; valid settings are: {', '.join(sorted(known))}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        return cls(**settings)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain, JSON-serialisable dict (a file system by its type; a URI without
        credentials)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["omit_env_config_keys"] = list(self.omit_env_config_keys)
        out["output_dir"] = public_uri(self.output_dir)
        if self.storage_filesystem is not None:
            out["storage_filesystem"] = type(self.storage_filesystem).__name__
        return out

    @property
    def durable(self) -> bool:
        """Whether files go to a durable target through staging (``output_dir`` a URI or in a given file
        system, or ``staging_dir`` set)."""
        return is_uri(self.output_dir) or self.storage_filesystem is not None or self.staging_dir is not None

    def staging_root(self) -> str:
        return self.staging_dir or os.path.join(tempfile.gettempdir(), "rllib_recorder_staging")

    def replace(self, **changes: Any) -> "RecorderConfig":
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_output_dir(self) -> str:
        """Creates ``output_dir`` if needed and proves it writable; returns its absolute path (a durable
        target: the staging root here, the target checked too)."""
        if self.durable:  # the target itself is checked by the run (format.store.check_writable)
            return self.replace(output_dir=self.staging_root(), staging_dir=None,
                                storage_filesystem=None).check_output_dir()
        path = os.path.abspath(os.path.expanduser(self.output_dir))
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
                pass
        except OSError as e:
            raise OutputDirError(
                f"output_dir {path!r} is not writable ({e.strerror or e}); "
                "choose a directory you can write to with output_dir=..."
            ) from None
        return path


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80


def _fail(field: str, value: Any, fix: str) -> None:
    raise ConfigError(f"invalid recorder setting {field}={_short.repr(value)}: {fix}")


def absolute_output_dir(path: str) -> str:
    """``path`` made absolute against the program's start dir (``TUNE_ORIG_WORKING_DIR`` inside a Tune trial,
    which Tune sets before it changes into the trial dir; else the current dir)."""
    path = os.path.expanduser(str(path))
    if os.path.isabs(path):
        return os.path.normpath(path)
    return os.path.normpath(os.path.join(os.environ.get("TUNE_ORIG_WORKING_DIR") or os.getcwd(), path))


def is_uri(path: Any) -> bool:
    """Whether ``path`` names a file system by scheme (``s3://bucket/prefix``); ``file://`` counts too."""
    return isinstance(path, str) and "://" in path.split("?", 1)[0]


def public_uri(uri: str) -> str:
    """``uri`` without credentials in it (``s3://key:secret@bucket`` -> ``s3://bucket``): what a manifest keeps."""
    if not is_uri(uri):
        return uri
    from urllib.parse import urlsplit, urlunsplit

    split = urlsplit(uri)
    return urlunsplit(split._replace(netloc=split.netloc.rpartition("@")[2]))


def _check_type(config: RecorderConfig) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        optional = str(f.type).endswith(" | None")
        kind = str(f.type).removesuffix(" | None")
        expected = {"int": int, "float": (int, float), "bool": bool, "str": str}.get(kind)
        if expected is None or value is None and optional:
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            _fail(f.name, value, f"expected a value of type {f.type}")


def _check_int(config: RecorderConfig, field: str, low: int, fix: str, high: int | None = None) -> None:
    value = getattr(config, field)
    if value < low or (high is not None and value > high):
        _fail(field, value, fix)


def _check_choice(config: RecorderConfig, field: str, choices: tuple[str, ...]) -> None:
    if getattr(config, field) not in choices:
        _fail(field, getattr(config, field), f"choose one of {', '.join(choices)}")
