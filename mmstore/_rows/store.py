"""The public store: :class:`Storage` (manifest, media) plus its rows (the rollouts table,
the writer, read-back)."""

from __future__ import annotations

from collections.abc import Iterable

from mmstore._families import Family
from mmstore._format.models import Rollout
from mmstore._format.schema import OPTIONAL_COLUMNS, ROLLOUT_SCHEMA
from mmstore._rows.readback import read_rollouts
from mmstore._rows.table import RolloutTable, TableFile
from mmstore._rows.versions import table_of, version_files
from mmstore._rows.writer import DEFAULT_ROW_GROUP_SIZE, RolloutWriter
from mmstore._storage.store import Storage


class Store(Storage):
    """A rollout store. Open with :meth:`Store.open`; safe to pickle into DataLoader workers.

    Its rollouts are a Delta Lake table at ``<root>/rollouts`` (:attr:`table`): every
    commit makes a new version, and every reader reads one version's files.
    """

    def initialize(self) -> None:
        """A new store's table: version 0, empty (a creator killed before it: see versions)."""
        self.table.create()

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
    ) -> RolloutWriter:
        """A writer whose rows become visible atomically when its ``with`` block exits (one
        new table version). With ``producer`` and ``seq`` the commit happens at most once
        per pair, across retries, processes and crashes (see :class:`RolloutWriter`)."""
        self._add_new_columns()
        return RolloutWriter(
            self,
            run_id,
            step,
            adapter=adapter,
            row_group_size=DEFAULT_ROW_GROUP_SIZE if row_group_size is None else row_group_size,
            producer=producer,
            seq=seq,
        )

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
