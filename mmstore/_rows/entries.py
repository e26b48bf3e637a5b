"""The rollouts table's log as data: the plain records every table answer is made of
(:class:`TableFile`, :class:`LogEntry`, :class:`TableSnapshot`, ...; plain data that pickles
into DataLoader workers) and the log's JSON: parsing an entry (every path checked against the
table's root, the reader protocol checked, a damaged entry named with its version and the
way back) and writing one. No I/O: :mod:`.log` reads and writes the entries, :mod:`.delta`
hands delta-rs's answers over as these records.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmstore._format.paths import ROLLOUTS, store_path, table_path
from mmstore.errors import (
    CorruptFileError,
    MmstoreError,
    SchemaVersionError,
)

PARTITION_COLUMNS = ["run_id", "step"]
# A random id in each commit's commitInfo: how a committer finds the version it made
# (delta-rs returns nothing) and tells its own commit from another's after a lost reply.
COMMIT_ID_KEY = "mmstore.commitId"
# What an exactly-once commit committed, in its commitInfo: a digest of its rows (the
# writer's: the step and the sorted sample ids), compared when the same pair comes again.
ROWS_DIGEST_KEY = "mmstore.rowsDigest"
# "true" in the commitInfo of a producer's final commit to its run (``writer(final=True)``):
# a follower learns that the run ended from the log, even if the file is released since.
FINAL_KEY = "mmstore.final"
LOG_DIR = f"{ROLLOUTS}/_delta_log"


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
    """What :meth:`mmstore._rows.table.RolloutTable.commit` did.

    ``version`` is the table version this call made, or None when it committed nothing:
    ``duplicate`` then says that ``(producer, seq)`` was committed before in the files'
    run with the same rows (by an earlier call, another process, or a retry racing this
    one); ``producer_seq`` is the producer's latest committed seq in the run as the log
    records it. ``skipped``: files left out because a commit after the caller's
    ``absent_since`` version had added them already (an upgrade racing another).
    """

    version: int | None
    duplicate: bool = False
    producer: str | None = None
    seq: int | None = None
    producer_seq: int | None = None
    skipped: tuple[str, ...] = ()

    @property
    def committed(self) -> bool:
        return self.version is not None


@dataclass(frozen=True)
class Removal:
    """What :meth:`mmstore._rows.table.RolloutTable.remove_run` removed, and the version
    that removed it (None when there was nothing to remove)."""

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
    # Store-relative paths of this entry's adds and removes with ``dataChange: false``: files
    # rewritten without changing the table's rows (another engine's compaction, OPTIMIZE).
    # Replaying keeps them (the version lists the new file); a follower never trains such an
    # add again, nor takes such a remove for rows gone.
    rearranged: frozenset[str] = frozenset()
    # a producer's final commit to its run (the runs of its adds ended with it)
    final: bool = False


PRODUCER_KEY_PREFIX = "run_id="


def producer_key(producer: str, run_id: str) -> str:
    """The app id of ``producer``'s txn in run ``run_id``: pairs are per producer *and* run,
    so a second run of a producer that numbers its commits by step commits its steps (an
    older mmstore keyed them by the producer alone, see
    :meth:`mmstore._rows.log.TableLog._prior`)."""
    return f"{PRODUCER_KEY_PREFIX}{run_id}/{producer}"


def producer_of(app: str) -> str | None:
    """The producer of a :func:`producer_key` (None for any other app id)."""
    if not app.startswith(PRODUCER_KEY_PREFIX) or "/" not in app:
        return None
    return app.split("/", 1)[1]


def writer_version(protocol: Mapping[str, Any]) -> int:
    """A protocol action's writer version; writer features (version 7) need more than
    mmstore's log writer does."""
    version = int(protocol.get("minWriterVersion") or 0)
    return max(version, 7) if protocol.get("writerFeatures") else version


# -- the log's JSON ----------------------------------------------------------------------


