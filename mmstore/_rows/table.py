"""The rollouts table: ``ROOT/rollouts/`` as a Delta Lake table (format v2's commit log).

mmstore writes its own Parquet files (footer keys, page checksums, row checks as in v1) at
``rollouts/run_id=<run>/step=<step>/part-<writer>-<seq>.parquet``; a file is committed when a
Delta transaction adds it (path, partition values ``run_id`` string and ``step`` int32, size,
row count in the ``numRecords`` stat). The files keep no ``run_id``/``step`` columns: Delta
readers (``deltalake``, polars ``scan_delta``/``read_delta``, Ray, Spark) take them from the
log, typed. What this module gives, all read from the log (``_delta_log/``, its checkpoints)
and never from a listing of ``rollouts/``:

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

**Never call delta-rs in a forked child.** Its tokio runtime is created by the first call in
a process; a fork of that process that calls delta-rs again panics (``PanicException``, a
``BaseException``). So the parent plans (opens versions, lists files) and workers read the
Parquet files by path. Every delta-rs call here first checks that the runtime, if this
module started it, belongs to the current process, and raises :class:`TableForkError`
instead of panicking. :meth:`RolloutTable.entries_after` and :meth:`RolloutTable.log_entry`
read the log's JSON through the store's backend, without delta-rs: safe anywhere; so does
:meth:`RolloutTable.replay` (the files of a version: the last checkpoint, then the JSON
entries), which :meth:`RolloutTable.snapshot` and :meth:`RolloutTable.latest_version` use in
such a forked child (a rank forked from a parent that used the table plans as its parent
would). Commits there still raise :class:`TableForkError`.

Commits are written by mmstore itself where the store can put a file only if it is absent
(a local store: a link; S3 with boto3: a conditional PUT): the commit's JSON entry (Delta's
add, txn and commitInfo actions) put-if-absent at the version after the newest it read,
retried at the next one when another commit took it (see ``_commit_log``). delta-rs 1.6
would load every live file's action and replay the log on each commit (10 ms at a few files,
56 ms at 10,000); this reads one missing entry and writes one small file, whatever the
table's size. Elsewhere (S3 without boto3, or options boto3 has no twin of) commits go
through delta-rs, with its conditional put; removals and schema changes always do.
Versions are kept: expired-log cleanup is off, so every version stays readable until gc
(format v2's lifecycle) decides otherwise. A checkpoint every :data:`CHECKPOINT_INTERVAL`
versions bounds what opening a version reads: one checkpoint (every live file's add action)
plus fewer than that many JSON entries. That is the log's own size, never a listing of
``rollouts/``. mmstore's commits write it in a background thread (it costs about an open of
the table); the latest version's files are followed entry by entry (:meth:`snapshot`).

Some delta-rs calls (``get_add_actions``, ``is_deltatable``) hold the GIL while they wait
on storage: other Python threads of the process stall meanwhile.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._storage.backends import LocalBackend, S3Backend
from mmstore._storage.store import ROLLOUTS, Storage
from mmstore.errors import (
    InvalidArgumentError,
    SchemaVersionError,
    TableConflictError,
    TableError,
    TableForkError,
    TableNotFoundError,
    TableVersionError,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

PARTITION_COLUMNS = ["run_id", "step"]
# The table's schema: the row schema plus the partition columns, which live in the log
# (add actions' partitionValues), not in the files. Delta takes nested lists and structs as
# they are; ``metadata`` (a JSON string) is a plain string column.
TABLE_SCHEMA = pa.schema(
    [
        *ROLLOUT_SCHEMA,
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
    ]
)
# A checkpoint (one Parquet file of every live add action) every N versions. delta-rs 1.6
# replays the log from the newest checkpoint on every open (and, for its own commits, every
# update before one and its post-commit snapshot), reading each JSON entry after it; so N bounds
# what each costs beyond reading the checkpoint: locally ~0.6 ms an entry, on S3 a round trip
# for every few. Writing one costs about one open (50 ms at 10,000 files locally), and they
# accumulate (no log cleanup): N = 20 keeps both small (see benchmarks/bench_table.py).
CHECKPOINT_INTERVAL = 20
# Whole attempts of one commit (each after delta-rs's own retries at later versions) before a
# commit that keeps losing to conflicting commits gives up with TableConflictError.
COMMIT_ATTEMPTS = 8
# delta-rs's retries within one attempt: an append that loses a version to another append
# retries at the next one after checking that the winner does not conflict.
DELTA_COMMIT_RETRIES = 100
# Commits on a local store or S3 (boto3) are written by mmstore (RolloutTable._commit_log):
# puts of a version's entry lost to other writers before a commit gives up. Every lost put
# means another commit took that version, so this only bounds a pathological log.
LOG_COMMIT_ATTEMPTS = 1000
# The highest protocol mmstore's own log writer follows: minWriterVersion 2 (appends of
# files that meet the schema's NOT NULL columns, no invariants, no writer features).
LOG_WRITER_VERSION = 2
# gc keeps files removed by commits since its cutoff; for commits a checkpoint covers, it
# reads the checkpoint's remove tombstones instead of each entry. A tombstone's deletion
# timestamp is taken before its commit (retries included): this margin covers that.
TOMBSTONE_MARGIN_MS = 60_000
# delta-rs drops tombstones older than delta.deletedFileRetentionDuration (a week by
# default) from checkpoints: a cutoff older than this reads the entries instead.
TOMBSTONE_TRUST_MS = 6 * 24 * 3600 * 1000
# A random id in each commit's commitInfo: how a committer finds the version it made
# (delta-rs returns nothing) and tells its own commit from another's after a lost reply.
COMMIT_ID_KEY = "mmstore.commitId"
INT32_MAX = 2**31 - 1
# Partition values that name a hive directory without escaping (as the writer's
# check_partition allows), so a Delta path is the plain file path.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LOG_DIR = "_delta_log"
_T = TypeVar("_T")
log = logging.getLogger("mmstore")


# -- plain results -----------------------------------------------------------------------


@dataclass(frozen=True)
class TableFile:
    """One committed Parquet file, as a version lists it.

    ``path`` is store-relative (``rollouts/run_id=r1/step=3/part-….parquet``): what the
    store's backend reads. ``rows`` is the ``numRecords`` stat (None only for a file some
    other tool added without stats).
    """

    path: str
    run_id: str
    step: int
    size: int
    rows: int | None


@dataclass(frozen=True)
class TableSnapshot:
    """The files of one table version, sorted by path."""

    version: int
    files: tuple[TableFile, ...]

    @property
    def rows(self) -> int:
        return sum(f.rows or 0 for f in self.files)


@dataclass(frozen=True)
class CommitResult:
    """What :meth:`RolloutTable.commit` did.

    ``version`` is the table version this call made, or None when it committed nothing:
    ``duplicate`` then says that ``(producer, seq)`` was committed before (by an earlier
    call, another process, or a retry racing this one); ``producer_seq`` is the producer's
    latest committed seq as the log records it.
    """

    version: int | None
    duplicate: bool = False
    producer: str | None = None
    seq: int | None = None
    producer_seq: int | None = None

    @property
    def committed(self) -> bool:
        return self.version is not None


@dataclass(frozen=True)
class Removal:
    """What :meth:`RolloutTable.remove_run` removed, and the version that removed it
    (None when there was nothing to remove)."""

    version: int | None
    files: tuple[TableFile, ...]


@dataclass(frozen=True)
class LogEntry:
    """One commit of the log: the files it added and removed, in the order it lists them,
    and the ``(producer, seq)`` pairs it recorded."""

    version: int
    added: tuple[TableFile, ...]
    removed: tuple[str, ...]  # store-relative paths
    producers: tuple[tuple[str, int], ...]
    operation: str | None
    timestamp_ms: int | None


# -- the table ---------------------------------------------------------------------------


class RolloutTable:
    """The Delta table at ``<store root>/rollouts``.

    Holds one open ``DeltaTable`` for the latest version, brought up to date before each use
    by delta-rs (removals, schema changes, S3 commits), the latest version's files followed
    through the log's new entries, and the commit path's own view of the log (the next
    version, the producers' seqs); other versions are opened on demand. Safe to share
    between threads; pickles without that state (see the module docstring for why a
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
        self.uri, self.storage_options = table_location(storage)
        self.checkpoint_interval = checkpoint_interval
        self._latest: DeltaTable | None = None
        self._lock = threading.RLock()
        self._head: _Head | None = None  # the commit path's view of the log (own entries)
        self._tip: _Tip | None = None  # the latest version's files, kept up to date
        self._checkpointing: threading.Thread | None = None
        self._due: int | None = None  # the version the checkpoint thread writes next

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_latest", "_head", "_tip", "_checkpointing", "_due"):
            state[name] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- creating and opening ------------------------------------------------------------

    def exists(self) -> bool:
        """Whether a Delta table exists at the store's ``rollouts/`` (opens it if so)."""
        # Not DeltaTable.is_deltatable: it holds the GIL while it waits on storage, which
        # stalls every other Python thread of the process (an in-process S3 proxy: forever).
        try:
            with self._lock:
                self._table()
        except TableNotFoundError:
            return False
        return True

    def create(self) -> int:
        """Create the table if there is none; return its latest version.

        Safe to race: of concurrent creators one writes version 0, the others find it. An
        existing table must be partitioned by ``run_id`` and ``step`` (else
        :class:`SchemaVersionError`).
        """
        from deltalake import CommitProperties, DeltaTable, Schema
        from deltalake.exceptions import DeltaError

        _check_runtime(self.uri)
        with self._lock:
            if not self.exists():
                try:
                    DeltaTable.create(
                        self.uri,
                        Schema.from_arrow(TABLE_SCHEMA),
                        mode="ignore",
                        partition_by=PARTITION_COLUMNS,
                        name="rollouts",
                        description="mmstore rollouts (format v2)",
                        configuration=self._configuration(),
                        storage_options=self.storage_options,
                        # No retry: delta-rs would retry a creation that lost the race for
                        # version 0 at version 1, a second protocol and metadata (a new
                        # table id; a schema added since, reverted).
                        commit_properties=CommitProperties(max_commit_retries=0),
                    )
                except DeltaError:
                    # Lost the race for version 0: fine, the winner's table is there.
                    if not self.exists():
                        raise
            return self.latest_version()

    def _configuration(self) -> dict[str, str | None]:
        return {
            "delta.checkpointInterval": str(self.checkpoint_interval),
            # Versions are the store's snapshots (a saved loader state, a pin): their log
            # entries stay until gc decides, not 30 days by delta-rs's default.
            "delta.enableExpiredLogCleanup": "false",
        }

    def _table(self) -> DeltaTable:
        """The latest version's DeltaTable, brought up to date (call under the lock)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError as DeltaTableNotFound

        _check_runtime(self.uri)
        try:
            if self._latest is None:
                table = DeltaTable(self.uri, storage_options=self.storage_options)
                _check_partitioning(table, self.uri)
                self._latest = table
            else:
                self._latest.update_incremental()
        except DeltaTableNotFound:
            raise TableNotFoundError(
                "no rollouts table (no Delta log): create it first", table=self.uri
            ) from None
        return self._latest

    # -- reading versions ----------------------------------------------------------------

    def latest_version(self) -> int:
        """The newest committed version (one failed read of the log when nothing is new)."""
        if _forked():
            return self.replay().version
        with self._lock:
            return self._tip_now().version

    def _tip_now(self) -> _Tip:
        """The latest version's files (call under the lock): delta-rs's snapshot once, then
        each new JSON entry applied, oldest first. Log entries appear in version order (a
        commit takes the version after one it read), so the first missing entry ends the
        log. Keeps the latest snapshot's cost the table's news, not its size: delta-rs
        would replay the log from its checkpoint for any new entry (15 ms at 10,000 files),
        and list every live file again (25 ms more)."""
        if self._tip is None:
            self._tip = self._opened_tip()
            return self._tip  # delta-rs just read the log to its end
        tip, applied = self._tip, 0
        while (text := self._read_log_json(tip.version + 1)) is not None:
            tip.apply(_parse_entry(tip.version + 1, text))
            applied += 1
            if applied == self.checkpoint_interval:  # far behind: skip to a checkpoint?
                last = self._last_checkpoint()
                if last is not None and int(last["version"]) > tip.version:
                    self._tip = tip = self._opened_tip()
        return tip

    def _opened_tip(self) -> _Tip:
        table = self._table()
        return _Tip(int(table.version()), _files(table))

    def snapshot(self, version: int | None = None) -> TableSnapshot:
        """The files of ``version`` (the latest if None), from the log and its checkpoint.

        Raises :class:`TableVersionError` for a version the table does not have. In a
        forked child of a process that used delta-rs (which would panic there) the log is
        replayed without it (:meth:`replay`): a forked rank plans as its parent would.
        """
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError

        if _forked():
            return self.replay(version)
        if version is not None:
            _check_version_argument(version)
        with self._lock:
            tip = self._tip_now() if version is None or self._tip is not None else None
            if tip is not None and version in (None, tip.version):
                return tip.snapshot()
        assert version is not None  # None is always the tip's
        _check_runtime(self.uri)
        try:
            table = DeltaTable(self.uri, version=version, storage_options=self.storage_options)
        except DeltaError:
            latest = self.latest_version()  # also raises TableNotFoundError if none
            raise TableVersionError(
                f"the rollouts table has no version {version} (latest is {latest})"
                if version > latest
                else f"the rollouts table's version {version} can no longer be read "
                "(its log entries are gone)",
                table=self.uri,
                version=version,
            ) from None
        return TableSnapshot(version, _files(table))

    def replay(self, version: int | None = None) -> TableSnapshot:
        """The files of ``version`` (the latest if None) read from the log without delta-rs:
        the newest checkpoint at or below it (single-file, as delta-rs writes them), then
        each JSON entry after it, applying adds and removes in order. Safe in any process;
        slower than :meth:`snapshot` for an old version below the last checkpoint (its
        entries are replayed from version 0)."""
        if version is not None:
            _check_version_argument(version)
        at, files = self._checkpoint_files(version)
        while version is None or at < version:
            text = self._read_log_json(at + 1)
            if text is None:
                break
            entry = _parse_entry(at + 1, text)
            for path in entry.removed:
                files.pop(path, None)
            files.update((f.path, f) for f in entry.added)
            at += 1
        if at < 0:
            raise TableNotFoundError(
                "no rollouts table (no Delta log): create it first", table=self.uri
            )
        if version is not None and at != version:
            raise TableVersionError(
                f"the rollouts table has no version {version} (latest is {at})",
                table=self.uri,
                version=version,
            )
        return TableSnapshot(at, tuple(sorted(files.values(), key=lambda f: f.path)))

    def _checkpoint_files(self, version: int | None) -> tuple[int, dict[str, TableFile]]:
        """The live files of the last checkpoint if it lies at or below ``version`` (and is
        one file), with its version; else nothing, at version -1."""
        try:
            raw = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/_last_checkpoint")
        except FileNotFoundError:
            return -1, {}
        last = json.loads(raw)
        at = int(last["version"])
        if (version is not None and at > version) or last.get("parts"):
            return -1, {}
        data = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/{at:020d}.checkpoint.parquet")
        adds = pq.read_table(pa.BufferReader(data), columns=["add"]).column("add").to_pylist()
        files = {}
        for add in adds:
            if add is not None:
                file = _logged_file({**add, "partitionValues": dict(add["partitionValues"])})
                files[file.path] = file
        return at, files

    def producer_seq(self, producer: str) -> int | None:
        """The latest seq committed by ``producer`` (None if it never committed)."""
        _check_producer(producer, 0)
        with self._lock:
            seq = self._table().transaction_version(producer)
        return None if seq is None else int(seq)

    # -- committing ----------------------------------------------------------------------

    def commit(
        self,
        files: Sequence[TableFile],
        *,
        producer: str | None = None,
        seq: int | None = None,
    ) -> CommitResult:
        """Add ``files`` (already written in place) to the table in one transaction.

        With ``producer`` and ``seq`` the commit happens at most once per pair: it records
        ``(producer, seq)`` in the same transaction, and a pair whose seq is not above the
        producer's latest committed seq commits nothing (``CommitResult.duplicate``). A
        producer's seqs must therefore grow and be committed one at a time, as a retrying
        producer does. Two commits of the same pair racing each other commit once: the
        second loses the version to the first (put-if-absent of its log entry locally,
        or delta-rs's conflict check), and its retry then finds the pair committed.

        Appends that race other appends are retried at later versions; a commit that keeps
        losing to conflicting commits raises :class:`TableConflictError`.
        """
        if isinstance(files, TableFile) or not files:
            raise InvalidArgumentError("commit needs a non-empty sequence of TableFile")
        if (producer is None) != (seq is None):
            raise InvalidArgumentError("producer and seq go together: give both or neither")
        transaction = None
        if producer is not None:
            _check_producer(producer, seq)
            transaction = (producer, int(seq or 0))
        for file in files:
            _check_file(file)
        commit_id = uuid.uuid4().hex
        _check_runtime(self.uri)  # it may start a checkpoint (delta-rs): never in a fork
        if _puts_if_absent(self.storage.backend):
            return self._commit_log(files, commit_id, producer, seq)
        actions = [_add_action(f) for f in files]
        first_read: int | None = None

        def attempt(table: DeltaTable, retry: int) -> CommitResult:
            nonlocal first_read
            read = int(table.version())
            if first_read is None:
                first_read = read
            elif (mine := self._find_commit(commit_id, first_read)) is not None:
                # An earlier attempt of this call did commit; only its reply was lost.
                return CommitResult(mine, False, producer, seq, seq)
            if transaction is not None:
                done = table.transaction_version(transaction[0])
                if done is not None and transaction[1] <= done:
                    return CommitResult(None, True, producer, seq, int(done))
            self._transact(table, actions, commit_id, transaction)
            return CommitResult(self._committed_at(commit_id, read), False, producer, seq, seq)

        what = f"commit of {len(files)} file(s)"
        if producer is not None:
            what += f" for producer {producer!r} seq {seq}"
        return self._retrying(what, attempt)

    def remove_run(self, run_id: str) -> Removal:
        """Remove every file of ``run_id`` from the latest version (Delta remove actions;
        no file is rewritten or deleted). Files a writer commits meanwhile stay."""
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise InvalidArgumentError(f"not a run id: {run_id!r}", table=self.uri)
        return self.remove_files(lambda f: f.run_id == run_id)

    def remove_files(self, select: Callable[[TableFile], bool]) -> Removal:
        """Remove the latest version's files for which ``select`` is true, in one
        transaction (chosen again from the newer version if a conflicting commit wins)."""

        def attempt(table: DeltaTable, retry: int) -> Removal:
            chosen = tuple(f for f in _files(table) if select(f))
            if not chosen:
                return Removal(None, ())
            read, commit_id = int(table.version()), uuid.uuid4().hex
            self._transact(table, [_remove_action(f) for f in chosen], commit_id, None)
            return Removal(self._committed_at(commit_id, read), chosen)

        return self._retrying("removal", attempt)

    def add_columns(self, fields: Iterable[pa.Field]) -> int | None:
        """Add the nullable columns of ``fields`` the table lacks (one metadata commit).

        Files committed before read them as null; returns the version that added them, or
        None when the table had them all. Add a column before committing a file that has
        it: on append, delta-rs keeps the table's schema and ignores the file's.
        """
        from deltalake import Schema
        from deltalake.exceptions import CommitFailedError, DeltaError
        from deltalake.transaction import CommitProperties

        fields = list(fields)
        for field in fields:
            if not field.nullable:
                raise InvalidArgumentError(
                    f"column {field.name!r} must be nullable: files committed before it "
                    "have no values",
                    table=self.uri,
                )

        def attempt(table: DeltaTable, retry: int) -> int | None:
            names = set(pa.schema(table.schema().to_arrow()).names)
            missing = [f for f in fields if f.name not in names]
            if not missing:
                return None
            read, commit_id = int(table.version()), uuid.uuid4().hex
            try:
                table.alter.add_columns(
                    list(Schema.from_arrow(pa.schema(missing)).fields),
                    # Retried here, from the newer version, never by delta-rs from this one.
                    commit_properties=CommitProperties(
                        custom_metadata={COMMIT_ID_KEY: commit_id}, max_commit_retries=0
                    ),
                )
            except CommitFailedError:
                raise  # retried from the newer version
            except DeltaError:
                # Another process may have added the same columns meanwhile: then done.
                names = set(pa.schema(self._table().schema().to_arrow()).names)
                if all(f.name in names for f in fields):
                    return None
                raise
            return self._committed_at(commit_id, read)

        return self._retrying("adding columns", attempt)

    def _retrying(self, what: str, attempt: Callable[[DeltaTable, int], _T]) -> _T:
        """``attempt(latest table, retry number)`` until it returns, retrying (after a short
        random pause) when a conflicting commit wins; :class:`TableConflictError` after
        :data:`COMMIT_ATTEMPTS` losses."""
        from deltalake.exceptions import CommitFailedError

        last: Exception | None = None
        for retry in range(COMMIT_ATTEMPTS):
            with self._lock:
                try:
                    return attempt(self._table(), retry)
                except CommitFailedError as exc:
                    last = exc
            time.sleep(random.uniform(0, 0.005 * (retry + 1)))
        raise TableConflictError(
            f"{what} kept conflicting with other commits ({COMMIT_ATTEMPTS} attempts): {last}",
            table=self.uri,
        )

    def _transact(
        self,
        table: DeltaTable,
        actions: list[Any],
        commit_id: str,
        transaction: tuple[str, int] | None,
    ) -> None:
        from deltalake import Transaction
        from deltalake.transaction import CommitProperties, PostCommitHookProperties

        _check_runtime(self.uri)
        transactions = None
        if transaction is not None:
            transactions = [Transaction(*transaction, int(time.time() * 1000))]
        table.create_write_transaction(
            actions,
            mode="append",
            # The table's own schema: on append delta-rs ignores any other (see add_columns).
            schema=table.schema(),
            partition_by=PARTITION_COLUMNS,
            commit_properties=CommitProperties(
                custom_metadata={COMMIT_ID_KEY: commit_id},
                max_commit_retries=DELTA_COMMIT_RETRIES,
                app_transactions=transactions,
            ),
            post_commithook_properties=PostCommitHookProperties(
                create_checkpoint=True, cleanup_expired_logs=False
            ),
        )

    def _committed_at(self, commit_id: str, read: int) -> int:
        """The version a commit that just succeeded made (read from the log)."""
        version = self._find_commit(commit_id, read)
        if version is None:
            raise TableError(
                f"a commit succeeded but no log entry after version {read} carries its id",
                table=self.uri,
                commit_id=commit_id,
            )
        return version

    def _find_commit(self, commit_id: str, after: int) -> int | None:
        """The version after ``after`` whose commitInfo carries ``commit_id`` (None if none
        does): usually the very next entry."""
        version = after + 1
        while (text := self._read_log_json(version)) is not None:
            if commit_id in text and _commit_info(text).get(COMMIT_ID_KEY) == commit_id:
                return version
            version += 1
        return None

    # -- mmstore's own log writer (local stores, S3 with boto3) ---------------------------
    #
    # delta-rs 1.6 loads every live file's add action to commit (``without_files`` is
    # ignored), replays the log after it and takes checkpoints on the commit's path: a
    # commit cost 10 ms next to a 1.5 ms rename, and 56 ms at 10,000 files. A blind append
    # needs none of that: only the next free version and, for exactly-once, the producers'
    # seqs. So on a local store mmstore writes the entry itself: the protocol's add, txn and
    # commitInfo actions, put-if-absent (a link, which never replaces) at the version after
    # the newest it read; a lost put reads the winner's entry and tries the next version.
    # Cost: one failed read of the log (the next entry) and one durable small write,
    # whatever the table's size. delta-rs still reads every version, writes checkpoints
    # (in the background) and commits removals and schema changes; S3 commits stay with
    # delta-rs (conditional put through object_store; pyarrow's S3 client cannot send
    # ``If-None-Match``).

    def _commit_log(
        self,
        files: Sequence[TableFile],
        commit_id: str,
        producer: str | None,
        seq: int | None,
    ) -> CommitResult:
        with self._lock:
            head = self._log_head()
            for _ in range(LOG_COMMIT_ATTEMPTS):
                if head.writer_version > LOG_WRITER_VERSION:
                    raise SchemaVersionError(
                        f"the rollouts table's protocol needs writer version "
                        f"{head.writer_version}; mmstore writes version {LOG_WRITER_VERSION}",
                        table=self.uri,
                    )
                done = None if producer is None else head.txns.get(producer)
                if done is not None and seq is not None and seq <= done:
                    return CommitResult(None, True, producer, seq, done)
                version = head.version + 1
                text = _append_entry(files, commit_id, producer, seq)
                if self._put_log_entry(version, text):
                    head.apply(text)
                    head.version = version
                    self._checkpoint_later(version, head)
                    return CommitResult(version, False, producer, seq, seq)
                self._advance(head)  # another commit took the version: read what it did
        raise TableConflictError(
            f"commit of {len(files)} file(s) lost the next version "
            f"{LOG_COMMIT_ATTEMPTS} attempts in a row",
            table=self.uri,
        )

    def _log_head(self) -> _Head:
        """The log read up to its newest entry (call under the lock): the last checkpoint's
        producers and protocol once, then only the entries after what was read before."""
        if self._head is None:
            self._head = self._checkpoint_head()
        self._advance(self._head)
        if self._head.version < 0:
            self._head = None
            raise TableNotFoundError(
                "no rollouts table (no Delta log): create it first", table=self.uri
            )
        return self._head

    def _advance(self, head: _Head) -> None:
        while (text := self._read_log_json(head.version + 1)) is not None:
            head.apply(text)
            head.version += 1

    def _checkpoint_head(self) -> _Head:
        """The producers' seqs and the protocol as of the last (single-file) checkpoint;
        an empty head at version -1 when there is none (the entries are then read from 0)."""
        try:
            raw = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/_last_checkpoint")
        except FileNotFoundError:
            return _Head(-1, {}, 0, -1)
        last = json.loads(raw)
        at = int(last["version"])
        if last.get("parts"):
            return _Head(-1, {}, 0, at)
        data = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/{at:020d}.checkpoint.parquet")
        actions = pq.read_table(pa.BufferReader(data), columns=["txn", "protocol"])
        head = _Head(at, {}, 0, at)
        for txn in actions.column("txn").to_pylist():
            if txn is not None:
                head.txns[str(txn["appId"])] = int(txn["version"])
        for protocol in actions.column("protocol").to_pylist():
            if protocol is not None:
                head.writer_version = _writer_version(protocol)
        return head

    def _put_log_entry(self, version: int, text: str) -> bool:
        """Write the entry of ``version`` if no commit has; False if one has. Durable (the
        entry and its name fsync'd) before it returns: the commit is the log entry."""
        rel = f"{ROLLOUTS}/{_LOG_DIR}/{version:020d}.json"
        return self.storage.backend.write_atomic(rel, text.encode(), replace=False)

    def _checkpoint_later(self, version: int, head: _Head) -> None:
        """Checkpoint ``version`` in a background thread when it is due (every
        :attr:`checkpoint_interval` versions, as delta-rs would, or long overdue), under
        the lock: writing one costs about an open of the table, which grows with its live
        files, so the commit does not wait for it. One thread per table, which takes the
        newest due version until none is left; the interpreter waits for it at exit (a
        killed process leaves none written, and the next due version gets one)."""
        overdue = version - head.checkpointed >= 2 * self.checkpoint_interval
        # delta-rs's rule (its post-commit hook): the versions that end an interval.
        if (version + 1) % self.checkpoint_interval and not overdue:
            return
        head.checkpointed = version
        self._due = version
        if self._checkpointing is None:
            self._checkpointing = threading.Thread(
                target=self._write_checkpoints, name="mmstore-checkpoint"
            )
            self._checkpointing.start()

    def _write_checkpoints(self) -> None:
        from deltalake import DeltaTable

        while True:
            with self._lock:
                version, self._due = self._due, None
                if version is None:
                    self._checkpointing = None
                    return
            try:
                table = DeltaTable(self.uri, version=version, storage_options=self.storage_options)
                table.create_checkpoint()
            except Exception:  # only costs: opening reads more entries until the next one
                log.warning("mmstore: checkpoint of version %d failed", version, exc_info=True)

    def join_checkpoint(self) -> None:
        """Wait until the checkpoints this table writes in the background are written."""
        while (thread := self._checkpointing) is not None:
            thread.join()

    def checkpoint(self) -> int:
        """Write a checkpoint of the latest version now; return that version."""
        self.join_checkpoint()
        with self._lock:
            table = self._table()
            table.create_checkpoint()
            return int(table.version())

    # -- following the log ---------------------------------------------------------------

    def log_entry(self, version: int, *, check_cleaned: bool = True) -> LogEntry | None:
        """The commit at ``version`` as its JSON log entry lists it; None if no such version
        is committed yet (or, with ``check_cleaned``, :class:`TableVersionError` if its
        entry was cleaned up below a checkpoint: one more read). No delta-rs call: safe in
        any process."""
        _check_version_argument(version)
        text = self._read_log_json(version)
        if text is None:
            if check_cleaned:
                self._check_not_cleaned(version)
            return None
        return _parse_entry(version, text)

    def entries_after(self, version: int, *, limit: int | None = None) -> list[LogEntry]:
        """The commits after ``version`` (at most ``limit``), oldest first: one read of each
        new log entry and one failed read at the end, whatever the table's size."""
        if version != -1:
            _check_version_argument(version)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise InvalidArgumentError(f"limit must be an int or None, got {limit!r}")
        entries: list[LogEntry] = []
        while limit is None or len(entries) < limit:
            entry = self.log_entry(version + 1 + len(entries))
            if entry is None:
                break
            entries.append(entry)
        return entries

    def removed_after(self, version: int, cutoff_ms: float) -> set[str]:
        """Every file a commit after ``version`` removed, where ``version`` is the newest
        commit older than ``cutoff_ms`` (ms since the epoch): what gc keeps for readers of
        the versions since. A bounded number of reads, not one per commit since
        ``version``: the entries after the last checkpoint one by one, and for the commits
        the checkpoint covers its remove tombstones deleted at or after ``cutoff_ms -``
        :data:`TOMBSTONE_MARGIN_MS` (a remove's deletion timestamp is taken just before
        its commit, so this keeps a few more, never fewer). Reads every entry after
        ``version`` instead when the checkpoint is not newer than it, is multi-part, or
        the cutoff lies beyond the tombstones' retention (delta-rs's default: a week)."""
        _check_version_argument(version)
        removed: set[str] = set()
        start = version
        last = self._last_checkpoint() or {"version": -1}
        recent = time.time() * 1000 - cutoff_ms < TOMBSTONE_TRUST_MS
        if int(last["version"]) > version and not last.get("parts") and recent:
            start = int(last["version"])
            removed |= self._tombstones(start, cutoff_ms - TOMBSTONE_MARGIN_MS)
        for entry in self.entries_after(start):
            removed.update(entry.removed)
        return removed

    def _last_checkpoint(self) -> dict[str, Any] | None:
        try:
            raw = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/_last_checkpoint")
        except FileNotFoundError:
            return None
        return dict(json.loads(raw))

    def _tombstones(self, checkpoint: int, since_ms: float) -> set[str]:
        """The paths of the remove tombstones of checkpoint ``checkpoint`` deleted at or
        after ``since_ms``."""
        data = self.storage.backend.read(
            f"{ROLLOUTS}/{_LOG_DIR}/{checkpoint:020d}.checkpoint.parquet"
        )
        removes = pq.read_table(pa.BufferReader(data), columns=["remove"]).column("remove")
        return {
            f"{ROLLOUTS}/{r['path']}"
            for r in removes.to_pylist()
            if r is not None and (r.get("deletionTimestamp") or 0) >= since_ms
        }

    def _read_log_json(self, version: int) -> str | None:
        try:
            data = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/{version:020d}.json")
        except FileNotFoundError:
            return None
        return data.decode("utf-8")

    def _check_not_cleaned(self, version: int) -> None:
        """A missing entry at or below the last checkpoint was committed and cleaned up
        (entries after the last checkpoint are never cleaned): say so instead of "none yet"."""
        try:
            raw = self.storage.backend.read(f"{ROLLOUTS}/{_LOG_DIR}/_last_checkpoint")
        except FileNotFoundError:
            return
        checkpointed = int(json.loads(raw)["version"])
        if version <= checkpointed:
            raise TableVersionError(
                f"the log entry of version {version} is gone (cleaned up below the checkpoint "
                f"at {checkpointed})",
                table=self.uri,
                version=version,
            )


# -- the latest version, followed ---------------------------------------------------------


class _Tip:
    """The files of the latest version read so far, by path and in path order, updated one
    log entry at a time; the snapshot's tuple is built once per version."""

    def __init__(self, version: int, files: Iterable[TableFile]) -> None:
        self.version = version
        self.files = {f.path: f for f in files}
        self.paths = sorted(self.files)
        self._snapshot: TableSnapshot | None = None

    def apply(self, entry: LogEntry) -> None:
        """Apply the entry after :attr:`version` (removes, then adds, as :meth:`replay`)."""
        for path in entry.removed:
            if self.files.pop(path, None) is not None:
                del self.paths[bisect.bisect_left(self.paths, path)]
        for file in entry.added:
            if file.path not in self.files:
                bisect.insort(self.paths, file.path)
            self.files[file.path] = file
        self.version = entry.version
        self._snapshot = None

    def snapshot(self) -> TableSnapshot:
        if self._snapshot is None:
            files = tuple(self.files[p] for p in self.paths)
            self._snapshot = TableSnapshot(self.version, files)
        return self._snapshot


# -- mmstore's own log entries ----------------------------------------------------------


@dataclass
class _Head:
    """What the commit path knows of the log, read up to ``version``: each producer's
    latest seq, the protocol's writer version, the newest checkpoint it knows of."""

    version: int
    txns: dict[str, int]
    writer_version: int
    checkpointed: int

    def apply(self, text: str) -> None:
        for action in _actions(text):
            if "txn" in action:
                self.txns[str(action["txn"]["appId"])] = int(action["txn"]["version"])
            elif "protocol" in action:
                self.writer_version = _writer_version(action["protocol"])


def _writer_version(protocol: Mapping[str, Any]) -> int:
    """A protocol action's writer version; writer features (version 7) need more than
    mmstore's log writer does."""
    version = int(protocol.get("minWriterVersion") or 0)
    return max(version, 7) if protocol.get("writerFeatures") else version


def _append_entry(
    files: Sequence[TableFile], commit_id: str, producer: str | None, seq: int | None
) -> str:
    """One commit's log entry (newline-delimited JSON actions, as Delta's protocol has
    them): a commitInfo (with its timestamp and mmstore's commit id), the producer's txn,
    an add per file."""
    now = int(time.time() * 1000)
    info = {
        "timestamp": now,
        "operation": "WRITE",
        "operationParameters": {"mode": "Append", "partitionBy": json.dumps(PARTITION_COLUMNS)},
        "isBlindAppend": True,
        "engineInfo": "mmstore",
        COMMIT_ID_KEY: commit_id,
    }
    actions: list[dict[str, Any]] = [{"commitInfo": info}]
    if producer is not None:
        actions.append({"txn": {"appId": producer, "version": seq, "lastUpdated": now}})
    for file in files:
        add = {
            "path": _table_path(file.path),
            "partitionValues": {"run_id": file.run_id, "step": str(file.step)},
            "size": file.size,
            "modificationTime": now,
            "dataChange": True,
            "stats": json.dumps({"numRecords": file.rows}),
        }
        actions.append({"add": add})
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)


# -- delta-rs access ---------------------------------------------------------------------

# The process whose tokio runtime delta-rs created through this module (None: none yet).
_RUNTIME_PID: int | None = None


def _puts_if_absent(backend: Any) -> bool:
    """Whether mmstore writes this store's log entries itself: an atomic put-if-absent
    (locally a link; on S3 a conditional PUT, with boto3); otherwise delta-rs commits."""
    return isinstance(backend, LocalBackend) or bool(getattr(backend, "conditional_put", False))


def _forked() -> bool:
    """Whether delta-rs was started by this module in another process (this one is its
    forked child, where a delta-rs call would panic)."""
    return _RUNTIME_PID is not None and os.getpid() != _RUNTIME_PID


def _check_runtime(uri: str) -> None:
    """Refuse a delta-rs call in a forked child of a process that already used delta-rs:
    the call would panic (tokio's runtime does not survive a fork)."""
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is None:
        _RUNTIME_PID = pid
    elif pid != _RUNTIME_PID:
        raise TableForkError(
            f"delta-rs was started in process {_RUNTIME_PID} and cannot run in its forked "
            f"child {pid}: plan in the parent and read the Parquet files by path in workers "
            "(or start workers with 'spawn')",
            table=uri,
        )


def table_location(storage: Storage) -> tuple[str, dict[str, str] | None]:
    """The table's URI for delta-rs and its storage options (None for a local store)."""
    backend = storage.backend
    if isinstance(backend, S3Backend):
        return f"s3://{backend.abspath(ROLLOUTS)}", delta_s3_options(storage.s3_options)
    if isinstance(backend, LocalBackend):
        return backend.abspath(ROLLOUTS), None
    raise InvalidArgumentError(
        f"no Delta table on a {type(backend).__name__} store", root=storage.root
    )


def delta_s3_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """The store's ``s3_options`` (``pyarrow.fs.S3FileSystem`` keywords) as delta-rs
    (object_store) storage options, with the same environment fallbacks as
    :func:`mmstore._storage.backends.s3_filesystem`; commits use conditional put."""
    opts = dict(options or {})
    out = {"conditional_put": "etag"}
    endpoint, scheme = opts.get("endpoint_override"), opts.get("scheme")
    if not endpoint:
        env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if env:
            parsed = urlparse(env)
            endpoint, scheme = parsed.netloc or parsed.path, scheme or parsed.scheme
    if endpoint:
        url = str(endpoint) if "://" in str(endpoint) else f"{scheme or 'https'}://{endpoint}"
        out["AWS_ENDPOINT_URL"] = url
        if url.startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    region = (
        opts.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    )
    if region:
        out["AWS_REGION"] = str(region)
    for key, name in (
        ("access_key", "AWS_ACCESS_KEY_ID"),
        ("secret_key", "AWS_SECRET_ACCESS_KEY"),
        ("session_token", "AWS_SESSION_TOKEN"),
    ):
        if opts.get(key):
            out[name] = str(opts[key])
    return out


def _check_partitioning(table: DeltaTable, uri: str) -> None:
    partitions = list(table.metadata().partition_columns)
    if partitions != PARTITION_COLUMNS:
        raise SchemaVersionError(
            f"the rollouts table is partitioned by {partitions}, not {PARTITION_COLUMNS}",
            table=uri,
        )


def _files(table: DeltaTable) -> tuple[TableFile, ...]:
    """A DeltaTable's live files (its add actions), sorted by path."""
    actions = pa.table(table.get_add_actions(flatten=True))
    columns = [
        actions.column(name).to_pylist()
        for name in ("path", "partition.run_id", "partition.step", "size_bytes", "num_records")
    ]
    files = [
        TableFile(f"{ROLLOUTS}/{path}", run_id, int(step), int(size), rows)
        for path, run_id, step, size, rows in zip(*columns, strict=True)
    ]
    return tuple(sorted(files, key=lambda f: f.path))


def _add_action(file: TableFile) -> Any:
    from deltalake.transaction import AddAction

    return AddAction(
        path=_table_path(file.path),
        size=file.size,
        partition_values={"run_id": file.run_id, "step": str(file.step)},
        modification_time=int(time.time() * 1000),
        data_change=True,
        stats=json.dumps({"numRecords": file.rows}),
    )


def _remove_action(file: TableFile) -> Any:
    from deltalake.transaction import RemoveAction

    return RemoveAction(
        path=_table_path(file.path),
        data_change=True,
        deletion_timestamp=int(time.time() * 1000),
        size=file.size,
        partition_values={"run_id": file.run_id, "step": str(file.step)},
    )


def _table_path(path: str) -> str:
    return path[len(ROLLOUTS) + 1 :]


# -- the log's JSON ----------------------------------------------------------------------


def _actions(text: str) -> Iterable[dict[str, Any]]:
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _commit_info(text: str) -> dict[str, Any]:
    for action in _actions(text):
        if "commitInfo" in action:
            return dict(action["commitInfo"])
    return {}


def _parse_entry(version: int, text: str) -> LogEntry:
    added: list[TableFile] = []
    removed: list[str] = []
    producers: list[tuple[str, int]] = []
    info: dict[str, Any] = {}
    for action in _actions(text):
        if "add" in action:
            added.append(_logged_file(action["add"]))
        elif "remove" in action:
            removed.append(f"{ROLLOUTS}/{action['remove']['path']}")
        elif "txn" in action:
            producers.append((action["txn"]["appId"], int(action["txn"]["version"])))
        elif "commitInfo" in action:
            info = action["commitInfo"]
    return LogEntry(
        version,
        tuple(added),
        tuple(removed),
        tuple(producers),
        info.get("operation"),
        info.get("timestamp"),
    )


def _logged_file(add: dict[str, Any]) -> TableFile:
    values = add["partitionValues"]
    stats = json.loads(add["stats"]) if add.get("stats") else {}
    rows = stats.get("numRecords")
    return TableFile(
        f"{ROLLOUTS}/{add['path']}",
        str(values["run_id"]),
        int(values["step"]),
        int(add["size"]),
        None if rows is None else int(rows),
    )


# -- argument checks ---------------------------------------------------------------------


def _check_version_argument(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"a table version is an int >= 0, got {version!r}")


def _check_producer(producer: Any, seq: Any) -> None:
    if not isinstance(producer, str) or not producer or len(producer) > 256:
        raise InvalidArgumentError(f"producer must be a non-empty string, got {producer!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise InvalidArgumentError(f"seq must be an int >= 0, got {seq!r}", producer=producer)


def _check_file(file: TableFile) -> None:
    """A file the table can list: under its own partition's directory, with sane numbers."""
    if not isinstance(file, TableFile):
        raise InvalidArgumentError(f"expected a TableFile, got {type(file).__name__}")
    if not isinstance(file.run_id, str) or not _RUN_ID.match(file.run_id):
        raise InvalidArgumentError(f"not a run id: {file.run_id!r}", file=file.path)
    if isinstance(file.step, bool) or not isinstance(file.step, int):
        raise InvalidArgumentError(f"step must be an int, got {file.step!r}", file=file.path)
    if not 0 <= file.step <= INT32_MAX:
        raise InvalidArgumentError(f"step {file.step} is not a non-negative int32", file=file.path)
    prefix = f"{ROLLOUTS}/run_id={file.run_id}/step={file.step}/"
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
    "PARTITION_COLUMNS",
    "TABLE_SCHEMA",
    "CommitResult",
    "LogEntry",
    "Removal",
    "RolloutTable",
    "TableError",
    "TableFile",
    "TableSnapshot",
    "delta_s3_options",
    "table_location",
]
