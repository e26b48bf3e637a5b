"""delta-rs's side of the rollouts table: creating it, opening versions, the latest
version's files, commits through delta-rs (schema changes; appends and removals where the
store cannot put-if-absent: where it can, a removal is a ``DELETE`` entry written here
through the store's backend) and checkpoints. Reading checks what mmstore cannot read
exactly: a reader feature it lacks (deletion vectors), a damaged entry, a path outside the
table (all typed, see :mod:`.log`).

**Never call delta-rs in a forked child.** Its tokio runtime is created by the first call in
a process; a fork of that process that calls delta-rs again panics (``PanicException``, a
``BaseException``). So every call here first checks that the runtime, if this module started
it, belongs to the current process (:func:`check_runtime`), and raises
:class:`TableForkError` instead of panicking; :func:`forked` tells the front to read the log
without delta-rs (:mod:`.log`) instead.

Versions are kept: expired-log cleanup is off, so every version stays readable until gc
(format v2's lifecycle) decides otherwise. A checkpoint every :data:`CHECKPOINT_INTERVAL`
versions bounds what opening a version reads: one checkpoint (every live file's add action)
plus fewer than that many JSON entries. That is the log's own size, never a listing of
``rollouts/``. mmstore's own commits have it written in a background thread
(:meth:`DeltaRsTable.checkpoint_later`: it costs about an open of the table).

Some delta-rs calls (``get_add_actions``, ``is_deltatable``) hold the GIL while they wait
on storage: other Python threads of the process stall meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._rows.delta_records import (
    add_action,
    check_partitioning,
    check_protocol,
    check_writable,
    remove_action,
    table_files,
)
from mmstore._rows.entries import (
    COMMIT_ID_KEY,
    FINAL_KEY,
    PARTITION_COLUMNS,
    ROWS_DIGEST_KEY,
    CommitResult,
    LogEntry,
    Removal,
    TableFile,
    TableSnapshot,
    Tip,
    entry_path,
    parse_entry,
    producer_key,
    removal_entry,
)
from mmstore._rows.log import LOG_COMMIT_ATTEMPTS, TableLog
from mmstore.errors import (
    InvalidArgumentError,
    MmstoreError,
    TableConflictError,
    TableForkError,
    TableNotFoundError,
    TableVersionError,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

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
_T = TypeVar("_T")
log = logging.getLogger("mmstore")

# The process whose tokio runtime delta-rs created through this module (None: none yet).
_RUNTIME_PID: int | None = None


def forked() -> bool:
    """Whether delta-rs was started by this module in another process (this one is its
    forked child, where a delta-rs call would panic)."""
    return _RUNTIME_PID is not None and os.getpid() != _RUNTIME_PID


def check_runtime(uri: str) -> None:
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


class DeltaRsTable:
    """The table at ``uri`` as delta-rs sees it: one open ``DeltaTable`` for the latest
    version, brought up to date before each use, and the latest version's files followed
    through the log's new entries (``log``); other versions are opened on demand.

    Methods that read or change the latest version run under ``lock`` (the front's, which
    holds it around calls that need several steps under it); the checkpoint thread keeps
    its own.
    """

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, str] | None,
        log: TableLog,
        lock: threading.RLock,
        checkpoint_interval: int,
    ) -> None:
        self.uri = uri
        self.storage_options = storage_options
        self.log = log
        self.lock = lock
        self.checkpoint_interval = checkpoint_interval
        self._latest: DeltaTable | None = None
        self._tip: Tip | None = None  # the latest version's files, kept up to date
        self._checkpoint_lock = threading.Lock()
        self._checkpointing: threading.Thread | None = None
        self._due: int | None = None  # the version the checkpoint thread writes next

    # -- creating and opening ------------------------------------------------------------

    def exists(self) -> bool:
        """Whether a Delta table exists at ``uri`` (opens it if so)."""
        # Not DeltaTable.is_deltatable: it holds the GIL while it waits on storage, which
        # stalls every other Python thread of the process (an in-process S3 proxy: forever).
        try:
            with self.lock:
                self._table()
        except TableNotFoundError:
            return False
        return True

    def create(self) -> None:
        """Create the table if there is none (safe to race: of concurrent creators one
        writes version 0, the others find it)."""
        from deltalake import CommitProperties, DeltaTable, Schema
        from deltalake.exceptions import DeltaError

        check_runtime(self.uri)
        with self.lock:
            if self.exists():
                return
            if self.log.backend.puts_if_absent:
                # Version 0 put if absent, as delta-rs writes it but for the absolute path
                # where the table was first made (a copy of the store is elsewhere). Of
                # racing creators one writes it; the others find the winner's table.
                rel = entry_path(0)
                self.log.backend.write_atomic(rel, self._creation_entry().encode(), replace=False)
                return
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
                    # version 0 at version 1, a second protocol and metadata (a new table
                    # id; a schema added since, reverted).
                    commit_properties=CommitProperties(max_commit_retries=0),
                )
            except DeltaError:
                # Lost the race for version 0: fine, the winner's table is there.
                if not self.exists():
                    raise

    def _creation_entry(self) -> str:
        """Version 0's entry as delta-rs writes it for this table (protocol, metadata, a
        CREATE TABLE commitInfo), made in a scratch folder, without the scratch folder's
        ``location``."""
        from deltalake import DeltaTable, Schema

        with tempfile.TemporaryDirectory(prefix="mmstore-create-") as scratch:
            DeltaTable.create(
                scratch,
                Schema.from_arrow(TABLE_SCHEMA),
                partition_by=PARTITION_COLUMNS,
                name="rollouts",
                description="mmstore rollouts (format v2)",
                configuration=self._configuration(),
            )
            with open(os.path.join(scratch, "_delta_log", f"{0:020d}.json")) as f:
                lines = [json.loads(line) for line in f if line.strip()]
        for action in lines:
            if "commitInfo" in action:
                action["commitInfo"].get("operationParameters", {}).pop("location", None)
                action["commitInfo"]["engineInfo"] = "mmstore"
        return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in lines)

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
        from deltalake.exceptions import DeltaError
        from deltalake.exceptions import TableNotFoundError as DeltaTableNotFound

        check_runtime(self.uri)
        try:
            if self._latest is None:
                table = DeltaTable(self.uri, storage_options=self.storage_options)
                check_partitioning(table, self.uri)
                self._latest = table
            else:
                self._latest.update_incremental()
        except DeltaTableNotFound:
            raise TableNotFoundError(
                "no rollouts table (no Delta log): create it first", table=self.uri
            ) from None
        except DeltaError:
            self._latest = None
            self._diagnose(None)
            raise
        check_protocol(self._latest, self.uri)
        return self._latest

    def _diagnose(self, version: int | None) -> None:
        """After delta-rs failed to read ``version`` (None: the latest): read the log as
        mmstore does, which names a damaged entry, a path outside the table or a reader
        feature mmstore lacks (typed); returns if it finds none of those."""
        with contextlib.suppress(TableVersionError, TableNotFoundError):
            self.log.replay(version)

    # -- reading versions ----------------------------------------------------------------

    def latest(self) -> TableSnapshot:
        """The latest version's files (call under the lock): delta-rs's snapshot once, then
        each new JSON entry applied, oldest first. Log entries appear in version order (a
        commit takes the version after one it read), so the first missing entry ends the
        log. Keeps the latest snapshot's cost the table's news, not its size: delta-rs
        would replay the log from its checkpoint for any new entry (15 ms at 10,000 files),
        and list every live file again (25 ms more)."""
        if self._tip is None:
            self._tip = self._opened_tip()
            return self._tip.snapshot()  # delta-rs just read the log to its end
        tip, applied = self._tip, 0
        while True:
            text = self.log.read_json(tip.version + 1)
            if text is None:
                # No entry after the tip: the end of the log, unless another engine cleaned
                # up entries below a newer checkpoint (``cleanup_metadata()``): then the log
                # goes on past the gap, and stopping here would take an old version for the
                # latest (gc would delete every file committed since).
                last = self.log.last_checkpoint()
                if last is None or int(last["version"]) <= tip.version:
                    break
                self._latest = None  # delta-rs's own table would stop at the gap too
                self._tip = tip = self._opened_tip()
                if int(last["version"]) > tip.version:
                    raise TableVersionError(
                        f"the log has no entry after version {tip.version}, yet a checkpoint "
                        f"of version {last['version']}",
                        table=self.uri,
                        version=tip.version + 1,
                    )
                continue
            tip.apply(parse_entry(tip.version + 1, text, table=self.uri))
            applied += 1
            if applied == self.checkpoint_interval:  # far behind: skip to a checkpoint?
                last = self.log.last_checkpoint()
                if last is not None and int(last["version"]) > tip.version:
                    self._tip = tip = self._opened_tip()
        return tip.snapshot()

    def _opened_tip(self) -> Tip:
        table = self._table()
        return Tip(int(table.version()), table_files(table))

    def snapshot(self, version: int) -> TableSnapshot:
        """The files of ``version``: the latest's if this object follows it already, else
        delta-rs's snapshot of that version. Raises :class:`TableVersionError` for a
        version the table does not have."""
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError

        with self.lock:
            if self._tip is not None:
                try:
                    latest: TableSnapshot | None = self.latest()
                except MmstoreError:  # an entry after ``version`` mmstore cannot read
                    latest = None
                if latest is not None and latest.version == version:
                    return latest
        check_runtime(self.uri)
        try:
            table = DeltaTable(self.uri, version=version, storage_options=self.storage_options)
        except DeltaError:
            with self.lock:
                latest_version = self.latest().version  # also raises TableNotFoundError
            if version <= latest_version:
                self._diagnose(version)  # a damaged entry: typed, naming it
            raise TableVersionError(
                f"the rollouts table has no version {version} (latest is {latest_version})"
                if version > latest_version
                else f"the rollouts table's version {version} can no longer be read "
                "(its log entries are gone)",
                table=self.uri,
                version=version,
            ) from None
        check_protocol(table, self.uri)
        return TableSnapshot(version, table_files(table))

    # -- committing ----------------------------------------------------------------------

    def append(
        self,
        files: Sequence[TableFile],
        commit_id: str,
        producer: str | None,
        seq: int | None,
        digest: str | None = None,
        absent_since: int | None = None,
        final: bool = False,
    ) -> CommitResult:
        """Add ``files`` in one delta-rs transaction, exactly once per ``(producer, run,
        seq)`` if given, leaving out files added after ``absent_since`` if given (see
        :meth:`mmstore._rows.table.RolloutTable.commit`)."""
        files = list(files)
        transaction = None
        if producer is not None:
            transaction = (producer_key(producer, files[0].run_id), int(seq or 0))
        paths = {f.path for f in files}
        first_read: int | None = None

        def attempt(table: DeltaTable, retry: int) -> CommitResult:
            nonlocal first_read
            read = int(table.version())
            if first_read is None:
                first_read = read
            elif (mine := self.log.find_commit(commit_id, first_read)) is not None:
                # An earlier attempt of this call did commit; only its reply was lost.
                return CommitResult(mine, False, producer, seq, seq)
            if producer is not None:
                prior = self.log.prior_commit(files, producer, int(seq or 0), digest)
                if prior is not None:
                    return prior
            todo: list[TableFile] = files
            taken: tuple[str, ...] = ()
            if absent_since is not None:
                added = {p for e in self.log.entries_after(absent_since) for p in _paths(e)}
                taken = tuple(sorted(paths & added))
                todo = [f for f in files if f.path not in added]
                if not todo:
                    return CommitResult(None, skipped=taken)
            self._transact(
                table,
                [add_action(f) for f in todo],
                commit_id,
                transaction,
                digest=digest,
                final=final,
                # Each attempt checks the files again: delta-rs must not retry blindly.
                retries=DELTA_COMMIT_RETRIES if absent_since is None else 0,
            )
            version = self.log.committed_at(commit_id, read)
            return CommitResult(version, False, producer, seq, seq, taken)

        what = f"commit of {len(files)} file(s)"
        if producer is not None:
            what += f" for producer {producer!r} seq {seq}"
        return self._retrying(what, attempt)

    def remove_files(
        self, select: Callable[[TableFile], bool], predicate: str | None = None
    ) -> Removal:
        """Remove the latest version's files for which ``select`` is true, in one
        transaction (chosen again from the newer version if a conflicting commit wins).

        Where the store puts a file only if it is absent, the removal is mmstore's own log
        entry, a Delta ``DELETE`` (``predicate`` says what it removed, e.g.
        ``run_id = 'r1'``), so that ``history()`` tells a release from a write. Elsewhere it
        goes through delta-rs, whose only removal without a rewrite is logged as ``WRITE``."""
        if self.log.backend.puts_if_absent:
            return self._remove_in_log(select, predicate)

        def attempt(table: DeltaTable, retry: int) -> Removal:
            chosen = tuple(f for f in table_files(table) if select(f))
            if not chosen:
                return Removal(None, ())
            read, commit_id = int(table.version()), uuid.uuid4().hex
            self._transact(table, [remove_action(f) for f in chosen], commit_id, None)
            return Removal(self.log.committed_at(commit_id, read), chosen)

        return self._retrying("removal", attempt)

    def _remove_in_log(self, select: Callable[[TableFile], bool], predicate: str | None) -> Removal:
        """:meth:`remove_files` as a log entry put if absent at the version after the latest:
        a lost put means another commit took it; the files are chosen again from there."""
        for _ in range(LOG_COMMIT_ATTEMPTS):
            with self.lock:
                check_writable(self._table(), self.uri)
                latest = self.latest()
                chosen = tuple(f for f in latest.files if select(f))
                if not chosen:
                    return Removal(None, ())
                version = latest.version + 1
                text = removal_entry(chosen, uuid.uuid4().hex, predicate)
                if self.log.backend.write_atomic(entry_path(version), text.encode(), replace=False):
                    if (version + 1) % self.checkpoint_interval == 0:
                        self.checkpoint_later(version)
                    return Removal(version, chosen)
        raise TableConflictError(
            f"removal lost the next version {LOG_COMMIT_ATTEMPTS} attempts in a row",
            table=self.uri,
        )

    def add_columns(self, fields: list[pa.Field]) -> int | None:
        """Add the columns of ``fields`` the table lacks (one metadata commit); the version
        that added them, or None when the table had them all."""
        from deltalake import Schema
        from deltalake.exceptions import CommitFailedError, DeltaError
        from deltalake.transaction import CommitProperties

        wanted = pa.schema(Schema.from_arrow(pa.schema(fields)).to_arrow())  # as Delta types

        def attempt(table: DeltaTable, retry: int) -> int | None:
            present = pa.schema(table.schema().to_arrow())
            names = set(present.names)
            for field in wanted:
                if field.name in names and not present.field(field.name).type.equals(field.type):
                    raise InvalidArgumentError(
                        f"column {field.name!r} is {present.field(field.name).type} in the "
                        f"table (another run declared it so), not {field.type}: a name has one "
                        "type across runs; choose another name",
                        table=self.uri,
                        column=field.name,
                    )
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
            return self.log.committed_at(commit_id, read)

        return self._retrying("adding columns", attempt)

    def _retrying(self, what: str, attempt: Callable[[DeltaTable, int], _T]) -> _T:
        """``attempt(latest table, retry number)`` until it returns, retrying (after a short
        random pause) when a conflicting commit wins; :class:`TableConflictError` after
        :data:`COMMIT_ATTEMPTS` losses."""
        from deltalake.exceptions import CommitFailedError

        last: Exception | None = None
        for retry in range(COMMIT_ATTEMPTS):
            with self.lock:
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
        *,
        digest: str | None = None,
        final: bool = False,
        retries: int = DELTA_COMMIT_RETRIES,
    ) -> None:
        from deltalake import Transaction
        from deltalake.transaction import CommitProperties, PostCommitHookProperties

        check_runtime(self.uri)
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
                custom_metadata={
                    COMMIT_ID_KEY: commit_id,
                    **({} if digest is None else {ROWS_DIGEST_KEY: digest}),
                    **({FINAL_KEY: "true"} if final else {}),
                },
                max_commit_retries=retries,
                app_transactions=transactions,
            ),
            post_commithook_properties=PostCommitHookProperties(
                create_checkpoint=True, cleanup_expired_logs=False
            ),
        )

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_later(self, version: int) -> None:
        """Checkpoint ``version`` in a background thread: writing one costs about an open
        of the table, which grows with its live files, so a commit does not wait for it.
        One thread per table, which takes the newest due version until none is left; the
        interpreter waits for it at exit (a killed process leaves none written, and the
        next due version gets one)."""
        with self._checkpoint_lock:
            self._due = version
            if self._checkpointing is None:
                self._checkpointing = threading.Thread(
                    target=self._write_checkpoints, name="mmstore-checkpoint"
                )
                self._checkpointing.start()

    def _write_checkpoints(self) -> None:
        from deltalake import DeltaTable

        while True:
            with self._checkpoint_lock:
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
        with self.lock:
            table = self._table()
            table.create_checkpoint()
            return int(table.version())


def _paths(entry: LogEntry) -> Iterable[str]:
    return (f.path for f in entry.added)
