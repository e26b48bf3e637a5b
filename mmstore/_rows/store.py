"""The public store: :class:`Storage` (manifest, media) plus its rows (the rollouts table,
the writer, read-back)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from mmstore._families import Family
from mmstore._format.columns import Column
from mmstore._format.models import Rollout
from mmstore._format.schema import OPTIONAL_COLUMNS, ROLLOUT_SCHEMA
from mmstore._rows.entries import LOG_DIR
from mmstore._rows.readback import read_rollouts
from mmstore._rows.runs import RUNS
from mmstore._rows.table import RolloutTable, TableFile
from mmstore._rows.versions import table_of, version_files
from mmstore._rows.writer import DEFAULT_ROW_GROUP_SIZE, RolloutWriter
from mmstore._storage.manifest import FORMAT_VERSION, MANIFEST
from mmstore._storage.store import PINS, Storage
from mmstore.errors import TableNotFoundError

# What the rollouts table's log starts with: version 0's entry, or (once old entries are
# cleaned up) the checkpoint that ``_last_checkpoint`` names.
FIRST_ENTRY = f"{LOG_DIR}/{0:020d}.json"
LAST_CHECKPOINT = f"{LOG_DIR}/_last_checkpoint"


class Store(Storage):
    """A rollout store. Open with :meth:`Store.open`; safe to pickle into DataLoader workers.

    Its rollouts are a Delta Lake table at ``<root>/rollouts`` (:attr:`table`): every
    commit makes a new version, and every reader reads one version's files.
    """

    def initialize(self) -> None:
        """A new store's table: version 0, empty."""
        self.table.create()

    def check_existing(self) -> None:
        """An existing (format-2) store opens only with its table's log (:meth:`check_log`);
        one that holds nothing but its manifest (its creator was killed before it made the
        table) gets the table now."""
        if self.manifest.get("format_version") == FORMAT_VERSION:
            self.check_log(create=True)

    def check_log(self, *, create: bool = False) -> None:
        """Refuse a store whose rollouts table has lost its log: one whose ``rollouts``
        (or ``rollouts/_delta_log``) is a file (:class:`NotAStoreError`), or whose log holds
        neither version 0 nor a checkpoint (:class:`TableNotFoundError`, naming what says
        rows were committed). Read as it stands, such a log would list no files: every
        read would find the store empty, and gc would delete every file as unlisted.
        ``create``: give a store that holds nothing but its manifest an empty table
        instead. One stat when the log starts at version 0."""
        if self.backend.stat(FIRST_ENTRY) is not None:
            return
        self.refuse_file_at(LOG_DIR)
        if self._checkpointed():
            return
        found = self._committed_rows()
        if create and not found:
            self.table.create()
            return
        raise TableNotFoundError(
            f"the store at {self.root!r} has no commit log: {LOG_DIR}/ holds neither version 0 "
            f"nor a checkpoint"
            + (f", yet it holds {'; '.join(found)}" if found else "")
            + ". A copy or restore that skips folders starting with '_' leaves the log "
            f"behind: restore {LOG_DIR}/ from the store it came from. Without a copy of it, "
            f'set "format_version": 1 in {MANIFEST} and run `mmstore upgrade {self.root}`: '
            "it commits every Parquet file under rollouts/ anew (rows released but not yet "
            "collected come back; versions and producers' seqs start over). Nothing was "
            "changed: without its log, mmstore neither opens nor collects the store (every "
            "row would look gone, and gc would delete every file)",
            root=self.root,
            log=LOG_DIR,
        )

    def _checkpointed(self) -> bool:
        """Whether the log starts at a checkpoint (entries before it cleaned up): the one
        ``_last_checkpoint`` names is there."""
        try:
            last = json.loads(self.backend.read(LAST_CHECKPOINT))
            version, parts = int(last["version"]), last.get("parts")
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return False
        name = f"{version:020d}.checkpoint" + (f".{1:010d}.{int(parts):010d}" if parts else "")
        return self.backend.stat(f"{LOG_DIR}/{name}.parquet") is not None

    def _committed_rows(self) -> list[str]:
        """What in the store says rows were committed (to a log): its manifest saying it
        was upgraded, rollout Parquet files, run records, pins."""
        found = []
        if "upgraded" in self.manifest:
            found.append(f"{MANIFEST} (upgraded {self.manifest['upgraded']})")
        for what, listed in (
            ("Parquet file(s)", [f.path for f in self.listed_rollout_files()]),
            ("run record(s)", [f.path for f in self.backend.list(RUNS)]),
            ("pin(s)", [f.path for f in self.backend.list(PINS)]),
        ):
            if listed:
                found.append(f"{len(listed)} {what} ({min(listed)}, ...)")
        return found

    @property
    def table(self) -> RolloutTable:
        """The rollouts table (``rollouts/`` as a Delta Lake table), built on first use."""
        return table_of(self)

    def files(self, version: int | None = None) -> list[TableFile]:
        """The committed rollout files of table ``version`` (None: the latest), sorted by
        path: ``path`` (store-relative), ``run_id``, ``step``, ``size``, ``rows``. What
        engines that read plain Parquet (DuckDB, HF datasets) take as the file list of a
        version; ``store.backend.abspath(f.path)`` is where each lies."""
        return list(version_files(self, version).files)

    def rollout_files(self, version: int | None = None) -> list[TableFile]:
        """The same as :meth:`files` (the name of the first format)."""
        return self.files(version)

    def writer(
        self,
        run_id: str,
        step: int,
        *,
        producer: str | None = None,
        seq: int | None = None,
        adapter: Family | None = None,
        row_group_size: int | None = None,
        final: bool = False,
        columns: Mapping[str, Column | str] | None = None,
    ) -> RolloutWriter:
        """A writer whose rows become visible atomically when its ``with`` block exits (one
        new table version). With ``producer`` and ``seq`` the commit happens at most once
        per pair, across retries, processes and crashes (see :class:`RolloutWriter`).
        ``final=True`` marks the producer's last commit to the run: a live loader that has
        followed the final commit of every run it follows trains what waits as a last,
        short step instead of waiting for more (commit nothing to the run after it).
        ``columns`` declares the run's extra columns (``{"ref_logprobs":
        mmstore.per_token("float32"), "difficulty": mmstore.per_sample("float32")}``, see
        :mod:`mmstore._format.columns`): its first writer's declaration is the run's, a
        writer declaring others is refused, one declaring none takes the run's; each row
        carries exactly those (``Rollout(columns={...})``).
        Arguments are checked before anything is done (:class:`InvalidArgumentError`)."""
        writer = RolloutWriter(
            self,
            run_id,
            step,
            adapter=adapter,
            row_group_size=DEFAULT_ROW_GROUP_SIZE if row_group_size is None else row_group_size,
            producer=producer,
            seq=seq,
            final=final,
            columns=columns,
        )
        self._add_new_columns()
        return writer

    def _add_new_columns(self) -> None:
        """Once per process: give a table made before a column was added to the row schema
        (``policy_version``) that column, so Delta readers see what new files carry."""
        if not getattr(self, "_columns_added", False):
            self.table.add_columns(ROLLOUT_SCHEMA.field(name) for name in OPTIONAL_COLUMNS)
            self._columns_added = True

    def rollouts(
        self,
        run_id: str | Iterable[str] | None = None,
        step: int | range | Iterable[int] | None = None,
        sample_ids: str | Iterable[str] | None = None,
        *,
        version: int | None = None,
    ) -> list[Rollout]:
        """Committed rows as :class:`Rollout` objects: those of ``run_id`` (one or several),
        at ``step`` (an int, a range or several), with these ``sample_ids``, in table
        ``version`` (None: the latest); every filter left out matches all. Nothing matching
        raises :class:`NoMatchError` naming what the store holds. For replay and
        inference: ``integrations.vllm`` takes a ``Rollout``."""
        return read_rollouts(self, run_id, step, sample_ids, version=version)
