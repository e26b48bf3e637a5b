"""Following the rollouts table's log as commits arrive: the files each new version adds to
the followed runs, with their rows' planning facts, in commit order.

Reads log entries one by one (one read of the next entry per poll, never a listing) and
each new file's footer and small columns; no delta-rs call, so it is safe in any process.
Between polls a follower of a local store sleeps until an entry appears in the log directory
(inotify: no CPU while idle, a commit seen at once); of an object store, for its poll
interval.
A position in commit order is a :class:`Cursor`: (table version, index of the file among
the version's adds, row within the file).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmstore._format.columns import footer_columns, per_sample
from mmstore._format.paths import check_partition
from mmstore._format.schema import META_FINAL
from mmstore._rows.files import check_run_id, where_of_file
from mmstore._rows.lengths import FileFacts, read_file_facts
from mmstore._rows.snapshot import WorkUnit, file_units
from mmstore._rows.table import LogEntry, TableFile
from mmstore._rows.versions import table_of
from mmstore._storage.store import Storage
from mmstore.errors import InvalidArgumentError, InvalidRolloutError

# Per-row columns a follower reads beside the planning facts.
FOLLOWED_COLUMNS = ("sample_id", "group_id", "policy_version", "loss_mask")


@dataclass(frozen=True, order=True)
class Cursor:
    """A position in commit order: row ``row`` of the ``index``-th file version ``version``
    added. ``Cursor(v, 0, 0)`` is the start of version ``v``."""

    version: int
    index: int
    row: int

    def as_list(self) -> list[int]:
        return [self.version, self.index, self.row]

    @classmethod
    def from_state(cls, value: object) -> Cursor:
        if (
            not isinstance(value, list | tuple)
            or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        ):
            raise InvalidArgumentError(f"live loader state has an invalid cursor {value!r}")
        return cls(*value)


@dataclass(frozen=True)
class FollowedFile:
    """One file a commit added to a followed run, and its rows' facts (rows from
    ``first_row`` on: a resumed cursor may start inside a file)."""

    version: int
    index: int
    file: TableFile
    units: tuple[WorkUnit, ...]
    facts: FileFacts
    first_row: int = 0

    @property
    def sample_ids(self) -> pa.ChunkedArray:
        return self.facts.columns["sample_id"]

    @property
    def final(self) -> bool:
        """Whether it is of its run's final commit (``store.writer(final=True)``)."""
        return (self.facts.meta.metadata or {}).get(META_FINAL) == b"true"

    def loss_tokens(self, start: int, stop: int) -> int:
        """Loss tokens of rows ``[start, stop)``, as the loader hands them over (after
        ``max_len``)."""
        # One pass over the rows' masks, not one Python object per row: a prefix sum of
        # the flattened masks, read at each row's start and its cut (``max_len``).
        rows = self.facts.columns["loss_mask"].slice(start, stop - start).combine_chunks()
        lengths = pc.list_value_length(rows).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(rows).to_numpy(zero_copy_only=False)
        prefix = np.concatenate([[0], np.cumsum(flat, dtype=np.int64)])
        firsts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        cuts = firsts + np.minimum(lengths, self.facts.lengths[start:stop])
        return int((prefix[cuts] - prefix[firsts]).sum())

    def open_rows(self, done_column: str) -> np.ndarray:
        """bool [rows]: rows whose ``done_column`` says False (more of their trajectory is
        to come); a null or a file without the column is done."""
        column = self.facts.columns.get(done_column)
        if column is None or pa.types.is_null(column.type):
            return np.zeros(len(self.facts.lengths), dtype=bool)
        return pc.equal(column, False).fill_null(False).to_numpy(zero_copy_only=False)

    def policy_versions(self, unknown: int) -> np.ndarray:
        """Each row's policy version, ``unknown`` where none is recorded."""
        column = self.facts.columns["policy_version"]
        return column.fill_null(unknown).to_numpy().astype(np.int64)

    def locate(self, row: int) -> tuple[WorkUnit, int]:
        """The work unit (row group) of file row ``row``, and the row's index within it."""
        starts = self.facts.row_starts
        group = int(np.searchsorted(starts, row, side="right")) - 1
        unit = next(u for u in self.units if u.row_group == group)
        return unit, row - int(starts[group])


