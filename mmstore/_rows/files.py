"""Media refs (images, videos) out of committed rollout files, reading only the leaf
columns asked for.

Shared by gc, pins, verify and export. A store's Parquet files name the list element
``element`` (pyarrow writes compliant nested types); other engines may use ``item``, so leaf
paths are looked up in each file's schema rather than spelled out. A path that names no
column would silently read nothing, which for gc would mean deleting live media.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from stat import S_ISREG
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mmstore._format.columns import META_COLUMNS, Column, encode, stored_column
from mmstore._format.paths import check_logged_run, partition_of
from mmstore._format.schema import OPTIONAL_COLUMNS, ROLLOUT_SCHEMA
from mmstore._progress import bar
from mmstore._rows.table import TableFile, TableSnapshot
from mmstore._rows.versions import version_files
from mmstore._storage.backends import network_error
from mmstore._storage.store import Storage
from mmstore.errors import (
    CorruptFileError,
    InvalidArgumentError,
    InvalidRolloutError,
    MmstoreError,
    NetworkError,
    RunNotFoundError,
    SchemaVersionError,
    StepNotCommittedError,
)

HASH_RE = re.compile(r"^[0-9a-f]{32}$")


# -- selecting files -----------------------------------------------------------------------


def select_files(
    store: Storage,
    runs: str | Iterable[str] | None = None,
    steps: int | range | Iterable[int] | None = None,
    *,
    version: int | None = None,
) -> list[TableFile]:
    """The files of table ``version`` (None: the latest) whose ``run_id``/``step`` match
    the selection, sorted by path; see :func:`select_from`."""
    return select_from(version_files(store, version), runs, steps, root=store.root)


def select_from(
    snapshot: TableSnapshot,
    runs: str | Iterable[str] | None = None,
    steps: int | range | Iterable[int] | None = None,
    *,
    root: str | None = None,
) -> list[TableFile]:
    """The files of ``snapshot`` whose partition matches the selection.

    A selection that names a run the version does not hold raises :class:`RunNotFoundError`;
    one that matches no file otherwise, :class:`StepNotCommittedError` (both a
    ``NoMatchError``), naming the runs and steps there are: a typo must not turn into a
    silent run over nothing.
    """
    run_set = _run_set(runs)
    step_set = _step_set(steps)
    selected = []
    held: dict[str, set[int]] = {}
    for file in snapshot.files:
        held.setdefault(file.run_id, set()).add(file.step)
        if (run_set is None or file.run_id in run_set) and (
            step_set is None or file.step in step_set
        ):
            selected.append(file)
    unknown = sorted(run_set - held.keys()) if run_set is not None else []
    if unknown or (not selected and (run_set is not None or step_set is not None)):
        chosen = " at ".join(
            part
            for part in (
                None if run_set is None else f"runs {sorted(run_set)}",
                None if step_set is None else _steps_text(step_set),
            )
            if part
        )
        why = f"no run {', '.join(map(repr, unknown))}" if unknown else "no such step"
        # A typo'd run and a step not committed yet are told apart by type: a consumer
        # polling for new steps stops on the first and waits on the second.
        error = RunNotFoundError if unknown else StepNotCommittedError
        raise error(
            f"no committed rollout files match {chosen} ({why}); version {snapshot.version} "
            f"of the store holds {holdings(held)}",
            root=root,
            version=snapshot.version,
            missing_runs=unknown or None,
        )
    return selected


def holdings(held: dict[str, set[int]], limit: int = 8) -> str:
    """``runs r1 (steps 0-3), r2 (step 5)`` for a message (the first ``limit`` runs)."""
    if not held:
        return "no rollouts"
    shown = [f"{run} ({_steps_text(held[run])})" for run in sorted(held)[:limit]]
    more = f" and {len(held) - limit} more" if len(held) > limit else ""
    return "runs " + ", ".join(shown) + more


def _steps_text(steps: range | set[int] | None) -> str:
    """``step 5``, ``steps 0-3`` or ``steps 1, 4, 9``."""
    if isinstance(steps, range) and steps.step == 1 and len(steps) > 1:
        return f"steps {steps.start}-{steps.stop - 1}"
    ordered = sorted(steps[:7] if isinstance(steps, range) else steps or ())
    if not ordered:
        return "no steps"
    if len(ordered) == 1:
        return f"step {ordered[0]}"
    if len(ordered) > 1 and ordered[-1] - ordered[0] == len(ordered) - 1:
        return f"steps {ordered[0]}-{ordered[-1]}"
    listed = ", ".join(map(str, ordered[:6]))
    return f"steps {listed}" + (", …" if len(ordered) > 6 else "")


def _run_set(runs: str | Iterable[str] | None) -> set[str] | None:
    if runs is None:
        return None
    chosen = {runs} if isinstance(runs, str) else set(runs)
    bad = [r for r in chosen if not isinstance(r, str)]
    if bad:
        raise InvalidArgumentError(f"runs must be run_id strings, got {bad[:3]!r}")
    return chosen


def _step_set(steps: int | range | Iterable[int] | None) -> range | set[int] | None:
    if steps is None or isinstance(steps, range):
        return steps
    chosen = {steps} if isinstance(steps, int) else set(steps)
    bad = [s for s in chosen if isinstance(s, bool) or not isinstance(s, int)]
    if bad:
        raise InvalidArgumentError(f"steps must be ints (or a range), got {bad[:3]!r}")
    return chosen


# -- reading refs --------------------------------------------------------------------------


def open_rollout_file(store: Storage, path: str) -> pq.ParquetFile:
    """The Parquet file at store-relative ``path``; MmstoreError naming it if unreadable.

    Every page read through it has its CRC checked (files written without checksums, by
    other engines, read as before). Read its pages inside :func:`reading` so that a corrupt
    page raises :class:`CorruptFileError` naming the file, not a bare ``OSError``.

    The footer is parsed once per file and process (:class:`_Footers`): readers open a file
    once per window or row group, and parsing a footer costs time in proportion to the
    file's row groups, so a file of many small row groups would cost its square.
    """
    with reading(path):
        full = store.backend.abspath(path)
        # Opening a FIFO for reading blocks until a writer appears: refuse anything but a
        # regular file first (stat never blocks).
        identity: tuple[int, ...] | None = None
        if isinstance(store.backend.fs, pafs.LocalFileSystem):
            st = os.stat(full)
            if not S_ISREG(st.st_mode):
                raise CorruptFileError("not a regular file", **where_of_file(path))
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        source = store.backend.fs.open_input_file(full)
        if identity is None:  # an object store: its objects are written once, whole
            identity = (int(source.size()),)
        key = (type(store.backend.fs).__name__, full)
        parquet = pq.ParquetFile(
            source, metadata=_FOOTERS.get(key, identity), page_checksum_verification=True
        )
        _FOOTERS.put(key, identity, parquet.metadata)
        return parquet


class _Footers:
    """Parsed footers of the files read last, each with what identified its file (device,
    inode, size and timestamps locally; the size of an immutable object on S3).

    A rewritten file is parsed again: its identity changed. A file modified within the file
    system's timestamp granularity of its last change could keep the identity its old footer
    was cached with, so a footer is kept only once its file is older than
    :data:`_SETTLED_S` (committed files are never rewritten; a young one is parsed each time).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[int, ...], pq.FileMetaData]] = (
            OrderedDict()
        )

    def get(self, key: tuple[str, str], identity: tuple[int, ...]) -> pq.FileMetaData | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[0] != identity:
                return None
            self._entries.move_to_end(key)
            return found[1]

    def put(self, key: tuple[str, str], identity: tuple[int, ...], meta: pq.FileMetaData) -> None:
        if len(identity) > 1 and time.time_ns() - identity[3] < _SETTLED_S * 1e9:
            return  # changed too recently to tell a later change from this one
        with self._lock:
            self._entries[key] = (identity, meta)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