def append_entry(
    files: Sequence[TableFile],
    commit_id: str,
    app: str | None,
    seq: int | None,
    digest: str | None = None,
    final: bool = False,
) -> str:
    """One commit's log entry (newline-delimited JSON actions, as Delta's protocol has
    them): a commitInfo (with its timestamp, mmstore's commit id and the rows' digest if
    given), the producer's txn (``app``: its :func:`producer_key`), an add per file."""
    now = int(time.time() * 1000)
    info = {
        "timestamp": now,
        "operation": "WRITE",
        "operationParameters": {"mode": "Append", "partitionBy": json.dumps(PARTITION_COLUMNS)},
        "isBlindAppend": True,
        "engineInfo": "mmstore",
        COMMIT_ID_KEY: commit_id,
    }
    if digest is not None:
        info[ROWS_DIGEST_KEY] = digest
    if final:
        info[FINAL_KEY] = "true"
    actions: list[dict[str, Any]] = [{"commitInfo": info}]
    if app is not None:
        actions.append({"txn": {"appId": app, "version": seq, "lastUpdated": now}})
    for file in files:
        add = {
            "path": table_path(file.path),
            "partitionValues": partition_values(file),
            "size": file.size,
            "modificationTime": now,
            "dataChange": True,
            "stats": json.dumps({"numRecords": file.rows}),
        }
        actions.append({"add": add})
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)


def partition_values(file: TableFile) -> dict[str, str | None]:
    """An add or remove action's ``partitionValues`` (strings, as Delta keeps them; None
    would be a null partition value, which mmstore never writes)."""
    return {"run_id": file.run_id, "step": str(file.step)}


def actions(text: str, version: int | None = None) -> Iterable[dict[str, Any]]:
    """The actions of an entry's JSON ``text`` (of ``version``, for errors): one JSON object
    a line, or :class:`CorruptFileError` naming the entry."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            action = json.loads(line)
        except (ValueError, RecursionError):
            action = None
        if not isinstance(action, dict):
            raise damaged_entry(version, f"line {number} is not a JSON object: {line[:200]!r}")
        yield action


def entry_path(version: int) -> str:
    """The store-relative path of the log entry of ``version``."""
    return f"{LOG_DIR}/{version:020d}.json"


def damaged_entry(version: int | None, what: str) -> CorruptFileError:
    """The error for a log entry no Delta reader can read (torn, garbage, an action missing
    what the protocol requires): it names the entry and the way back."""
    return CorruptFileError(
        f"the rollouts table's log entry is damaged ({what}). Every read of the table and "
        "every commit stops at it: Delta writes an entry whole, so something else wrote or "
        "changed it. Restore it from a copy of the store (a backup, the store it was copied "
        "from); without one, if it is the newest entry, move it out of the log to give up "
        "that commit (the files it added become orphans that gc collects)",
        file=None if version is None else entry_path(version),
        version=version,
    )


# Reader features mmstore implements: none changes what a file of mmstore's holds
# (timestampNtz: a type mmstore's columns never use; vacuumProtocolCheck: a vacuum rule).
READER_FEATURES = frozenset({"timestampNtz", "vacuumProtocolCheck"})


def check_reader_protocol(
    protocol: Mapping[str, Any], *, table: str | None = None, version: int | None = None
) -> None:
    """Refuse a table whose protocol needs a reader feature mmstore does not implement
    (deletion vectors, column mapping, ...): read without it, rows the table no longer holds
    (or columns under other names) would reach the model. :class:`SchemaVersionError`
    naming the feature."""
    try:
        reader = int(protocol.get("minReaderVersion") or 1)
        features = [str(f) for f in protocol.get("readerFeatures") or []]
    except (TypeError, ValueError, AttributeError):
        raise damaged_entry(version, f"unreadable protocol action {protocol!r:.200}") from None
    if reader <= 1:
        return
    if reader == 2:
        missing = ["columnMapping"]
    elif reader == 3:
        missing = sorted(set(features) - READER_FEATURES)
    else:
        missing = [f"minReaderVersion {reader}"]
    if missing:
        raise unsupported_feature(", ".join(missing), table=table, version=version)


def unsupported_feature(
    feature: str, *, table: str | None = None, version: int | None = None, file: str | None = None
) -> SchemaVersionError:
    return SchemaVersionError(
        f"the rollouts table uses the Delta reader feature {feature}, which mmstore does not "
        "implement: read as mmstore reads, it would give rows the table no longer holds. "
        "Another engine changed the table; mmstore refuses it rather than train on deleted "
        "rows. Read it with an engine that implements the feature, and copy the rows to keep "
        "into a new mmstore store; see docs/engines.md for what other engines may do to a "
        "store's table",
        feature=feature,
        table=table,
        version=version,
        file=file,
    )


def added_paths(text: str) -> set[str]:
    """The store-relative paths an entry's add actions name."""
    if '"add"' not in text:
        return set()
    return {store_path(a["add"]["path"]) for a in actions(text) if "add" in a}


