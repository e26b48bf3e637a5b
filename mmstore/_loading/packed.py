"""The packed loader's plumbing: the epoch plan of what a rank reads, and a stream of
micro-batches.

:class:`PackedPlanner` turns a :class:`.spec.ReadSpec` (snapshot, order settings) into this
rank's :class:`RankPlan` for an epoch (from row metadata only, see :mod:`mmstore._rows.lengths`
and :mod:`mmstore._planning.pack`), refusing a sample longer than the budget by name.
:class:`PackedStream` builds micro-batches ``start + w, start + w + n, …`` in DataLoader
worker ``w`` of ``n``, so DataLoader's round robin yields them in plan order for any number
of workers, and a resume at micro-batch ``k`` only needs ``start = k``; its samples come
from the :class:`.spec.MaterializerSource` the loader chose (plain, or decoded only for the
device stage).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from mmstore._loading.materialize import Materialized
from mmstore._loading.microbatch import pack
from mmstore._loading.spec import MaterializerSource, ReadSpec
from mmstore._planning.pack import RankPlan, budget_for, epoch_order, plan_epoch
from mmstore._rows.check import RowWindow
from mmstore._rows.files import open_rollout_file
from mmstore._rows.lengths import RowMeta, read_row_meta
from mmstore._rows.snapshot import WorkUnit, read_units
from mmstore._rows.store import Store
from mmstore.errors import CorruptFileError, InvalidArgumentError, SampleTooLongError

log = logging.getLogger("mmstore")

# Row groups a worker keeps decoded: a step's rows come from a couple of shuffle windows.
UNIT_CACHE = 16


class PackedPlanner:
    """Plans of one spec's epochs for ``max_tokens`` / ``batch_size`` (cached per epoch)."""

    def __init__(
        self, spec: ReadSpec, *, batch_size: int, max_tokens: int, prefix_sharing: bool = False
    ) -> None:
        family = spec.adapter
        self.dummy_tokens = family.num_tokens(*family.dummy_size)
        if max_tokens <= self.dummy_tokens:
            raise InvalidArgumentError(
                f"max_tokens={max_tokens} leaves no room beside the {self.dummy_tokens}-token "
                "dummy image"
            )
        self.spec = spec
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.prefix_sharing = prefix_sharing
        self._meta: RowMeta | None = None
        self._plans: dict[int, tuple[RankPlan, np.ndarray]] = {}  # the last epoch planned

    def for_spec(self, spec: ReadSpec) -> PackedPlanner:
        """This planner, or one for ``spec`` if it is another (a resumed run's snapshot)."""
        if spec is self.spec:
            return self
        return PackedPlanner(
            spec,
            batch_size=self.batch_size,
            max_tokens=self.max_tokens,
            prefix_sharing=self.prefix_sharing,
        )

    def meta(self) -> RowMeta:
        if self._meta is None:
            spec = self.spec
            self._meta = read_row_meta(
                spec.store, spec.snapshot, spec.max_len, prefixes=self.prefix_sharing
            )
        return self._meta

    def budget(self) -> int:
        return budget_for(self.max_tokens, self.dummy_tokens, bool(self.meta().images.any()))

    def plan(self, epoch: int) -> tuple[RankPlan, np.ndarray]:
        """This rank's micro-batches of ``epoch``, and the flat row of each epoch position."""
        meta = self.meta()
        if epoch not in self._plans:
            spec = self.spec
            self._refuse_too_long(meta)
            order = epoch_order(
                spec.snapshot,
                meta.unit_offsets,
                meta.block_start,
                seed=spec.seed,
                epoch=epoch,
                shuffle=spec.shuffle,
                window_units=spec.window_units,
            )
            packing = plan_epoch(
                meta.lengths[order],
                meta.images[order] > 0,
                batch_size=self.batch_size,
                world_size=spec.world_size,
                budget=self.budget(),
                shared=None if meta.shared is None else _shared_in_order(meta.shared, order),
            )
            self._log_unshared(packing.unshared_trees, order)
            self._plans = {epoch: (packing.for_rank(spec.rank), order)}
        return self._plans[epoch]

    def _log_unshared(self, heads: np.ndarray, order: np.ndarray) -> None:
        """Name the groups too large to share a micro-batch (packed unshared instead)."""
        if not len(heads) or not log.isEnabledFor(logging.DEBUG):
            return
        unit, index = self.locate(int(order[heads[0]]))
        first = _read_rows(self.spec, unit, [index], ["sample_id"])[0]["sample_id"]
        log.debug(
            "prefix sharing: %d group(s) hold more than max_tokens after sharing and are "
            "packed unshared, the first starting at sample %r (run %r, step %d)",
            len(heads), first, unit.run_id, unit.step,
        )  # fmt: skip

    def _refuse_too_long(self, meta: RowMeta) -> None:
        budget = self.budget()
        too_long = np.flatnonzero(meta.lengths > budget)
        if not len(too_long):
            return
        row = int(too_long[0])
        unit, index = self.locate(row)
        found = _read_rows(self.spec, unit, [index], ["sample_id", "tokens"])[0]
        sample_id, actual = found["sample_id"], len(found["tokens"])
        max_len = self.spec.max_len
        if min(actual, max_len or actual) <= budget:
            # The plan's length comes from the footer (mmstore.num_tokens); the row itself
            # fits, so it is the footer that lies, not the sample that is too long.
            raise CorruptFileError(
                f"footer says the row has {int(meta.lengths[row])} tokens, it has {actual}",
                file=unit.file,
                run_id=unit.run_id,
                step=unit.step,
                sample_id=sample_id,
            )
        reserve = self.max_tokens - budget
        raise SampleTooLongError(
            f"sample of {int(meta.lengths[row])} tokens exceeds max_tokens={self.max_tokens}"
            + (
                f" less the {reserve}-token dummy image kept free in every micro-batch"
                if reserve
                else ""
            )
            + f" ({len(too_long)} such sample(s)); set max_len <= {budget} to truncate "
            "(whole images kept) or raise max_tokens",
            file=unit.file,
            run_id=unit.run_id,
            step=unit.step,
            sample_id=sample_id,
        )

    def locate(self, row: int) -> tuple[WorkUnit, int]:
        """The unit of flat row ``row``, and the row's index within it."""
        offsets = self.meta().unit_offsets
        u = int(np.searchsorted(offsets, row, side="right")) - 1
        return self.spec.snapshot.units[u], row - int(offsets[u])


