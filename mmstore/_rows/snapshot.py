"""A snapshot of a store's committed rollout files, split into row-group work units.

The files are those one version of the rollouts table lists (read from its log, never a
listing); only Parquet footers are read: a unit is (file, row group, row count), so any point of an
epoch can be located without reading the data before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._format.columns import Column, footer_columns
from mmstore._format.paths import partition_of
from mmstore._format.schema import FILE_COLUMN, META_LAYOUTS, ROW_COLUMNS, check_schema_version
from mmstore._rows.files import (
    check_run_id,
    check_value_counts,
    conform,
    distinct_field,
    distinct_leaf,
    media_leaf,
    open_rollout_file,
    reading,
    select_from,
    where_of_file,
    with_declared_columns,
)
from mmstore._rows.table import LogEntry, TableSnapshot
from mmstore._rows.versions import table_of, version_files
from mmstore._storage.store import Storage
from mmstore.errors import (
    CorruptFileError,
    InvalidArgumentError,
    MmstoreError,
    SchemaVersionError,
    TableVersionError,
)


@dataclass(frozen=True)
class WorkUnit:
    """One row group of one committed file: the unit of sharding and seeking."""

    file: str  # store-relative path
    row_group: int
    num_rows: int
    run_id: str
    step: int
    # The group_id range (min, max: Parquet statistics) of the row groups just before and
    # just after this one in its file; None where there is none, or no statistics. A GRPO
    # group at this unit's edge can go on over there only if its id lies in that range
    # (:func:`mmstore._loading.materialize.wanted_elsewhere`). A hint for the node cache,
    # never for order.
    neighbours: Neighbours = field(default=(None, None), compare=False, repr=False)


GroupRange = tuple[str, str]  # (smallest, largest) group_id of a row group
Neighbours = tuple[GroupRange | None, GroupRange | None]  # (before, after) a unit


@dataclass(frozen=True)
class Snapshot:
    """The committed files a dataset reads (those of table version ``version`` that its
    selection chose), frozen when it is built."""

    files: tuple[str, ...]
    units: tuple[WorkUnit, ...]
    version: int

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)


def take_snapshot(
    store: Storage,
    runs: Iterable[str] | None = None,
    steps: Iterable[int] | range | None = None,
    files: Sequence[str] | None = None,
    *,
    version: int | None = None,
) -> Snapshot:
    """Units of the files of table ``version`` (None: the latest) selected by run and step,
    or exactly ``files``, which must each be listed by that version (they may come from a
    saved state, which names its version)."""
    table = version_files(store, version)
    if files is None:
        files = [f.path for f in select_from(table, runs, steps, root=store.root)]
    else:
        files = listed_files(store, table, files)
    logged = {f.path: f for f in table.files}
    for path in files:  # every file, before any is read
        check_run_id(logged[path])
    units = []
    for path in files:
        try:
            units.extend(file_units(store, path))
        except (CorruptFileError, SchemaVersionError) as exc:
            raise unreadable(store, table.version, path, exc) from None
    return Snapshot(tuple(files), tuple(units), table.version)


def unreadable(store: Storage, version: int, path: str, exc: MmstoreError) -> MmstoreError:
    """What to raise for file ``path`` of ``version`` that failed with ``exc``: a
    :class:`TableVersionError` if gc collected it after a later commit removed it (the
    version is no longer readable), a :class:`SchemaVersionError` naming the commit and the
    way back if another engine wrote it (no mmstore footer: a compaction), else ``exc``."""
    if store.backend.stat(path) is None:
        return collected(store, version, path) or exc
    if isinstance(exc, SchemaVersionError) and _foreign(store, path):
        return _foreign_file(store, version, path)
    return exc


def collected(store: Storage, version: int, path: str) -> TableVersionError | None:
    """The error for reading ``version`` whose file ``path`` is gone, if a commit after
    ``version`` removed it (gc then collected it: the version is no longer readable); None
    if none did (the file is missing from a version that still lists it)."""
    table = table_of(store)
    try:
        removal = next((e for e in table.entries_after(version) if path in e.removed), None)
    except MmstoreError:
        return None
    if removal is None:
        return None
    when = _when(removal.timestamp_ms)
    return TableVersionError(
        f"version {version} of the rollouts table is no longer readable: version "
        f"{removal.version} removed its file{when} and gc has collected it since (after its "
        "grace period). mmstore.readable_versions(store) lists the versions that read whole; "
        "pin a version you mean to come back to (mmstore.pin_rows(store, name, version=...))",
        table=table.uri,
        version=version,
        file=path,
        removed_at=removal.version,
    )


def _when(stamp_ms: int | None) -> str:
    if stamp_ms is None:
        return ""
    return time.strftime(" at %Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp_ms / 1000))


def _foreign(store: Storage, path: str) -> bool:
    """Whether committed file ``path`` carries none of mmstore's footer keys."""
    try:
        keys = open_rollout_file(store, path).metadata.metadata or {}
    except MmstoreError:
        return False
    return not any(key.startswith(b"mmstore.") for key in keys)


