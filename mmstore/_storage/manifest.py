"""The store manifest, ``mmstore.json``: what makes a location a store, and of which format.

A pydantic model checks its fields strictly (``format_version: true`` is not 1); the
version is checked first, since a later format may change any other field. Unknown extra
fields are kept: a minor addition by a later mmstore does not make a store unreadable.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mmstore._format.media import HASH_ALGORITHM
from mmstore._storage.backends import Backend
from mmstore.errors import (
    NotAFileError,
    NotAStoreError,
    SchemaVersionError,
    UpgradeRequiredError,
)

# 2: rollouts/ is a Delta Lake table (a commit log of the Parquet files); 1: a directory of
# renamed Parquet files, read by listing it (``mmstore upgrade`` turns a 1 into a 2 in place).
FORMAT_VERSION = 2
FORMAT_V1 = 1
MANIFEST = "mmstore.json"
# A real manifest is a few hundred bytes; anything far larger is not one.
MAX_MANIFEST_BYTES = 1 << 20


class Manifest(BaseModel):
    """The fields of ``mmstore.json`` (see FORMAT.md)."""

    model_config = ConfigDict(extra="allow", strict=True)

    format: Literal["mmstore"] = "mmstore"
    format_version: int
    hash_algorithm: str
    created: str | None = None  # UTC, ISO 8601, informational


def create_manifest(backend: Backend, root: str) -> dict[str, Any]:
    """Write a new manifest where there is nothing yet; return the one that is there."""
    if not backend.is_empty():
        raise NotAStoreError(
            f"{root!r} is not an empty directory and holds no {MANIFEST}; refusing to create "
            "a store over other files",
            root=root,
        )
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        hash_algorithm=HASH_ALGORITHM,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    ).model_dump()
    if backend.write_atomic(MANIFEST, json.dumps(manifest, indent=2).encode(), replace=False):
        return manifest
    # Another process created the store at the same moment: open theirs.
    return read_manifest(backend, root) or manifest


def read_manifest(backend: Backend, root: str) -> dict[str, Any] | None:
    """The manifest as a JSON object, None where there is none; NotAStoreError for anything
    that is not a small JSON object (a directory, a FIFO, megabytes or deep nesting)."""
    found = backend.stat(MANIFEST)
    if found is not None and found.size > MAX_MANIFEST_BYTES:
        raise NotAStoreError(
            f"{MANIFEST} at {root!r} is {found.size} bytes, not a manifest", root=root
        )
    try:
        raw = backend.read(MANIFEST)
    except NotAFileError:
        raise NotAStoreError(f"{MANIFEST} at {root!r} is not a regular file", root=root) from None
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise NotAStoreError(f"{MANIFEST} at {root!r} is not JSON", root=root) from None
    if not isinstance(manifest, dict):
        raise NotAStoreError(f"{MANIFEST} at {root!r} is not a JSON object", root=root)
    return manifest


def check_manifest(
    manifest: dict[str, Any], root: str, formats: tuple[int, ...] = (FORMAT_VERSION,)
) -> Manifest:
    """Refuse a manifest of a format version not in ``formats`` or another hash, or with
    malformed fields; a format-1 store is told how to upgrade."""
    version = manifest.get("format_version")
    if version == FORMAT_V1 and not isinstance(version, bool) and FORMAT_V1 not in formats:
        raise UpgradeRequiredError(
            f"the store at {root!r} has format 1 (rollouts without a commit log); this "
            f"mmstore reads format {FORMAT_VERSION}: upgrade it once, in place, with "
            f"`mmstore upgrade {root}` (or mmstore.upgrade(root)); its files are kept",
            root=root,
        )
    if version not in formats or isinstance(version, bool):
        raise SchemaVersionError(
            f"store format_version {version!r} is not supported (this mmstore reads "
            f"{FORMAT_VERSION})",
            root=root,
        )
    try:
        parsed = Manifest.model_validate(manifest)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise SchemaVersionError(f"{MANIFEST} is malformed: {problems}", root=root) from None
    if parsed.hash_algorithm != HASH_ALGORITHM:
        raise SchemaVersionError(
            f"store hashes with {parsed.hash_algorithm!r}, this mmstore with {HASH_ALGORITHM!r}",
            root=root,
        )
    return parsed
