"""A store: a manifest, content-addressed media and committed rollout files under one root.

The root is a local directory or an ``s3://bucket/prefix``; see :mod:`._backends`.
"""

from __future__ import annotations

import json
import os
import posixpath
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from PIL import Image

from ._backends import STAGING, Backend, FileStat, LocalBackend, S3Backend
from ._exceptions import (
    HashMismatchError,
    ImageDecodeError,
    MediaNotFoundError,
    NotAStoreError,
    SchemaVersionError,
    UntrustedURIError,
)
from ._media import (
    DEFAULT_MAX_PIXELS,
    EXTENSIONS,
    FORMAT_EXTENSIONS,
    HASH_ALGORITHM,
    content_hash,
    decode_rgb,
    encode_image,
    media_path,
    probe,
)
from ._models import ImageRef, MediaRef

if TYPE_CHECKING:
    from ._adapters import QwenVLAdapter
    from ._writer import RolloutWriter

FORMAT_VERSION = 1
MANIFEST = "mmstore.json"
ROLLOUTS = "rollouts"
MEDIA = "media"
PINS = "pins"


class Store:
    """A rollout store. Open with :meth:`Store.open`; safe to pickle into DataLoader workers."""

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
        self._external: dict[str, Backend] = {}

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        create: bool = False,
        *,
        trusted_roots: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> Store:
        """Open the store at ``root`` (a path or ``s3://bucket/prefix``).

        ``create=True`` makes a new store where there is none (an empty or absent location).
        ``trusted_roots`` lists the ``file://`` / ``s3://`` prefixes that absolute media URIs
        may point into. ``s3_options`` go to ``pyarrow.fs.S3FileSystem``.
        """
        root = os.fspath(root)
        backend: Backend
        if root.startswith("s3://"):
            backend = S3Backend(root, s3_options)
        elif "://" in root and not root.startswith("file://"):
            raise NotAStoreError(f"unsupported store location scheme in {root!r}", root=root)
        else:
            backend = LocalBackend(unquote(urlparse(root).path) if "://" in root else root)
        raw = _read_manifest(backend, root)
        if raw is None:
            if not create:
                raise NotAStoreError(
                    f"no mmstore store at {root!r} (no {MANIFEST}); pass create=True to make one",
                    root=root,
                )
            if not backend.is_empty():
                raise NotAStoreError(
                    f"{root!r} is not empty and holds no {MANIFEST}; refusing to create a store "
                    "over other files",
                    root=root,
                )
            raw = {
                "format": "mmstore",
                "format_version": FORMAT_VERSION,
                "hash_algorithm": HASH_ALGORITHM,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            backend.write_atomic(MANIFEST, json.dumps(raw, indent=2).encode())
        _check_manifest(raw, root)
        return cls(
            root,
            backend,
            raw,
            trusted_roots=trusted_roots,
            s3_options=s3_options,
            max_image_pixels=max_image_pixels,
        )

    # -- media ---------------------------------------------------------------------------

    def put_media(self, data: bytes, ext: str = "png") -> MediaRef:
        """Store encoded image bytes once, by content; return their ref.

        A put of bytes already present writes nothing and renews the file's timestamp, so a
        concurrent gc's grace period protects rows about to reference it.
        """
        ext = ext.lower().lstrip(".")
        if ext not in EXTENSIONS:
            raise ImageDecodeError(
                f"unsupported media extension {ext!r}; one of {sorted(EXTENSIONS)}"
            )
        fmt, width, height = probe(data, max_pixels=self.max_image_pixels)
        if ext not in FORMAT_EXTENSIONS.get(fmt, ()):
            raise ImageDecodeError(f"bytes are {fmt or 'unknown'} but ext={ext!r}")
        digest = content_hash(data)
        rel = media_path(digest, ext)
        if self.backend.stat(rel) is not None or not self.backend.write_atomic(
            rel, data, replace=False
        ):
            self.backend.touch(rel, data)
        return MediaRef(hash=digest, uri=rel, width=width, height=height, nbytes=len(data))

    def put_image(self, image: Image.Image, format: str = "png", quality: int = 95) -> MediaRef:
        """Encode (PNG: lossless, deterministic) and store a PIL image."""
        data, ext = encode_image(image, format, quality)
        return self.put_media(data, ext=ext)

    def read_media(self, uri: str, expected_hash: str) -> bytes:
        """The bytes at ``uri``, verified against ``expected_hash``."""
        backend, rel = self.resolve(uri)
        try:
            data = backend.read(rel)
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

    def media_stat(self, uri: str) -> FileStat | None:
        """Size and timestamp of the media at ``uri``, or None if absent (no hash check)."""
        backend, rel = self.resolve(uri)
        return backend.stat(rel)

    def ensure_media(self, ref: ImageRef | MediaRef, **where: Any) -> None:
        """Refuse a ref whose bytes are absent (or whose store path does not match its hash)."""
        if not posixpath.basename(ref.uri).startswith(ref.hash) and "://" not in ref.uri:
            raise HashMismatchError(
                f"store URI {ref.uri!r} does not name hash {ref.hash}", uri=ref.uri, **where
            )
        if self.media_stat(ref.uri) is None:
            raise MediaNotFoundError("referenced media is not in the store", uri=ref.uri, **where)

    # -- URIs ----------------------------------------------------------------------------

    def resolve(self, uri: str) -> tuple[Backend, str]:
        """The backend and relative path a media URI names, refusing anything untrusted."""
        if not isinstance(uri, str) or not uri:
            raise UntrustedURIError(f"media URI must be a non-empty string, got {uri!r}")
        if "://" not in uri:
            return self.backend, self._store_relative(uri)
        scheme = uri.split("://", 1)[0].lower()
        if scheme not in ("file", "s3"):
            raise UntrustedURIError(f"URI scheme {scheme!r} is never trusted", uri=uri)
        target = _normalize_root(uri)
        if ".." in target.split("/"):
            raise UntrustedURIError("URI contains '..'", uri=uri)
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

    def _store_relative(self, uri: str) -> str:
        parts = uri.split("/")
        if (
            uri.startswith("/")
            or "\\" in uri
            or parts[0] != MEDIA
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise UntrustedURIError(
                "store-relative media URIs are normalized paths under media/", uri=uri
            )
        if isinstance(self.backend, LocalBackend) and not self.backend.inside(
            self.backend.abspath(uri)
        ):
            raise UntrustedURIError("media URI leaves the store via a symlink", uri=uri)
        return uri

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
        return state

    # -- rollouts ------------------------------------------------------------------------

    def writer(
        self,
        run_id: str,
        step: int,
        *,
        adapter: QwenVLAdapter | None = None,
        row_group_size: int | None = None,
    ) -> RolloutWriter:
        """A writer whose rows become visible atomically when its ``with`` block exits."""
        from ._writer import DEFAULT_ROW_GROUP_SIZE, RolloutWriter

        return RolloutWriter(
            self,
            run_id,
            step,
            adapter=adapter,
            row_group_size=row_group_size or DEFAULT_ROW_GROUP_SIZE,
        )

    def rollout_files(self) -> list[FileStat]:
        """Committed rollout Parquet files, sorted by path (staging is never listed)."""
        files = [
            f
            for f in self.backend.list(ROLLOUTS)
            if f.path.endswith(".parquet")
            and not any(part.startswith(("_", ".")) for part in f.path.split("/"))
        ]
        return sorted(files, key=lambda f: f.path)

    def staging_files(self) -> list[FileStat]:
        return self.backend.list(STAGING)


def _normalize_root(root: str) -> str:
    """``file:///x/y`` / ``/x/y`` / ``s3://b/p`` -> canonical prefix without a trailing slash."""
    if root.startswith("s3://"):
        return "s3://" + root[len("s3://") :].strip("/")
    path = unquote(urlparse(root).path) if root.startswith("file://") else root
    if not os.path.isabs(path):
        raise UntrustedURIError(f"trusted root must be absolute, got {root!r}")
    return "file://" + os.path.realpath(path)


def _read_manifest(backend: Backend, root: str) -> dict[str, Any] | None:
    try:
        raw = backend.read(MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise NotAStoreError(f"{MANIFEST} at {root!r} is not JSON", root=root) from None
    if not isinstance(manifest, dict):
        raise NotAStoreError(f"{MANIFEST} at {root!r} is not a JSON object", root=root)
    return manifest


def _check_manifest(manifest: dict[str, Any], root: str) -> None:
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SchemaVersionError(
            f"store format version {version!r} is not supported (this mmstore reads "
            f"{FORMAT_VERSION})",
            root=root,
        )
    if manifest.get("hash_algorithm") != HASH_ALGORITHM:
        raise SchemaVersionError(
            f"store hashes with {manifest.get('hash_algorithm')!r}, this mmstore with "
            f"{HASH_ALGORITHM!r}",
            root=root,
        )
