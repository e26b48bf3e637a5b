"""A store's rollouts table as the rest of mmstore uses it: one :class:`RolloutTable` per
open store, the files of a version, and commits.

Every reader reads the files of one table version (the latest by default) and every writer
commits through the table; nothing here lists ``rollouts/``. Nothing here creates a
table: a store's open does (``Store.check_log``), so a table missing here lost its log
since, and an empty one made now would say every committed row is gone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from mmstore._rows.entries import LOG_DIR
from mmstore._rows.table import CommitResult, RolloutTable, TableFile, TableSnapshot
from mmstore._storage.store import Storage
from mmstore.errors import TableNotFoundError

# One table per open store object: it keeps the latest version's DeltaTable up to date
# incrementally (a fresh one replays the log from its checkpoint). Keyed by the object, so
# a store pickled into a DataLoader worker gets none (and must not call delta-rs there).
_TABLES: weakref.WeakKeyDictionary[Storage, RolloutTable] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_T = TypeVar("_T")


def table_of(storage: Storage) -> RolloutTable:
    """The rollouts table of ``storage`` (built on first use, then shared)."""
    with _LOCK:
        table = _TABLES.get(storage)
        if table is None:
            table = _TABLES[storage] = RolloutTable(storage)
        return table


def _on_table(storage: Storage, use: Callable[[RolloutTable], _T]) -> _T:
    """``use(table)`` of ``storage``'s table; a missing one (its log gone since the store
    was opened) raises :class:`TableNotFoundError` saying so."""
    table = table_of(storage)
    try:
        return use(table)
    except NotADirectoryError:  # rollouts/ (or its log's folder) is a file now
        storage.refuse_file_at(LOG_DIR)
        raise
    except TableNotFoundError:
        raise TableNotFoundError(
            f"the store at {storage.root!r} has lost its commit log ({LOG_DIR}/) "
            "since it was opened: restore the log from a copy of the store (nothing was "
            "changed; mmstore makes a table only with its store)",
            root=storage.root,
            table=table.uri,
        ) from None


def version_files(storage: Storage, version: int | None = None) -> TableSnapshot:
    """The committed files of ``version`` (None: the latest), read from the log."""
    return _on_table(storage, lambda table: table.snapshot(version))


def latest_version(storage: Storage) -> int:
    """The newest committed version of ``storage``'s table."""
    return _on_table(storage, lambda table: table.latest_version())


def commit_files(
    storage: Storage,
    files: Sequence[TableFile],
    *,
    producer: str | None = None,
    seq: int | None = None,
    commit_id: str | None = None,
    digest: str | None = None,
    absent_since: int | None = None,
    final: bool = False,
) -> CommitResult:
    """Commit files already written in place (see :meth:`RolloutTable.commit`)."""
    return _on_table(
        storage,
        lambda table: table.commit(
            files,
            producer=producer,
            seq=seq,
            commit_id=commit_id,
            digest=digest,
            absent_since=absent_since,
            final=final,
        ),
    )


def version_at(storage: Storage, cutoff_ms: float, latest: int) -> int:
    """The version that was the latest at ``cutoff_ms`` (ms since the epoch): the newest
    whose commit is older, by the timestamps of the log's entries (a binary search, no
    delta-rs); 0 if every version is newer (or, where the entries below the last checkpoint
    were cleaned up, the version before it). An entry without a timestamp counts as new,
    so that the answer errs towards an older version (gc then keeps more)."""
    table = table_of(storage)

    def older(version: int) -> bool:
        entry = table.log_entry(version, check_cleaned=False)
        stamp = None if entry is None else entry.timestamp_ms
        return stamp is not None and stamp < cutoff_ms

    # Entries below the oldest version the log opens were cleaned up (another engine's
    # cleanup_metadata()): no timestamps to read, and no reader can open those versions
    # now. The answer is then at least the version before it, which gc reads as "older
    # than the checkpoint" (the checkpoint's tombstones, then the entries after it).
    first = table.first_version()
    low, high = max(first - 1, 0), latest  # invariant: the answer lies in [low, high]
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
