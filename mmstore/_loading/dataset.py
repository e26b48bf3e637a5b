"""The trainer's path: RolloutDataset (what to read) and RolloutLoader (batches, resume).

The loader is a torch DataLoader over a stream of whole batches (``batch_size=None``):
worker ``w`` builds batches ``k + w, k + w + n, …`` of the rank's sample sequence (see
:mod:`._order`), so the batches come out in the same order for any number of workers and a
resume at batch ``k`` reads nothing before it.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmstore._families import Family, adapter_for, takes_tensors, video_half
from mmstore._format.media import warm_decoder
from mmstore._loading.buffers import BatchBuffers, batch_buffers
from mmstore._loading.collate import collate, model_input_names
from mmstore._loading.device import DevicePreprocessor, check_device
from mmstore._loading.materialize import (
    DEFAULT_CACHE_BYTES,
    Materializer,
    MissingPolicy,
    Sample,
    check_missing_policy,
)
from mmstore._loading.microbatch import packed_input_names
from mmstore._loading.node_cache import DEFAULT_NODE_CACHE_BYTES, default_directory
from mmstore._loading.options import flag, optional_whole, seconds, whole
from mmstore._loading.packed import PackedPlanner, PackedStream
from mmstore._loading.prefetch import DEFAULT_PREFETCH_BYTES, default_requests
from mmstore._loading.ranks import agreed_version
from mmstore._loading.spec import MaterializerSource, ReadSpec
from mmstore._loading.workers import (
    WorkerStream,
    check_context,
    check_worker_threads,
    init_worker,
    reraise,
    start_method,
)
from mmstore._planning.order import DEFAULT_WINDOW_UNITS, EpochPlan, worker_batches
from mmstore._rows.files import partition_of
from mmstore._rows.snapshot import (
    Snapshot,
    fingerprints_by_file,
    recorded_layouts,
    take_snapshot,
    video_fingerprints_by_file,
)
from mmstore._rows.store import Store
from mmstore.errors import InvalidArgumentError, LayoutMismatchError

# 2: the state names the table version it read ("table_version"); 1 (format-1 stores):
# files only, checked against the latest version.
STATE_VERSION = 2
STATE_VERSIONS = (1, 2)


class _Part:
    """A read-only dataset attribute that lives on one of its parts (``spec``, ``source``)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:  # looked up on the class (help(), autodoc)
            return self
        return getattr(getattr(dataset, self.part), self.name)