def commit_info(text: str) -> dict[str, Any]:
    """The commitInfo action of an entry ({} if it has none)."""
    for action in actions(text):
        if "commitInfo" in action:
            return dict(action["commitInfo"])
    return {}


def parse_entry(version: int, text: str, *, table: str | None = None) -> LogEntry:
    """The entry of ``version`` (its JSON ``text``) as a :class:`LogEntry`.

    Everything read is checked: a damaged entry (a torn or garbage line, an action without
    what the protocol requires) raises :class:`CorruptFileError` naming the entry and the
    way back; a path outside the table (:func:`~mmstore._format.paths.store_path`) raises
    it too; a protocol or a file needing a reader feature mmstore does not implement
    (deletion vectors) raises :class:`SchemaVersionError` naming the feature."""
    added: list[TableFile] = []
    removed: list[str] = []
    producers: list[tuple[str, int]] = []
    rearranged: set[str] = set()
    info: dict[str, Any] = {}
    for action in actions(text, version):
        try:
            if "add" in action:
                file = logged_file(action["add"])
                added.append(file)
                if action["add"].get("dataChange") is False:
                    rearranged.add(file.path)
            elif "remove" in action:
                path = store_path(action["remove"]["path"])
                removed.append(path)
                if action["remove"].get("dataChange") is False:
                    rearranged.add(path)
            elif "txn" in action:
                producers.append((str(action["txn"]["appId"]), int(action["txn"]["version"])))
            elif "protocol" in action:
                check_reader_protocol(action["protocol"], table=table, version=version)
            elif "commitInfo" in action:
                info = action["commitInfo"] if isinstance(action["commitInfo"], dict) else {}
        except MmstoreError as exc:
            raise exc.with_context(entry=entry_path(version), version=version) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            kind = next(iter(action), "?")
            raise damaged_entry(version, f"its {kind} action lacks or garbles {exc}") from None
    stamp = info.get("timestamp")
    return LogEntry(
        version,
        tuple(added),
        tuple(removed),
        tuple(producers),
        info.get("operation"),
        stamp if isinstance(stamp, int) and not isinstance(stamp, bool) else None,
        frozenset(rearranged),
        final=info.get(FINAL_KEY) == "true",
    )


def logged_file(add: Mapping[str, Any]) -> TableFile:
    """The file an add action lists. Its path must lie inside the table
    (:func:`~mmstore._format.paths.store_path`: :class:`CorruptFileError`), and it must
    not carry a deletion vector (rows deleted that mmstore would read:
    :class:`SchemaVersionError`). Missing or garbled fields raise ``KeyError``,
    ``TypeError`` or ``ValueError`` (:func:`parse_entry` names the entry)."""
    path = store_path(add["path"])
    if add.get("deletionVector") is not None:
        raise unsupported_feature("deletionVectors", file=path)
    values = add["partitionValues"]
    stats = json.loads(add["stats"]) if add.get("stats") else {}
    rows = stats.get("numRecords")
    size = add["size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size {size!r} is not a byte count")
    return TableFile(
        path,
        str(values["run_id"]),
        int(values["step"]),
        size,
        None if rows is None else int(rows),
    )


def removal_entry(files: Iterable[TableFile], commit_id: str, predicate: str | None) -> str:
    """A removal's log entry: a DELETE commitInfo and a remove action per file (as delta-rs
    writes them: partition values, size, the deletion timestamp gc reads)."""
    now = int(time.time() * 1000)
    info = {
        "timestamp": now,
        "operation": "DELETE",
        "operationParameters": {"predicate": predicate or "(chosen files)"},
        "engineInfo": "mmstore",
        COMMIT_ID_KEY: commit_id,
    }
    actions: list[dict[str, Any]] = [{"commitInfo": info}]
    for file in files:
        remove = {
            "path": table_path(file.path),
            "dataChange": True,
            "deletionTimestamp": now,
            "extendedFileMetadata": True,
            "partitionValues": partition_values(file),
            "size": file.size,
        }
        actions.append({"remove": remove})
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions)


# -- the latest version, followed ---------------------------------------------------------


class Tip:
    """The files of the latest version read so far, by path and in path order, updated one
    log entry at a time; the snapshot's tuple is built once per version."""

    def __init__(self, version: int, files: Iterable[TableFile]) -> None:
        self.version = version
        self.files = {f.path: f for f in files}
        self.paths = sorted(self.files)
        self._snapshot: TableSnapshot | None = None

    def apply(self, entry: LogEntry) -> None:
        """Apply the entry after :attr:`version` (removes, then adds, as a replay does)."""
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