# Files whose footers stay parsed per process: a DataLoader worker reads a few files at a time.
FOOTER_CACHE_FILES = 64
# Seconds after its last change before a local file's footer is kept (far above any file
# system's timestamp granularity).
_SETTLED_S = 2.0
_FOOTERS = _Footers(FOOTER_CACHE_FILES)


@contextmanager
def reading(path: str) -> Iterator[None]:
    """Turn a failed read of rollout file ``path`` (a bad page checksum, a torn page, bytes
    that are not UTF-8 in a string column) into :class:`CorruptFileError` naming it; a
    storage that did not answer says nothing about the file: :class:`NetworkError`
    (retryable), naming it too."""
    try:
        yield
    except NetworkError as exc:
        raise exc.with_context(**where_of_file(path)) from None
    except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:
        typed = network_error(exc, **where_of_file(path))
        if typed is not None:
            raise typed from None
        raise CorruptFileError(
            f"unreadable rollout file: {type(exc).__name__}: {exc}", **where_of_file(path)
        ) from None


def check_value_counts(meta: pq.FileMetaData, row_group: int, table: pa.Table, path: str) -> None:
    """Refuse a row group whose columns decoded to another number of values than the footer
    records.

    Page checksums cover page bodies, not page headers: a flipped bit in a header's value
    count makes pyarrow read fewer values and silently shorten the last list of the row
    group. The footer records each chunk's count separately; comparing costs one pass over
    the list lengths, not over the values.
    """
    expected = {name: _level_entries(table.column(name)) for name in table.column_names}
    group = meta.row_group(row_group)
    for j in range(group.num_columns):
        chunk = group.column(j)
        count = expected.get(chunk.path_in_schema.split(".")[0])
        if count is not None and count != chunk.num_values:
            raise CorruptFileError(
                f"column {chunk.path_in_schema} of row group {row_group} decodes to {count} "
                f"values, the footer records {chunk.num_values}",
                **where_of_file(path),
            )


