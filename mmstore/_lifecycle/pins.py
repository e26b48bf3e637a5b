"""Pins: what gc keeps alive however unreferenced, stored as ``pins/<name>.json``.

A pin is how something outside the latest table version holds on to data:

- :func:`pin` holds media hashes (a trainer checkpoint's pending buffer, a debug dump that
  still points into the store);
- :func:`pin_rows` holds rows: the files of one table version (all of them, or a selection
  by run and step) and every media hash they reference. A loader state names its version;
  pinning that version keeps the resume readable past gc's grace period. ``release_run``
  refuses to release rows a pin holds unless forced, and gc never deletes a pinned file.

A pin protects from every gc that starts after it is written; it cannot bring back bytes
that are already gone (``verify`` reports that): :func:`pin_rows` of a version whose files
gc collected raises :class:`~mmstore.errors.TableVersionError` saying so, and
:func:`readable_versions` lists the versions that still read whole.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mmstore._format.models import ImageRef, MediaRef, VideoRef
from mmstore._rows.files import HASH_RE, referenced_hashes, select_from
from mmstore._rows.snapshot import collected
from mmstore._rows.store import Store
from mmstore._rows.versions import version_files
from mmstore._storage.store import PINS
from mmstore.errors import CorruptFileError, InvalidArgumentError, NoMatchError

PIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PIN_FORMAT = "mmstore.pin"
# 2 adds the rows a pin holds (``table_version``, ``files``); a version-1 pin holds media.
PIN_VERSION = 2
PIN_VERSIONS = (1, 2)


@dataclass(frozen=True)
class PinRecord:
    """One pin: the media hashes it holds, and the files of the table version it holds
    (``table_version`` None and no files for a pin of media only)."""

    name: str
    hashes: frozenset[str]
    table_version: int | None = None
    files: frozenset[str] = frozenset()


def pin_path(name: str) -> str:
    if not isinstance(name, str) or not PIN_NAME.match(name):
        raise InvalidArgumentError(
            f"pin name {name!r} must match {PIN_NAME.pattern} (it names a file)"
        )
    return f"{PINS}/{name}.json"


def pin(store: Store, name: str, refs: Iterable[ImageRef | MediaRef | VideoRef | str]) -> str:
    """Keep the media of ``refs`` (image or video refs, or bare hashes) alive; return the
    pin's store path.

    Writing a pin of an existing name replaces it atomically.
    """
    return _write_pin(store, name, {_hash_of(ref, name) for ref in refs})


def _write_pin(
    store: Store,
    name: str,
    hashes: set[str],
    table_version: int | None = None,
    files: Iterable[str] = (),
) -> str:
    rel = pin_path(name)
    doc: dict[str, Any] = {
        "format": PIN_FORMAT,
        "version": PIN_VERSION,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hashes": sorted(hashes),
    }
    if table_version is not None:
        doc["table_version"] = table_version
        doc["files"] = sorted(files)
    store.backend.write_atomic(rel, json.dumps(doc, indent=0).encode())
    return rel


def pin_rows(
    store: Store,
    name: str,
    runs: str | Iterable[str] | None = None,
    steps: int | range | Iterable[int] | None = None,
    *,
    version: int | None = None,
) -> str:
    """Hold the selected rows of table ``version`` (None: the latest): their files and every
    media hash they reference stay until :func:`unpin` (e.g. the version a checkpoint's
    loader state reads: ``version=loader.state_dict()["table_version"]``)."""
    pin_path(name)
    table = version_files(store, version)
    files = select_from(table, runs, steps, root=store.root)
    if not files:
        raise NoMatchError(f"no committed rollout files match runs={runs!r}, steps={steps!r}")
    paths = [f.path for f in files]
    for path in paths:  # a pin of rows gc has collected would hold nothing
        if store.backend.stat(path) is None:
            raise collected(store, table.version, path) or CorruptFileError(
                f"a file of version {table.version} is missing, yet the version still lists it",
                file=path,
                version=table.version,
            )
    hashes = referenced_hashes(store, paths, progress=False)
    return _write_pin(store, name, hashes, table.version, paths)


def readable_versions(store: Store) -> list[int]:
    """The table versions that still read whole, oldest first: those whose every file is
    still there (gc collects a version's files once a later commit removed them and the
    grace period passed, unless a pin holds them) and whose log entry is not cleaned up.
    Reads the log's entries back from the latest and lists ``rollouts/`` once."""
    store.check_log()
    table = store.table
    latest = version_files(store)
    there = {f.path for f in store.listed_rollout_files()}
    first = table.first_version()
    current = {f.path for f in latest.files}
    missing = current - there
    readable = []
    version = latest.version
    while True:
        if not missing:
            readable.append(version)
        if version <= first:
            break
        entry = table.log_entry(version, check_cleaned=False)
        if entry is None:
            break
        for file in entry.added:  # version - 1 lists what this one lists, but these
            current.discard(file.path)
            missing.discard(file.path)
        for path in entry.removed:  # and these
            current.add(path)
            if path not in there:
                missing.add(path)
        version -= 1
    return readable[::-1]


