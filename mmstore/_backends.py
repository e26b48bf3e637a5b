"""Where a store's bytes live: a local directory or an S3 prefix, behind one small API.

Paths given to a backend are store-relative POSIX paths (``media/ab/cd/<hash>.png``). Each
backend also exposes a pyarrow ``FileSystem`` and the root's path in it, for dataset scans.

Atomicity: locally a file is written under ``_staging/``, fsync'd, then linked or renamed
into place; on S3 one PUT of the final key makes the object visible only once complete.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

import pyarrow.fs as pafs

STAGING = "_staging"


@dataclass(frozen=True)
class FileStat:
    path: str  # store-relative
    size: int
    mtime: float  # seconds since the epoch


class Backend(Protocol):
    fs: pafs.FileSystem
    base: str

    def abspath(self, rel: str) -> str: ...
    def read(self, rel: str) -> bytes: ...
    def write_atomic(self, rel: str, data: bytes, *, replace: bool = True) -> bool: ...
    def touch(self, rel: str, data: bytes) -> None: ...
    def stat(self, rel: str) -> FileStat | None: ...
    def list(self, rel: str) -> list[FileStat]: ...
    def delete(self, rel: str) -> None: ...
    def delete_tree(self, rel: str) -> None: ...
    def is_empty(self) -> bool: ...


class LocalBackend:
    def __init__(self, root: str) -> None:
        self.base = os.path.realpath(os.path.abspath(os.path.expanduser(root)))
        self.fs = pafs.LocalFileSystem()

    def abspath(self, rel: str) -> str:
        return os.path.join(self.base, *rel.split("/")) if rel else self.base

    def read(self, rel: str) -> bytes:
        with open(self.abspath(rel), "rb") as f:
            return f.read()

    def write_atomic(self, rel: str, data: bytes, *, replace: bool = True) -> bool:
        """Write ``data`` at ``rel`` atomically; False if it existed and ``replace`` is off."""
        dest = self.abspath(rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = self.stage(data)
        try:
            if replace:
                os.replace(tmp, dest)
            else:
                # link() never replaces: the first of two concurrent writers wins, whole.
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(os.path.dirname(dest))
        return True

    def stage(self, data: bytes) -> str:
        """A durable staging file holding ``data``; the caller moves or removes it."""
        staging = self.abspath(STAGING)
        os.makedirs(staging, exist_ok=True)
        tmp = os.path.join(staging, f"{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def touch(self, rel: str, data: bytes) -> None:
        os.utime(self.abspath(rel))

    def stat(self, rel: str) -> FileStat | None:
        try:
            st = os.stat(self.abspath(rel))
        except FileNotFoundError:
            return None
        return FileStat(rel, st.st_size, st.st_mtime)

    def list(self, rel: str) -> list[FileStat]:
        top = self.abspath(rel)
        out = []
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed while we walked
                    continue
                out.append(
                    FileStat(
                        os.path.relpath(full, self.base).replace(os.sep, "/"),
                        st.st_size,
                        st.st_mtime,
                    )
                )
        return out

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.abspath(rel))

    def delete_tree(self, rel: str) -> None:
        import shutil

        shutil.rmtree(self.abspath(rel), ignore_errors=True)

    def is_empty(self) -> bool:
        return not os.path.isdir(self.base) or not os.listdir(self.base)

    def inside(self, path: str) -> bool:
        """True if ``path`` (after symlinks) lies inside the store root."""
        real = os.path.realpath(path)
        return real == self.base or real.startswith(self.base + os.sep)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def s3_filesystem(options: dict[str, Any] | None = None) -> pafs.S3FileSystem:
    """An S3 filesystem from explicit options, else the usual AWS environment variables.

    ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) points it at any S3-protocol server.
    """
    opts = dict(options or {})
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_override" not in opts:
        parsed = urlparse(endpoint)
        opts["endpoint_override"] = parsed.netloc or parsed.path
        opts.setdefault("scheme", parsed.scheme or "https")
    if "region" not in opts and (region := os.environ.get("AWS_DEFAULT_REGION")):
        opts["region"] = region
    # Delayed open sends a small object as one PutObject instead of a multipart upload.
    opts.setdefault("allow_delayed_open", True)
    return pafs.S3FileSystem(**opts)


class S3Backend:
    def __init__(self, uri: str, options: dict[str, Any] | None = None) -> None:
        parsed = urlparse(uri)
        self.base = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        self.fs = s3_filesystem(options)

    def abspath(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def read(self, rel: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.abspath(rel)) as f:
                return bytes(f.read())
        except OSError as exc:
            if self.stat(rel) is None:
                raise FileNotFoundError(self.abspath(rel)) from exc
            raise

    def write_atomic(self, rel: str, data: bytes, *, replace: bool = True) -> bool:
        if not replace and self.stat(rel) is not None:
            return False
        with self.fs.open_output_stream(self.abspath(rel)) as f:
            f.write(data)
        return True

    def touch(self, rel: str, data: bytes) -> None:
        # S3 cannot bump a timestamp in place; rewriting the same bytes renews LastModified.
        self.write_atomic(rel, data)

    def stat(self, rel: str) -> FileStat | None:
        info = self.fs.get_file_info(self.abspath(rel))
        if info.type != pafs.FileType.File:
            return None
        return FileStat(rel, info.size or 0, info.mtime.timestamp() if info.mtime else 0.0)

    def list(self, rel: str) -> list[FileStat]:
        selector = pafs.FileSelector(self.abspath(rel), recursive=True, allow_not_found=True)
        prefix = self.base + "/"
        return [
            FileStat(
                info.path[len(prefix) :],
                info.size or 0,
                info.mtime.timestamp() if info.mtime else 0.0,
            )
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.File
        ]

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.abspath(rel))

    def delete_tree(self, rel: str) -> None:
        for item in self.list(rel):
            self.delete(item.path)

    def is_empty(self) -> bool:
        selector = pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        return not self.fs.get_file_info(selector)