def _foreign_file(store: Storage, version: int, path: str) -> SchemaVersionError:
    """The error for a committed file mmstore did not write, naming the commit that added
    it (another engine's compaction, typically) and how to undo it."""
    table = table_of(store)
    added: LogEntry | None = None
    try:
        for at in range(version, -1, -1):
            entry = table.log_entry(at)
            if entry is not None and any(f.path == path for f in entry.added):
                added = entry
                break
    except MmstoreError:  # its entry was cleaned up below a checkpoint
        pass
    if added is None:
        by, back = "", "v) of the version before it (DeltaTable(uri).history() names it"
    else:
        by = f" at version {added.version} ({added.operation or 'an unnamed commit'})"
        back = str(added.version - 1)
    return SchemaVersionError(
        f"committed file carries no mmstore footer: another engine wrote it into the table{by}"
        ". A compaction (delta-rs optimize.compact(), Spark OPTIMIZE, auto-compaction) "
        "rewrites mmstore's files without the footer the loader checks rows against, and "
        "mmstore reads only files it wrote. Undo it with deltalake.DeltaTable(uri)."
        f"restore({back}) if nothing was committed after it (a "
        "restore takes back later commits too), and turn off compaction of this table: see "
        "docs/engines.md",
        file=path,
        version=version,
        added_at=None if added is None else added.version,
        table=table.uri,
    )


def file_units(store: Storage, path: str, meta: pq.FileMetaData | None = None) -> list[WorkUnit]:
    """The work units (non-empty row groups) of committed file ``path`` (its footer
    ``meta`` if already read)."""
    run_id, step = partition_of(path)
    if meta is None:
        meta = read_footer(store, path)
    else:
        check_schema_version(meta.metadata, where=path)
    kept = [i for i in range(meta.num_row_groups) if meta.row_group(i).num_rows]
    ranges = [None, *(_group_range(meta.row_group(i)) for i in kept), None]
    return [
        WorkUnit(
            path, i, meta.row_group(i).num_rows, run_id, step, neighbours=(ranges[k], ranges[k + 2])
        )
        for k, i in enumerate(kept)
    ]


def listed_files(store: Storage, table: TableSnapshot, files: Sequence[Any]) -> list[str]:
    """``files`` if the table version lists each of them and its bytes are still there;
    else :class:`InvalidArgumentError` naming the first that is not.

    A loader state is data from outside: a path its version does not list (``..``,
    ``_staging``, a file committed elsewhere, a state edited by hand) would make the loader
    read rows that were never committed to that version.
    """
    listed = {f.path for f in table.files}
    seen: set[str] = set()
    for path in files:
        if not isinstance(path, str) or path not in listed:
            raise InvalidArgumentError(
                f"state names a file that version {table.version} of the rollouts table does "
                "not list",
                file=repr(path)[:300],
                version=table.version,
            )
        if path in seen:  # its rows would be read twice an epoch, each sample trained twice
            raise InvalidArgumentError(
                "state names the same file twice", file=path, version=table.version
            )
        seen.add(path)
        if store.backend.stat(path) is None:
            raise InvalidArgumentError(
                f"state names a file of version {table.version} whose bytes are gone (gc "
                "deleted them after the grace period: pin a version you mean to resume, "
                "mmstore.pin_rows(store, name, version=...))",
                file=path,
                version=table.version,
            )
    return list(files)


def _group_range(row_group: pq.RowGroupMetaData) -> GroupRange | None:
    """A row group's smallest and largest group_id, from its statistics; None without."""
    for j in range(row_group.num_columns):
        column = row_group.column(j)
        if column.path_in_schema != "group_id":
            continue
        stats = column.statistics
        if stats is None or not stats.has_min_max:
            return None
        low, high = stats.min, stats.max
        return (low, high) if isinstance(low, str) and isinstance(high, str) else None
    return None


def read_footer(store: Storage, path: str) -> pq.FileMetaData:
    meta = open_rollout_file(store, path).metadata
    check_schema_version(meta.metadata, where=path)
    return meta