def decode_every_page(parquet: pq.ParquetFile, path: str) -> pa.Table:
    """Every row of an opened rollout file: each page read (its CRC checked) and the Arrow
    data validated (UTF-8, offsets), each row group's value counts checked against the
    footer; :class:`CorruptFileError` naming the file otherwise."""
    tables = []
    for i in range(parquet.metadata.num_row_groups):
        with reading(path):
            table = parquet.read_row_group(i)
            table.validate(full=True)
        check_value_counts(parquet.metadata, i, table, path)
        tables.append(table)
    if not tables:
        return parquet.schema_arrow.empty_table()
    with reading(path):
        return pa.concat_tables(tables)


def check_run_id(file: TableFile) -> None:
    """Refuse a committed file whose run id (as the log records it) the writer refuses
    (``rün``, ``exp 1``, ``a%2Fb``, 129 characters: another engine wrote and committed it),
    or whose path names another run.

    Readers refuse it where they choose files, before any row is read: a loader that trained
    on it could not resume (its state would name a file no mmstore path may name).
    """
    check_logged_run(file.path, file.run_id)


def _level_entries(column: pa.ChunkedArray) -> int | None:
    """How many values Parquet writes for each leaf of a top-level column: one per row for a
    flat column, one per element (or per empty or null list) for a list of flat values or
    of flat structs; None for deeper nesting (not in the v1 schema; left unchecked)."""
    if not pa.types.is_list(column.type):
        return None if pa.types.is_nested(column.type) else len(column)
    value = column.type.value_type
    fields = (
        [value.field(k).type for k in range(value.num_fields)]
        if pa.types.is_struct(value)
        else [value]
    )
    if any(pa.types.is_nested(t) for t in fields):
        return None
    # From the offsets (a null list spans nothing, as an empty one): microseconds a chunk.
    return sum(
        int(np.maximum(np.diff(chunk.offsets.to_numpy()), 1).sum()) for chunk in column.chunks
    )


# The columns of media refs, each a list of structs with ``uri``, ``hash`` and ``nbytes``:
# whatever reads every ref a file holds (gc, pins, verify, export) reads each of them.
MEDIA_COLUMNS = ("images", "videos")


