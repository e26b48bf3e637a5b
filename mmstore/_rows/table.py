"""The rollouts table: ``ROOT/rollouts/`` as a Delta Lake table (format v2's commit log).

mmstore writes its own Parquet files (footer keys, page checksums, row checks as in v1) at
``rollouts/run_id=<run>/step=<step>/part-<writer>-<seq>.parquet`` (the naming rule:
:mod:`mmstore._format.paths`); a file is committed when a Delta transaction adds it (path,
partition values ``run_id`` string and ``step`` int32, size, row count in the
``numRecords`` stat). The files keep no ``run_id``/``step`` columns: Delta readers
(``deltalake``, polars ``scan_delta``/``read_delta``, Ray, Spark) take them from the log,
typed. What :class:`RolloutTable` gives, all read from the log (``_delta_log/``, its
checkpoints) and never from a listing of ``rollouts/``:

- :meth:`RolloutTable.commit`: one transaction adding files, optionally exactly once per
  ``(producer, seq)`` (a Delta application transaction, ``txn``: app id = producer,
  version = seq); a retry of a committed pair commits nothing and says so.
- :meth:`RolloutTable.snapshot`: the files of one version (the latest by default).
- :meth:`RolloutTable.entries_after`: what each commit after a version added and removed,
  read from ``_delta_log/<v>.json`` directly (delta-rs has no API for one entry).
- :meth:`RolloutTable.remove_run`: a Delta remove of a run's files (metadata only; the
  bytes stay until gc decides).

Everything returned is plain data (strings, ints, tuples of frozen dataclasses) that pickles
into DataLoader workers.

The table is this front over two sides: mmstore's own log (:mod:`.log`: entries read and,
where the store can put a file only if it is absent, commits written through the store's
backend, without delta-rs) and delta-rs (:mod:`.delta`: creating, opening versions,
removals, schema changes, checkpoints). Commits are mmstore's own log entries on a local
store and on S3 with boto3 (a conditional PUT); elsewhere (S3 without boto3, or options
boto3 has no twin of) they go through delta-rs, with its conditional put. Removals are
mmstore's own log entries there too (a Delta ``DELETE``, so that ``history()`` tells a
release from a write), through delta-rs elsewhere; schema changes always go through it.

**Never call delta-rs in a forked child** (it panics there, see :mod:`.delta`): the parent
plans (opens versions, lists files) and workers read the Parquet files by path. Every
delta-rs call raises :class:`TableForkError` in such a child instead of panicking.
:meth:`RolloutTable.entries_after` and :meth:`RolloutTable.log_entry` read the log's JSON
through the store's backend, without delta-rs: safe anywhere; so does
:meth:`RolloutTable.replay` (the files of a version: the last checkpoint, then the JSON
entries), which :meth:`RolloutTable.snapshot` and :meth:`RolloutTable.latest_version` use in
such a forked child (a rank forked from a parent that used the table plans as its parent
would). Commits there still raise :class:`TableForkError`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa

from mmstore._format.paths import (
    ROLLOUTS,
    check_producer,
    is_run_id,
    is_step,
    partition_dir,
)
from mmstore._rows.delta import (
    CHECKPOINT_INTERVAL,
    TABLE_SCHEMA,
    DeltaRsTable,
    check_runtime,
    forked,
)
from mmstore._rows.entries import (
    COMMIT_ID_KEY,
    PARTITION_COLUMNS,
    CommitResult,
    LogEntry,
    Removal,
    TableFile,
    TableSnapshot,
)
from mmstore._rows.log import TableLog
from mmstore._storage.backends import FileStat
from mmstore._storage.store import Storage
from mmstore.errors import InvalidArgumentError, TableError


class RolloutTable:
    """The Delta table at ``<store root>/rollouts``.

    Holds its log (:class:`~mmstore._rows.log.TableLog`: the commit path's view of it) and
    its delta-rs side (:class:`~mmstore._rows.delta.DeltaRsTable`: the latest version kept
    up to date, other versions opened on demand). Safe to share between threads (one lock
    for both sides); pickles without their state (see the module docstring for why a
    DataLoader worker must not use it anyway).
    """

    def __init__(self, storage: Storage, *, checkpoint_interval: int = CHECKPOINT_INTERVAL):
        if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int):
            raise InvalidArgumentError(
                f"checkpoint_interval must be an int, got {checkpoint_interval!r}"
            )
        if checkpoint_interval < 1:
            raise InvalidArgumentError(
                f"checkpoint_interval must be positive, got {checkpoint_interval}"
            )
        self.storage = storage
        self.checkpoint_interval = checkpoint_interval
        self.uri, self.storage_options = storage.backend.delta_location(ROLLOUTS)
        self._lock = threading.RLock()
        self._log = TableLog(storage.backend, self.uri)
        self._delta = DeltaRsTable(
            self.uri, self.storage_options, self._log, self._lock, checkpoint_interval
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "checkpoint_interval": self.checkpoint_interval}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], checkpoint_interval=state["checkpoint_interval"])  # type: ignore[misc]

    # -- creating and opening ------------------------------------------------------------

    def exists(self) -> bool:
        """Whether a Delta table exists at the store's ``rollouts/`` (opens it if so)."""
        return self._delta.exists()

    def create(self) -> int:
        """Create the table if there is none; return its latest version.

        Safe to race: of concurrent creators one writes version 0, the others find it. An
        existing table must be partitioned by ``run_id`` and ``step`` (else
        :class:`SchemaVersionError`).
        """
        with self._lock:
            self._delta.create()
            return self._delta.latest().version

    # -- reading versions ----------------------------------------------------------------

    def latest_version(self) -> int:
        """The newest committed version (when nothing is new: one failed read of the log,
        and one of its ``_last_checkpoint``, which says whether entries were cleaned up)."""
        if forked():
            return self.replay().version
        with self._lock:
            return self._delta.latest().version

    def snapshot(self, version: int | None = None) -> TableSnapshot:
        """The files of ``version`` (the latest if None), from the log and its checkpoint.

        Raises :class:`TableVersionError` for a version the table does not have. In a
        forked child of a process that used delta-rs (which would panic there) the log is
        replayed without it (:meth:`replay`): a forked rank plans as its parent would.
        """
        if forked():
            return self.replay(version)
        if version is None:
            with self._lock:
                return self._delta.latest()
        _check_version_argument(version)
        return self._delta.snapshot(version)

    def replay(self, version: int | None = None) -> TableSnapshot:
        """The files of ``version`` (the latest if None) read from the log without delta-rs:
        the newest checkpoint at or below it (single-file, as delta-rs writes them), then
        each JSON entry after it, applying adds and removes in order. Safe in any process;
        slower than :meth:`snapshot` for an old version below the last checkpoint (its
        entries are replayed from version 0)."""
        if version is not None:
            _check_version_argument(version)
        return self._log.replay(version)

    def producer_seq(self, producer: str, run_id: str | None = None) -> int | None:
        """The latest seq ``producer`` committed in run ``run_id`` (None: in any of its
        runs); None if it never committed there. Read from the log (no delta-rs)."""
        check_producer(producer, 0)
        if run_id is not None and not is_run_id(run_id):
            raise InvalidArgumentError(f"not a run id: {run_id!r}", table=self.uri)
        with self._lock:
            return self._log.producer_seq(producer, run_id)

    # -- committing ----------------------------------------------------------------------

    def commit(
        self,
        files: Sequence[TableFile],
        *,
        producer: str | None = None,
        seq: int | None = None,
        commit_id: str | None = None,
        digest: str | None = None,
        absent_since: int | None = None,
        final: bool = False,
    ) -> CommitResult:
        """Add ``files`` (already written in place) to the table in one transaction.

        ``commit_id`` names this commit in its log entry (a new one if None): a caller
        that retries a commit that raised passes the same id, and a commit whose entry
        was made (its reply lost, or a failure after the entry was durable) is then found
        and returned, never made twice. With ``absent_since`` (a version whose files the
        caller read) the files a later commit added are left out (``CommitResult.skipped``).
        ``final``: a producer's last commit to the run, marked in the entry (``LogEntry.final``).

        With ``producer`` and ``seq`` (files of one run) the commit happens at most once
        per ``(producer, run, seq)``: it records the pair in the same transaction (a Delta
        txn keyed ``run_id=<run>/<producer>``, with the rows' ``digest`` in its
        commitInfo). A pair the run holds already commits nothing when its rows are the
        same (``CommitResult.duplicate``; the digests, else the files' partitions and row
        counts, are compared), and raises :class:`ProducerConflictError` when they differ
        or when its seq lies below the producer's latest in the run without having been
        committed. A producer's seqs in a run must therefore grow, as a retrying producer's
        do. Two commits of the same pair racing each other commit once: the second loses
        the version to the first (put-if-absent of its log entry, or delta-rs's conflict
        check), and its retry then finds the pair committed.

        Appends that race other appends are retried at later versions; a commit that keeps
        losing to conflicting commits raises :class:`TableConflictError`.
        """
        if isinstance(files, TableFile) or not files:
            raise InvalidArgumentError("commit needs a non-empty sequence of TableFile")
        if (producer is None) != (seq is None):
            raise InvalidArgumentError("producer and seq go together: give both or neither")
        if producer is not None:
            check_producer(producer, seq)
        for file in files:
            _check_file(file)
        if producer is not None and len({f.run_id for f in files}) > 1:
            raise InvalidArgumentError(
                "an exactly-once commit (producer, seq) adds files of one run", table=self.uri
            )
        commit_id = commit_id or uuid.uuid4().hex
        check_runtime(self.uri)  # it may start a checkpoint (delta-rs): never in a fork
        if not self.storage.backend.puts_if_absent:
            with self._lock:
                mine = self._log.earlier_attempt(commit_id, lambda: self._delta.latest().version)
            if mine is not None:
                return CommitResult(mine, False, producer, seq, seq)
            result = self._delta.append(
                files, commit_id, producer, seq, digest, absent_since, final=final
            )
            self._log.settle(commit_id)
            return result
        with self._lock:
            result = self._log.commit(
                files,
                commit_id,
                producer,
                seq,
                digest=digest,
                absent_since=absent_since,
                final=final,
            )
            if result.version is not None and self._log.checkpoint_due(
                result.version, self.checkpoint_interval
            ):
                self._delta.checkpoint_later(result.version)
            return result

    def remove_run(self, run_id: str) -> Removal:
        """Remove every file of ``run_id`` from the latest version (Delta remove actions;
        no file is rewritten or deleted). Files a writer commits meanwhile stay."""
        if not is_run_id(run_id):
            raise InvalidArgumentError(f"not a run id: {run_id!r}", table=self.uri)
        return self.remove_files(lambda f: f.run_id == run_id, predicate=f"run_id = '{run_id}'")

    def remove_files(
        self, select: Callable[[TableFile], bool], *, predicate: str | None = None
    ) -> Removal:
        """Remove the latest version's files for which ``select`` is true, in one
        transaction (chosen again from the newer version if a conflicting commit wins); a
        Delta ``DELETE`` whose ``predicate`` says what it removed (where mmstore writes the
        log itself, see :meth:`mmstore._rows.delta.DeltaRsTable.remove_files`)."""
        return self._delta.remove_files(select, predicate)

    def add_columns(self, fields: Iterable[pa.Field]) -> int | None:
        """Add the nullable columns of ``fields`` the table lacks (one metadata commit).

        Files committed before read them as null; returns the version that added them, or
        None when the table had them all. Add a column before committing a file that has
        it: on append, delta-rs keeps the table's schema and ignores the file's.
        """
        fields = list(fields)
        for field in fields:
            if not field.nullable:
                raise InvalidArgumentError(
                    f"column {field.name!r} must be nullable: files committed before it "
                    "have no values",
                    table=self.uri,
                )
        return self._delta.add_columns(fields)

    # -- checkpoints ---------------------------------------------------------------------

    def join_checkpoint(self) -> None:
        """Wait until the checkpoints this table writes in the background are written."""
        self._delta.join_checkpoint()

    def checkpoint(self) -> int:
        """Write a checkpoint of the latest version now; return that version."""
        return self._delta.checkpoint()

    # -- following the log ---------------------------------------------------------------

    def table_id(self) -> str | None:
        """The table's id, as its log records it (one read; no delta-rs)."""
        return self._log.table_id()

    def log_entry(self, version: int, *, check_cleaned: bool = True) -> LogEntry | None:
        """The commit at ``version`` as its JSON log entry lists it; None if no such version
        is committed yet (or, with ``check_cleaned``, :class:`TableVersionError` if its
        entry was cleaned up below a checkpoint: one more read). No delta-rs call: safe in
        any process."""
        _check_version_argument(version)
        return self._log.entry(version, check_cleaned=check_cleaned)

    def first_version(self) -> int:
        """The oldest version the log can still open (0, or a checkpoint's once the entries
        below it were collected). No delta-rs call."""
        return self._log.first_version()

    def collect_log_before(self, boundary: int, *, dry_run: bool = False) -> list[FileStat]:
        """Delete the log files no version from ``boundary`` on needs (see
        :meth:`TableLog.collect_before`): what it deleted. No delta-rs call."""
        return self._log.collect_before(boundary, dry_run=dry_run)

    def entries_after(self, version: int, *, limit: int | None = None) -> list[LogEntry]:
        """The commits after ``version`` (at most ``limit``), oldest first: one read of each
        new log entry and one failed read at the end, whatever the table's size."""
        if version != -1:
            _check_version_argument(version)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise InvalidArgumentError(f"limit must be an int or None, got {limit!r}")
        return self._log.entries_after(version, limit)

    def removed_after(self, version: int, cutoff_ms: float) -> set[str]:
        """Every file a commit after ``version`` removed, where ``version`` is the newest
        commit older than ``cutoff_ms`` (ms since the epoch): what gc keeps for readers of
        the versions since (see :meth:`mmstore._rows.log.TableLog.removed_after`)."""
        _check_version_argument(version)
        return self._log.removed_after(version, cutoff_ms)


# -- argument checks ---------------------------------------------------------------------


def _check_version_argument(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"a table version is an int >= 0, got {version!r}")


def _check_file(file: TableFile) -> None:
    """A file the table can list: under its own partition's directory, with sane numbers."""
    if not isinstance(file, TableFile):
        raise InvalidArgumentError(f"expected a TableFile, got {type(file).__name__}")
    if not is_run_id(file.run_id):
        raise InvalidArgumentError(f"not a run id: {file.run_id!r}", file=file.path)
    if isinstance(file.step, bool) or not isinstance(file.step, int):
        raise InvalidArgumentError(f"step must be an int, got {file.step!r}", file=file.path)
    if not is_step(file.step):
        raise InvalidArgumentError(f"step {file.step} is not a non-negative int32", file=file.path)
    prefix = f"{partition_dir(file.run_id, file.step)}/"
    name = file.path[len(prefix) :] if isinstance(file.path, str) else ""
    if (
        not file.path.startswith(prefix)
        or not name.endswith(".parquet")
        or "/" in name
        or name.startswith((".", "_"))
        or "%" in name
    ):
        raise InvalidArgumentError(
            f"a committed file lies directly under {prefix} and ends in .parquet",
            file=file.path,
        )
    for label, value in (("size", file.size), ("rows", file.rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(
                f"{label} must be an int >= 0, got {value!r}", file=file.path
            )


__all__ = [
    "CHECKPOINT_INTERVAL",
    "COMMIT_ID_KEY",
    "PARTITION_COLUMNS",
    "TABLE_SCHEMA",
    "CommitResult",
    "LogEntry",
    "Removal",
    "RolloutTable",
    "TableError",
    "TableFile",
    "TableSnapshot",
]