def recorded_layouts(store: Storage, files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The layout parameters each file's footer records, by fingerprint (footers only)."""
    found: dict[str, dict[str, Any]] = {}
    for path in files:
        raw = (read_footer(store, path).metadata or {}).get(META_LAYOUTS)
        try:
            layouts = json.loads(raw or b"{}")
        except ValueError:
            raise CorruptFileError("unreadable mmstore.layouts footer entry", file=path) from None
        for fingerprint, params in layouts.items():
            found.setdefault(fingerprint, params)
    return found


def fingerprints_by_run(store: Storage, snapshot: Snapshot) -> dict[str, set[str]]:
    """Every layout fingerprint in the snapshot -> the runs using it (one leaf column read)."""
    return {
        fp: {partition_of(path)[0] for path in paths}
        for fp, paths in fingerprints_by_file(store, snapshot).items()
    }


def fingerprints_by_file(store: Storage, snapshot: Snapshot) -> dict[str, set[str]]:
    """Every layout fingerprint in the snapshot -> the files using it."""
    found: dict[str, set[str]] = {}
    for path in snapshot.files:
        for fp in distinct_leaf(store, path, "layout_fingerprint").to_pylist():
            found.setdefault(fp, set()).add(path)
    return found


def video_fingerprints_by_file(store: Storage, snapshot: Snapshot) -> dict[str, set[str]]:
    """Every video layout fingerprint in the snapshot -> the files using it (the
    ``videos[].layout_fingerprint`` leaf only; files without the column have none)."""
    found: dict[str, set[str]] = {}
    for path in snapshot.files:
        parquet = open_rollout_file(store, path)
        leaf = media_leaf(parquet, "videos", "layout_fingerprint", file=path)
        if leaf is None:
            continue
        with reading(path):
            column = parquet.read(columns=[leaf]).column("videos")
        for fp in distinct_field(column, "layout_fingerprint").to_pylist():
            found.setdefault(fp, set()).add(path)
    return found


def read_units(store: Storage, units: Sequence[WorkUnit], columns: Sequence[str] = ()) -> pa.Table:
    """The rows of ``units``, in order, as one table: the loader's columns cast to the v1
    types (or :class:`CorruptFileError` naming the file), the declared ``columns`` asked
    for (checked, see :func:`with_declared_columns`; no other column is read), and
    ``_file``, each row's file."""
    tables = []
    handles: dict[str, Any] = {}
    declared: dict[str, Column] = {}
    for unit in units:
        handle = handles.get(unit.file) or handles.setdefault(
            unit.file, open_rollout_file(store, unit.file)
        )
        names = [*ROW_COLUMNS, *columns]
        with reading(unit.file):
            # One row group, read where one core's work is (a loader worker): 1.6 against
            # 2.4 ms with Arrow's thread pool for a GRPO step's rows here.
            raw = handle.read_row_group(unit.row_group, columns=names, use_threads=False)
        check_value_counts(handle.metadata, unit.row_group, raw, unit.file)
        table = conform(raw, ROW_COLUMNS, file=unit.file)
        asked = _asked_columns(handle.metadata.metadata, columns, declared, unit.file)
        table = with_declared_columns(table, raw, asked, file=unit.file)
        files = pa.array([unit.file] * table.num_rows, pa.string())
        tables.append(table.append_column(FILE_COLUMN, files))
    if not tables:
        return pa.table({})
    joined = pa.concat_tables(tables, promote_options="none")
    return joined.replace_schema_metadata(tables[0].schema.metadata)


def _asked_columns(
    footer: dict[bytes, bytes] | None,
    names: Sequence[str],
    seen: dict[str, Column],
    file: str,
) -> dict[str, Column]:
    """The declarations of the columns ``names`` in a file's footer: each must be declared
    there, alike in every file read together (``seen``: the first declaration of each)."""
    if not names:
        return {}
    where = where_of_file(file)
    declared = footer_columns(footer, where=where)
    out = {}
    for name in names:
        column = declared.get(name)
        if column is None:
            raise InvalidArgumentError(
                f"column {name!r} was asked for, but the rows of this file have none (their "
                f"run declares {sorted(declared) or 'no columns'}): select runs that declare it",
                column=name,
                **where,
            )
        first = seen.setdefault(name, column)
        if first != column:
            raise InvalidArgumentError(
                f"column {name!r} is declared {column.record()} here and {first.record()} in "
                "another file read with it: one batch cannot hold both",
                column=name,
                **where,
            )
        out[name] = column
    return out
