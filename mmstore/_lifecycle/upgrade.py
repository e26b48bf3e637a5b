"""upgrade: a format-1 store becomes a format-2 store in place, its files kept as they are.

Format 1 committed a rollout file by renaming it into ``rollouts/run_id=…/step=…/``; readers
listed the directory. Format 2 adds the commit log (``rollouts/_delta_log/``): the upgrade
lists the format-1 files once, in sorted path order, and commits them to a new table in
that order (batches of :data:`BATCH_FILES` files, one transaction each), then writes each
run's layout records from the footers (``runs/``), and only then bumps the manifest to
format 2. Nothing is rewritten or moved; pins (media hashes) keep working as they are.

Safe to kill at any point and run again: until the manifest says 2 the store is a format-1
store (a format-1 reader ignores ``_delta_log``, whose name starts with ``_``), and a rerun
commits only the files the table does not list yet, in the same order. Safe to run twice at
once (two operators, a retried job): idempotent at the log, each batch's commit leaves out
the files any commit since the upgrade read the table added (``absent_since``: checked
against every log entry it loses a version to, under the commit's put-if-absent), so no
file is added twice and a live loader following the log from version 0 trains each once.
Stop the writers of the old mmstore first: a file they commit after the upgrade listed the
directory is not in the table (format 2 reads only what the log lists; gc would remove it
as an orphan).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from mmstore._format.paths import is_placed, partition_of
from mmstore._format.schema import META_LAYOUTS
from mmstore._progress import bar
from mmstore._rows.files import open_rollout_file
from mmstore._rows.runs import record_layouts
from mmstore._rows.store import Store
from mmstore._rows.table import TableFile
from mmstore._rows.versions import commit_files, version_files
from mmstore._storage.backends import FileStat
from mmstore._storage.manifest import FORMAT_V1, FORMAT_VERSION, MANIFEST
from mmstore.errors import CorruptFileError

# Files per commit: a commit's log entry stays small (an add action is ~300 bytes), and a
# store of 100,000 files takes 100 commits, a few checkpoints among them.
BATCH_FILES = 1000


@dataclass(frozen=True)
class UpgradeReport:
    root: str
    upgraded: bool  # False: the store was format 2 already (nothing to do)
    files_committed: int  # by this call
    files_already_committed: int  # by an earlier, interrupted call
    table_version: int  # the latest version when done
    runs_recorded: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def upgrade(
    root: str | os.PathLike[str],
    *,
    s3_options: dict[str, Any] | None = None,
    batch_files: int = BATCH_FILES,
    progress: bool | None = None,
) -> UpgradeReport:
    """Upgrade the store at ``root`` from format 1 to format 2 in place (see the module
    docstring); a format-2 store is left as it is. Returns what was done."""
    root = os.fspath(root)
    store = Store.open_format(root, False, (FORMAT_V1, FORMAT_VERSION), s3_options=s3_options)
    if store.manifest.get("format_version") == FORMAT_VERSION:
        version = store.table.create()  # a creator killed before making it: make it now
        return UpgradeReport(root, False, 0, len(store.files()), version, 0)
    files = _format_1_files(store)
    store.table.create()
    read = version_files(store)
    committed = {f.path for f in read.files}
    todo = [f for f in files if f.path not in committed]
    layouts: dict[str, dict[str, dict[str, Any]]] = {}
    pending: list[TableFile] = []
    batches = _Batches(store, read.version, committed)
    for stat in bar(todo, desc="upgrade", unit="file", progress=progress):
        pending.append(_table_file(store, stat, layouts))
        if len(pending) >= batch_files:
            batches.commit(pending)
            pending = []
    if pending:
        batches.commit(pending)
    for path in (f.path for f in files if f.path in committed):  # their runs' records too
        _read_layouts(store, path, layouts)
    for run_id, found in sorted(layouts.items()):
        record_layouts(store, run_id, found, cached=False)
    _bump_manifest(store)
    version = version_files(store).version
    done = batches.added
    return UpgradeReport(root, True, done, len(files) - done, version, len(layouts))


class _Batches:
    """An upgrade's commits: each batch leaves out the files the table lists by now (read
    from the log entries since the last batch: another upgrade's commits), and its commit
    leaves out those a commit racing it adds (``absent_since``)."""

    def __init__(self, store: Store, version: int, committed: set[str]) -> None:
        self.store = store
        self.seen = version  # the log read up to here; committed: its files
        self.committed = committed
        self.added = 0  # files this upgrade committed

    def commit(self, batch: list[TableFile]) -> None:
        for entry in self.store.table.entries_after(self.seen):
            self.committed.update(f.path for f in entry.added)
            self.seen = entry.version
        batch = [f for f in batch if f.path not in self.committed]
        if not batch:
            return
        result = commit_files(self.store, batch, absent_since=self.seen)
        self.added += len(batch) - len(result.skipped)


def _format_1_files(store: Store) -> list[FileStat]:
    """What a format-1 reader read: every Parquet file under ``rollouts/`` outside ``_`` and
    ``.`` folders, in path order; each must lie directly in its partition's directory."""
    files = store.listed_rollout_files()
    misplaced = [f.path for f in files if not is_placed(f.path)]
    if misplaced:
        raise CorruptFileError(
            f"{len(misplaced)} rollout file(s) are not directly under a "
            "rollouts/run_id=<run>/step=<step>/ directory, so no table can list them: move "
            "them there (or out of rollouts/) and run the upgrade again",
            root=store.root,
            files=misplaced[:10],
        )
    return files


def _table_file(
    store: Store, stat: FileStat, layouts: dict[str, dict[str, dict[str, Any]]]
) -> TableFile:
    """The add action of one format-1 file: its row count from the footer (which must read),
    its size as it is; its layouts noted for the run's records."""
    meta = _read_layouts(store, stat.path, layouts)
    run_id, step = partition_of(stat.path)
    return TableFile(stat.path, run_id, step, stat.size, meta)


def _read_layouts(store: Store, path: str, layouts: dict[str, dict[str, dict[str, Any]]]) -> int:
    """Note the layouts ``path``'s footer records under its run; return its row count."""
    footer = open_rollout_file(store, path).metadata
    run_id, _ = partition_of(path)
    raw = (footer.metadata or {}).get(META_LAYOUTS)
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        raise CorruptFileError("unreadable mmstore.layouts footer entry", file=path) from None
    if isinstance(found, dict):
        run = layouts.setdefault(run_id, {})
        for fingerprint, params in _records(found):
            run.setdefault(fingerprint, params)
    return int(footer.num_rows)


def _records(found: dict[Any, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for fingerprint, params in found.items():
        if isinstance(fingerprint, str) and isinstance(params, dict):
            yield fingerprint, params


def _bump_manifest(store: Store) -> None:
    """The last step: the manifest says format 2 (atomically replaced, other keys kept)."""
    manifest = {
        **store.manifest,
        "format_version": FORMAT_VERSION,
        "upgraded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    store.backend.write_atomic(MANIFEST, json.dumps(manifest, indent=2).encode())