def _shared_in_order(shared: np.ndarray, order: np.ndarray) -> np.ndarray:
    """What each epoch position shares with the position before it: its row's ``shared``
    where that position holds the row before it in the file (a block stays in file order),
    else nothing."""
    follows = np.zeros(len(order), dtype=bool)
    follows[1:] = order[:-1] == order[1:] - 1
    return np.where(follows, shared[order], 0)


class PackedStream(IterableDataset[dict[str, Any]]):
    """Micro-batches ``start, start+1, …`` of one rank's epoch, split across workers."""

    def __init__(
        self,
        planner: PackedPlanner,
        source: MaterializerSource,
        *,
        epoch: int,
        start: int,
        stop: int | None = None,
        pad_token_id: int | None = None,
        distinct_images: bool = False,
    ) -> None:
        self.planner = planner  # its prefix_sharing says how micro-batches are built
        self.source = source
        self.distinct_images = distinct_images
        self.stop = stop
        self.pad_token_id = pad_token_id
        self.epoch = epoch
        self.start = start

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan, _ = self.planner.plan(self.epoch)
        stop = len(plan) if self.stop is None else min(self.stop, len(plan))
        yield from self.batches(self.epoch, range(self.start + worker, stop, workers))

    def batches(self, epoch: int, indices: range) -> Generator[dict[str, Any], None, None]:
        """Micro-batches ``indices`` (increasing) of ``epoch``, built in this process."""
        plan, order = self.planner.plan(epoch)
        spec = self.planner.spec
        cache = self.source.get().cache
        reader = UnitReader(spec.store, self.source)
        for index in indices:
            hits, misses = cache.hits, cache.misses
            samples = [self._sample(int(order[p]), reader) for p in plan.samples(index)]
            batch = pack(
                samples,
                spec.adapter,
                add_dummy=bool(plan.dummy[index]),
                dtype=spec.dtype,
                pad_token_id=self.pad_token_id,
                distinct_images=self.distinct_images,
                prefix_sharing=self.planner.prefix_sharing,
            )
            batch.update(
                epoch=epoch,
                step=int(plan.step[index]),
                micro=int(plan.micro[index]),
                num_micro=int(plan.num_micro[index]),
                micro_index=index,
                cache_hits=cache.hits - hits,
                cache_misses=cache.misses - misses,
            )
            yield batch

    def _sample(self, row: int, reader: UnitReader) -> Any:
        unit, index = self.planner.locate(row)
        return reader.sample(unit, index, int(self.planner.meta().lengths[row]))


class UnitReader:
    """Checked, materialized rows of work units for one stream in one process: a unit is
    read (conformed, checked as the padded loader reads) once while it is among the
    :data:`UNIT_CACHE` last used."""

    def __init__(self, store: Store, source: MaterializerSource) -> None:
        self.store = store
        self.source = source
        self.units: OrderedDict[WorkUnit, RowWindow] = OrderedDict()

    def sample(self, unit: WorkUnit, index: int, expected_tokens: int) -> Materialized:
        """Row ``index`` of ``unit``, whose length the plan (the footer) says is
        ``expected_tokens``: the footer's count is checked, never trusted."""
        materializer = self.source.get()
        window = self.units.get(unit)
        if window is None:
            table = read_units(self.store, [unit], self.source.columns)
            # Which worker packs which row is the plan's: any row may be another's.
            materializer.note_window(table, [table.num_rows])
            window = self.units[unit] = materializer.window(table)
            while len(self.units) > UNIT_CACHE:
                self.units.popitem(last=False)
        else:
            self.units.move_to_end(unit)
        sample = materializer.checked_sample(window.row(index))
        if len(sample.input_ids) != expected_tokens:
            raise CorruptFileError(
                f"row has {len(sample.input_ids)} tokens, the plan (footer) says {expected_tokens}",
                file=unit.file,
                run_id=unit.run_id,
                step=unit.step,
                sample_id=sample.sample_id,
            )
        return sample


def _read_rows(
    spec: ReadSpec, unit: WorkUnit, indices: list[int] | None, columns: list[str]
) -> list[dict[str, Any]]:
    try:
        table = open_rollout_file(spec.store, unit.file).read_row_group(
            unit.row_group, columns=columns
        )
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f"unreadable rollout file: {exc}", file=unit.file) from None
    if indices is not None:
        table = table.take(indices)
    return table.to_pylist()
