"""What a loader reads, and where each process gets the materializer that reads it.

Both batch streams (padded: ``_BatchStream`` in :mod:`.dataset`; packed: :mod:`.packed`)
take these two objects instead of the dataset, so neither imports the dataset:

- :class:`ReadSpec`, a value: the store and snapshot, the processor's family, the order
  settings (seed, shuffle, rank, world_size, window_units) and what a sample is cut and
  cast to (max_len, dtype). A resumed run's snapshot makes a new one (``with_snapshot``).
- :class:`MaterializerSource`: this process's materializer (its image cache, the node
  cache, S3 read-ahead), built on first use in each process. Pickled into a DataLoader
  worker it travels as settings only, so every worker builds its own cache, never a copy of
  the parent's. :meth:`MaterializerSource.deferred` is the source whose materializer stops
  before the image processor (``preprocess_device``, :mod:`.device`): the loader picks one
  source once, and the streams only ask it for samples.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mmstore._families import Family
from mmstore._loading.device import DeferredMaterializer
from mmstore._loading.materialize import Materialized, Materializer, MissingPolicy
from mmstore._loading.node_cache import NodeCache
from mmstore._loading.prefetch import Prefetcher, prefetcher_for
from mmstore._loading.settings import Materialize, training_dtype
from mmstore._planning.order import EpochPlan, block_permutation, check_shares
from mmstore._rows.snapshot import Snapshot, read_units
from mmstore._rows.store import Store


@dataclass(frozen=True, eq=False)
class ReadSpec:
    """The rows one rank reads, in which order, and the form its samples take."""

    store: Store
    snapshot: Snapshot
    adapter: Family
    seed: int
    shuffle: bool
    rank: int
    world_size: int
    window_units: int
    max_len: int | None
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # Every rank's share must hold a sample (raised on every rank alike): a rank with
        # none would train nothing, and with even_ranks no rank would.
        check_shares(
            self.snapshot.num_rows,
            rank=self.rank,
            world_size=self.world_size,
            version=self.snapshot.version,
        )

    def with_snapshot(self, snapshot: Snapshot) -> ReadSpec:
        return dataclasses.replace(self, snapshot=snapshot)

    def plan(self, epoch: int, rank: int | None = None) -> EpochPlan:
        """This rank's (or ``rank``'s) ``epoch``, from metadata only: its contiguous,
        sample-balanced share of the epoch order (:mod:`mmstore._planning.order`)."""
        return EpochPlan.build(
            self.snapshot,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            window_units=self.window_units,
        )

    def order_settings(self) -> dict[str, Any]:
        """Besides the snapshot, what decides which sample comes when (a saved state's)."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "window_units": self.window_units,
        }


