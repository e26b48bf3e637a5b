"""The trainer's path: RolloutDataset (what to read) and RolloutLoader (batches, resume).

The loader is a torch DataLoader over a stream of whole batches (``batch_size=None``):
worker ``w`` builds batches ``k + w, k + w + n, …`` of the rank's sample sequence (see
:mod:`._order`), so the batches come out in the same order for any number of workers and a
resume at batch ``k`` reads nothing before it.
"""

from __future__ import annotations

import functools
import operator
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmstore._exceptions import InvalidArgumentError, LayoutMismatchError
from mmstore._families import adapter_for
from mmstore._format.media import warm_decoder
from mmstore._loading.buffers import BatchBuffers
from mmstore._loading.collate import collate
from mmstore._loading.device import DeferredMaterializer, DevicePreprocessor, check_device
from mmstore._loading.materialize import (
    DEFAULT_CACHE_BYTES,
    Materializer,
    MissingPolicy,
    Sample,
    check_missing_policy,
)
from mmstore._loading.microbatch import packed_input_names
from mmstore._loading.node_cache import DEFAULT_NODE_CACHE_BYTES, NodeCache, default_directory
from mmstore._loading.packed import PackedPlanner, PackedStream
from mmstore._loading.prefetch import DEFAULT_PREFETCH_BYTES, Prefetcher, prefetcher_for
from mmstore._loading.workers import (
    WorkerStream,
    check_worker_threads,
    init_worker,
    reraise,
    start_method,
)
from mmstore._planning.order import (
    DEFAULT_WINDOW_UNITS,
    EpochPlan,
    block_permutation,
    worker_batches,
)
from mmstore._rows.files import partition_of
from mmstore._rows.snapshot import (
    Snapshot,
    fingerprints_by_file,
    read_units,
    recorded_layouts,
    take_snapshot,
)
from mmstore._rows.store import Store

STATE_VERSION = 1