def unpin(store: Store, name: str) -> None:
    """Remove a pin; its media becomes collectable unless something else references it."""
    rel = pin_path(name)
    if store.backend.stat(rel) is None:
        raise NoMatchError(f"no pin named {name!r}", file=rel)
    store.backend.delete(rel)


def list_pins(store: Store) -> dict[str, int]:
    """Pin name -> number of hashes it keeps alive."""
    return {name: len(hashes) for name, hashes in read_pins(store).items()}


def pinned_hashes(store: Store) -> set[str]:
    """The union of every pin (gc's second set of roots)."""
    return set().union(*read_pins(store).values())


def read_pins(store: Store) -> dict[str, set[str]]:
    """Every pin's hashes by name; an unreadable pin raises (gc must not guess what it keeps)."""
    return {name: set(record.hashes) for name, record in read_pin_records(store).items()}


def read_pin_records(store: Store) -> dict[str, PinRecord]:
    """Every pin by name; an unreadable pin raises (gc must not guess what it keeps)."""
    pins = {}
    for stat in sorted(store.backend.list(PINS), key=lambda s: s.path):
        if not stat.path.endswith(".json"):
            continue
        name = stat.path[len(PINS) + 1 : -len(".json")]
        try:
            doc = json.loads(store.backend.read(stat.path))
        except FileNotFoundError:  # unpinned while we listed
            continue
        except (ValueError, RecursionError):  # RecursionError: forged, deeply nested JSON
            raise CorruptFileError("pin file is not JSON", file=stat.path) from None
        pins[name] = _pin_record(name, doc, stat.path)
    return pins


def _pin_record(name: str, doc: Any, rel: str) -> PinRecord:
    hashes = doc.get("hashes") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != PIN_FORMAT
        or doc.get("version") not in PIN_VERSIONS
        or not isinstance(hashes, list)
        or not all(isinstance(h, str) and HASH_RE.match(h) for h in hashes)
    ):
        raise CorruptFileError(
            f"not a {PIN_FORMAT} v{PIN_VERSION} file with a list of hashes", file=rel
        )
    version, files = doc.get("table_version"), doc.get("files", [])
    if version is not None and (
        isinstance(version, bool)
        or not isinstance(version, int)
        or version < 0
        or not isinstance(files, list)
        or not all(isinstance(f, str) for f in files)
    ):
        raise CorruptFileError(
            "pin's table_version is not an int >= 0 with a list of files", file=rel
        )
    return PinRecord(name, frozenset(hashes), version, frozenset(files))


def _hash_of(ref: ImageRef | MediaRef | VideoRef | str, name: str) -> str:
    digest = ref if isinstance(ref, str) else getattr(ref, "hash", None)
    if not isinstance(digest, str) or not HASH_RE.match(digest):
        raise InvalidArgumentError(
            f"pin {name!r}: expected an ImageRef, VideoRef, MediaRef or 32-hex-digit hash, "
            f"got {ref!r}"
        )
    return digest