def image_leaf(parquet: pq.ParquetFile, field: str, *, file: str) -> str:
    """The column path of ``images[].<field>`` in this file (``images.list.element.hash``)."""
    leaf = media_leaf(parquet, "images", field, file=file)
    if leaf is None:  # unreachable: images is not optional; kept for the type checker
        raise SchemaVersionError(f"rollout file has no images[].{field} column", file=file)
    return leaf


def media_leaf(parquet: pq.ParquetFile, column: str, field: str, *, file: str) -> str | None:
    """The column path of ``<column>[].<field>`` in this file (``videos.list.element.hash``).

    None where the file predates an optional column (``videos``: its rows hold none); a
    file without the leaf of a column it does have, or without ``images``, is refused: a
    path that names no column would read nothing, and gc would take that for no refs.
    """
    present = False
    for i in range(parquet.metadata.num_columns):
        path: str = parquet.schema.column(i).path
        parts = path.split(".")
        present = present or parts[0] == column
        if len(parts) == 4 and parts[0] == column and parts[3] == field:
            return path
    if not present and column in OPTIONAL_COLUMNS:
        return None
    raise SchemaVersionError(f"rollout file has no {column}[].{field} column", file=file)


def distinct_leaf(store: Storage, path: str, field: str) -> pa.Array:
    """Distinct values of ``images[].<field>`` in one committed file (that leaf column only)."""
    parquet = open_rollout_file(store, path)
    with reading(path):
        column = parquet.read(columns=[image_leaf(parquet, field, file=path)]).column("images")
        return distinct_field(column, field)


def distinct_field(column: pa.ChunkedArray, field: str) -> pa.Array:
    """Distinct values of ``<field>`` over every ref of a media column (lists of structs)."""
    return pc.unique(pc.struct_field(pc.list_flatten(column), field))


def distinct_media_leaf(store: Storage, path: str, field: str) -> pa.Array:
    """Distinct values of ``<column>[].<field>`` over every media column of one committed
    file (images and videos; only those leaf columns are read)."""
    parquet = open_rollout_file(store, path)
    leaves = {
        column: leaf
        for column in MEDIA_COLUMNS
        if (leaf := media_leaf(parquet, column, field, file=path)) is not None
    }
    with reading(path):
        table = parquet.read(columns=list(leaves.values()))
        values = [
            pc.struct_field(pc.list_flatten(table.column(column)), field) for column in leaves
        ]
        chunks = [chunk for value in values for chunk in value.chunks]
        return pc.unique(pa.chunked_array(chunks, values[0].type))


def referenced_hashes(
    store: Storage, paths: Iterable[str], *, progress: bool | None = None, desc: str = "mark"
) -> set[str]:
    """Every hash the files at ``paths`` reference (images and videos)."""
    listed = bar(list(paths), desc=desc, unit="file", progress=progress)
    chunks = [_hashes_unless_removed(store, path) for path in listed]
    if not chunks:
        return set()
    return set(pc.unique(pa.chunked_array(chunks, pa.string())).to_pylist())


def _hashes_unless_removed(store: Storage, path: str) -> pa.Array:
    """A file released since it was listed references nothing any more; anything else that
    cannot be read stops the caller (gc must not guess what an unreadable file keeps)."""
    try:
        return distinct_media_leaf(store, path, "hash")
    except MmstoreError:
        if store.backend.stat(path) is None:
            return pa.array([], pa.string())
        raise


# The ref fields verify and export read of each media column.
REF_FIELDS = ("uri", "hash", "nbytes")


def read_ref_columns(parquet: pq.ParquetFile, *, file: str, column: str = "images") -> pa.Table:
    """``sample_id`` and the ``<column>[].{uri,hash,nbytes}`` leaves of a file, nothing
    else; a file written before an optional column (``videos``) reads it as nulls."""
    leaves = [media_leaf(parquet, column, f, file=file) for f in REF_FIELDS]
    present = [leaf for leaf in leaves if leaf is not None]
    with reading(file):
        table = parquet.read(columns=["sample_id", *present])
    if column in table.column_names:
        return table
    ref_type = pa.struct(
        [ROLLOUT_SCHEMA.field(column).type.value_type.field(f) for f in REF_FIELDS]
    )
    return table.append_column(column, pa.nulls(table.num_rows, pa.list_(ref_type)))