@dataclass(frozen=True)
class Polled:
    """What one poll found: the followed files new versions added (each not removed by a
    later version of the same poll), and every file those versions removed (a file handed
    over by an earlier poll and removed since must not be trained either)."""

    files: list[FollowedFile]
    removed: frozenset[str]
    #: followed runs whose producer's final commit these versions hold (from the log: known
    #: even where the file was released since)
    finished: frozenset[str] = frozenset()
    #: rows of followed files these versions added and a later one removed: never handed
    #: over, never trained (counted as removed)
    removed_rows: int = 0


class LogFollower:
    """The files of ``runs`` committed after a cursor, read as new log entries arrive."""

    def __init__(
        self,
        store: Storage,
        runs: Iterable[str],
        *,
        start: Cursor,
        max_len: int | None,
        prefixes: bool = False,
        done_column: str | None = None,
    ) -> None:
        runs = [runs] if isinstance(runs, str) else list(runs)
        if not runs:
            raise InvalidArgumentError("runs must name at least one run to follow")
        for run in runs:
            check_partition(run, 0)
        self.store = store
        self.runs = frozenset(runs)
        self.max_len = max_len
        self.prefixes = prefixes  # read what each row shares with the one before it
        self.done_column = done_column  # a per-sample bool column read beside the facts
        self.start = start
        # The last version whose entry has been read (its files handed over).
        self.version = start.version - 1
        self._watch: _LogWatch | None = None
        self._first_poll = True

    def watch(self, directory: str | None) -> None:
        """Wake waits when an entry appears in ``directory`` (the local log), where inotify
        is there; elsewhere (an object store, another OS) waits sleep."""
        if directory is not None and self._watch is None:
            self._watch = _LogWatch.start(directory)

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the log changes meanwhile (a local store's)."""
        if self._watch is None:
            time.sleep(seconds)
        else:
            self._watch.wait(seconds)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def poll(self) -> Polled:
        """The followed files of every version committed since the last poll, and the files
        those versions removed (one read of each new entry, and one of the next, absent
        entry). A file a later version removes is never handed over, so its footer is not
        read either: released, it may be collected already."""
        # A change from here on wakes the next wait (one before is read by this poll).
        if self._watch is not None:
            self._watch.drain()
        table = table_of(self.store)
        # Whether the start was cleaned up below a checkpoint is asked once: later polls of a
        # version not there yet are one read each (one request on an object store).
        check = self._first_poll
        self._first_poll = False
        entries: list[LogEntry] = []
        while True:
            try:
                entry = table.log_entry(self.version + 1 + len(entries), check_cleaned=check)
            except Exception:
                if entries:  # hand over the entries before it; it raises again next time
                    break
                raise
            if entry is None:
                break
            entries.append(entry)
            check = False
        found: list[FollowedFile] = []
        removed: set[str] = set()
        finished: set[str] = set()
        removed_rows = 0
        for entry, removed_later in zip(entries, _removed_later(entries), strict=True):
            try:
                files = self._files_of(entry, removed_later)  # all of an entry's, or none
            except Exception:
                if found or removed:  # hand over the entries before it; it raises again
                    break
                raise
            found.extend(files)
            removed.update(_deleted(entry))
            if entry.final:
                finished.update(f.run_id for f in entry.added if f.run_id in self.runs)
            removed_rows += self._rows_removed_unseen(entry, removed_later)
            self.version = entry.version
        return Polled(found, frozenset(removed), frozenset(finished), removed_rows)

    def _rows_removed_unseen(self, entry: LogEntry, removed_later: frozenset[str]) -> int:
        """Rows of followed files ``entry`` added that a later entry of the poll removed
        (from the adds' row counts: their footers are not read, their bytes may be gone)."""
        rows = 0
        for index, file in enumerate(entry.added):
            if file.run_id not in self.runs or file.path not in removed_later:
                continue
            if file.path in entry.rearranged:
                continue
            first = 0
            if entry.version == self.start.version:
                if index < self.start.index:
                    continue
                if index == self.start.index:
                    first = self.start.row
            rows += max(0, (file.rows or 0) - first)
        return rows

    def _files_of(self, entry: LogEntry, removed_later: frozenset[str]) -> list[FollowedFile]:
        files = []
        for index, file in enumerate(entry.added):
            if file.run_id not in self.runs or file.path in removed_later:
                continue
            if file.path in entry.rearranged:  # a rewrite (compaction): no new rows
                continue
            first_row = 0
            if entry.version == self.start.version:
                if index < self.start.index:
                    continue
                if index == self.start.index:
                    first_row = self.start.row
            check_run_id(file)  # its path must name the run the log says
            extra = (self.done_column,) if self.done_column else ()
            facts = read_file_facts(
                self.store,
                file.path,
                self.max_len,
                FOLLOWED_COLUMNS + extra,
                layouts=True,
                prefixes=self.prefixes,
            )
            if self.done_column:
                _check_done_column(facts, self.done_column, file.path)
            units = tuple(file_units(self.store, file.path, facts.meta))
            files.append(FollowedFile(entry.version, index, file, units, facts, first_row))
        return files


def _check_done_column(facts: FileFacts, name: str, path: str) -> None:
    """A file that declares ``name`` must declare it ``per_sample("bool")``: a live loader
    holds a trajectory's rows while it says False."""
    declared = footer_columns(facts.meta.metadata, where=where_of_file(path)).get(name)
    if declared is not None and declared != per_sample("bool"):
        raise InvalidRolloutError(
            f"column {name!r} (the live loader's done_column) is declared {declared.per} "
            f"{declared.dtype}{list(declared.shape) or ''}; a done column is "
            "mmstore.per_sample('bool')",
            file=path,
        )


def _deleted(entry: LogEntry) -> frozenset[str]:
    """The files whose rows ``entry`` deletes. A remove with ``dataChange: false`` (another
    engine's compaction) only moves rows into a file the follower skips as a rewrite: the
    rows are still to be trained, from the file they were committed in (kept on disk until
    a vacuum or gc collects it)."""
    return frozenset(entry.removed) - entry.rearranged


def _removed_later(entries: list[LogEntry]) -> list[frozenset[str]]:
    """For each entry, the files whose rows the entries after it delete."""
    later: list[frozenset[str]] = []
    removed: frozenset[str] = frozenset()
    for entry in reversed(entries):
        later.append(removed)
        removed = removed | _deleted(entry)
    return later[::-1]


class _LogWatch:
    """Wakes a waiting follower when an entry appears in a local log directory: inotify
    (through ``inotify_simple``) on the directory, read with a timeout (a blocking ``poll``
    system call: no CPU while nothing happens)."""

    def __init__(self, inotify: Any) -> None:
        self.inotify = inotify

    @classmethod
    def start(cls, directory: str) -> _LogWatch | None:
        try:
            from inotify_simple import INotify, flags
        except ImportError:  # not Linux, or not installed: waits sleep, polls find commits
            return None
        try:
            inotify = INotify()
            # A commit's entry is renamed (delta-rs) or linked (mmstore) into the directory.
            inotify.add_watch(directory, flags.CREATE | flags.MOVED_TO)
        except OSError:  # no such directory yet, or out of inotify watches: poll
            return None
        return cls(inotify)

    def drain(self) -> None:
        """Forget changes so far (the poll that follows reads them)."""
        self.inotify.read(timeout=0)

    def wait(self, seconds: float) -> None:
        self.inotify.read(timeout=max(0, int(seconds * 1000)))

    def close(self) -> None:
        self.inotify.close()