@dataclass(eq=False)
class MaterializerSource:
    """Settings for this process's :class:`Materializer`, which it builds on first use.

    ``node_cache_dir`` / ``node_cache_bytes``: the node-wide cache, off when either is
    empty. ``prefetch_requests`` / ``prefetch_bytes``: S3 read-ahead (:mod:`.prefetch`).
    """

    store: Store
    adapter: Family
    dtype: torch.dtype
    missing: MissingPolicy
    max_len: int | None
    cache_bytes: int
    node_cache_dir: str | None
    node_cache_bytes: int
    prefetch_requests: int | None
    prefetch_bytes: int
    columns: tuple[str, ...] = ()  # the extra columns read with the rows
    # Built lazily, once per process: the caches live as long as the worker does.
    _built: Materializer | None = field(default=None, init=False, repr=False)
    _prefetcher: Prefetcher | None = field(default=None, init=False, repr=False)
    _built_by: int | None = field(default=None, init=False, repr=False)  # its process id

    @classmethod
    def of(cls, store: Store, adapter: Family, settings: Materialize) -> MaterializerSource:
        """The source of ``settings`` on ``store`` (its node cache and read-ahead bound
        resolved here: they depend on the machine and the store)."""
        node_dir, node_bytes = settings.node_cache_place()
        return cls(
            store,
            adapter,
            dtype=training_dtype(settings.dtype),
            missing=settings.missing,
            max_len=settings.max_len,
            cache_bytes=settings.cache_bytes,
            node_cache_dir=node_dir,
            node_cache_bytes=node_bytes,
            prefetch_requests=settings.prefetch_requests,
            prefetch_bytes=settings.read_ahead_bound(store),
            columns=settings.columns,
        )

    def __getstate__(self) -> dict[str, Any]:
        # Workers build their own materializer, cache and read-ahead threads; never ship the
        # parent's to them.
        return {**self.__dict__, "_built": None, "_prefetcher": None, "_built_by": None}

    def deferred(self) -> MaterializerSource:
        """A source with these settings whose materializer stops before the processor."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return DeferredSource(**settings)

    @property
    def built(self) -> Materializer | None:
        """This process's materializer, None before the first use here."""
        return self._built if self._built_by == os.getpid() else None

    @property
    def prefetcher(self) -> Prefetcher | None:
        """This process's read-ahead (None before the first use, or without read-ahead)."""
        return self._prefetcher if self._built_by == os.getpid() else None

    def get(self) -> Materializer:
        """This process's materializer, built (with its read-ahead) on the first call."""
        # A forked worker inherits the parent's objects without pickling them: it builds its
        # own too (the parent's read-ahead threads do not survive a fork).
        if self._built is None or self._built_by != os.getpid():
            self._built = self._build()
            self._built_by = os.getpid()
            self._prefetcher = prefetcher_for(
                self.store, self.prefetch_requests, self.prefetch_bytes
            )
            if self._prefetcher is not None:
                self._built.media = self._prefetcher
        return self._built

    def _build(self) -> Materializer:
        node = None
        if self.node_cache_bytes and self.node_cache_dir:
            node = NodeCache(self.node_cache_dir, self.node_cache_bytes)
        return Materializer(
            self.store,
            self.adapter,
            dtype=self.dtype,
            missing=self.missing,
            max_len=self.max_len,
            cache_bytes=self.cache_bytes,
            node_cache=node,
        )

    def samples(
        self, spec: ReadSpec, epoch: int, positions: Iterable[int]
    ) -> Iterator[tuple[int, Materialized]]:
        """The samples at increasing ``positions`` of this rank's share of ``spec``'s
        ``epoch``, materialized window by window (each window's rows read once, its media
        read ahead)."""
        plan = spec.plan(epoch)
        wanted = list(positions)
        if wanted and not 0 <= wanted[0] <= wanted[-1] < plan.num_samples:
            raise IndexError(f"positions {wanted[0]}..{wanted[-1]} outside the rank's share")
        at = [plan.first + p for p in wanted]  # epoch positions
        i = 0
        materializer = self.get()
        prefetcher = self._prefetcher
        while i < len(wanted):
            window = plan.window_at(at[i])
            lo, hi = plan.window_range(window)
            j = i
            while j < len(wanted) and at[j] < hi:
                j += 1
            table = read_units(spec.store, plan.windows[window], self.columns)
            order = block_permutation(
                table.column("group_id").to_pylist(),
                seed=spec.seed,
                epoch=epoch,
                window=window,
                shuffle=spec.shuffle,
            )
            # A window at either end of the share is another rank's too: only the rows of
            # this share are taken (the others are published to the node cache as wanted
            # elsewhere, see note_window).
            mine = order[[p - lo for p in at[i:j]]]
            units = plan.windows[window]
            materializer.note_window(
                table, [u.num_rows for u in units], mine, [u.neighbours for u in units]
            )
            rows = table.take(mine)
            self._read_ahead(rows, materializer, prefetcher)
            try:
                yield from zip(wanted[i:j], materializer.samples(rows), strict=True)
            finally:
                if prefetcher is not None:
                    prefetcher.clear()
            i = j

    def _read_ahead(
        self, rows: Any, materializer: Materializer, prefetcher: Prefetcher | None
    ) -> None:
        # Read these rows' media ahead (remote stores), but images already processed, in this
        # worker's cache or the node cache: those are never read, and would hold the bound.
        if prefetcher is None:
            return
        fp, node = self.adapter.fingerprint, materializer.node_cache

        def processed(h: str) -> bool:
            if (h, fp) in materializer.cache:
                return True
            return node is not None and node.key(h, fp, *materializer._node_key) in node

        prefetcher.feed_rows(rows, skip=processed)


class DeferredSource(MaterializerSource):
    """A source of :class:`DeferredMaterializer` s: images decoded in the worker, processed
    on the device in the main process. No node cache: nothing is processed in workers."""

    def _build(self) -> Materializer:
        return DeferredMaterializer(
            self.store,
            self.adapter,
            dtype=self.dtype,
            missing=self.missing,
            max_len=self.max_len,
            cache_bytes=self.cache_bytes,
        )