def flatten_refs(table: pa.Table, column: str = "images") -> pa.Table:
    """One row per ref of ``column``: row, ``<kind>_index`` (``image_index``,
    ``video_index``), sample_id, uri, hash, nbytes. A null list holds no refs."""
    refs = table.column(column).combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(refs), 0).to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    flat = pc.list_flatten(refs)
    return pa.table(
        {
            "row": rows,
            index_column(column): np.arange(len(rows), dtype=np.int64) - starts,
            "sample_id": pc.take(table.column("sample_id"), pa.array(rows)),
            **{f: pc.struct_field(flat, f) for f in REF_FIELDS},
        }
    )


def index_column(column: str) -> str:
    """``image_index`` for ``images``, ``video_index`` for ``videos`` (errors' context keys)."""
    return f"{column.removesuffix('s')}_index"


def media_hash(path: str) -> str | None:
    """The hash a store media path ``media/ab/cd/<hash>.<ext>`` names, else None."""
    parts = path.split("/")
    if len(parts) != 4 or parts[0] != "media":
        return None
    digest = parts[3].split(".", 1)[0]
    if not HASH_RE.match(digest) or parts[1] != digest[:2] or parts[2] != digest[2:4]:
        return None
    return digest


def where_of_file(path: str) -> dict[str, Any]:
    """``file``, ``run_id`` and ``step`` of a rollout file, as far as its path tells."""
    try:
        run_id, step = partition_of(path)
    except MmstoreError:
        return {"file": path, "run_id": None, "step": None}
    return {"file": path, "run_id": run_id, "step": step}


def conform(table: pa.Table, columns: Sequence[str], *, file: str) -> pa.Table:
    """``columns`` of ``table`` with the v1 Arrow types: a compatible file (int64 tokens,
    large strings, reordered ref fields) is cast, an incompatible one refused naming it."""
    arrays = []
    for name in columns:
        target = ROLLOUT_SCHEMA.field(name).type
        if name not in table.column_names and name in OPTIONAL_COLUMNS:
            # A file written before the column existed: nulls (pyarrow skips absent columns).
            arrays.append(pa.chunked_array([pa.nulls(table.num_rows, target)]))
            continue
        if name not in table.column_names:
            raise CorruptFileError(f"rollout file has no {name!r} column", **where_of_file(file))
        column = table.column(name)
        if column.type != target:
            try:
                column = column.cast(target)
            except (pa.ArrowException, ValueError, TypeError) as exc:
                raise CorruptFileError(
                    f"column {name!r} of type {column.type} does not read as the v1 {target}: "
                    f"{exc}",
                    **where_of_file(file),
                ) from None
        arrays.append(column)
    return pa.Table.from_arrays(arrays, names=list(columns))


def with_declared_columns(
    table: pa.Table, raw: pa.Table, columns: Mapping[str, Column], *, file: str
) -> pa.Table:
    """``table`` (conformed v1 columns) with ``columns`` of ``raw`` appended, each cast to
    its declaration and checked: one value per token (per sample), of its shape. A column
    the file lacks, or a bad value, is refused naming the file, run, step, sample and
    column."""
    if not columns:
        return table
    counts = pc.list_value_length(table.column("tokens")).to_numpy(zero_copy_only=False)
    for name, column in columns.items():
        if name not in raw.column_names:
            raise CorruptFileError(
                f"the rows of this file have no column {name!r} (their run declares none; "
                "select runs that do)",
                column=name,
                **where_of_file(file),
            )
        array, bad, problem = stored_column(raw.column(name), column, counts)
        if bad is not None:
            sample_id = table.column("sample_id")[bad].as_py()
            raise InvalidRolloutError(
                f"column {name!r}: {problem}",
                column=name,
                **where_of_file(file),
                sample_id=sample_id,
            )
        table = table.append_column(name, array)
    # The declaration rides along (the schema's metadata): readers build values from it.
    return table.replace_schema_metadata({META_COLUMNS: encode(columns)})
