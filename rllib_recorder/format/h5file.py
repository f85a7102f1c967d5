"""Opening a worker file: without HDF5's locks where a writer opens it, checked for format and version, damage as one
line.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import h5py

from rllib_recorder.errors import SchemaError
from rllib_recorder.format.layout import FORMAT_NAME, check_version

# HDF5 chunk cache of each column of a file open for appending. The writer keeps its columns
# open, so only the partial last chunk of each needs to stay cached (a chunk is at most
# hdf5_chunk_bytes, 64 KiB by default); HDF5's default, 1 MiB per column, would let a file of
# ~35 columns hold ~35 MiB of old chunks in the writer's memory.
APPEND_CHUNK_CACHE_BYTES = 128 << 10


def open_h5(path: str, mode: str = "r", **kwargs: Any) -> h5py.File:
    """``h5py.File`` for every open of a worker file by this package; a writer's opens take no HDF5 file lock.

    A worker file has one writer by design, and readers coordinate with it through the file's commit record, not
    a lock: with HDF5's locks a reader could not open a file while it records, and a writer reopening its file
    (after a compaction) would fail while a reader had it open. Reads open as plain ``h5py.File`` does (so that a
    user's own ``h5py.File`` of the same file in the same process still opens) and fall back to no locking when
    the file is locked or already open here without locks.
    """
    if mode != "r":
        try:
            return h5py.File(path, mode, locking=False, **kwargs)
        except OSError as e:
            if not _lock_trouble(e):
                raise
            return h5py.File(path, mode, **kwargs)
    try:
        return h5py.File(path, mode, **kwargs)
    except OSError as e:
        if not _lock_trouble(e):
            raise
        return h5py.File(path, mode, locking=False, **kwargs)


def _lock_trouble(error: OSError) -> bool:
    text = str(error)
    return "lock" in text and ("flag values don't match" in text or "unable to lock" in text
                               or getattr(error, "errno", None) == 11)


def create_file(path: str, file_space: str = "none") -> h5py.File:
    """Creates a new HDF5 file with the file-space strategy ``file_space`` (refuses an existing one)."""
    if file_space == "none":
        # fs_persist/threshold only matter for the "fsm" and "page" strategies.
        return open_h5(path, "x", fs_strategy="none", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES)
    return open_h5(path, "x", rdcc_nbytes=APPEND_CHUNK_CACHE_BYTES)


@contextlib.contextmanager
def damaged_file_errors(
    path: str, fix: str = "run 'rllib-recorder recover' on its run directory, or remove the file"
) -> Iterator[None]:
    """Turns what h5py raises on a damaged or foreign file into a one-line SchemaError naming ``path`` and ``fix``."""
    try:
        yield
    except SchemaError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError, IndexError, AttributeError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise SchemaError(
            f"{path} is damaged or not an rllib_recorder file ({type(e).__name__}: {first}); {fix}"
        ) from None


def validate_header(h5: h5py.File, path: str) -> None:
    """Raises SchemaError if ``h5`` is not an rllib_recorder worker file of a known version."""
    if h5.attrs.get("format") != FORMAT_NAME:
        raise SchemaError(f"{path} is an HDF5 file but not an rllib_recorder worker file")
    check_version(h5.attrs.get("schema_version"), path)


# Filters a recording may come to hold that HDF5 and h5py lack: a user's h5repack of the files, or another writer.
# h5py decodes gzip, shuffle, fletcher32, scaleoffset, szip (where built) and lzf itself.
PLUGIN_FILTERS = {307: "bzip2", 32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32013: "zfp", 32015: "zstd",
                  32017: "sz", 32018: "fcidecomp", 32024: "sz3", 32026: "blosc2"}


def unavailable_filters(dataset: h5py.Dataset) -> list[int]:
    """The ids of the filters ``dataset`` is stored with that this HDF5 cannot decode (none for a virtual one)."""
    plist = dataset.id.get_create_plist()
    ids = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    missing = [i for i in ids if not h5py.h5z.filter_avail(i)]
    if missing and _load_filter_plugins():
        missing = [i for i in missing if not h5py.h5z.filter_avail(i)]
    return missing


def _load_filter_plugins() -> bool:
    """Registers hdf5plugin's filters if that package is installed (True if it was loaded now)."""
    try:
        import hdf5plugin  # noqa: F401  (registers its filters with HDF5 on import)
    except ImportError:
        return False
    return True


def filter_error(path: str, column: str, filter_id: int) -> SchemaError:
    """One line for a column whose filter this HDF5 lacks, naming the filter and the fix."""
    name = PLUGIN_FILTERS.get(filter_id, "a filter this HDF5 does not know")
    return SchemaError(f"{path}: {column} is compressed with HDF5 filter {filter_id} ({name}), which this h5py cannot "
                       "decode; pip install hdf5plugin (rllib_recorder loads it when present), or rewrite the file "
                       f"with gzip: h5repack -f GZIP=1 {path} OUT.h5")
