"""The public store: :class:`Storage` (manifest, media) plus its rows (writer, read-back)."""

from __future__ import annotations

from collections.abc import Iterable

from mmstore._families import Family
from mmstore._format.models import Rollout
from mmstore._rows.readback import read_rollouts
from mmstore._rows.writer import DEFAULT_ROW_GROUP_SIZE, RolloutWriter
from mmstore._storage.store import Storage


class Store(Storage):
    """A rollout store. Open with :meth:`Store.open`; safe to pickle into DataLoader workers."""

    def writer(
        self,
        run_id: str,
        step: int,
        *,
        adapter: Family | None = None,
        row_group_size: int | None = None,
    ) -> RolloutWriter:
        """A writer whose rows become visible atomically when its ``with`` block exits."""
        return RolloutWriter(
            self,
            run_id,
            step,
            adapter=adapter,
            row_group_size=DEFAULT_ROW_GROUP_SIZE if row_group_size is None else row_group_size,
        )

    def rollouts(
        self,
        run_id: str | Iterable[str] | None = None,
        step: int | range | Iterable[int] | None = None,
        sample_ids: str | Iterable[str] | None = None,
    ) -> list[Rollout]:
        """Committed rows as :class:`Rollout` objects: those of ``run_id`` (one or several),
        at ``step`` (an int, a range or several), with these ``sample_ids``; every filter
        left out matches all. Nothing matching raises :class:`NoMatchError` naming what the
        store holds. For replay and inference: ``integrations.vllm`` takes a ``Rollout``."""
        return read_rollouts(self, run_id, step, sample_ids)
