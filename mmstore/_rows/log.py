"""mmstore's own side of the rollouts table's log: ``rollouts/_delta_log/`` read and written
through the store's backend, without delta-rs (so safe in any process, a forked one too).

- The records and the JSON of an entry live in :mod:`.entries`.
- Reading: one entry (:meth:`TableLog.entry`), the entries after a version, the files a
  version lists replayed from the last checkpoint and the entries after it
  (:meth:`TableLog.replay`), the files removed since a version (:meth:`TableLog.removed_after`).
- Writing, where the backend puts a file only if it is absent
  (:attr:`~mmstore._storage.backends.Backend.puts_if_absent`: a local store, S3 with
  boto3): one commit's JSON entry (Delta's add, txn and commitInfo actions) put-if-absent at
  the version after the newest it read, retried at the next one when another commit took
  it (:meth:`TableLog.commit`).

Why write commits without delta-rs: delta-rs 1.6 loads every live file's add action to
commit (``without_files`` is ignored), replays the log after it and takes checkpoints on the
commit's path: a commit cost 10 ms next to a 1.5 ms rename, and 56 ms at 10,000 files. A
blind append needs none of that: only the next free version and, for exactly-once, the
producers' seqs. Cost here: one failed read of the log (the next entry) and one durable
small write, whatever the table's size. delta-rs still opens versions, writes checkpoints
(in the background) and commits removals and schema changes (:mod:`.delta`), and commits
appends on a store that cannot put-if-absent (S3 without boto3, or options boto3 has no
twin of).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._format.paths import store_path
from mmstore._rows.entries import (
    COMMIT_ID_KEY,
    LOG_DIR,
    ROWS_DIGEST_KEY,
    CommitResult,
    LogEntry,
    TableFile,
    TableSnapshot,
    actions,
    added_paths,
    append_entry,
    check_reader_protocol,
    commit_info,
    logged_file,
    parse_entry,
    producer_key,
    producer_of,
    writer_version,
)
from mmstore._storage.backends import Backend, FileStat
from mmstore.errors import (
    CorruptFileError,
    MmstoreError,
    ProducerConflictError,
    SchemaVersionError,
    TableConflictError,
    TableError,
    TableNotFoundError,
    TableVersionError,
)

# Puts of a version's entry lost to other writers before a commit gives up. Every lost put
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


# -- the log, read and written through the backend ----------------------------------------


class TableLog:
    """The log of the table at ``uri`` (``uri`` only names it in errors), read and written
    through ``backend``. Holds the commit path's view of the log (the next version, the
    producers' seqs); not thread-safe: its owner
    (:class:`mmstore._rows.table.RolloutTable`) locks."""

    def __init__(self, backend: Backend, uri: str) -> None:
        self.backend = backend
        self.uri = uri
        self._head: _Head | None = None
        # Commits that raised, by id: the version read before their first attempt (a retry
        # looks for its entry from there, see earlier_attempt).
        self._attempts: dict[str, int] = {}

    # -- reading -------------------------------------------------------------------------

    def read_json(self, version: int) -> str | None:
        """The JSON entry of ``version``; None if no such version is committed (yet)."""
        data = self.backend.read_if_present(f"{LOG_DIR}/{version:020d}.json")
        return None if data is None else data.decode("utf-8")

    def last_checkpoint(self) -> dict[str, Any] | None:
        """The log's ``_last_checkpoint`` record (None if no checkpoint was written)."""
        try:
            raw = self.backend.read(f"{LOG_DIR}/_last_checkpoint")
        except FileNotFoundError:
            return None
        return dict(json.loads(raw))

    def entry(self, version: int, *, check_cleaned: bool = True) -> LogEntry | None:
        """The commit at ``version``; None if not committed yet (or, with
        ``check_cleaned``, :class:`TableVersionError` if its entry was cleaned up below a
        checkpoint: one more read)."""
        text = self.read_json(version)
        if text is None:
            if check_cleaned:
                self._check_not_cleaned(version)
            return None
        return parse_entry(version, text, table=self.uri)

    def entries_after(self, version: int, limit: int | None = None) -> list[LogEntry]:
        """The commits after ``version`` (at most ``limit``), oldest first."""
        entries: list[LogEntry] = []
        while limit is None or len(entries) < limit:
            entry = self.entry(version + 1 + len(entries))
            if entry is None:
                break
            entries.append(entry)
        return entries

    def first_version(self) -> int:
        """The oldest version the log can still open: 0, or once the entries below a
        checkpoint were collected (gc's log retention, another engine's
        ``cleanup_metadata()``), that checkpoint's. Both collect the oldest first, so the
        entries left run without a gap to the latest: a binary search finds the oldest."""
        if self.read_json(0) is not None:
            return 0
        last = self.last_checkpoint()
        if last is None:
            return 0
        low, high = 1, int(last["version"])  # the oldest entry left lies in [low, high]
        while low < high:
            middle = (low + high) // 2
            if self.read_json(middle) is None:
                low = middle + 1
            else:
                high = middle
        if self.backend.stat(checkpoint_path(low)) is not None:
            return low
        # A collection stopped half-way: entries are left below the checkpoint it kept.
        return min((v for v in self._checkpoint_versions() if v >= low), default=high)

    def _checkpoint_versions(self) -> list[int]:
        return [
            version
            for f in self.backend.list(LOG_DIR)
            if (version := log_file_version(f.path)) is not None
            and ".checkpoint." in f.path.rsplit("/", 1)[-1]
        ]

    def collect_before(self, boundary: int, *, dry_run: bool = False) -> list[FileStat]:
        """Delete the log's files (entries, checkpoints, checksums) of the versions below
        the newest checkpoint at or below ``boundary``: every version from that checkpoint
        on still opens (the checkpoint, then the entries after it); none before it does.
        Oldest first, so what is left always runs without a gap. What it deleted (or would,
        with ``dry_run``); nothing without such a checkpoint."""
        files = [
            (v, f)
            for f in self.backend.list(LOG_DIR)
            if (v := log_file_version(f.path)) is not None
        ]
        kept = [v for v, f in files if ".checkpoint." in f.path and v <= boundary]
        if not kept:
            return []
        doomed = sorted(((v, f) for v, f in files if v < max(kept)), key=lambda vf: vf[0])
        if not dry_run:
            for _, f in doomed:
                self.backend.delete(f.path)
        return [f for _, f in doomed]

    def _check_not_cleaned(self, version: int) -> None:
        """A missing entry at or below the last checkpoint was committed and cleaned up
        (entries after the last checkpoint are never cleaned): say so instead of "none yet"."""
        last = self.last_checkpoint()
        if last is None:
            return
        checkpointed = int(last["version"])
        if version <= checkpointed:
            raise TableVersionError(
                f"the log entry of version {version} is gone (cleaned up below the checkpoint "
                f"at {checkpointed})",
                table=self.uri,
                version=version,
            )

    def replay(self, version: int | None = None) -> TableSnapshot:
        """The files of ``version`` (the latest if None): the newest checkpoint at or below
        it (single-file, as delta-rs writes them), then each JSON entry after it, applying
        adds and removes in order (an old version below the last checkpoint replays its
        entries from version 0)."""
        at, files = self._checkpoint_files(version)
        while version is None or at < version:
            text = self.read_json(at + 1)
            if text is None:
                break
            entry = parse_entry(at + 1, text, table=self.uri)
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
        last = self.last_checkpoint()
        if last is None:
            return -1, {}
        at = int(last["version"])
        if (version is not None and at > version) or last.get("parts"):
            return -1, {}
        files = {}
        actions = self._checkpoint(at, "add", "protocol")
        for protocol in actions.column("protocol").to_pylist():
            if protocol is not None:
                check_reader_protocol(protocol, table=self.uri, version=at)
        for add in actions.column("add").to_pylist():
            if add is not None:
                try:
                    file = logged_file({**add, "partitionValues": dict(add["partitionValues"])})
                except MmstoreError as exc:
                    raise exc.with_context(table=self.uri, version=at) from None
                except (KeyError, TypeError, ValueError) as exc:
                    raise CorruptFileError(
                        f"the checkpoint of version {at} lists an add action that lacks or "
                        f"garbles {exc}: restore it from a copy of the store, or move it out "
                        "of the log (with _last_checkpoint) to replay the JSON entries",
                        file=f"{LOG_DIR}/{at:020d}.checkpoint.parquet",
                        version=at,
                    ) from None
                files[file.path] = file
        return at, files

    def table_id(self) -> str | None:
        """The table's id (its ``metaData`` action's, written when it was created; a copy
        of the store keeps it): from version 0's entry, or the last checkpoint once that is
        cleaned up. None where neither holds one."""
        text = self.read_json(0)
        if text is not None:
            for action in actions(text):
                if isinstance(action.get("metaData"), dict):
                    return str(action["metaData"].get("id"))
        last = self.last_checkpoint()
        if last is None or last.get("parts"):
            return None
        metadata = self._checkpoint(int(last["version"]), "metaData").column("metaData")
        found = [m["id"] for m in metadata.to_pylist() if m is not None and m.get("id")]
        return str(found[0]) if found else None

    def _checkpoint(self, version: int, *columns: str) -> pa.Table:
        """The action ``columns`` of the (single-file) checkpoint of ``version``."""
        data = self.backend.read(checkpoint_path(version))
        return pq.read_table(pa.BufferReader(data), columns=list(columns))

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
        removed: set[str] = set()
        start = version
        last = self.last_checkpoint() or {"version": -1}
        recent = time.time() * 1000 - cutoff_ms < TOMBSTONE_TRUST_MS
        if int(last["version"]) > version and not last.get("parts") and recent:
            start = int(last["version"])
            removed |= self._tombstones(start, cutoff_ms - TOMBSTONE_MARGIN_MS)
        for entry in self.entries_after(start):
            removed.update(entry.removed)
        return removed

    def _tombstones(self, checkpoint: int, since_ms: float) -> set[str]:
        """The paths of the remove tombstones of checkpoint ``checkpoint`` deleted at or
        after ``since_ms``."""
        return {
            store_path(r["path"])
            for r in self._checkpoint(checkpoint, "remove").column("remove").to_pylist()
            if r is not None and (r.get("deletionTimestamp") or 0) >= since_ms
        }

    def find_commit(self, commit_id: str, after: int) -> int | None:
        """The version after ``after`` whose commitInfo carries ``commit_id`` (None if none
        does): usually the very next entry."""
        version = after + 1
        while (text := self.read_json(version)) is not None:
            if commit_id in text and commit_info(text).get(COMMIT_ID_KEY) == commit_id:
                return version
            version += 1
        return None

    def committed_at(self, commit_id: str, read: int) -> int:
        """The version a commit that just succeeded made (read from the log)."""
        version = self.find_commit(commit_id, read)
        if version is None:
            raise TableError(
                f"a commit succeeded but no log entry after version {read} carries its id",
                table=self.uri,
                commit_id=commit_id,
            )
        return version

    # -- committing (where the backend puts if absent) -----------------------------------

    def commit(
        self,
        files: Sequence[TableFile],
        commit_id: str,
        producer: str | None,
        seq: int | None,
        *,
        digest: str | None = None,
        absent_since: int | None = None,
        final: bool = False,
    ) -> CommitResult:
        """Put the entry adding ``files`` at the next free version; a lost put reads the
        winner's entry and tries the version after it.

        A commit recognises its own entry: one that carries ``commit_id`` (a put whose reply
        was lost, then refused as taken when retried, or an earlier call of the same commit
        that raised after its entry was durable) is this commit, never another's: its
        version is returned, nothing is put twice. With ``producer`` and ``seq`` the commit
        is exactly once per ``(producer, run, seq)`` (:meth:`prior_commit`); with
        ``absent_since`` the files some commit after that version added are left out (they
        are listed already: ``CommitResult.skipped``), so no file is added twice."""
        head = self._log_head()
        mine = self.earlier_attempt(commit_id, lambda: head.version)
        if mine is not None:
            return CommitResult(mine, False, producer, seq, seq)
        found: list[int] = []  # versions of entries that carry this commit's id
        paths = {f.path for f in files}
        taken: set[str] = set()

        def watch(version: int, text: str) -> None:
            if commit_id in text and commit_info(text).get(COMMIT_ID_KEY) == commit_id:
                found.append(version)
            if absent_since is not None and version > absent_since:
                taken.update(paths.intersection(added_paths(text)))

        if absent_since is not None:
            for version in range(absent_since + 1, head.version + 1):
                watch(version, self._entry_text(version))
        for _ in range(LOG_COMMIT_ATTEMPTS):
            if head.writer_version > LOG_WRITER_VERSION:
                raise SchemaVersionError(
                    f"the rollouts table's protocol needs writer version "
                    f"{head.writer_version}; mmstore writes version {LOG_WRITER_VERSION}",
                    table=self.uri,
                )
            result = None
            if found:  # a put of ours that said "taken" had made the entry after all
                result = CommitResult(found[0], False, producer, seq, seq)
            elif producer is not None:
                assert seq is not None
                result = self._prior(head, files, producer, seq, digest)
            todo = [f for f in files if f.path not in taken]
            if result is None and not todo:
                result = CommitResult(None, skipped=tuple(sorted(taken)))
            if result is not None:
                self.settle(commit_id)
                return result
            version = head.version + 1
            app = None if producer is None else producer_key(producer, files[0].run_id)
            text = append_entry(todo, commit_id, app, seq, digest, final)
            if self._put_entry(version, text):
                head.apply(text, version)
                self.settle(commit_id)
                return CommitResult(version, False, producer, seq, seq, tuple(sorted(taken)))
            self._advance(head, watch)  # the version was taken: read what took it
        raise TableConflictError(
            f"commit of {len(files)} file(s) lost the next version "
            f"{LOG_COMMIT_ATTEMPTS} attempts in a row",
            table=self.uri,
        )

    def earlier_attempt(self, commit_id: str, read: Callable[[], int]) -> int | None:
        """The version an earlier call of commit ``commit_id`` made, if that call raised
        after its entry was made (a reply lost for good, a failure after the entry was
        durable); else None, and the version ``read()`` gives is noted, so that a retry of
        this commit that finds no answer looks for its entry from there."""
        since = self._attempts.get(commit_id)
        if since is None:
            self._attempts[commit_id] = read()
            return None
        mine = self.find_commit(commit_id, since)
        if mine is not None:
            self.settle(commit_id)
        return mine

    def settle(self, commit_id: str) -> None:
        """Commit ``commit_id`` returned: its retries need not look for it any more."""
        self._attempts.pop(commit_id, None)

    def prior_commit(
        self, files: Sequence[TableFile], producer: str, seq: int, digest: str | None
    ) -> CommitResult | None:
        """What the log holds of ``(producer, run, seq)`` (see :meth:`_prior`), read up to
        its newest entry."""
        return self._prior(self._log_head(), files, producer, seq, digest)

    def _prior(
        self,
        head: _Head,
        files: Sequence[TableFile],
        producer: str,
        seq: int,
        digest: str | None,
    ) -> CommitResult | None:
        """None if ``(producer, run of files, seq)`` is new: commit it. Else the commit the
        log holds for the pair: this very commit (its files listed: the version that
        made them), or the same rows committed before (a duplicate: nothing committed);
        other rows raise :class:`ProducerConflictError`, and so does a seq below the
        producer's latest in the run that was never committed (the log can then no longer
        tell what was).

        The key is the producer in its run (:func:`producer_key`). A pair an older mmstore
        recorded under the bare producer counts for the run its entry's files are in: a
        producer's steps of another run are not this run's."""
        run = files[0].run_id
        done = head.txns.get(producer_key(producer, run))
        legacy = head.txns.get(producer)
        found: tuple[LogEntry, dict[str, Any]] | None = None
        if done is not None and seq <= done:
            found = self._pair_entry(head, producer_key(producer, run), seq)
        if found is None and legacy is not None and seq <= legacy:
            old = self._pair_entry(head, producer, seq)
            if old is not None and any(f.run_id == run for f in old[0].added):
                found = old
        if found is None:
            if done is not None and seq <= done:
                raise ProducerConflictError(
                    f"producer {producer!r} committed up to seq {done} in run {run!r}; seq "
                    f"{seq} below it was never committed, so it cannot be committed exactly "
                    "once now (a producer's seqs grow): nothing committed",
                    table=self.uri,
                    producer=producer,
                    run_id=run,
                    seq=seq,
                )
            return None
        entry, info = found
        latest = done if done is not None else legacy
        if {f.path for f in files} & {f.path for f in entry.added}:
            return CommitResult(entry.version, False, producer, seq, latest)  # this commit
        if _same_rows(entry, info, files, digest):
            return CommitResult(None, True, producer, seq, latest)
        raise ProducerConflictError(
            f"producer {producer!r} seq {seq} of run {run!r} was committed at version "
            f"{entry.version} with other rows than these: nothing committed (a producer "
            "names each commit of a run by a new seq; another run of the same producer "
            "is a new run_id)",
            table=self.uri,
            producer=producer,
            run_id=run,
            seq=seq,
            version=entry.version,
        )

    def _pair_entry(
        self, head: _Head, app: str, seq: int
    ) -> tuple[LogEntry, dict[str, Any]] | None:
        """The entry whose txn recorded ``(app, seq)`` and its commitInfo; None if the log
        shows none did (read newest first, from the app's latest entry down, until an
        entry of the app with a lower seq: an app's seqs grow along the log)."""
        version = head.pairs.get((app, seq), head.txn_at.get(app, head.version))
        while version >= 0:
            text = self.read_json(version)
            if text is None:
                raise ProducerConflictError(
                    f"the log entry of version {version} is gone, so whether {app!r} seq "
                    f"{seq} was committed cannot be told: nothing committed",
                    table=self.uri,
                    version=version,
                )
            if '"txn"' in text:
                for action in actions(text):
                    txn = action.get("txn")
                    if txn is None or str(txn["appId"]) != app:
                        continue
                    head.pairs[(app, int(txn["version"]))] = version
                    if int(txn["version"]) == seq:
                        return parse_entry(version, text, table=self.uri), commit_info(text)
                    if int(txn["version"]) < seq:
                        return None
            version -= 1
        return None

    def producer_seq(self, producer: str, run_id: str | None = None) -> int | None:
        """The latest seq ``producer`` committed in ``run_id`` (None: in any run); None if
        it never committed there. A seq an older mmstore recorded under the bare producer
        counts for the run of its entry."""
        head = self._log_head()
        if run_id is not None:
            seq = head.txns.get(producer_key(producer, run_id))
            legacy = head.txns.get(producer)
            if seq is None and legacy is not None:
                entry = self._pair_entry(head, producer, legacy)
                if entry is not None and any(f.run_id == run_id for f in entry[0].added):
                    return legacy
            return seq
        seqs = [
            seq for app, seq in head.txns.items() if app == producer or producer_of(app) == producer
        ]
        return max(seqs, default=None)

    def _entry_text(self, version: int) -> str:
        text = self.read_json(version)
        if text is None:
            self._check_not_cleaned(version)
            raise TableVersionError(
                f"the log has no version {version}", table=self.uri, version=version
            )
        return text

    def checkpoint_due(self, version: int, interval: int) -> bool:
        """Whether version ``version``, just committed, gets a checkpoint: every
        ``interval`` versions, as delta-rs would (its post-commit hook's rule: the versions
        that end an interval), or when the last known one is long overdue. A due one counts
        as written from here on (its writer runs in the background)."""
        head = self._head
        assert head is not None, "a commit read the log first"
        overdue = version - head.checkpointed >= 2 * interval
        if (version + 1) % interval and not overdue:
            return False
        head.checkpointed = version
        return True

    def _log_head(self) -> _Head:
        """The log read up to its newest entry: the last checkpoint's producers and
        protocol once, then only the entries after what was read before."""
        if self._head is None:
            self._head = self._checkpoint_head()
        self._advance(self._head)
        if (
            self._head.version > self._head.checkpointed
            and self.read_json(self._head.version) is None
        ):
            # The newest entry read is gone: another engine cleaned the log up below a newer
            # checkpoint (entries go oldest first, so while it stands the next one is truly
            # free). Its next version is then no free version: read again from the checkpoint.
            self._head = self._checkpoint_head()
            self._advance(self._head)
        if self._head.version < 0:
            self._head = None
            raise TableNotFoundError(
                "no rollouts table (no Delta log): create it first", table=self.uri
            )
        return self._head

    def _advance(self, head: _Head, watch: Callable[[int, str], None] | None = None) -> None:
        """Apply the entries after ``head``'s version (each also given to ``watch``)."""
        while (text := self.read_json(head.version + 1)) is not None:
            head.apply(text, head.version + 1)
            if watch is not None:
                watch(head.version, text)

    def _checkpoint_head(self) -> _Head:
        """The producers' seqs and the protocol as of the last (single-file) checkpoint;
        an empty head at version -1 when there is none (the entries are then read from 0)."""
        last = self.last_checkpoint()
        if last is None:
            return _Head(-1, {}, 0, -1)
        at = int(last["version"])
        if last.get("parts"):
            return _Head(-1, {}, 0, at)
        actions = self._checkpoint(at, "txn", "protocol")
        head = _Head(at, {}, 0, at)
        for txn in actions.column("txn").to_pylist():
            if txn is not None:
                head.txns[str(txn["appId"])] = int(txn["version"])
        for protocol in actions.column("protocol").to_pylist():
            if protocol is not None:
                head.writer_version = writer_version(protocol)
        return head

    def _put_entry(self, version: int, text: str) -> bool:
        """Write the entry of ``version`` if no commit has; False if one has. Durable (the
        entry and its name fsync'd) before it returns: the commit is the log entry."""
        rel = f"{LOG_DIR}/{version:020d}.json"
        return self.backend.write_atomic(rel, text.encode(), replace=False)


