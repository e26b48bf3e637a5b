"""Per-run records: the image layouts a run's rows use, at ``runs/<run_id>/<fp>.json``.

A writer of text-only rows needs the run's family to refuse image-only tokens outside
spans (see :class:`.writer.RolloutWriter`). Reading it from the run's newest Parquet footers
meant listing the store, and missed the family of a run whose last steps were text-only.
So a writer records each layout its rows use once per run, before the commit that makes
those rows visible, and a writer that needs the run's family lists one small folder.

A record is ``{"run_id": ..., "fingerprint": ..., "layout": {...}}`` (the footer's layout
record) at ``runs/<run_id>/<fingerprint>.json``: writers racing on the same run and layout
write the same bytes. Each write renews the record's timestamp (as a media put does), and a
writer process writes each of its runs' records again at most every
:data:`RENEW_SECONDS`: so a record is at most that old while a process writes its run.
``mmstore upgrade`` writes them for a format-1 store from its footers.

A record goes when nothing needs its run any more: gc deletes the records of a run that no
version something still needs lists files of, once they are older than the grace period
(:func:`stale_records`). Keep the grace period above :data:`RENEW_SECONDS` (the default,
an hour, is): a process that recorded a run less than that ago does not write its record
again, so a record deleted sooner (a run released and collected with a shorter grace, then
written again by the same process) is missing until its next renewal, and text-only rows
of that run go unchecked for the family's image-only tokens meanwhile.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from mmstore._format.columns import Column, decode, encode
from mmstore._storage.backends import FileStat
from mmstore._storage.store import Storage
from mmstore.errors import InvalidRolloutError

RUNS = "runs"
# How often (seconds) a writer process writes a run's records again (renewing them).
RENEW_SECONDS = 600.0
# A layout record's file name: the layout's fingerprint (what Layout.fingerprint gives); or
# the run's column declaration (gc collects both alike).
_RECORD_NAME = re.compile(r"^([0-9a-f]{16}|columns)\.json$")
COLUMNS_RECORD = "columns.json"

# (store root, run, fingerprint) -> when this process last wrote it (time.monotonic()).
_RECORDED: dict[tuple[str, str, str], float] = {}
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
    """Record ``layouts`` (fingerprint -> layout record) as used by ``run_id``: written (or
    renewed) and made durable, at most every :data:`RENEW_SECONDS` per process unless
    ``cached`` is off."""
    for fingerprint, params in sorted(layouts.items()):
        key = (storage.root, run_id, fingerprint)
        now = time.monotonic()
        with _LOCK:
            if cached and now - _RECORDED.get(key, -RENEW_SECONDS) < RENEW_SECONDS:
                continue
        record = {"run_id": run_id, "fingerprint": fingerprint, "layout": params}
        data = json.dumps(record, sort_keys=True).encode()
        rel = f"{run_dir(run_id)}/{fingerprint}.json"
        storage.backend.put_content(rel, data)  # the same bytes: renews the timestamp
        storage.backend.sync([rel])
        with _LOCK:
            _RECORDED[key] = now


def stale_records(
    records: Iterable[FileStat], keep_runs: set[str], cutoff: float
) -> list[FileStat]:
    """Of the files listed under ``runs/``, the layout records gc may delete: those of runs
    not in ``keep_runs`` (the runs some needed version, or a file still on storage, has
    files of) written before ``cutoff``. Other files there (a release's marker) are not
    records and never chosen."""
    stale = []
    for stat in records:
        parts = stat.path.split("/")
        if len(parts) != 3 or parts[0] != RUNS or not _RECORD_NAME.match(parts[2]):
            continue
        if parts[1] not in keep_runs and stat.mtime < cutoff:
            stale.append(stat)
    return stale


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


# -- the run's extra columns -----------------------------------------------------------------


def run_columns(storage: Storage, run_id: str) -> dict[str, Column] | None:
    """The extra columns ``run_id`` declared (its first writer with ``columns=``), or None
    if it declared none yet."""
    rel = f"{run_dir(run_id)}/{COLUMNS_RECORD}"
    raw = storage.backend.read_if_present(rel)
    if raw is None:
        return None
    return decode(raw, where={"run_id": run_id, "file": rel})


def record_columns(storage: Storage, run_id: str, columns: Mapping[str, Column]) -> None:
    """Record ``columns`` as ``run_id``'s declaration (put if absent, durable); a run that
    declared other columns meanwhile is refused (:class:`InvalidRolloutError`)."""
    rel = f"{run_dir(run_id)}/{COLUMNS_RECORD}"
    if storage.backend.write_atomic(rel, encode(columns), replace=False):
        storage.backend.sync([rel])
        return
    recorded = run_columns(storage, run_id) or {}
    if recorded != dict(columns):
        raise column_mismatch(run_id, recorded, columns)


def column_mismatch(
    run_id: str, recorded: Mapping[str, Column], given: Mapping[str, Column]
) -> InvalidRolloutError:
    differ = sorted(n for n in recorded.keys() | given.keys() if recorded.get(n) != given.get(n))
    return InvalidRolloutError(
        f"run {run_id!r} declares the columns {_listing(recorded)}, this writer "
        f"{_listing(given)}: every file of a run has the columns its first writer declared "
        "(write other columns to another run)",
        run_id=run_id,
        column=differ[0],
    )


def _listing(columns: Mapping[str, Column]) -> str:
    if not columns:
        return "none"
    return ", ".join(
        f"{n} ({c.per} {c.dtype}{list(c.shape) if c.shape else ''})" for n, c in columns.items()
    )
