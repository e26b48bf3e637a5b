"""A store's bytes: a manifest, content-addressed media and rollout files under one root.

The root is a local directory or an ``s3://bucket/prefix``; see :mod:`.backends`.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
from PIL import Image
from typing_extensions import Self

from mmstore._format.media import (
    DEFAULT_MAX_PIXELS,
    EXTENSIONS,
    FORMAT_EXTENSIONS,
    as_pil,
    content_hash,
    decode_rgb,
    encode_image,
    is_path,
    media_path,
    probe,
)
from mmstore._format.models import MAX_CLIP_FRAMES, ImageRef, MediaRef, VideoRef
from mmstore._format.paths import ROLLOUTS, RUN_DIR_PREFIX
from mmstore._format.video import VideoInfo, clip_mismatch, probe_video
from mmstore._storage.backends import (
    STAGING,
    Backend,
    FileStat,
    LocalBackend,
    S3Backend,
    network_error,
)
from mmstore._storage.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    check_manifest,
    create_manifest,
    read_manifest,
)
from mmstore.errors import (
    HashMismatchError,
    ImageDecodeError,
    InvalidArgumentError,
    InvalidRolloutError,
    MediaNotFoundError,
    MediaPermissionError,
    MmstoreError,
    NetworkError,
    NotAFileError,
    NotAStoreError,
    UntrustedURIError,
)

MEDIA = "media"
PINS = "pins"
# Linux's limits (limits.h): longer names fail every file call with ENAMETOOLONG.
NAME_MAX = 255
PATH_MAX = 4096
# An RFC 3986 scheme prefix; a URI without one is store-relative.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# A C0 control character (NUL, newline, ...): one regex search, not a Python loop per char
# (checked on every image of every row read).
_CONTROL = re.compile(r"[\x00-\x1f]")


class Storage:
    """A store's bytes: its manifest and content-addressed media under one root.

    :class:`mmstore.Store` adds the rows (writer, read-back); everything below the rows stage
    takes a ``Storage``. Open with :meth:`open`; safe to pickle into DataLoader workers.
    """

    def __init__(
        self,
        root: str,
        backend: Backend,
        manifest: dict[str, Any],
        *,
        trusted_roots: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.root = root
        self.backend = backend
        self.manifest = manifest
        self.trusted_roots = tuple(_normalize_root(r) for r in trusted_roots)
        self.s3_options = dict(s3_options or {})
        self.max_image_pixels = max_image_pixels
        # Whether this process's open() wrote the manifest (the store's rows stage then
        # creates the rollouts table too).
        self._external: dict[str, Backend] = {}
        self._clips: dict[str, VideoInfo] = {}  # hash -> what put_video or a probe found

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        create: bool = False,
        *,
        trusted_roots: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> Self:
        """Open the store at ``root`` (a path or ``s3://bucket/prefix``).

        ``create=True`` makes a new store where there is none (an empty or absent location).
        ``trusted_roots`` lists the ``file://`` / ``s3://`` prefixes that absolute media URIs
        may point into. ``s3_options`` go to ``pyarrow.fs.S3FileSystem``; without them the
        endpoint, region and credentials come from the usual AWS environment variables
        (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ...). Images above
        ``max_image_pixels`` are refused as decompression bombs, on put and on decode.

        Raises :class:`NotAStoreError` where there is no store (and ``create`` is off, or the
        location holds other files) and :class:`SchemaVersionError` for a store format this
        mmstore does not read (:class:`UpgradeRequiredError` for format 1).
        """
        return cls.open_format(
            root,
            create,
            (FORMAT_VERSION,),
            trusted_roots=trusted_roots,
            s3_options=s3_options,
            max_image_pixels=max_image_pixels,
        )

    @classmethod
    def open_format(
        cls,
        root: str | os.PathLike[str],
        create: bool,
        formats: tuple[int, ...],
        *,
        trusted_roots: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> Self:
        """:meth:`open`, accepting a store of any format version in ``formats`` (the
        upgrade opens format 1 this way)."""
        root = os.fspath(root)
        backend: Backend
        if root.startswith("s3://"):
            backend = S3Backend(root, s3_options)
        elif "://" in root and not root.startswith("file://"):
            raise NotAStoreError(f"unsupported store location scheme in {root!r}", root=root)
        else:
            backend = LocalBackend(_local_path(root))
        raw = read_manifest(backend, root)
        created = False
        if raw is None:
            if not create:
                raise NotAStoreError(missing_store_message(root, CREATE_REMEDY), root=root)
            raw, created = create_manifest(backend, root), True
        check_manifest(raw, root, formats)
        store = cls(
            root,
            backend,
            raw,
            trusted_roots=trusted_roots,
            s3_options=s3_options,
            max_image_pixels=max_image_pixels,
        )
        if created:
            store.initialize()
        else:
            store.check_existing()
        return store

    def initialize(self) -> None:
        """What a new store needs besides its manifest (subclasses add their parts)."""

    def check_existing(self) -> None:
        """What opening an existing store checks besides its manifest (subclasses add
        their parts)."""

    def refuse_file_at(self, folder: str) -> None:
        """Refuse a store where ``folder`` (``rollouts/_delta_log``) or one of the folders
        above it is a file: :class:`NotAStoreError` naming it. Nothing if none is."""
        parts = folder.split("/")
        for end in range(1, len(parts) + 1):
            rel = "/".join(parts[:end])
            if self.backend.stat(rel) is not None:
                raise NotAStoreError(
                    f"{rel!r} in the store at {self.root!r} is a file where the store keeps "
                    f"a folder: move it away, and put the store's {rel}/ folder back",
                    root=self.root,
                    path=rel,
                ) from None

    # -- media ---------------------------------------------------------------------------

    def put_media(self, data: bytes, ext: str = "png") -> MediaRef:
        """Store encoded image bytes once, by content; return their ref.

        The bytes must start with the header of an image of the format ``ext`` names, within
        the pixel limit; puts read headers only (a corrupt body fails when it is decoded,
        with :class:`ImageDecodeError`). A put of bytes already present writes nothing new
        and renews the file's timestamp, so gc's grace period protects rows about to
        reference it; a damaged file at that path (other bytes) is replaced with the good
        ones, locally after a byte comparison, on S3 by the PUT every put sends.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgumentError(
                f"put_media takes encoded image bytes, got {type(data).__name__}; for a path, "
                "a PIL image or an array use put_image"
            )
        data = bytes(data)
        ext = ext.lower().lstrip(".")
        if ext not in EXTENSIONS:
            raise ImageDecodeError(
                f"unsupported media extension {ext!r}; one of {sorted(EXTENSIONS)}"
            )
        fmt, width, height = probe(data, max_pixels=self.max_image_pixels)
        allowed = FORMAT_EXTENSIONS.get(fmt, ())
        if ext not in allowed:
            raise ImageDecodeError(f"bytes are {fmt or 'unknown'} but ext={ext!r}")
        digest = content_hash(data)
        rel = media_path(digest, allowed[0])
        self.backend.put_content(rel, data)
        return MediaRef(hash=digest, uri=rel, width=width, height=height, nbytes=len(data))

    def put_image(self, image: Any, format: str | None = None, quality: int = 95) -> MediaRef:
        """Store an image once, by content; return its ref.

        ``image`` is a file path (its bytes are stored as they are, unless ``format`` asks
        for a re-encode), a PIL image, a uint8 numpy array (HxW, HxWx3 or HxWx4) or a uint8
        torch tensor (CHW or HWC). In-memory images are encoded as ``format``: PNG by
        default (lossless, deterministic), ``jpeg`` (at ``quality``) or ``webp``. Anything
        else raises :class:`InvalidArgumentError` saying what to pass.
        """
        if is_path(image):
            data = self._read_image_file(os.fspath(image))
            if format is None:
                fmt, _, _ = probe(data, max_pixels=self.max_image_pixels, where=os.fspath(image))
                if fmt not in FORMAT_EXTENSIONS:
                    raise ImageDecodeError(
                        f"{fmt} files are not stored as they are; pass format='png' to re-encode",
                        uri=os.fspath(image),
                    )
                return self.put_media(data, ext=FORMAT_EXTENSIONS[fmt][0])
            image = decode_rgb(data, max_pixels=self.max_image_pixels, where=os.fspath(image))
        data, ext = encode_image(as_pil(image), format or "png", quality)
        return self.put_media(data, ext=ext)

    def put_video(self, video: Any) -> MediaRef:
        """Store a video clip once, by content; return its ref (``kind="video"``, with the
        clip's frame size, frame count and average rate).

        ``video`` is a file path or the encoded bytes, stored as they are. Accepted: MP4 and
        MOV, Matroska and WebM holding H.264, HEVC, VP8, VP9, AV1 or MPEG-4 Part 2 video
        (what the bundled FFmpeg of PyAV, the ``video`` extra, decodes); anything else raises
        :class:`ImageDecodeError` naming it. A clip over the store's pixel limit per frame or
        over ``MAX_CLIP_FRAMES`` frames is refused as a bomb from its container, before a
        frame is decoded (the first frame is decoded, to prove the clip decodes).
        """
        where = None
        if is_path(video):
            where = os.fspath(video)
            data = self._read_image_file(where)
        elif isinstance(video, bytes | bytearray | memoryview):
            data = bytes(video)
        else:
            raise InvalidArgumentError(
                f"put_video takes a file path or the clip's bytes, got {type(video).__name__}"
            )
        info = probe_video(
            data, max_pixels=self.max_image_pixels, max_frames=MAX_CLIP_FRAMES, where=where
        )
        digest = content_hash(data)
        rel = media_path(digest, info.ext)
        self.backend.put_content(rel, data)
        self._remember_clip(digest, info)
        return MediaRef(
            hash=digest,
            uri=rel,
            width=info.width,
            height=info.height,
            nbytes=len(data),
            kind="video",
            num_frames=info.num_frames,
            fps=info.fps,
        )

    def check_clip(self, ref: VideoRef, **where: Any) -> None:
        """Refuse a video ref whose size, frame count or rate is not its clip's (its span
        was laid out for another clip), with ``where`` in the error. The facts come from
        this process's ``put_video`` of the clip, else from reading and probing it once."""
        info = self._clips.get(ref.hash)
        try:
            if info is None:
                data = self.read_media(ref.uri, ref.hash)
                limit = self.max_image_pixels
                info = probe_video(
                    data, max_pixels=limit, max_frames=MAX_CLIP_FRAMES, where=ref.uri
                )
                self._remember_clip(ref.hash, info)
        except MmstoreError as exc:
            raise exc.with_context(**where) from None
        if (problem := clip_mismatch(info, ref)) is not None:
            raise InvalidRolloutError(problem, uri=ref.uri, **where)

    def _remember_clip(self, digest: str, info: VideoInfo) -> None:
        if len(self._clips) >= _CLIPS_REMEMBERED:  # a bound: forget, probe again if asked
            self._clips.clear()
        self._clips[digest] = info

    @staticmethod
    def _read_image_file(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise InvalidArgumentError(f"no image file at {path!r}") from None
        except IsADirectoryError:
            raise InvalidArgumentError(f"{path!r} is a directory, not an image file") from None

    def read_media(self, uri: str, expected_hash: str) -> bytes:
        """The bytes at ``uri``, verified against ``expected_hash``."""
        backend, rel = self.resolve(uri)
        try:
            with media_failures(uri):
                data = backend.read(rel)
        except NotAFileError:  # a FIFO, device or directory: refused without blocking
            raise MediaNotFoundError("media path is not a regular file", uri=uri) from None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise MediaNotFoundError("media file not found", uri=uri) from None
        actual = content_hash(data)
        if actual != expected_hash:
            raise HashMismatchError(
                f"media bytes hash to {actual}, expected {expected_hash}", uri=uri
            )
        return data

    def open_image(self, uri: str, expected_hash: str) -> Image.Image:
        """Verified read, then a safe RGB decode."""
        return decode_rgb(
            self.read_media(uri, expected_hash), max_pixels=self.max_image_pixels, where=uri
        )

    def sync_media(self, uris: Iterable[str]) -> None:
        """Make the store media at ``uris`` durable (a commit's referenced media; ``put_media``
        does not fsync). Media under trusted external roots is not ours to sync."""
        rels = []
        for uri in uris:
            backend, rel = self.resolve(uri)
            if backend is self.backend:
                rels.append(rel)
        try:
            self.backend.sync(rels)
        except FileNotFoundError as exc:
            raise MediaNotFoundError(
                "referenced media vanished before its rows committed", uri=exc.filename
            ) from None

    def media_stat(self, uri: str) -> FileStat | None:
        """Size and timestamp of the media at ``uri``, or None if absent (no hash check)."""
        backend, rel = self.resolve(uri)
        with media_failures(uri):
            return backend.stat(rel)

    def ensure_media(self, ref: ImageRef | MediaRef | VideoRef, **where: Any) -> None:
        """Refuse a ref whose bytes are not where it says, with ``where`` in the error.

        Store media is named by its hash and written whole, so a name check and an existence
        check prove it; media under a trusted root has no such guarantee and is read and
        hashed.
        """
        try:
            backend, rel = self.resolve(ref.uri)
            if backend is not self.backend:
                self.read_media(ref.uri, ref.hash)
                return
            if rel != media_path(ref.hash, posixpath.splitext(rel)[1][1:]):
                raise HashMismatchError(
                    f"store URI does not name hash {ref.hash} (expected "
                    f"{media_path(ref.hash, '<ext>')})",
                    uri=ref.uri,
                )
            if backend.stat(rel) is None:
                raise MediaNotFoundError("referenced media is not in the store", uri=ref.uri)
        except MmstoreError as exc:
            raise exc.with_context(**where) from None

    # -- URIs ----------------------------------------------------------------------------

    def resolve(self, uri: str) -> tuple[Backend, str]:
        """The backend and relative path a media URI names, refusing anything untrusted.

        A URI without a scheme is store-relative and must be a normalized path under
        ``media/``; ``file://`` and ``s3://`` URIs must lie under a trusted root; every other
        scheme (http, data, ftp, ...) is refused: a row never makes a reader fetch from the
        network or read outside what its owner allowed.
        """
        if not isinstance(uri, str) or not uri:
            raise UntrustedURIError(f"media URI must be a non-empty string, got {uri!r}")
        if _CONTROL.search(uri):
            raise UntrustedURIError("media URI contains control characters", uri=uri)
        match = _SCHEME.match(uri)
        if match is None:
            return self.backend, self._store_relative(uri)
        scheme = match.group(1).lower()
        if scheme == "s3":
            target = _s3_target(uri)
        elif scheme == "file":
            target = _file_target(uri)
        else:
            raise UntrustedURIError(f"URI scheme {scheme!r} is never trusted", uri=uri)
        return self._under_trusted_root(uri, target)

    def _store_relative(self, uri: str) -> str:
        if uri.startswith("/"):
            raise UntrustedURIError("absolute path; media URIs are store-relative", uri=uri)
        if "\\" in uri:
            raise UntrustedURIError("backslash in a media URI", uri=uri)
        parts = uri.split("/")
        if ".." in parts:
            raise UntrustedURIError("'..' in a media URI", uri=uri)
        if parts[0] != MEDIA or len(parts) < 2 or any(p in ("", ".") for p in parts):
            raise UntrustedURIError(
                f"store-relative media URIs are normalized paths under {MEDIA}/", uri=uri
            )
        _check_name_lengths(uri, uri)
        if isinstance(self.backend, LocalBackend) and not self.backend.inside(
            self.backend.abspath(uri)
        ):
            raise UntrustedURIError("media URI leaves the store via a symlink", uri=uri)
        return uri

    def _under_trusted_root(self, uri: str, target: str) -> tuple[Backend, str]:
        for root in self.trusted_roots:
            if not target.startswith(root + "/"):
                continue
            backend = self._external_backend(root)
            rel = target[len(root) + 1 :]
            if isinstance(backend, LocalBackend) and not backend.inside(backend.abspath(rel)):
                raise UntrustedURIError("URI leaves its trusted root via a symlink", uri=uri)
            return backend, rel
        raise UntrustedURIError(
            "absolute media URI outside every trusted root (Store.open(trusted_roots=...))",
            uri=uri,
        )

    def _external_backend(self, root: str) -> Backend:
        if root not in self._external:
            if root.startswith("s3://"):
                self._external[root] = S3Backend(root, self.s3_options)
            else:
                self._external[root] = LocalBackend(root[len("file://") :])
        return self._external[root]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_external"] = {}
        state["_clips"] = {}
        return state

    # -- rollout files -------------------------------------------------------------------

    def listed_rollout_files(self) -> list[FileStat]:
        """Every Parquet file under ``rollouts/`` (committed, removed from the table or never
        committed alike), sorted by path; the table's log and staging are never listed.

        A listing, for the lifecycle's search for orphans: what is committed is what a
        table version lists (:meth:`mmstore.Store.files`), never a listing."""
        files = [
            f
            for f in self.backend.list(ROLLOUTS)
            if f.path.endswith(".parquet")
            and not any(part.startswith(("_", ".")) for part in f.path.split("/"))
        ]
        return sorted(files, key=lambda f: f.path)

    def staging_files(self) -> list[FileStat]:
        return self.backend.list(STAGING)


# What to do where there is no store; the command line, which has no create=, says its own.
CREATE_REMEDY = "pass create=True to make one"


# Clips whose probed facts a Storage remembers (a few hundred bytes each).
_CLIPS_REMEMBERED = 4096


def missing_store_message(root: str, remedy: str) -> str:
    """No store at ``root``: point at the store's root if ``root`` lies inside one."""
    inside = enclosing_root(root)
    if inside is not None:
        return (
            f"no mmstore store at {root!r}: it looks like a folder inside the store at {inside!r}; "
            "open the store's root"
        )
    return f"no mmstore store at {root!r} (no {MANIFEST}); {remedy}"


def enclosing_root(root: str) -> str | None:
    """``ROOT`` for a path like ``ROOT/rollouts/run_id=r1`` (no I/O beyond a local check)."""
    parts = root.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if i and (part in (ROLLOUTS, MEDIA, PINS, STAGING) or part.startswith(RUN_DIR_PREFIX)):
            candidate = "/".join(parts[:i])
            local = not candidate.startswith("s3://")
            path = unquote(urlparse(candidate).path) if "://" in candidate else candidate
            if not local or os.path.isfile(os.path.join(path, MANIFEST)):
                return candidate
            return None
    return None


def _normalize_root(root: str) -> str:
    """A trusted root (``file:///x/y``, ``/x/y`` or ``s3://b/p``) as a canonical prefix
    without a trailing slash; local roots have their symlinks resolved."""
    root = os.fspath(root)
    if root.lower().startswith("s3://"):
        return _s3_target("s3://" + root[len("s3://") :].strip("/"))
    target = _file_target(root if root.lower().startswith("file://") else "file://" + root)
    return "file://" + os.path.realpath(target[len("file://") :])


def _s3_target(uri: str) -> str:
    """``s3://bucket/key`` (or a whole ``s3://bucket``) checked for path tricks."""
    bucket, slash, key = uri[len("s3://") :].partition("/")
    parts = key.split("/") if slash else []
    if not bucket or "\\" in uri or any(p in ("", ".", "..") for p in parts):
        raise UntrustedURIError("S3 URI must be s3://bucket/key with a normalized key", uri=uri)
    return f"s3://{bucket}/{key}" if slash else f"s3://{bucket}"


def _file_target(uri: str) -> str:
    """``file:///abs/path`` (or ``file://localhost/...``) checked, as ``file:///abs/path``.

    ``..`` is refused outright rather than normalized: a ref names its file directly. Symlinks
    are resolved later, against the trusted root that the path falls under.
    """
    parsed = urlsplit(uri)
    if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise UntrustedURIError("file URI must be file:///absolute/path (no host)", uri=uri)
    path = unquote(parsed.path)
    if not path.startswith("/") or "\\" in path or ".." in path.split("/"):
        raise UntrustedURIError("file URI must name a normalized absolute path", uri=uri)
    if _CONTROL.search(path):  # %00 and friends: no OS takes them in a file name
        raise UntrustedURIError("file URI encodes control characters", uri=uri)
    _check_name_lengths(path, uri)
    return "file://" + os.path.normpath(path)


def _local_path(root: str) -> str:
    """The directory a plain path or a ``file://`` URI names.

    ``file://`` goes through pyarrow's own URI parser (percent-decoding; a URI naming
    another host is refused rather than silently read from this one).
    """
    if not root.startswith("file://"):
        return root
    try:
        _, path = pafs.FileSystem.from_uri(root)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise NotAStoreError(f"unusable store location {root!r}: {exc}", root=root) from None
    return str(path)


def _check_name_lengths(path: str, uri: str) -> None:
    """Refuse a path no file system can hold (a name over NAME_MAX, the whole over PATH_MAX)
    up front, with the URI named, instead of an OSError from the first stat."""
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) >= PATH_MAX or any(len(p) > NAME_MAX for p in encoded.split(b"/")):
        raise UntrustedURIError(
            f"media path is longer than a file system allows ({NAME_MAX} bytes a name, "
            f"{PATH_MAX} in all)",
            uri=uri[:300],
        )


@contextmanager
def media_failures(uri: str) -> Iterator[None]:
    """A media read's failures that say nothing about the media, typed and naming ``uri``:
    a read this process is not allowed (:class:`MediaPermissionError`), storage that did not
    answer (:class:`NetworkError`, retryable). Anything else passes unchanged."""
    try:
        yield
    except NetworkError as exc:  # typed by the backend; the ref's URI is what rows name
        raise exc.with_context(uri=uri) from None
    except PermissionError as exc:
        raise MediaPermissionError(
            f"this process may not read the media file ({exc.strerror or exc})", uri=uri
        ) from None
    except OSError as exc:
        typed = network_error(exc, uri=uri)
        if typed is None:
            raise
        raise typed from None