@dataclass
class _Head:
    """What the commit path knows of the log, read up to ``version``: each app's (producer
    key's) latest seq and the version of its entry where read, the protocol's writer
    version, the newest checkpoint it knows of, and the entries of pairs found by a
    search (:meth:`TableLog._pair_entry`)."""

    version: int
    txns: dict[str, int]
    writer_version: int
    checkpointed: int
    txn_at: dict[str, int] = field(default_factory=dict)
    pairs: dict[tuple[str, int], int] = field(default_factory=dict)

    def apply(self, text: str, version: int) -> None:
        """Apply the entry of ``version`` (the one after :attr:`version`)."""
        for action in actions(text, version):
            if "txn" in action:
                app = str(action["txn"]["appId"])
                self.txns[app] = int(action["txn"]["version"])
                self.txn_at[app] = version
            elif "protocol" in action:
                self.writer_version = writer_version(action["protocol"])
        self.version = version


def _same_rows(
    entry: LogEntry, info: Mapping[str, Any], files: Sequence[TableFile], digest: str | None
) -> bool:
    """Whether ``files`` (rows digested as ``digest``) are the rows ``entry`` committed: the
    digests where both have one, else the files' partitions and row counts."""
    theirs = info.get(ROWS_DIGEST_KEY)
    if digest is not None and theirs is not None:
        return bool(theirs == digest)

    def shape(added: Iterable[TableFile]) -> list[tuple[str, int, int]]:
        return sorted((f.run_id, f.step, f.rows if f.rows is not None else -1) for f in added)

    return shape(entry.added) == shape(files)


# A producer's exactly-once key (a Delta txn's appId) in a run: ``run_id=<run>/<producer>``.


def checkpoint_path(version: int) -> str:
    """The store-relative path of ``version``'s (single-file) checkpoint."""
    return f"{LOG_DIR}/{version:020d}.checkpoint.parquet"


def log_file_version(path: str) -> int | None:
    """The version a log file belongs to (``00000000000000000042.json``, ``...42.checkpoint
    .parquet``, ``...42.crc``); None for ``_last_checkpoint`` and anything else."""
    name = path.rsplit("/", 1)[-1]
    head = name.split(".", 1)[0]
    return int(head) if len(head) == 20 and head.isdigit() and "." in name else None
