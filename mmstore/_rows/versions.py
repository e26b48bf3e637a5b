"""A store's rollouts table as the rest of mmstore uses it: one :class:`RolloutTable` per
open store, the files of a version, and commits.

Every reader reads the files of one table version (the latest by default) and every writer
commits through the table; nothing here lists ``rollouts/``. A format-2 store whose table
is missing (a creator killed between writing the manifest and creating the table) gets
it created on first use: creation is idempotent and safe to race.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from mmstore._rows.table import CommitResult, RolloutTable, TableFile, TableSnapshot
from mmstore._storage.store import Storage
from mmstore.errors import TableNotFoundError

# One table per open store object: it keeps the latest version's DeltaTable up to date
# incrementally (a fresh one replays the log from its checkpoint). Keyed by the object, so
# a store pickled into a DataLoader worker gets none (and must not call delta-rs there).
_TABLES: weakref.WeakKeyDictionary[Storage, RolloutTable] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def table_of(storage: Storage) -> RolloutTable:
    """The rollouts table of ``storage`` (built on first use, then shared)."""
    with _LOCK:
        table = _TABLES.get(storage)
        if table is None:
            table = _TABLES[storage] = RolloutTable(storage)
        return table


def version_files(storage: Storage, version: int | None = None) -> TableSnapshot:
    """The committed files of ``version`` (None: the latest), read from the log."""
    table = table_of(storage)
    try:
        return table.snapshot(version)
    except TableNotFoundError:
        table.create()
        return table.snapshot(version)


def latest_version(storage: Storage) -> int:
    """The newest committed version of ``storage``'s table."""
    table = table_of(storage)
    try:
        return table.latest_version()
    except TableNotFoundError:
        return table.create()


def commit_files(
    storage: Storage,
    files: Sequence[TableFile],
    *,
    producer: str | None = None,
    seq: int | None = None,
) -> CommitResult:
    """Commit files already written in place (see :meth:`RolloutTable.commit`)."""
    table = table_of(storage)
    try:
        return table.commit(files, producer=producer, seq=seq)
    except TableNotFoundError:
        table.create()
        return table.commit(files, producer=producer, seq=seq)


def version_at(storage: Storage, cutoff_ms: float, latest: int) -> int:
    """The version that was the latest at ``cutoff_ms`` (ms since the epoch): the newest
    whose commit is older, by the timestamps of the log's entries (a binary search, no
    delta-rs); 0 if every version is newer. An entry without a timestamp counts as new,
    so that the answer errs towards an older version (gc then keeps more)."""
    table = table_of(storage)

    def older(version: int) -> bool:
        entry = table.log_entry(version)
        stamp = None if entry is None else entry.timestamp_ms
        return stamp is not None and stamp < cutoff_ms

    low, high = 0, latest  # invariant: the answer lies in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if older(middle):
            low = middle
        else:
            high = middle - 1
    return low


def added_after(storage: Storage, version: int) -> set[str]:
    """Every file a commit after ``version`` added (read from the log's JSON entries)."""
    added: set[str] = set()
    for entry in table_of(storage).entries_after(version):
        added.update(f.path for f in entry.added)
    return added
