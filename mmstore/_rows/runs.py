"""Per-run records: the image layouts a run's rows use, at ``runs/<run_id>/<fp>.json``.

A writer of text-only rows needs the run's family to refuse image-only tokens outside
spans (see :class:`.writer.RolloutWriter`). Reading it from the run's newest Parquet footers
meant listing the store, and missed the family of a run whose last steps were text-only.
So a writer records each layout its rows use once per run, before the commit that makes
those rows visible, and a writer that needs the run's family lists one small folder.

A record is ``{"run_id": ..., "fingerprint": ..., "layout": {...}}`` (the footer's layout
record), written create-if-absent: writers racing on the same run and layout write the same
bytes, and a record is never changed or removed (each process writes a record once, so a
removal behind its back would go unnoticed): a run released and written again keeps the
families it had. ``mmstore upgrade`` writes them for a format-1 store from its footers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from mmstore._storage.store import Storage

RUNS = "runs"

# (store root, run, fingerprint) already recorded by this process: one write per process.
_RECORDED: set[tuple[str, str, str]] = set()
_LOCK = threading.Lock()


def run_dir(run_id: str) -> str:
    return f"{RUNS}/{run_id}"


def record_layouts(
    storage: Storage,
    run_id: str,
    layouts: Mapping[str, dict[str, Any]],
    *,
    cached: bool = True,
) -> None:
    """Record ``layouts`` (fingerprint -> layout record) as used by ``run_id`` (once per
    process unless ``cached`` is off)."""
    for fingerprint, params in sorted(layouts.items()):
        key = (storage.root, run_id, fingerprint)
        with _LOCK:
            if cached and key in _RECORDED:
                continue
        record = {"run_id": run_id, "fingerprint": fingerprint, "layout": params}
        data = json.dumps(record, sort_keys=True).encode()
        storage.backend.write_atomic(f"{run_dir(run_id)}/{fingerprint}.json", data, replace=False)
        with _LOCK:
            _RECORDED.add(key)


def run_layouts(storage: Storage, run_id: str) -> dict[str, dict[str, Any]]:
    """The layouts ``run_id``'s rows use, by fingerprint (one listing of its folder).

    Records that do not read as one are skipped: they only ever add refusals, and a
    damaged one must not stop a writer (``verify`` reads footers, not records)."""
    found: dict[str, dict[str, Any]] = {}
    for stat in sorted(storage.backend.list(run_dir(run_id)), key=lambda s: s.path):
        if not stat.path.endswith(".json"):
            continue
        try:
            record = json.loads(storage.backend.read(stat.path))
        except (FileNotFoundError, ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("layout"), dict):
            found[str(record.get("fingerprint"))] = record["layout"]
    return found
