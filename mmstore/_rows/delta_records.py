"""delta-rs's records as mmstore reads and writes them: the checks a table must pass before
delta-rs reads or writes it (partitioning, the reader's protocol, what a writer may write),
the live files of a ``DeltaTable``, and the add and remove actions of a commit. Only
:mod:`.delta` imports this; like it, nothing here runs in a forked child.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from mmstore._format.paths import store_path, table_path
from mmstore._rows.entries import (
    PARTITION_COLUMNS,
    TableFile,
    check_reader_protocol,
    partition_values,
)
from mmstore._rows.log import LOG_WRITER_VERSION
from mmstore.errors import SchemaVersionError, TableError

if TYPE_CHECKING:
    from deltalake import DeltaTable


def check_partitioning(table: DeltaTable, uri: str) -> None:
    partitions = list(table.metadata().partition_columns)
    if partitions != PARTITION_COLUMNS:
        raise SchemaVersionError(
            f"the rollouts table is partitioned by {partitions}, not {PARTITION_COLUMNS}",
            table=uri,
        )


def check_writable(table: DeltaTable, uri: str) -> None:
    """Refuse to write a removal into a table whose protocol asks more of a writer than
    mmstore's log writer does (writer features, a version above 2) or that is append-only."""
    protocol = table.protocol()
    if protocol.min_writer_version > LOG_WRITER_VERSION or protocol.writer_features:
        raise SchemaVersionError(
            f"the rollouts table's protocol needs writer version "
            f"{protocol.min_writer_version} (features {protocol.writer_features or []}); "
            f"mmstore writes version {LOG_WRITER_VERSION}",
            table=uri,
        )
    if table.metadata().configuration.get("delta.appendOnly") == "true":
        raise TableError("the rollouts table is append-only (delta.appendOnly)", table=uri)


def check_protocol(table: DeltaTable, uri: str) -> None:
    """Refuse a table whose protocol needs a reader feature mmstore lacks (typed, naming
    it; see :func:`~mmstore._rows.entries.check_reader_protocol`)."""
    protocol = table.protocol()
    check_reader_protocol(
        {
            "minReaderVersion": protocol.min_reader_version,
            "readerFeatures": protocol.reader_features,
        },
        table=uri,
        version=int(table.version()),
    )


def table_files(table: DeltaTable) -> tuple[TableFile, ...]:
    """A DeltaTable's live files (its add actions), sorted by path."""
    # Through the C stream interface: pa.table() of an arro3 table imports pandas (0.2 s) to
    # ask whether it is a DataFrame, and the CLI's read-only commands never need pandas.
    actions = pa.RecordBatchReader.from_stream(table.get_add_actions(flatten=True)).read_all()
    columns = [
        actions.column(name).to_pylist()
        for name in ("path", "partition.run_id", "partition.step", "size_bytes", "num_records")
    ]
    files = [
        TableFile(store_path(path), run_id, int(step), int(size), rows)
        for path, run_id, step, size, rows in zip(*columns, strict=True)
    ]
    return tuple(sorted(files, key=lambda f: f.path))


def add_action(file: TableFile) -> Any:
    from deltalake.transaction import AddAction

    return AddAction(
        path=table_path(file.path),
        size=file.size,
        partition_values=partition_values(file),
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=json.dumps({"numRecords": file.rows}),
    )


def remove_action(file: TableFile) -> Any:
    from deltalake.transaction import RemoveAction

    return RemoveAction(
        path=table_path(file.path),
        data_change=True,
        deletion_timestamp=int(time.time() * 1000),
        size=file.size,
        partition_values=partition_values(file),
    )
