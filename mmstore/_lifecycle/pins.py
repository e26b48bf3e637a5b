"""Pins: named sets of media hashes that gc keeps alive, stored as ``pins/<name>.json``.

A pin is how something outside the committed rollout files holds on to media: a trainer
checkpoint's pending buffer, a debug dump that still points into the store, the rows of a
run about to be released. It protects its media from every gc that starts after ``pin``
returns; it cannot bring back media that is already gone (``verify`` reports that).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from mmstore._exceptions import CorruptFileError, InvalidArgumentError, NoMatchError
from mmstore._format.models import ImageRef, MediaRef
from mmstore._rows.files import HASH_RE, referenced_hashes, select_files
from mmstore._rows.store import Store
from mmstore._storage.store import PINS

PIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PIN_FORMAT = "mmstore.pin"
PIN_VERSION = 1


def pin_path(name: str) -> str:
    if not isinstance(name, str) or not PIN_NAME.match(name):
        raise InvalidArgumentError(
            f"pin name {name!r} must match {PIN_NAME.pattern} (it names a file)"
        )
    return f"{PINS}/{name}.json"


def pin(store: Store, name: str, refs: Iterable[ImageRef | MediaRef | str]) -> str:
    """Keep the media of ``refs`` (refs or bare hashes) alive; return the pin's store path.

    Writing a pin of an existing name replaces it atomically.
    """
    rel = pin_path(name)
    hashes = sorted({_hash_of(ref, name) for ref in refs})
    doc = {
        "format": PIN_FORMAT,
        "version": PIN_VERSION,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hashes": hashes,
    }
    store.backend.write_atomic(rel, json.dumps(doc, indent=0).encode())
    return rel


def pin_rows(
    store: Store,
    name: str,
    runs: str | Iterable[str] | None = None,
    steps: int | range | Iterable[int] | None = None,
) -> str:
    """Pin every hash the selected committed rows reference (e.g. before releasing a run)."""
    pin_path(name)
    files = select_files(store, runs, steps)
    if not files:
        raise NoMatchError(f"no committed rollout files match runs={runs!r}, steps={steps!r}")
    return pin(store, name, referenced_hashes(store, [f.path for f in files], progress=False))


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
        pins[name] = _pin_hashes(doc, stat.path)
    return pins


def _pin_hashes(doc: Any, rel: str) -> set[str]:
    hashes = doc.get("hashes") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != PIN_FORMAT
        or doc.get("version") != PIN_VERSION
        or not isinstance(hashes, list)
        or not all(isinstance(h, str) and HASH_RE.match(h) for h in hashes)
    ):
        raise CorruptFileError(
            f"not a {PIN_FORMAT} v{PIN_VERSION} file with a list of hashes", file=rel
        )
    return set(hashes)


def _hash_of(ref: ImageRef | MediaRef | str, name: str) -> str:
    digest = ref if isinstance(ref, str) else getattr(ref, "hash", None)
    if not isinstance(digest, str) or not HASH_RE.match(digest):
        raise InvalidArgumentError(
            f"pin {name!r}: expected an ImageRef, MediaRef or 32-hex-digit hash, got {ref!r}"
        )
    return digest
