"""Where a store's bytes live: a local directory or an S3 prefix, behind one small API.

Paths given to a backend are store-relative POSIX paths (``media/ab/cd/<hash>.png``). Each
backend also exposes a pyarrow ``FileSystem`` and the root's path in it, for dataset scans.

Atomicity: locally a file is written under ``_staging/``, fsync'd, then linked or renamed
into place (and the directories that changed are fsync'd), so a reader never sees half a
file and a crash leaves garbage only in ``_staging/``. Content-addressed media
(``put_content``) is written the same way but not fsync'd: it only needs to be durable
before a row that references it commits, so the writer's commit calls ``sync`` once for all
of them (one fsync per file and per directory, instead of three per put). On S3 one
PUT of the final key makes the object visible only once it is complete.

Failures: a store that cannot be reached, or does not answer in time, raises
:class:`NetworkError` (retryable, naming the object's ``location``), never a bare ``OSError``
and never a report of damage (:func:`network_error`, :func:`network_errors`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

import pyarrow.fs as pafs

from mmstore.errors import (
    HashMismatchError,
    MmstoreError,
    NetworkError,
    NotAFileError,
    NotAStoreError,
)

STAGING = "_staging"
# Threads that fsync a commit's media files together (see LocalBackend.sync).
SYNC_THREADS = 8


@dataclass(frozen=True)
class FileStat:
    path: str  # store-relative
    size: int
    mtime: float  # seconds since the epoch


class Backend(Protocol):
    """What a store needs of where its bytes live (a new backend implements all of it)."""

    fs: pafs.FileSystem
    base: str

    def abspath(self, rel: str) -> str: ...
    def read(self, rel: str) -> bytes: ...

    def read_if_present(self, rel: str) -> bytes | None:
        """``rel``'s bytes, or None where it does not exist: what a poll of the log asks, in
        one request where the storage allows."""
        ...

    def write_atomic(
        self, rel: str, data: bytes, *, replace: bool = True, durable: bool = True
    ) -> bool: ...
    def put_content(self, rel: str, data: bytes) -> None: ...
    def sync(self, rels: Iterable[str]) -> None: ...
    def stat(self, rel: str) -> FileStat | None: ...
    def list(self, rel: str) -> list[FileStat]: ...
    def delete(self, rel: str) -> None: ...
    def delete_tree(self, rel: str) -> None: ...
    def is_empty(self) -> bool: ...

    # The rollouts table's log: whether ``write_atomic(..., replace=False)`` is an atomic
    # put-if-absent here (then mmstore writes the log's commits itself, see
    # mmstore._rows.log), and where delta-rs finds the table at ``rel`` (its URI and
    # storage options).
    @property
    def puts_if_absent(self) -> bool: ...
    def delta_location(self, rel: str) -> tuple[str, dict[str, str] | None]: ...


class LocalBackend:
    def __init__(self, root: str) -> None:
        self.base = os.path.realpath(os.path.abspath(os.path.expanduser(root)))
        self.fs = pafs.LocalFileSystem()

    def abspath(self, rel: str) -> str:
        return os.path.join(self.base, *rel.split("/")) if rel else self.base

    def read(self, rel: str) -> bytes:
        """The file's bytes. Anything but a regular file (a FIFO, a device, a directory)
        raises :class:`NotAFileError` without blocking."""
        with _open_regular(self.abspath(rel)) as f:
            return f.read()

    def read_if_present(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except FileNotFoundError:
            return None

    def write_atomic(
        self, rel: str, data: bytes, *, replace: bool = True, durable: bool = True
    ) -> bool:
        """Write ``data`` at ``rel`` atomically; False if it existed and ``replace`` is off.

        ``durable=False`` skips every fsync: the file is still whole or absent for readers
        and after a killed process, but a power loss may lose it until :meth:`sync`.
        """
        dest = self.abspath(rel)
        if durable:
            _makedirs_durable(os.path.dirname(dest))
        else:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = self.stage(data, durable=durable)
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
        if durable:
            _fsync_path(os.path.dirname(dest))
        return True

    def put_content(self, rel: str, data: bytes) -> None:
        """Store immutable (content-addressed) bytes once; if present, renew the timestamp.

        Bytes already at ``rel`` are compared with ``data`` first: a damaged file (bit rot, a
        truncated copy) is replaced atomically with the good bytes, so rows committed after
        this put never point at bytes that fail their hash. Why compare every time: a dedup
        hit reads a file that ``data`` (the same size) already sits next to in memory, so the
        check costs one read from the page cache and a memcmp, small next to the probe and
        hash every put already does; a size check alone would miss a flipped bit.
        """
        if self._holds(rel, data) and self._renew(rel):
            return
        # Not fsync'd here: the commit of the rows that reference it syncs it (``sync``).
        if self.write_atomic(rel, data, replace=False, durable=False):
            return
        # Present after all: a concurrent put linked the same bytes first, or it is damaged.
        if self._holds(rel, data) and self._renew(rel):
            return
        try:
            self.write_atomic(rel, data, replace=True, durable=False)
        except IsADirectoryError:
            raise HashMismatchError(
                "a directory sits where these bytes belong; remove it", uri=rel
            ) from None

    def _holds(self, rel: str, data: bytes) -> bool:
        """True if a regular file with exactly ``data`` is at ``rel``."""
        try:
            with _open_regular(self.abspath(rel)) as f:
                if os.fstat(f.fileno()).st_size != len(data):
                    return False
                return f.read(len(data) + 1) == data
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _renew(self, rel: str) -> bool:
        try:
            os.utime(self.abspath(rel))
        except FileNotFoundError:
            return False
        return True

    def sync(self, rels: Iterable[str]) -> None:
        """Make the files at ``rels`` durable with the directory entries leading to them.

        Called before a commit makes rows that reference them visible, whoever wrote them: a
        dedup hit may name another writer's copy that is not yet durable, and fsync of a file
        that already is costs little. Each directory is fsync'd once, leaf to root.

        ``rels`` are store-relative paths (the store's ``resolve`` checked them), so the
        directories to sync are their parents up to the root, found from the path itself:
        a symlink check per parent (a ``realpath``: one ``lstat`` per component) cost more
        than the fsyncs.
        """
        files = sorted(set(rels))
        if len(files) > 1:
            # fsync blocks on the disk, not the CPU: issued together, the file system
            # commits them in fewer journal transactions (a third less time on ext4).
            with ThreadPoolExecutor(min(SYNC_THREADS, len(files))) as pool:
                for _ in pool.map(_fsync_path, (self.abspath(rel) for rel in files)):
                    pass
        elif files:
            _fsync_path(self.abspath(files[0]))
        dirs: set[str] = set()
        for rel in files:
            parts = rel.split("/")[:-1]
            for depth in range(len(parts), -1, -1):  # leaf directory up to the root
                directory = self.abspath("/".join(parts[:depth]))
                if directory in dirs:  # and so are all of its parents
                    break
                dirs.add(directory)
        for directory in sorted(dirs, key=len, reverse=True):
            _fsync_path(directory)

    def stage(self, data: bytes, *, durable: bool = True) -> str:
        """A staging file holding ``data`` (fsync'd if ``durable``); the caller moves or
        removes it."""
        staging = self.abspath(STAGING)
        os.makedirs(staging, exist_ok=True)
        tmp = os.path.join(staging, f"{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            # Disk full, file too large, I/O error: leave no torn file behind.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def stat(self, rel: str) -> FileStat | None:
        """Size and timestamp of the file at ``rel``; None if absent or not a file."""
        try:
            st = os.stat(self.abspath(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return FileStat(rel, st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else None

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
                if not stat.S_ISREG(st.st_mode):  # a FIFO or device is nobody's file
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
        shutil.rmtree(self.abspath(rel), ignore_errors=True)

    def is_empty(self) -> bool:
        """True where a store may be created: an absent path or an empty directory."""
        if not os.path.lexists(self.base):
            return True
        return os.path.isdir(self.base) and not os.listdir(self.base)

    def inside(self, path: str) -> bool:
        """True if ``path`` (after symlinks) lies inside the store root."""
        real = os.path.realpath(path)
        return real == self.base or real.startswith(self.base + os.sep)

    @property
    def puts_if_absent(self) -> bool:
        """Always: :meth:`write_atomic` without ``replace`` links, which never replaces."""
        return True

    def delta_location(self, rel: str) -> tuple[str, dict[str, str] | None]:
        """The table at ``rel`` for delta-rs: its local path, no storage options."""
        return self.abspath(rel), None


def _open_regular(path: str) -> io.BufferedReader:
    """``open(path, "rb")`` that never blocks and only opens regular files.

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer; the
    ``fstat`` of what was opened (not a ``stat`` of the name, which could be swapped in
    between) decides whether it is a regular file, whose reads ignore the flag.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFileError(errno.ENOENT, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _fsync_path(path: str) -> None:
    """fsync the file or directory at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: str) -> None:
    """``makedirs``, then fsync the parent of each directory it created, so that a file
    linked into a new directory survives a power loss along with its directory entries."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    if not missing:
        return
    os.makedirs(missing[0], exist_ok=True)
    for created in reversed(missing):
        _fsync_path(os.path.dirname(created))


# What says "the storage was not reached or did not answer", not "the request or the data is
# wrong": the AWS SDK's own retryable error kinds (pyarrow's S3 errors are OSErrors that name
# them: "AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 28, ..."), any
# 5xx, and the errnos of a network mount (NFS, a FUSE bucket) that lost its server.
_AWS_TRANSIENT = re.compile(
    r"AWS Error (NETWORK_CONNECTION|REQUEST_TIMEOUT|SERVICE_UNAVAILABLE|SLOW_DOWN|THROTTLING"
    r"|INTERNAL_FAILURE)\b|HTTP status 5\d\d\b"
)
_NETWORK_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ETIMEDOUT", "EHOSTUNREACH", "EHOSTDOWN", "ENETUNREACH", "ENETDOWN", "ENOLINK")
    if hasattr(errno, name)
)


def network_error(exc: BaseException, **where: Any) -> NetworkError | None:
    """``exc`` as a :class:`NetworkError` with ``where`` as its context if it says the
    storage was not reached or did not answer in time; None for anything else (a missing
    file, a refusal, damage: not worth a retry). An mmstore error is typed already: None."""
    if isinstance(exc, MmstoreError) or not isinstance(exc, OSError):
        return None
    transient = (
        isinstance(exc, ConnectionError | TimeoutError)
        or exc.errno in _NETWORK_ERRNOS
        or _AWS_TRANSIENT.search(str(exc)) is not None
    )
    if not transient:
        return None
    return NetworkError(
        f"storage unreachable or too slow (retryable): {type(exc).__name__}: {exc}", **where
    )


# What says "the storage answered and refused this caller": S3's own refusals (pyarrow's
# OSError "... AWS Error ACCESS_DENIED during GetObject operation: Access Denied"), and a
# bare 403 whose code the SDK could not read (a HEAD has no body to carry one).
_AWS_DENIED = re.compile(
    r"AWS Error (ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH"
    r"|ACCESS_DENIED_EXCEPTION)\b|HTTP status 403\b"
)


def access_denied(exc: BaseException, location: str) -> PermissionError | None:
    """``exc`` as a ``PermissionError`` (``EACCES``) naming ``location`` if the object store
    refused the caller, as a local file system's ``EACCES`` would read; None for anything
    else. Readers type it further (media: :class:`MediaPermissionError`)."""
    if isinstance(exc, PermissionError | MmstoreError) or not isinstance(exc, OSError):
        return None
    if _AWS_DENIED.search(str(exc)) is None:
        return None
    return PermissionError(errno.EACCES, f"access denied by the object store ({exc})", location)


@contextlib.contextmanager
def network_errors(**where: Any) -> Iterator[None]:
    """Inside, a network failure (:func:`network_error`) raises :class:`NetworkError` with
    ``where``; every other error passes unchanged."""
    try:
        yield
    except OSError as exc:
        typed = network_error(exc, **where)
        if typed is None:
            raise
        raise typed from None


def s3_filesystem(options: dict[str, Any] | None = None) -> pafs.S3FileSystem:
    """An S3 filesystem from explicit options, else the usual AWS environment variables.

    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` points it at any S3-protocol server (MinIO,
    Ceph, moto); ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` set the region; credentials come from
    the AWS SDK's usual chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, profiles,
    instance roles). Explicit options win over the environment.
    """
    return pafs.S3FileSystem(**s3_settings(options))


def s3_settings(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`s3_filesystem`'s options: explicit ones over the AWS environment's."""
    opts = dict(options or {})
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_override" not in opts:
        parsed = urlparse(endpoint)
        opts["endpoint_override"] = parsed.netloc or parsed.path
        opts.setdefault("scheme", parsed.scheme or "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region and "region" not in opts:
        opts["region"] = region
    # Delayed open buffers a small object and sends it as one PutObject on close, instead of
    # CreateMultipartUpload + UploadPart + Complete: one request per media file, the object
    # appears whole or not at all, and S3 emulators with incomplete multipart support (some
    # moto versions) work. Objects above the part size still go multipart, as S3 requires.
    opts.setdefault("allow_delayed_open", True)
    return opts


# pyarrow S3 options that have a boto3 twin (the rest only tune pyarrow's own client); a store
# opened with any other (a role to assume, anonymous access, a proxy) writes its log through
# delta-rs instead.
_BOTO3_TWINS = {
    "access_key": "aws_access_key_id",
    "secret_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "region": "region_name",
}
_PYARROW_ONLY = {"allow_bucket_creation", "allow_bucket_deletion", "allow_delayed_open",
                 "connect_timeout", "request_timeout", "endpoint_override", "scheme"}  # fmt: skip


def conditional_put_client(settings: dict[str, Any]) -> Any | None:
    """A boto3 S3 client for the same endpoint and credentials as ``settings`` (pyarrow's
    options), for put-if-absent (``If-None-Match: *``, which pyarrow cannot send); None
    without boto3 or for options it has no twin of."""
    if set(settings) - _PYARROW_ONLY - set(_BOTO3_TWINS):
        return None
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    kwargs = {_BOTO3_TWINS[k]: v for k, v in settings.items() if k in _BOTO3_TWINS}
    if settings.get("endpoint_override"):
        scheme = settings.get("scheme") or "https"
        kwargs["endpoint_url"] = f"{scheme}://{settings['endpoint_override']}"
    config = Config(retries={"max_attempts": 5, "mode": "standard"})
    return boto3.session.Session().client("s3", config=config, **kwargs)


def delta_s3_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """The store's ``s3_options`` (``pyarrow.fs.S3FileSystem`` keywords) as delta-rs
    (object_store) storage options, with the same environment fallbacks as
    :func:`s3_filesystem`; commits use conditional put."""
    opts = dict(options or {})
    out = {"conditional_put": "etag"}
    endpoint, scheme = opts.get("endpoint_override"), opts.get("scheme")
    if not endpoint:
        env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if env:
            parsed = urlparse(env)
            endpoint, scheme = parsed.netloc or parsed.path, scheme or parsed.scheme
    if endpoint:
        url = str(endpoint) if "://" in str(endpoint) else f"{scheme or 'https'}://{endpoint}"
        out["AWS_ENDPOINT_URL"] = url
        if url.startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    region = (
        opts.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    )
    if region:
        out["AWS_REGION"] = str(region)
    for key, name in (
        ("access_key", "AWS_ACCESS_KEY_ID"),
        ("secret_key", "AWS_SECRET_ACCESS_KEY"),
        ("session_token", "AWS_SESSION_TOKEN"),
    ):
        if opts.get(key):
            out[name] = str(opts[key])
    return out


class S3Backend:
    def __init__(self, uri: str, options: dict[str, Any] | None = None) -> None:
        parsed = urlparse(uri)
        self.base = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        self.options = dict(options or {})  # as given: delta_location translates them
        self.settings = s3_settings(options)
        self.fs = pafs.S3FileSystem(**self.settings)
        self._client: Any = None  # boto3, built on first put-if-absent (never pickled)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    @property
    def conditional_put(self) -> bool:
        """Whether :meth:`put_if_absent` is atomic here (boto3 installed, options it takes)."""
        if self._client is None:
            self._client = conditional_put_client(self.settings) or False
        return self._client is not False

    @property
    def puts_if_absent(self) -> bool:
        """With :attr:`conditional_put` only: a stat-then-put would race."""
        return self.conditional_put

    def delta_location(self, rel: str) -> tuple[str, dict[str, str] | None]:
        """The table at ``rel`` for delta-rs: its ``s3://`` URI and object_store options."""
        return f"s3://{self.abspath(rel)}", delta_s3_options(self.options)

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` unless it exists, atomically (S3's ``If-None-Match: *``): True if
        this call wrote it, False if an object was there (or a racing write won)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if not self.conditional_put:
            raise RuntimeError("put_if_absent needs boto3 (the s3 extra)")
        bucket, _, key = self.abspath(rel).partition("/")
        try:
            self._client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # 412: the object exists; 409: a racing conditional write (retry: it may not have
            # won, and a False here makes the caller read the version again and retry).
            if status in (409, 412):
                return False
            raise self._boto_error(exc, rel, "conditional put") from None
        except BotoCoreError as exc:
            raise self._boto_error(exc, rel, "conditional put") from None
        return True

    def _boto_error(self, exc: Exception, rel: str, what: str) -> Exception:
        """A boto3 failure on ``rel`` as the error mmstore raises for it."""
        from botocore.exceptions import ClientError

        location = f"s3://{self.abspath(rel)}"
        if not isinstance(exc, ClientError):  # no answer: a connection or a timeout
            return NetworkError(
                f"storage unreachable or too slow (retryable): {exc}", location=location
            )
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code")
        if code == "NoSuchBucket":
            return self._no_bucket(rel)
        if code in ("NoSuchKey", "404") or status == 404:
            return FileNotFoundError(errno.ENOENT, "no such object", location)
        if status == 403:
            return PermissionError(errno.EACCES, f"access denied ({exc})", location)
        if status is not None and status < 500 and status != 429:
            return OSError(f"{what} of {location} refused: {exc}")
        return NetworkError(f"storage did not answer (retryable): {exc}", location=location)

    def abspath(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def _no_bucket(self, rel: str) -> NotAStoreError:
        bucket = self.abspath(rel).split("/", 1)[0]
        return NotAStoreError(
            f"the bucket {bucket!r} does not exist (create it first, or check the endpoint "
            "and region)",
            bucket=bucket,
            location=f"s3://{self.abspath(rel)}",
        )

    @contextlib.contextmanager
    def _network(self, rel: str) -> Iterator[None]:
        """Network failures on ``rel`` as :class:`NetworkError` naming its location; a
        refusal (access denied) as ``PermissionError`` naming it."""
        location = f"s3://{self.abspath(rel)}"
        with network_errors(location=location):
            try:
                yield
            except OSError as exc:
                if "NO_SUCH_BUCKET" in str(exc):
                    raise self._no_bucket(rel) from None
                denied = access_denied(exc, location)
                if denied is None:
                    raise
                raise denied from None

    def read_if_present(self, rel: str) -> bytes | None:
        """``rel``'s bytes, or None where there is no such object: with boto3 one GET, whose
        404 is an answer (a failed :meth:`read` asks again with a HEAD and a LIST: three
        requests for each poll of a log entry still to come)."""
        if not self.conditional_put:
            try:
                return self.read(rel)
            except FileNotFoundError:
                return None
        try:
            return self._get(rel)
        except FileNotFoundError:
            return None

    def read(self, rel: str) -> bytes:
        with self._network(rel):
            try:
                with self.fs.open_input_stream(self.abspath(rel)) as f:
                    return bytes(f.read())
            except OSError as exc:
                # Not found, or another failure? Ask once more, unless the endpoint did not
                # answer at all or refused us: asking again would get the same.
                answered = network_error(exc) is None and access_denied(exc, "") is None
                if answered and self.stat(rel) is None:
                    raise FileNotFoundError(self.abspath(rel)) from exc
                raise

    def _get(self, rel: str) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, key = self.abspath(rel).partition("/")
        try:
            body = self._client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()
        except (BotoCoreError, ClientError) as exc:
            raise self._boto_error(exc, rel, "read") from None

    def write_atomic(
        self, rel: str, data: bytes, *, replace: bool = True, durable: bool = True
    ) -> bool:
        # One PUT: durable once it returns, whatever ``durable`` says.
        if not replace and self.conditional_put:
            return self.put_if_absent(rel, data)
        if not replace and self.stat(rel) is not None:  # racy: without boto3 only
            return False
        with self._network(rel), self.fs.open_output_stream(self.abspath(rel)) as f:
            f.write(data)
        return True

    def put_content(self, rel: str, data: bytes) -> None:
        # One PUT either way. S3 has no in-place timestamp renewal (and refuses a CopyObject
        # onto itself that changes no metadata, which is all pyarrow can send); rewriting the
        # identical bytes stores new content and renews LastModified of present content, in
        # one request, with no HEAD and no race between writers of the same hash.
        self.write_atomic(rel, data)

    def sync(self, rels: Iterable[str]) -> None:
        """Nothing to do: an S3 object is durable once its PUT returns."""

    def stat(self, rel: str) -> FileStat | None:
        with self._network(rel):
            info = self.fs.get_file_info(self.abspath(rel))
        if info.type != pafs.FileType.File:
            return None
        return FileStat(rel, info.size or 0, info.mtime.timestamp() if info.mtime else 0.0)

    def list(self, rel: str) -> list[FileStat]:
        selector = pafs.FileSelector(self.abspath(rel), recursive=True, allow_not_found=True)
        prefix = self.base + "/"
        with self._network(rel):
            infos = self.fs.get_file_info(selector)
        return [
            FileStat(
                info.path[len(prefix) :],
                info.size or 0,
                info.mtime.timestamp() if info.mtime else 0.0,
            )
            for info in infos
            if info.type == pafs.FileType.File
        ]

    def delete(self, rel: str) -> None:
        with self._network(rel), contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.abspath(rel))

    def delete_tree(self, rel: str) -> None:
        for item in self.list(rel):
            self.delete(item.path)

    def is_empty(self) -> bool:
        selector = pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        with self._network(""):
            return not self.fs.get_file_info(selector)