class RolloutDataset(IterableDataset[Sample]):
    """The committed rollouts of a store (a snapshot taken now), read for one rank.

    Building it checks every layout fingerprint in the snapshot against ``image_processor``
    and raises :class:`LayoutMismatchError` before any batch. Iterating it directly yields
    unbatched samples; use :class:`RolloutLoader` for batches, workers and resume.
    """

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        dtype: torch.dtype | str = torch.bfloat16,
        missing: MissingPolicy = "error",
        runs: Iterable[str] | None = None,
        steps: Iterable[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        max_len: int | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        node_cache_bytes: int | None = None,
        node_cache_dir: str | None = None,
        window_units: int = DEFAULT_WINDOW_UNITS,
        prefetch_requests: int | None = None,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
    ) -> None:
        check_missing_policy(missing)
        dtype = training_dtype(dtype)
        self.store = store
        self.image_processor = image_processor
        self.adapter = adapter_for(image_processor)
        self.dtype = dtype
        self.missing = missing
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.max_len = max_len
        self.cache_bytes = cache_bytes
        self.node_cache_dir = node_cache_dir or default_directory()
        if node_cache_bytes is None:
            node_cache_bytes = DEFAULT_NODE_CACHE_BYTES if self.node_cache_dir else 0
        if node_cache_bytes < 0:
            raise ValueError(f"node_cache_bytes must be >= 0, got {node_cache_bytes}")
        self.node_cache_bytes = node_cache_bytes
        self.window_units = window_units
        self.prefetch_requests = prefetch_requests
        self.prefetch_bytes = prefetch_bytes
        self.epoch = 0
        self.position = 0
        self.snapshot = take_snapshot(store, runs, steps)
        self._check_layouts(self.snapshot)
        self._materializer: Materializer | None = None
        self._deferred: Materializer | None = None
        self._prefetcher: Prefetcher | None = None

    def _check_layouts(self, snapshot: Snapshot) -> None:
        found = fingerprints_by_file(self.store, snapshot)
        wrong = {fp: files for fp, files in found.items() if fp != self.adapter.fingerprint}
        if wrong:
            runs = {fp: {partition_of(f)[0] for f in files} for fp, files in wrong.items()}
            stored = recorded_layouts(self.store, snapshot.files)
            mine = self.adapter.layout.params()
            listing = "; ".join(
                f"runs {sorted(runs[fp])}: {_layout_diff(stored.get(fp), mine)}"
                for fp in sorted(wrong, key=str)
            )
            raise LayoutMismatchError(
                f"the processor lays images out differently from how they were stored "
                f"(stored vs processor) in {listing}. Build the image processor with the stored "
                "parameters, or select other runs (runs=...)",
                runs=sorted({r for rs in runs.values() for r in rs}),
                files=sorted({f for files in wrong.values() for f in files}),
            )

    def use_snapshot(self, files: list[str]) -> None:
        """Read exactly these committed files (a resumed run's snapshot)."""
        if list(self.snapshot.files) != list(files):
            snapshot = take_snapshot(self.store, files=files)
            self._check_layouts(snapshot)
            self.snapshot = snapshot

    def plan(self, epoch: int | None = None, rank: int | None = None) -> EpochPlan:
        """This rank's (or ``rank``'s) epoch, from metadata only."""
        return EpochPlan.build(
            self.snapshot,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
            shuffle=self.shuffle,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            window_units=self.window_units,
        )

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        return self.plan().num_samples

    def __getstate__(self) -> dict[str, Any]:
        # Workers build their own materializer and cache; never ship the parent's to them.
        state = self.__dict__.copy()
        state["_materializer"] = None
        state["_deferred"] = None
        state["_prefetcher"] = None  # a thread pool: each worker builds its own
        return state

    def materializer(self, deferred: bool = False) -> Materializer:
        """This process's materializer; ``deferred``: the one that stops before the image
        processor (preprocessing on a device, see :mod:`._device`)."""
        # Built lazily, once per worker process: the cache lives as long as the worker.
        if self._materializer is None:
            self._materializer = Materializer(
                self.store,
                self.adapter,
                dtype=self.dtype,
                missing=self.missing,
                max_len=self.max_len,
                cache_bytes=self.cache_bytes,
                node_cache=self._node_cache(),
            )
            self._prefetcher = prefetcher_for(
                self.store, self.prefetch_requests, self.prefetch_bytes
            )
            if self._prefetcher is not None:
                self._materializer.media = self._prefetcher
        if deferred:
            if self._deferred is None:
                self._deferred = DeferredMaterializer.beside(self._materializer)
            return self._deferred
        return self._materializer

    def _node_cache(self) -> NodeCache | None:
        if not self.node_cache_bytes or not self.node_cache_dir:
            return None
        return NodeCache(self.node_cache_dir, self.node_cache_bytes)

    def samples(
        self, epoch: int, positions: Iterable[int], *, deferred: bool = False
    ) -> Iterator[tuple[int, Sample]]:
        """Materialize the samples at increasing ``positions`` of this rank's epoch
        (``deferred``: images decoded only, for the device stage)."""
        plan = self.plan(epoch)
        wanted = list(positions)
        i = 0
        materializer = self.materializer(deferred)
        while i < len(wanted):
            window = plan.window_of(wanted[i])
            lo, hi = plan.window_range(window)
            j = i
            while j < len(wanted) and wanted[j] < hi:
                j += 1
            table = read_units(self.store, plan.windows[window])
            order = block_permutation(
                table.column("group_id").to_pylist(),
                seed=self.seed,
                epoch=epoch,
                rank=self.rank,
                window=window,
                shuffle=self.shuffle,
            )
            mine = order[[p - lo for p in wanted[i:j]]]
            units = plan.windows[window]
            materializer.note_window(
                table, [u.num_rows for u in units], mine, [u.neighbours for u in units]
            )
            rows = table.take(mine)
            self._read_ahead(rows, materializer)
            try:
                yield from zip(wanted[i:j], materializer.samples(rows), strict=True)
            finally:
                if self._prefetcher is not None:
                    self._prefetcher.clear()
            i = j

    def _read_ahead(self, rows: Any, materializer: Materializer) -> None:
        # Read these rows' media ahead (remote stores), but images already processed, in this
        # worker's cache or the node cache: those are never read, and would hold the bound.
        if self._prefetcher is None:
            return
        fp, node = self.adapter.fingerprint, materializer.node_cache

        def processed(h: str) -> bool:
            if (h, fp) in materializer.cache:
                return True
            key = node.key(h, fp, *materializer._node_key) if node else ""
            return node is not None and os.path.exists(os.path.join(node.directory, key))

        self._prefetcher.feed_rows(rows, skip=processed)

    def __iter__(self) -> Iterator[Sample]:
        """Unbatched samples from ``self.position`` on (sharded by position across workers).

        In the main process (no workers) ``state_dict`` tracks what was yielded; with
        workers, resume through :class:`RolloutLoader`.
        """
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        positions = range(self.position + worker, self.plan().num_samples, workers)
        for position, sample in self.samples(self.epoch, positions):
            if info is None:
                self.position = position + 1
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "files": list(self.snapshot.files)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.use_snapshot(state["files"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class _BatchStream(IterableDataset[dict[str, Any]]):
    """Whole batches ``start, start+1, …`` of one epoch, split across DataLoader workers."""

    def __init__(
        self,
        dataset: RolloutDataset,
        *,
        epoch: int,
        start: int,
        batch_size: int,
        drop_last: bool,
        dummy_image: bool,
        pad_token_id: int | None,
        total: int | None = None,
        deferred: bool = False,
        distinct_images: bool = False,
    ) -> None:
        self.dataset = dataset
        self.total = total
        self.deferred = deferred
        self.distinct_images = distinct_images
        self.epoch = epoch
        self.start = start
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.dummy_image = dummy_image
        self.pad_token_id = pad_token_id

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan = self.dataset.plan(self.epoch)
        total = self.total
        if total is None:
            total = plan.num_batches(self.batch_size, self.drop_last)
        mine = worker_batches(self.start, total, worker, workers)
        bs = self.batch_size
        positions = (p for b in mine for p in range(b * bs, min((b + 1) * bs, plan.num_samples)))
        materializer = self.dataset.materializer(self.deferred)
        cache, node = materializer.cache, materializer.node_cache
        pending: list[Sample] = []
        hits, misses = cache.hits, cache.misses
        node_hits, node_misses = (node.hits, node.misses) if node else (0, 0)
        for position, sample in self.dataset.samples(self.epoch, positions, deferred=self.deferred):
            pending.append(sample)
            if position + 1 == min((position // bs + 1) * bs, plan.num_samples):
                batch = collate(
                    pending,
                    self.dataset.adapter,
                    pad_token_id=self.pad_token_id,
                    dummy_image=self.dummy_image,
                    dtype=self.dataset.dtype,
                    distinct_images=self.distinct_images,
                )
                batch["batch_index"] = position // bs
                batch["cache_hits"], batch["cache_misses"] = (
                    cache.hits - hits,
                    cache.misses - misses,
                )
                hits, misses = cache.hits, cache.misses
                # Node level: images this worker found published by any process of the node,
                # and images it processed itself (summed over a node: each distinct image once).
                if node is not None:
                    batch["node_cache_hits"] = node.hits - node_hits
                    batch["node_cache_misses"] = node.misses - node_misses
                    node_hits, node_misses = node.hits, node.misses
                else:
                    batch["node_cache_hits"] = 0
                    batch["node_cache_misses"] = batch["cache_misses"]
                pending = []
                if info is None:
                    self.start = batch["batch_index"] + 1
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.start = int(state["epoch"]), int(state["start"])


class RolloutLoader:
    """Batches of one rank, in an order independent of ``num_workers``, resumable exactly.

    ``state_dict()`` records the epoch, how many batches this loader has handed out, and the
    snapshot's files; ``load_state_dict()`` continues with exactly the rest of that epoch.
    When an epoch is read to its end the loader moves on to the next epoch by itself.
    ``set_epoch(n)`` to the epoch the loader is already in keeps its position (so the usual
    loop below resumes after ``load_state_dict``, as torchdata's ``StatefulDataLoader``
    does); any other epoch starts from its first batch::

        loader.load_state_dict(state)                # optional: resume
        for epoch in range(state["epoch"], epochs):  # or range(epochs) on a fresh run
            loader.set_epoch(epoch)
            for batch in loader:
                ...

    Breaking out of ``for batch in loader`` and iterating again continues after the last
    batch handed out (a plain ``DataLoader`` would start the epoch over); call
    ``set_epoch`` with another epoch, or build a new loader, to start afresh.

    Ranks get whole row groups, so their batch counts can differ by a few. FSDP/DDP hang
    when one rank runs a step the others don't: ``even_ranks=True`` stops every rank after
    the fewest batches any rank has (computed from metadata), dropping the surplus of that
    epoch, as ``DistributedSampler(drop_last=True)`` does; the default keeps every sample.

    **Packed** (``max_tokens=T``): the loader yields micro-batches of at most ``T`` tokens
    instead of padded batches (see :mod:`._microbatch` for what one holds). A step is
    ``batch_size`` samples per rank: positions ``[s*B*W, (s+1)*B*W)`` of the epoch's global
    order, packed all ranks together and dealt token-balanced, every rank the same
    ``num_micro`` (see :mod:`._pack`). Every sample appears once per epoch on one rank; the
    plan comes from footers and small columns only, identically on every rank; ``state_dict``
    counts micro-batches, so a resume is exact at any micro-batch, any ``num_workers``.
    A sample longer than the budget is refused when the epoch is planned
    (:class:`SampleTooLongError`); ``max_len`` truncates first (whole images kept).

    **Preprocessing on a device** (``preprocess_device="cuda"``, a torchvision image
    processor only): workers verify, read and decode each image and send it as uint8 (half
    the bytes of bf16 pixels); the main process runs the real processor on that device
    (resize, rescale, normalize), casts to the train dtype, checks every image against its
    span, and collates the family's image tensors there. Batches (plain or packed) then
    hold their image tensors on the device, floats in the train dtype, integers in their
    usual dtype; every other tensor stays on the CPU as usual. Order, ``state_dict`` and
    resume are unchanged. The node cache does not apply (nothing is processed in workers);
    each worker's cache holds decoded images (``cache_misses``: images decoded), and the
    device processes each distinct image of a batch once.
    A processor that is not a torchvision backend, a device torch does not know, or CUDA
    where none is available raises :class:`InvalidArgumentError`. ``"cpu"`` is valid too
    (the processor in the main process). With ``pin_memory=True`` the uint8 images arrive
    pinned and copy to the GPU asynchronously.

    **Each distinct image once** (``distinct_images=True``, plain or packed): a batch whose
    samples share an image (a GRPO group's) holds its tensors once, plus ``image_index`` and
    ``image_rows`` (see :mod:`._distinct`); :func:`mmstore.expand_images` turns it into the
    plain batch the model takes, best on the GPU after ``.to(device)``: workers then copy,
    and the trainer moves, each image once per batch, and the trainer may also run the
    vision tower once per distinct image and gather its features with ``image_index``.
    """

    def __init__(
        self,
        dataset: RolloutDataset,
        batch_size: int = 8,
        num_workers: int = 0,
        *,
        drop_last: bool = False,
        even_ranks: bool = False,
        dummy_image: bool = False,
        pad_token_id: int | None = None,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        worker_threads: int | None = None,
        max_tokens: int | None = None,
        preprocess_device: str | torch.device | None = None,
        distinct_images: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise InvalidArgumentError(f"batch_size must be positive, got {batch_size}")
        if max_tokens is not None and drop_last:
            raise InvalidArgumentError("drop_last does not apply to packed micro-batches")
        self.max_tokens = max_tokens
        self.distinct_images = distinct_images
        self._planner = (
            None
            if max_tokens is None
            else PackedPlanner(dataset, batch_size=batch_size, max_tokens=max_tokens)
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.even_ranks = even_ranks
        self.dummy_image = dummy_image
        self.pad_token_id = pad_token_id
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.timeout = timeout
        self.worker_threads = check_worker_threads(worker_threads, multiprocessing_context)
        self.epoch = dataset.epoch
        self.batches_yielded = 0
        self.preprocess_device = (
            None if preprocess_device is None else check_device(preprocess_device, dataset.adapter)
        )
        self._device_stage = (
            None
            if self.preprocess_device is None
            else DevicePreprocessor(dataset.adapter, self.preprocess_device, dataset.dtype)
        )

    @property
    def model_input_names(self) -> tuple[str, ...]:
        """The batch keys the family's transformers model takes:
        ``model(**{k: batch[k] for k in loader.model_input_names})`` runs (packed: position
        ids and no padding mask)."""
        if self._planner is not None:
            return packed_input_names(self.dataset.adapter)
        return self.dataset.adapter.model_input_names

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` next: from its first batch, or from where this loader stands in it
        if it is the current epoch (the resume point a ``load_state_dict`` set survives)."""
        if isinstance(epoch, bool) or not hasattr(epoch, "__index__") or operator.index(epoch) < 0:
            raise InvalidArgumentError(f"epoch must be a non-negative int, got {epoch!r}")
        epoch = operator.index(epoch)
        if epoch != self.epoch:
            self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches_yielded = 0

    def __len__(self) -> int:
        """Batches of the current epoch on this rank (the fewest of any rank if even_ranks);
        packed: micro-batches, the same number on every rank."""
        if self._planner is not None:
            return len(self._planner.plan(self.epoch)[0])
        ds = self.dataset
        ranks = range(ds.world_size) if self.even_ranks else [ds.rank]
        return min(
            ds.plan(self.epoch, rank=r).num_batches(self.batch_size, self.drop_last) for r in ranks
        )

    def _stream(self, epoch: int, start: int, total: int) -> IterableDataset[dict[str, Any]]:
        """Batches (or packed micro-batches) ``start..total-1`` of ``epoch`` on this rank."""
        deferred = self._device_stage is not None
        if self._planner is not None:
            return PackedStream(
                self._planner,
                epoch=epoch,
                start=start,
                stop=total,
                pad_token_id=self.pad_token_id,
                deferred=deferred,
                distinct_images=self.distinct_images,
            )
        return _BatchStream(
            self.dataset,
            epoch=epoch,
            start=start,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            dummy_image=self.dummy_image,
            pad_token_id=self.pad_token_id,
            total=total,
            deferred=deferred,
            distinct_images=self.distinct_images,
        )

    def build_batch(self, epoch: int, index: int) -> dict[str, Any]:
        """Batch ``index`` of ``epoch`` on this rank, built in this process: what a worker
        builds (for executors other than DataLoader workers, e.g. Ray actors). With
        ``preprocess_device`` its images are decoded, not processed: pass it through
        :meth:`finish_batch` where the batch is consumed."""
        return next(iter(self._stream(epoch, index, index + 1)))

    def finish_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A worker's batch as this loader yields it: with ``preprocess_device``, its images
        processed and collated on the device (in this process); otherwise as it is."""
        return batch if self._device_stage is None else self._device_stage(batch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = len(self)
        stream = self._stream(self.epoch, self.batches_yielded, total)
        buffers = self._batch_buffers()
        if self.num_workers and self.dataset.adapter.takes_tensors:
            warm_decoder()  # imported once here, not once in each worker it forks (~50 ms)
        loader = DataLoader(
            WorkerStream(stream, buffers) if self.num_workers else stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.multiprocessing_context if self.num_workers else None,
            timeout=self.timeout,
            worker_init_fn=functools.partial(init_worker, self.worker_threads),
        )
        for built in loader:
            reraise(built)
            if buffers is not None:
                buffers.track(built)
            batch = self.finish_batch(built)
            if batch["images_missing"]:
                warnings.warn(
                    f"{batch['images_missing']} sample(s) had missing media, replaced by "
                    f"zero-loss placeholders: {batch['missing_uris']}",
                    stacklevel=2,
                )
            self.batches_yielded += 1
            yield batch
        if self.batches_yielded >= total:
            self._start_epoch(self.epoch + 1)

    def _batch_buffers(self) -> BatchBuffers | None:
        """Reusable shared memory for the workers' batches (:mod:`._buffers`): forked
        workers only (they inherit the table of flags it shares)."""
        if not self.num_workers:
            return None
        if start_method(self.multiprocessing_context) != "fork":
            return None
        # In flight (prefetch_factor each), being built, and held by the trainer.
        return BatchBuffers(self.num_workers, per_worker=(self.prefetch_factor or 2) + 2)

    def _order_settings(self) -> dict[str, Any]:
        """Everything besides the snapshot that decides which batch comes when."""
        ds = self.dataset
        return {
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "even_ranks": self.even_ranks,
            "seed": ds.seed,
            "shuffle": ds.shuffle,
            "rank": ds.rank,
            "world_size": ds.world_size,
            "window_units": ds.window_units,
            "max_tokens": self.max_tokens,
            # the plan's lengths are after truncation: a packed resume needs the same max_len
            **({"max_len": ds.max_len} if self.max_tokens is not None else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            **self._order_settings(),
            "files": list(self.dataset.snapshot.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (any ``num_workers``)."""
        if state.get("version") != STATE_VERSION:
            raise InvalidArgumentError(
                f"loader state version {state.get('version')!r} is not supported"
            )
        fixed = self._order_settings()
        differ = {k: (state.get(k), v) for k, v in fixed.items() if state.get(k) != v}
        if differ:
            raise InvalidArgumentError(
                "loader state was taken with other settings (saved, current): "
                + ", ".join(f"{k}={a!r}/{b!r}" for k, (a, b) in differ.items())
            )
        self.dataset.use_snapshot(state["files"])
        self.epoch = int(state["epoch"])
        self.batches_yielded = int(state["batches_yielded"])


def _layout_diff(stored: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    """``patch_size 14 vs 16, max_pixels …`` over every parameter either side records."""
    if stored is None:
        return "a layout their footers do not record"
    keys = sorted(stored.keys() | mine.keys(), key=lambda k: (k != "family", k))
    differ = [f"{k} {stored.get(k)} vs {mine.get(k)}" for k in keys if stored.get(k) != mine.get(k)]
    return ", ".join(differ) or "the same parameters under another fingerprint"


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size


# Short names people write for the training dtype, beside torch's own attribute names.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def training_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.float16"``,
    ``"bf16"``); anything else raises :class:`InvalidArgumentError`."""
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        found = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
        if not isinstance(found, torch.dtype):
            raise InvalidArgumentError(
                f"dtype {dtype!r} names no torch dtype; pass torch.bfloat16 or a name such as "
                "'bfloat16', 'float16', 'float32' (or 'bf16', 'fp16', 'fp32')"
            )
        dtype = found
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"dtype must be a floating torch dtype (pixel_values are cast to it), got {dtype!r}"
        )
    return dtype