class RolloutDataset(IterableDataset[Sample]):
    """The committed rollouts of one version of a store's rollouts table, read for one rank.

    Building it checks every argument and every layout fingerprint in the snapshot against
    ``image_processor``, and raises :class:`InvalidArgumentError` or
    :class:`LayoutMismatchError` before any batch. Iterating it directly yields unbatched
    samples; use :class:`RolloutLoader` for batches, workers and resume. Every argument
    after the processor is keyword-only.

    Args:
        store: the :class:`Store` to read.
        image_processor: the image processor the model trains with, or a full transformers
            processor (image processor + tokenizer); its layout must be the stored one.

    What to read:
        runs: a run id or run ids; ``None``: every run. A run the store does not hold
            raises :class:`NoMatchError`.
        steps: a step, a ``range`` or steps; ``None``: every step.
        version: the table version to read (:attr:`version` says which was read);
            ``None``: the latest. Under ``torch.distributed``, a dataset sharded over the
            job's ranks (``world_size`` equal to the job's) reads the same version on every
            rank: with ``None`` the smallest latest version any rank sees (one all-reduce;
            every rank must build the dataset), and a version that differs across ranks
            raises :class:`VersionMismatchError` on every rank. Another dataset (one rank's
            evaluation set, ``world_size=1``) talks to no other rank.

    Order and sharding:
        shuffle: shuffle row groups, then the rows within each window of them; ``False``
            reads in file order.
        seed: the shuffle's seed (an int; taken modulo 2**32).
        rank, world_size: this process's shard of the row groups. Both ``None``: from
            ``torch.distributed`` when it is initialized, else rank 0 of 1. ``world_size``
            above 1 without ``rank`` is refused (every process would read shard 0).
        window_units: row groups shuffled together (>= 1): a bigger window mixes more and
            holds more rows in memory.

    Materialization:
        dtype: the train dtype floats are cast to (``torch.bfloat16``, or a name such as
            ``"bf16"``).
        missing: ``"error"`` (a missing image raises :class:`MediaNotFoundError`) or
            ``"placeholder_zero_loss"`` (a zero image, the sample kept out of the loss).
        max_len: truncate samples to this many tokens (>= 1), whole images kept.

    Caches:
        cache_bytes: each process's cache of processed images, in bytes (0: none).
        node_cache_bytes: the node-wide cache's bound, shared by every worker and rank of
            the machine (:mod:`._node_cache`). ``None``: 2 GiB where a directory is usable,
            else off; ``0`` turns it off (``node_cache_dir`` then unused).
        node_cache_dir: where the node cache lives; ``None``: ``$MMSTORE_NODE_CACHE``, else
            a per-user folder on ``/dev/shm``. A positive ``node_cache_bytes`` with neither
            usable is refused.

    Read-ahead (object stores, :mod:`._prefetch`):
        prefetch_requests: media reads in flight per worker. ``None``: 16 on a remote
            store, none on a local one; ``0`` turns read-ahead off (``prefetch_bytes`` then
            unused).
        prefetch_bytes: no new read starts while this many bytes wait (>= 1); ``None``:
            64 MiB. Given where read-ahead is off by default (a local store, without
            ``prefetch_requests``), it is refused: it would bound nothing.
    """

    # What to read, in which order, cut and cast to what (the spec both streams take).
    store = _Part("spec")
    snapshot = _Part("spec")
    adapter = _Part("spec")
    seed = _Part("spec")
    shuffle = _Part("spec")
    rank = _Part("spec")
    world_size = _Part("spec")
    window_units = _Part("spec")
    max_len = _Part("spec")
    dtype = _Part("spec")
    # How this process materializes it (the source of its materializer).
    missing = _Part("source")
    cache_bytes = _Part("source")
    node_cache_dir = _Part("source")
    node_cache_bytes = _Part("source")
    prefetch_requests = _Part("source")
    prefetch_bytes = _Part("source")

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        *,
        # what to read
        runs: Iterable[str] | None = None,
        steps: Iterable[int] | None = None,
        version: int | None = None,
        # order and sharding
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        window_units: int = DEFAULT_WINDOW_UNITS,
        # materialization
        dtype: torch.dtype | str = torch.bfloat16,
        missing: MissingPolicy = "error",
        max_len: int | None = None,
        # caches
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        node_cache_bytes: int | None = None,
        node_cache_dir: str | None = None,
        # read-ahead
        prefetch_requests: int | None = None,
        prefetch_bytes: int | None = None,
    ) -> None:
        check_missing_policy(missing)
        shuffle = flag("shuffle", shuffle)
        seed = whole("seed", seed)
        rank, world_size = _rank_and_world(rank, world_size)
        window_units = whole("window_units", window_units, minimum=1)
        dtype = training_dtype(dtype)
        max_len = optional_whole("max_len", max_len, minimum=1)
        cache_bytes = whole("cache_bytes", cache_bytes, minimum=0)
        node_directory, node_bytes = _node_cache_place(node_cache_dir, node_cache_bytes)
        # Asked for by argument (not merely the default): refused where it cannot apply.
        self._node_cache_asked = node_bytes > 0 and (
            node_cache_bytes is not None or node_cache_dir is not None
        )
        prefetch_requests = optional_whole("prefetch_requests", prefetch_requests, minimum=0)
        prefetch_bytes = _read_ahead_bound(store, prefetch_requests, prefetch_bytes)
        version = optional_whole("version", version, minimum=0)
        self.image_processor = image_processor
        adapter = adapter_for(image_processor)
        version = agreed_version(
            store, version, world_size=world_size, what="building a RolloutDataset"
        )
        snapshot = take_snapshot(store, runs, steps, version=version)
        _check_layouts(store, adapter, snapshot)
        self.spec = ReadSpec(
            store=store,
            snapshot=snapshot,
            adapter=adapter,
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            window_units=window_units,
            max_len=max_len,
            dtype=dtype,
        )
        self.source = MaterializerSource(
            store,
            adapter,
            dtype=dtype,
            missing=missing,
            max_len=max_len,
            cache_bytes=cache_bytes,
            node_cache_dir=node_directory,
            node_cache_bytes=node_bytes,
            prefetch_requests=prefetch_requests,
            prefetch_bytes=prefetch_bytes,
        )
        self.epoch = 0
        self.position = 0

    @property
    def version(self) -> int:
        """The rollouts table version this dataset reads."""
        return int(self.snapshot.version)

    def use_snapshot(self, files: list[str], version: int | None = None) -> None:
        """Read exactly these files of table ``version`` (a resumed run's snapshot; None:
        a state of the first format, whose files the latest version must list). The ranks
        must name the same version (:class:`VersionMismatchError` on every rank if not)."""
        if version is not None:
            version = whole("table_version", version, minimum=0)
        version = agreed_version(
            self.store, version, world_size=self.world_size, what="loading a saved state"
        )
        if version != self.version or list(self.snapshot.files) != list(files):
            snapshot = take_snapshot(self.store, files=files, version=version)
            _check_layouts(self.store, self.adapter, snapshot)
            self.spec = self.spec.with_snapshot(snapshot)

    def plan(self, epoch: int | None = None, rank: int | None = None) -> EpochPlan:
        """This rank's (or ``rank``'s) epoch, from metadata only."""
        return self.spec.plan(self.epoch if epoch is None else epoch, rank)

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        return self.plan().num_samples

    def materializer(self) -> Materializer:
        """This process's materializer (built on first use; each worker builds its own)."""
        return self.source.get()

    def samples(self, epoch: int, positions: Iterable[int]) -> Iterator[tuple[int, Sample]]:
        """Materialize the samples at increasing ``positions`` of this rank's epoch."""
        return self.source.samples(self.spec, epoch, positions)

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
        return {
            "epoch": self.epoch,
            "position": self.position,
            "table_version": self.version,
            "files": list(self.snapshot.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.use_snapshot(state["files"], state.get("table_version"))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# Differences and files a layout mismatch names (the count says how many there are).
SHOWN = 3


def _check_layouts(store: Store, adapter: Family, snapshot: Snapshot) -> None:
    """Refuse a snapshot whose files were laid out for another processor, naming the runs."""
    refuse_other_layouts(
        store,
        adapter,
        fingerprints_by_file(store, snapshot),
        video_fingerprints_by_file(store, snapshot),
    )


def refuse_other_layouts(
    store: Store,
    adapter: Family,
    images: dict[str, set[str]],
    videos: dict[str, set[str]],
) -> None:
    """Refuse, before any worker starts, files whose images (``images``: fingerprint ->
    files) or videos were laid out by another processor, naming the runs and first files."""
    _refuse_video_layouts(adapter, videos)
    wrong = {fp: files for fp, files in images.items() if fp != adapter.fingerprint}
    if not wrong:
        return
    runs = {fp: {partition_of(f)[0] for f in files} for fp, files in wrong.items()}
    files = sorted({f for files in wrong.values() for f in files})
    stored = recorded_layouts(store, files)
    mine = adapter.layout.params()
    listing = "; ".join(
        f"runs {sorted(runs[fp])}: {_layout_diff(stored.get(fp), mine)}"
        for fp in sorted(wrong, key=str)
    )
    raise LayoutMismatchError(
        f"the processor lays images out differently from how they were stored "
        f"(stored vs processor) in {listing}. Build the image processor with the stored "
        "parameters, or select other runs (runs=...)",
        runs=sorted({r for rs in runs.values() for r in rs}),
        # the first few files: a long run would fill a screen with paths
        files=files[:SHOWN],
        num_files=len(files),
    )


def _refuse_video_layouts(adapter: Family, found: dict[str, set[str]]) -> None:
    """Refuse videos laid out by another video processor (or videos where the processor
    has none)."""
    video = video_half(adapter) if found else None
    wrong = {fp: files for fp, files in found.items() if video is None or fp != video.fingerprint}
    if not wrong:
        return
    files = sorted({f for fs in wrong.values() for f in fs})
    runs = sorted({partition_of(f)[0] for f in files})
    mine = "has no video processor" if video is None else f"lays videos out as {video.fingerprint}"
    raise LayoutMismatchError(
        f"rows hold videos laid out as {sorted(wrong)}; the processor {mine}. Pass the full "
        "processor (with its video_processor) the rollouts were written with, or select "
        "other runs (runs=...)",
        runs=runs,
        files=files[:SHOWN],
        num_files=len(files),
    )


def _node_cache_place(directory: str | None, capacity: Any) -> tuple[str | None, int]:
    """Where the node cache lives and its bound in bytes (0: off)."""
    capacity = optional_whole("node_cache_bytes", capacity, minimum=0)
    where = directory or default_directory()
    if capacity is None:
        return where, DEFAULT_NODE_CACHE_BYTES if where else 0
    if capacity and not where:
        raise InvalidArgumentError(
            f"node_cache_bytes={capacity} needs a directory: pass node_cache_dir (there is "
            "no writable /dev/shm here and $MMSTORE_NODE_CACHE is unset)"
        )
    return where, capacity


def _read_ahead_bound(store: Store, requests: int | None, bound: Any) -> int:
    """The read-ahead's byte bound, refused where it would bound nothing."""
    if bound is None:
        return DEFAULT_PREFETCH_BYTES
    bound = whole("prefetch_bytes", bound, minimum=1)
    if requests is None and default_requests(store) == 0:
        raise InvalidArgumentError(
            f"prefetch_bytes={bound} bounds nothing: a local store reads without read-ahead; "
            "pass prefetch_requests (reads in flight) to read ahead here, or drop "
            "prefetch_bytes"
        )
    return bound


class _BatchStream(IterableDataset[dict[str, Any]]):
    """Whole batches ``start, start+1, …`` of one epoch, split across DataLoader workers."""

    def __init__(
        self,
        spec: ReadSpec,
        source: MaterializerSource,
        *,
        epoch: int,
        start: int,
        batch_size: int,
        drop_last: bool,
        dummy_image: bool,
        pad_token_id: int | None,
        total: int | None = None,
        distinct_images: bool = False,
    ) -> None:
        self.spec = spec
        self.source = source
        self.total = total
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
        spec = self.spec
        plan = spec.plan(self.epoch)
        total = self.total
        if total is None:
            total = plan.num_batches(self.batch_size, self.drop_last)
        mine = worker_batches(self.start, total, worker, workers)
        bs = self.batch_size
        positions = (p for b in mine for p in range(b * bs, min((b + 1) * bs, plan.num_samples)))
        materializer = self.source.get()
        cache, node = materializer.cache, materializer.node_cache
        pending: list[Sample] = []
        hits, misses = cache.hits, cache.misses
        node_hits, node_misses = (node.hits, node.misses) if node else (0, 0)
        for position, sample in self.source.samples(spec, self.epoch, positions):
            pending.append(sample)
            if position + 1 == min((position // bs + 1) * bs, plan.num_samples):
                batch = collate(
                    pending,
                    spec.adapter,
                    pad_token_id=self.pad_token_id,
                    dummy_image=self.dummy_image,
                    dtype=spec.dtype,
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

    Every argument after the dataset is keyword-only. Each one takes effect or is refused
    with :class:`InvalidArgumentError` naming the conflict (an option that would be
    silently ignored, such as ``prefetch_factor`` without workers, is refused).

    Args:
        dataset: the :class:`RolloutDataset` to read (what, in which order, materialized
            how).

    Batching:
        batch_size: samples per batch (>= 1); packed: samples per rank per step.
        drop_last: drop the epoch's last, short batch (padded batches only).
        even_ranks: every rank stops after the fewest batches any rank has (padded batches
            only: packed steps are already in lock-step, every rank the same ``num_micro``).
        dummy_image: a batch without images gets one tiny zero image out of the loss, so
            every FSDP rank runs the vision tower (padded batches only: the packing plan
            gives such micro-batches their dummy image by itself).
        pad_token_id: the token padding is filled with (>= 0); ``None``: the family's.
        max_tokens: pack micro-batches of at most this many tokens instead of padding.
        distinct_images: each distinct image once per batch, plus ``image_index``.

    Workers (torch ``DataLoader``'s names and meanings):
        num_workers: worker processes (>= 0); 0 builds batches in this process.
        prefetch_factor: batches each worker builds ahead (>= 1; workers only).
        pin_memory: pinned batches, for asynchronous copies to the GPU.
        timeout: seconds to wait for a worker's batch (>= 0; 0 waits forever; workers
            only).
        multiprocessing_context: how workers start (``"fork"``, ``"spawn"``,
            ``"forkserver"`` or a context; workers only).
        worker_threads: torch threads per worker (>= 1; workers only); more than one needs
            ``"spawn"`` or ``"forkserver"``.

    Device stage:
        preprocess_device: run the image processor on this device in the main process
            (see above); the dataset's node cache must then be off or left to its default.
    """

    def __init__(
        self,
        dataset: RolloutDataset,
        *,
        batch_size: int = 8,
        num_workers: int = 0,
        # batching
        drop_last: bool = False,
        even_ranks: bool = False,
        dummy_image: bool = False,
        pad_token_id: int | None = None,
        max_tokens: int | None = None,
        distinct_images: bool = False,
        # workers (torch DataLoader's names)
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        worker_threads: int | None = None,
        # device stage
        preprocess_device: str | torch.device | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = whole("batch_size", batch_size, minimum=1)
        self.drop_last = flag("drop_last", drop_last)
        self.even_ranks = flag("even_ranks", even_ranks)
        self.dummy_image = flag("dummy_image", dummy_image)
        self.pad_token_id = optional_whole("pad_token_id", pad_token_id, minimum=0)
        self.max_tokens = optional_whole("max_tokens", max_tokens, minimum=1)
        self.distinct_images = flag("distinct_images", distinct_images)
        self._refuse_padded_options_when_packed()
        self.num_workers = whole("num_workers", num_workers, minimum=0)
        self.prefetch_factor = optional_whole("prefetch_factor", prefetch_factor, minimum=1)
        self.pin_memory = flag("pin_memory", pin_memory)
        self.timeout = seconds("timeout", timeout)
        self.multiprocessing_context = check_context(multiprocessing_context)
        self.worker_threads = check_worker_threads(worker_threads, multiprocessing_context)
        self._refuse_worker_options_without_workers(worker_threads)
        self._planner = (
            None
            if self.max_tokens is None
            else PackedPlanner(dataset.spec, batch_size=self.batch_size, max_tokens=self.max_tokens)
        )
        self.epoch = dataset.epoch
        self.batches_yielded = 0
        self._device_stage = self._device_stage_for(preprocess_device)
        self.preprocess_device = None if self._device_stage is None else self._device_stage.device
        # Chosen once: workers process images, or only decode them for the device stage.
        self._source = dataset.source if self._device_stage is None else dataset.source.deferred()

    def _device_stage_for(self, device: str | torch.device | None) -> DevicePreprocessor | None:
        """The main-process stage of ``preprocess_device``, refused where it cannot run."""
        if device is None:
            return None
        found = check_device(device, self.dataset.adapter)
        if self.dataset._node_cache_asked:
            raise InvalidArgumentError(
                "the dataset's node_cache_bytes/node_cache_dir do not apply with "
                f"preprocess_device={str(found)!r}: workers only decode images, so nothing "
                "is processed for the node cache to share; build the dataset with "
                "node_cache_bytes=0, or without preprocess_device"
            )
        return DevicePreprocessor(self.dataset.adapter, found, self.dataset.dtype)

    def _refuse_padded_options_when_packed(self) -> None:
        """Packed micro-batches have their own rules for what these options do for padded
        batches: refused rather than silently ignored."""
        if self.max_tokens is None:
            return
        refused = {
            "drop_last": (self.drop_last, "every sample is packed; no batch is short"),
            "even_ranks": (
                self.even_ranks,
                "every rank already gets the same num_micro for each step",
            ),
            "dummy_image": (
                self.dummy_image,
                "the packing plan gives a micro-batch without images its dummy image "
                "itself, wherever the data has images",
            ),
        }
        for name, (on, reason) in refused.items():
            if on:
                raise InvalidArgumentError(
                    f"{name}=True does not apply to packed micro-batches "
                    f"(max_tokens={self.max_tokens}): {reason}"
                )

    def _refuse_worker_options_without_workers(self, worker_threads: int | None) -> None:
        """DataLoader settings for worker processes, refused when there are none."""
        if self.num_workers:
            return
        given = {
            "prefetch_factor": self.prefetch_factor is not None,
            "timeout": self.timeout > 0,
            "multiprocessing_context": self.multiprocessing_context is not None,
            "worker_threads": worker_threads is not None,
        }
        named = [name for name, on in given.items() if on]
        if named:
            raise InvalidArgumentError(
                f"{', '.join(named)} only apply to DataLoader workers, and num_workers=0 "
                "builds every batch in this process; set num_workers or drop them"
            )

    @property
    def model_input_names(self) -> tuple[str, ...]:
        """The batch keys the family's transformers model takes:
        ``model(**{k: batch[k] for k in loader.model_input_names})`` runs (packed: position
        ids and no padding mask)."""
        if self.max_tokens is not None:
            return packed_input_names(self.dataset.adapter)
        return model_input_names(self.dataset.adapter)

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
        planner = self._packed()
        if planner is not None:
            return len(planner.plan(self.epoch)[0])
        spec = self.dataset.spec
        ranks = range(spec.world_size) if self.even_ranks else [spec.rank]
        return min(
            spec.plan(self.epoch, rank=r).num_batches(self.batch_size, self.drop_last)
            for r in ranks
        )

    def _packed(self) -> PackedPlanner | None:
        """The packed planner of the dataset's current snapshot (a resume may replace it)."""
        if self._planner is not None:
            self._planner = self._planner.for_spec(self.dataset.spec)
        return self._planner

    def _stream(self, epoch: int, start: int, total: int) -> IterableDataset[dict[str, Any]]:
        """Batches (or packed micro-batches) ``start..total-1`` of ``epoch`` on this rank."""
        planner = self._packed()
        if planner is not None:
            return PackedStream(
                planner,
                self._source,
                epoch=epoch,
                start=start,
                stop=total,
                pad_token_id=self.pad_token_id,
                distinct_images=self.distinct_images,
            )
        return _BatchStream(
            self.dataset.spec,
            self._source,
            epoch=epoch,
            start=start,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            dummy_image=self.dummy_image,
            pad_token_id=self.pad_token_id,
            total=total,
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
        if self.num_workers and takes_tensors(self.dataset.adapter.image_processor):
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
        return batch_buffers(
            self.num_workers, start_method(self.multiprocessing_context), self.prefetch_factor
        )

    def _order_settings(self) -> dict[str, Any]:
        """Everything besides the snapshot that decides which batch comes when."""
        spec = self.dataset.spec
        return {
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "even_ranks": self.even_ranks,
            **spec.order_settings(),
            "max_tokens": self.max_tokens,
            # the plan's lengths are after truncation: a packed resume needs the same max_len
            **({"max_len": spec.max_len} if self.max_tokens is not None else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: epoch, batches yielded, the order settings, and the
        table version and files it reads (a resume reads exactly those, whatever was
        committed or released since; pin the version to keep its bytes past gc's grace)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            **self._order_settings(),
            "table_version": self.dataset.version,
            "files": list(self.dataset.snapshot.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (any ``num_workers``)."""
        if state.get("version") not in STATE_VERSIONS:
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
        self.dataset.use_snapshot(state["files"], state.get("table_version"))
        self.epoch = int(state["epoch"])
        self.batches_yielded = int(state["batches_yielded"])


def _layout_diff(stored: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    """``family differs (a vs b)``, or ``2 parameters differ: patch_size 14 vs 16, …`` (the
    first few): what tells a user which processor to build, not every field."""
    if stored is None:
        return "a layout their footers do not record"
    if stored.get("family") != mine.get("family"):
        return f"family differs ({stored.get('family')} vs {mine.get('family')})"
    keys = sorted(stored.keys() | mine.keys())
    differ = [f"{k} {stored.get(k)} vs {mine.get(k)}" for k in keys if stored.get(k) != mine.get(k)]
    if not differ:
        return "the same parameters under another fingerprint"
    more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
    return f"{len(differ)} parameter(s) differ: {', '.join(differ[:SHOWN])}{more}"


def _rank_and_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """This process's shard: as given, or from ``torch.distributed`` when both are None."""
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = whole("world_size", 1 if world_size is None else world_size, minimum=1)
    if rank is None and world > 1:
        raise InvalidArgumentError(
            f"world_size={world} without rank: every process would read rank 0's share; "
            "pass rank too, or neither (to take both from torch.distributed)"
        )
    shard = whole("rank", 0 if rank is None else rank, minimum=0)
    if shard >= world:
        raise InvalidArgumentError(f"rank {shard} is outside world_size {world}")
    return shard, world


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
