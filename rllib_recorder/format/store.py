"""Durable targets: an ``output_dir`` that is a URI (``s3://``, ``gs://``, ``abfs://``, ...) or a path inside a
``pyarrow.fs.FileSystem``, with the conventions of Tune's ``storage_path``/``storage_filesystem``.

Files go to a target whole and are checked there: size, then SHA-256 of the bytes read back. A file that replaces
an older one (an index, the manifest) is written beside it and moved over it, so a reader sees the old or the new.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rllib_recorder.config import is_uri, public_uri
from rllib_recorder.errors import OutputDirError

__all__ = ["Target", "check_writable", "is_uri", "public_uri", "resolve", "uri_join"]

COPY_BYTES = 8 << 20


def uri_join(base: str, *parts: str) -> str:
    """``base`` with ``parts`` appended to its path; a query (``?endpoint_override=...``) stays at the end."""
    if not is_uri(base):
        return os.path.join(base, *parts)
    split = urlsplit(base)
    return urlunsplit(split._replace(path=posixpath.join(split.path or "/", *parts)))


@dataclass
class Target:
    """A directory on a ``pyarrow.fs.FileSystem``: where a run's sealed segments, indexes and manifest go."""

    fs: Any
    path: str  # inside ``fs``
    uri: str  # as the user named it (for messages and for readers)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def child(self, *parts: str) -> "Target":
        return Target(self.fs, self.join(*parts), uri_join(self.uri, *parts))

    def size(self, relpath: str) -> int | None:
        """Bytes of ``relpath`` at the target (None: no such file)."""
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.join(relpath))
        return None if info.type == pafs.FileType.NotFound else int(info.size)

    def put(self, local: str, relpath: str, *, replace: bool = False, check: bool = True) -> dict[str, Any]:
        """Copies the local file ``local`` to ``relpath`` and checks it there; returns its size and SHA-256.

        ``replace``: write beside and move over (for a file readers may be reading). ``check``: read it back and
        compare the SHA-256 (always: the size). Raises OSError when the target refuses or the check fails.
        """
        dest = self.join(relpath)
        parent = posixpath.dirname(dest)
        if parent:
            self.fs.create_dir(parent, recursive=True)
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}" if replace else dest
        digest, size = hashlib.sha256(), 0
        with open(local, "rb") as src, self.fs.open_output_stream(tmp) as out:
            while block := src.read(COPY_BYTES):
                digest.update(block)
                out.write(block)
                size += len(block)
        try:
            self._check(tmp, size, digest.hexdigest() if check else None)
            if replace:
                self.fs.move(tmp, dest)
        except BaseException:
            if replace:
                _quietly(self.fs.delete_file, tmp)
            raise
        return {"size": size, "sha256": digest.hexdigest()}

    def put_bytes(self, data: bytes, relpath: str) -> None:
        """Writes ``data`` to ``relpath`` (beside, then moved over it) and checks its size."""
        dest = self.join(relpath)
        self.fs.create_dir(posixpath.dirname(dest), recursive=True)
        tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self._check(tmp, len(data), None)
        self.fs.move(tmp, dest)

    def get_bytes(self, relpath: str) -> bytes:
        with self.fs.open_input_stream(self.join(relpath)) as f:
            return f.read()

    def get(self, relpath: str, local: str, size: int | None = None, sha256: str | None = None) -> None:
        """Copies ``relpath`` to the local file ``local`` (written beside, renamed when whole and checked)."""
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        tmp = f"{local}.part-{uuid.uuid4().hex[:8]}"
        digest, got = hashlib.sha256(), 0
        try:
            with self.fs.open_input_stream(self.join(relpath)) as src, open(tmp, "wb") as out:
                while block := src.read(COPY_BYTES):
                    digest.update(block)
                    out.write(block)
                    got += len(block)
            if size is not None and got != size:
                raise OSError(f"{self.uri_of(relpath)} holds {got} bytes, its index says {size}")
            if sha256 is not None and digest.hexdigest() != sha256:
                raise OSError(f"{self.uri_of(relpath)} does not match the SHA-256 its index names")
            os.replace(tmp, local)
        finally:
            _quietly(os.remove, tmp)

    def uri_of(self, relpath: str) -> str:
        return public_uri(uri_join(self.uri, relpath))

    def _check(self, path: str, size: int, sha256: str | None) -> None:
        info = self.fs.get_file_info(path)
        if int(info.size or 0) != size:
            raise OSError(f"{path}: {info.size} bytes arrived of {size} written")
        if sha256 is None:
            return
        digest = hashlib.sha256()
        with self.fs.open_input_stream(path) as f:
            while block := f.read(COPY_BYTES):
                digest.update(block)
        if digest.hexdigest() != sha256:
            raise OSError(f"{path}: the bytes read back differ from those written (SHA-256)")


def resolve(uri_or_path: str, filesystem: Any = None) -> Target:
    """The target ``uri_or_path`` names: in ``filesystem`` when given (a path inside it, as Tune's
    ``storage_filesystem``), else the file system its scheme names. Raises OutputDirError in one line."""
    try:
        if filesystem is not None:
            path = uri_or_path.split("://", 1)[1] if is_uri(uri_or_path) else uri_or_path
            return Target(filesystem, path.split("?", 1)[0].rstrip("/") or "/", uri_or_path)
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(uri_or_path)
        return Target(fs, path.rstrip("/") or "/", uri_or_path)
    except (ValueError, TypeError, OSError) as e:
        raise OutputDirError(f"cannot open {public_uri(str(uri_or_path))!r} ({_first_line(e)}); name a directory "
                             "as a URI pyarrow knows (s3://bucket/prefix, gs://..., file:///path) or pass "
                             "storage_filesystem=pyarrow.fs.S3FileSystem(...)") from None


def check_writable(target: Target) -> None:
    """Writes and removes a probe file at ``target``; a refusal is one OutputDirError naming it and the fix."""
    probe = f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        target.fs.create_dir(target.path, recursive=True)
        target.put_bytes(b"ok", probe)
        target.fs.delete_file(target.join(probe))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise OutputDirError(f"output_dir {public_uri(target.uri)!r} is not writable ({_first_line(e)}); check the "
                             "bucket, its endpoint and your credentials, or pass storage_filesystem=...") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except (OSError, FileNotFoundError):
        pass
