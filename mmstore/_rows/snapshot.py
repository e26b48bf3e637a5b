"""A snapshot of a store's committed rollout files, split into row-group work units.

Only Parquet footers are read: a unit is (file, row group, row count), so any point of an
epoch can be located without reading the data before it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._exceptions import CorruptFileError, InvalidArgumentError
from mmstore._format.schema import FILE_COLUMN, META_LAYOUTS, ROW_COLUMNS, check_schema_version
from mmstore._rows.files import (
    check_value_counts,
    conform,
    distinct_leaf,
    open_rollout_file,
    partition_of,
    reading,
    select_files,
)
from mmstore._storage.backends import LocalBackend
from mmstore._storage.store import ROLLOUTS, Storage


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
    # (:func:`._materialize.wanted_elsewhere`). A hint for the node cache, never for order.
    neighbours: Neighbours = field(default=(None, None), compare=False, repr=False)


GroupRange = tuple[str, str]  # (smallest, largest) group_id of a row group
Neighbours = tuple[GroupRange | None, GroupRange | None]  # (before, after) a unit


@dataclass(frozen=True)
class Snapshot:
    """The committed files a dataset reads, frozen when it is built."""

    files: tuple[str, ...]
    units: tuple[WorkUnit, ...]

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)


def take_snapshot(
    store: Storage,
    runs: Iterable[str] | None = None,
    steps: Iterable[int] | range | None = None,
    files: Sequence[str] | None = None,
) -> Snapshot:
    """Units of the committed files selected by run and step (or exactly ``files``, which
    must each name a committed rollout file of this store: they may come from a saved
    state)."""
    if files is None:
        files = [stat.path for stat in select_files(store, runs, steps)]
    else:
        files = [committed_file(store, path) for path in files]
    units: list[WorkUnit] = []
    for path in files:
        run_id, step = partition_of(path)
        meta = read_footer(store, path)
        kept = [i for i in range(meta.num_row_groups) if meta.row_group(i).num_rows]
        ranges = [None, *(_group_range(meta.row_group(i)) for i in kept), None]
        units.extend(
            WorkUnit(
                path,
                i,
                meta.row_group(i).num_rows,
                run_id,
                step,
                neighbours=(ranges[k], ranges[k + 2]),
            )
            for k, i in enumerate(kept)
        )
    return Snapshot(tuple(files), tuple(units))


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


# rollouts/run_id=<run>/step=<step>/[...]/<name>.parquet: what Store.rollout_files lists.
_PARTITION = re.compile(r"^run_id=[A-Za-z0-9][A-Za-z0-9._-]{0,127}/step=(0|[1-9][0-9]{0,9})$")


def committed_file(store: Storage, path: Any) -> str:
    """``path`` if it names a committed rollout file of ``store``; else InvalidArgumentError.

    A loader state is data from outside: ``..``, an absolute path, ``_staging`` or a symlink
    out of the store would make the loader read rows that were never committed here.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        len(parts) < 4
        or parts[0] != ROLLOUTS
        or not _PARTITION.match("/".join(parts[1:3]))
        or not parts[-1].endswith(".parquet")
        or any(not p or p.startswith(("_", ".")) or "\\" in p for p in parts)
    ):
        raise InvalidArgumentError(
            "state names a file that is not a committed rollout file path "
            "(rollouts/run_id=…/step=…/….parquet)",
            file=repr(path)[:300],
        )
    backend = store.backend
    outside = isinstance(backend, LocalBackend) and not backend.inside(backend.abspath(path))
    if outside or backend.stat(path) is None:
        raise InvalidArgumentError(
            "state names a rollout file that is not committed in this store", file=path
        )
    return path


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


# A text-only writer reads at most this many of its run's newest footers for a layout.
RUN_LAYOUT_FILES = 8


def run_layouts(store: Storage, run_id: str) -> dict[str, dict[str, Any]]:
    """The layouts recorded by the newest committed file of ``run_id`` that records one
    (looking at its newest few files only)."""
    prefix = f"rollouts/run_id={run_id}/"
    files = [f.path for f in store.rollout_files() if f.path.startswith(prefix)]
    newest = sorted(files, key=lambda path: partition_of(path)[1], reverse=True)
    for path in newest[:RUN_LAYOUT_FILES]:
        found = recorded_layouts(store, [path])
        if found:
            return found
    return {}


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


def read_units(store: Storage, units: Sequence[WorkUnit]) -> pa.Table:
    """The rows of ``units``, in order, as one table: the loader's columns cast to the v1
    types (or :class:`CorruptFileError` naming the file), and ``_file``, each row's file."""
    tables = []
    handles: dict[str, Any] = {}
    for unit in units:
        handle = handles.get(unit.file) or handles.setdefault(
            unit.file, open_rollout_file(store, unit.file)
        )
        with reading(unit.file):
            raw = handle.read_row_group(unit.row_group, columns=ROW_COLUMNS)
        check_value_counts(handle.metadata, unit.row_group, raw, unit.file)
        table = conform(raw, ROW_COLUMNS, file=unit.file)
        files = pa.array([unit.file] * table.num_rows, pa.string())
        tables.append(table.append_column(FILE_COLUMN, files))
    return pa.concat_tables(tables, promote_options="none") if tables else pa.table({})
