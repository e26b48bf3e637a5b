"""The trainer's path: RolloutDataset (what to read) and RolloutLoader (batches, resume).

The loader is a torch DataLoader over a stream of whole batches (``batch_size=None``):
worker ``w`` builds batches ``k + w, k + w + n, …`` of the rank's sample sequence (see
:mod:`mmstore._planning.order`), so the batches come out in the same order for any number
of workers and a resume at batch ``k`` reads nothing before it.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmstore._families import adapter_for, takes_tensors
from mmstore._format.media import warm_decoder
from mmstore._loading.buffers import BatchBuffers, batch_buffers
from mmstore._loading.collate import collate
from mmstore._loading.device import DevicePreprocessor, check_device
from mmstore._loading.inputs import input_names, model_inputs
from mmstore._loading.layouts import check_layouts
from mmstore._loading.materialize import Materializer, Sample
from mmstore._loading.options import flag, optional_whole, seconds, whole
from mmstore._loading.packed import PackedPlanner, PackedStream
from mmstore._loading.persistent import PersistentWorkers, worker_options
from mmstore._loading.ranks import agreed_version
from mmstore._loading.settings import Materialize, rank_and_world, settings_from
from mmstore._loading.spec import MaterializerSource, ReadSpec
from mmstore._loading.workers import (
    WorkerStream,
    check_context,
    check_worker_threads,
    reraise,
    start_method,
)
from mmstore._planning.order import DEFAULT_WINDOW_UNITS, SHARDING, EpochPlan, worker_batches
from mmstore._rows.snapshot import take_snapshot
from mmstore._rows.store import Store
from mmstore.errors import InvalidArgumentError

# 3: padded batches: ranks share each epoch by samples (contiguous, balanced: "sharding");
# 2: the state names the table version it read ("table_version"); 1 (format-1 stores):
# files only, checked against the latest version. A padded state of 1 or 2 dealt row groups
# to ranks: resumed only where the order is the same (one rank), see _comparable.
STATE_VERSION = 3
STATE_VERSIONS = (1, 2, 3)
# The settings a RolloutLoader still takes as flat keywords (for one release): the batch's
# form and the device stage, applied over its dataset's.
PER_LOADER = ("pad_token_id", "dummy_image", "distinct_images", "preprocess_device")


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
        rank, world_size: this process's share of each epoch: a contiguous run of the
            epoch order, the ranks' sizes differing by at most one sample (see
            :mod:`mmstore._planning.order`). Both ``None``: from ``torch.distributed`` when
            it is initialized, else rank 0 of 1. ``world_size`` above 1 without ``rank`` is
            refused (every process would read shard 0); fewer samples than ranks is refused
            (:class:`InvalidArgumentError` on every rank: one would train nothing).
        window_units: row groups shuffled together (>= 1): a bigger window mixes more and
            holds more rows in memory.

    How rows become tensors:
        materialize: a :class:`Materialize` (dtype, missing media, truncation, caches,
            read-ahead, the per-batch form the loaders build, the device stage); ``None``:
            its defaults. For one release its fields are also taken as flat keywords
            (``dtype="bf16"``), with a DeprecationWarning.
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
        # how rows become tensors
        materialize: Materialize | None = None,
        **flat_settings: Any,
    ) -> None:
        settings = settings_from(materialize, flat_settings, reader="RolloutDataset")
        shuffle = flag("shuffle", shuffle)
        seed = whole("seed", seed)
        rank, world_size = rank_and_world(rank, world_size)
        window_units = whole("window_units", window_units, minimum=1)
        version = optional_whole("version", version, minimum=0)
        self.materialize = settings
        self.image_processor = image_processor
        adapter = adapter_for(image_processor)
        source = MaterializerSource.of(store, adapter, settings)
        version = agreed_version(
            store, version, world_size=world_size, what="building a RolloutDataset"
        )
        snapshot = take_snapshot(store, runs, steps, version=version)
        check_layouts(store, adapter, snapshot)
        self.spec = ReadSpec(
            store=store,
            snapshot=snapshot,
            adapter=adapter,
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            window_units=window_units,
            max_len=settings.max_len,
            dtype=source.dtype,
        )
        self.source = source
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
            check_layouts(self.store, self.adapter, snapshot)
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
            "sharding": SHARDING,
            "table_version": self.version,
            "files": list(self.snapshot.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sharding", SHARDING if self.world_size == 1 else None) != SHARDING:
            # Saved when ranks were dealt row groups: its position names other samples here.
            raise InvalidArgumentError(
                f"dataset state shares ranks by {state.get('sharding') or 'row groups'!r}, "
                f"this dataset by {SHARDING!r} ({self.world_size} ranks): its position would "
                "skip or repeat samples; start its epoch over (set .epoch, position 0)"
            )
        self.use_snapshot(state["files"], state.get("table_version"))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


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
        total = self.total
        if total is None:
            total = self.spec.plan(self.epoch).num_batches(self.batch_size, self.drop_last)
        for batch in self.batches(self.epoch, worker_batches(self.start, total, worker, workers)):
            if info is None:
                self.start = batch["batch_index"] + 1
            yield batch

    def batches(self, epoch: int, mine: range) -> Generator[dict[str, Any], None, None]:
        """Batches ``mine`` (increasing indices) of ``epoch``, built in this process: the
        rows of each window read once, its media read ahead, as the samples come."""
        spec = self.spec
        plan = spec.plan(epoch)
        bs = self.batch_size
        positions = (p for b in mine for p in range(b * bs, min((b + 1) * bs, plan.num_samples)))
        materializer = self.source.get()
        cache, node = materializer.cache, materializer.node_cache
        pending: list[Sample] = []
        hits, misses = cache.hits, cache.misses
        node_hits, node_misses = (node.hits, node.misses) if node else (0, 0)
        for position, sample in self.source.samples(spec, epoch, positions):
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

    As torchdata's ``StatefulDataLoader``: a state loaded applies to the next iterator, which
    continues from it; any other new iterator (after a ``break``, or a peek) starts the
    epoch over, so no batch is lost; ``loader.load_state_dict(loader.state_dict())``
    continues after a ``break``.

    Ranks' shares differ by at most one sample, so their batch counts by at most one; FSDP/DDP
    hang when one rank runs a step the others don't: ``even_ranks=True`` stops every rank
    after the fewest batches any rank has (computed from metadata), dropping the surplus of
    that epoch, as ``DistributedSampler(drop_last=True)`` does; the default keeps every
    sample. ``len(loader)`` is what the rank yields in an epoch, the same in every epoch.

    **Packed** (``max_tokens=T``): the loader yields micro-batches of at most ``T`` tokens
    instead of padded batches (see :mod:`.microbatch` for what one holds). A step is
    ``batch_size`` samples per rank: positions ``[s*B*W, (s+1)*B*W)`` of the epoch's global
    order, packed all ranks together and dealt token-balanced, every rank the same
    ``num_micro`` (see :mod:`mmstore._planning.pack`). Every sample appears once per epoch
    on one rank; the plan comes from footers and small columns only, identically on every
    rank; ``state_dict`` counts micro-batches, so a resume is exact at any micro-batch, any
    ``num_workers``.
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
    ``image_rows`` (see :mod:`.distinct`); :func:`mmstore.expand_images` turns it into the
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
        max_tokens: pack micro-batches of at most this many tokens instead of padding.

    The form of a batch (``pad_token_id``, ``dummy_image``, ``distinct_images``) and the
    device stage (``preprocess_device``) are the dataset's :class:`Materialize` settings.
    For one release they are also taken here as flat keywords (with a DeprecationWarning),
    applied over the dataset's.

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
        persistent_workers: keep the workers, their image caches and the packed plan from
            one pass to the next (epochs, ``set_epoch``, a resume of the same snapshot;
            workers only): a pass after the first starts no process. The batches and their
            order are the same; :meth:`close` (or dropping the loader) stops the workers;
            one that died raises :class:`WorkerDiedError`, and the next pass starts new
            ones. One pass at a time: a new iterator ends the one before.
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
        max_tokens: int | None = None,
        prefix_sharing: bool = False,
        # workers (torch DataLoader's names)
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        worker_threads: int | None = None,
        persistent_workers: bool = False,
        **flat_settings: Any,
    ) -> None:
        self._workers: PersistentWorkers | None = None  # (first: __del__ reads it)
        self.dataset = dataset
        self.materialize = settings = settings_from(
            None,
            flat_settings,
            reader="RolloutLoader",
            base=dataset.materialize,
            accepted=PER_LOADER,
        )
        self.batch_size = whole("batch_size", batch_size, minimum=1)
        self.drop_last = flag("drop_last", drop_last)
        self.even_ranks = flag("even_ranks", even_ranks)
        self.dummy_image = settings.dummy_image
        self.pad_token_id = settings.pad_token_id
        self.max_tokens = optional_whole("max_tokens", max_tokens, minimum=1)
        self.distinct_images = settings.distinct_images
        self.prefix_sharing = flag("prefix_sharing", prefix_sharing)
        self._refuse_padded_options_when_packed()
        self._refuse_sharing_unless_packed()
        self.num_workers = whole("num_workers", num_workers, minimum=0)
        self.prefetch_factor = optional_whole("prefetch_factor", prefetch_factor, minimum=1)
        self.pin_memory = flag("pin_memory", pin_memory)
        self.timeout = seconds("timeout", timeout)
        self.multiprocessing_context = check_context(multiprocessing_context)
        self.worker_threads = check_worker_threads(worker_threads, multiprocessing_context)
        self.persistent_workers = flag("persistent_workers", persistent_workers)
        self._refuse_worker_options_without_workers(worker_threads)
        self._planner = (
            None
            if self.max_tokens is None
            else PackedPlanner(
                dataset.spec,
                batch_size=self.batch_size,
                max_tokens=self.max_tokens,
                prefix_sharing=self.prefix_sharing,
            )
        )
        self.epoch = dataset.epoch
        self.batches_yielded = 0
        self._resume = False  # set by load_state_dict: the next iterator continues
        self._refuse_an_empty_epoch()
        self._device_stage = self._device_stage_for(settings.preprocess_device)
        self.preprocess_device = None if self._device_stage is None else self._device_stage.device
        # Chosen once: workers process images, or only decode them for the device stage.
        self._source = dataset.source if self._device_stage is None else dataset.source.deferred()

    def _device_stage_for(self, device: str | torch.device | None) -> DevicePreprocessor | None:
        """The main-process stage of ``preprocess_device``, refused where it cannot run."""
        if device is None:
            return None
        found = check_device(device, self.dataset.adapter)
        return DevicePreprocessor(self.dataset.adapter, found, self.dataset.dtype)

    def _refuse_an_empty_epoch(self) -> None:
        """``drop_last`` with a share smaller than a batch trains nothing on some rank:
        refused on every rank (the smallest share decides), never silently."""
        if not self.drop_last:
            return
        spec = self.dataset.spec
        smallest = spec.plan(self.epoch, rank=spec.world_size - 1).num_samples
        if smallest < self.batch_size:
            raise InvalidArgumentError(
                f"drop_last=True with batch_size={self.batch_size} drops every sample of a "
                f"rank whose share is {smallest} sample(s) ({spec.world_size} rank(s)): "
                "lower batch_size, or drop drop_last"
            )

    def _refuse_sharing_unless_packed(self) -> None:
        if self.prefix_sharing and self.max_tokens is None:
            raise InvalidArgumentError(
                "prefix_sharing=True builds packed micro-batches: set max_tokens too"
            )

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
            "persistent_workers": self.persistent_workers,
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
        ids and no padding mask). A prefix forest (``prefix_sharing``) and a packed Gemma 3
        micro-batch need an attention mask built for the model: :meth:`model_inputs` does
        that, and this refuses."""
        return input_names(self.dataset.adapter, **self._form())

    def model_inputs(self, batch: Mapping[str, Any], model: Any = None) -> dict[str, Any]:
        """What to call the family's model with, in every form:
        ``model(**loader.model_inputs(batch, model))``. Where the batch needs an attention
        mask (a prefix forest, a packed Gemma 3 micro-batch) it is built for ``model`` on the
        batch's device (:func:`mmstore.forest_attention_mask`); elsewhere ``model`` is not
        needed."""
        return model_inputs(batch, self.dataset.adapter, model, **self._form())

    def _form(self) -> dict[str, bool]:
        return {"packed": self.max_tokens is not None, "prefix_sharing": self.prefix_sharing}

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
        """Batches of the current epoch on this rank (the fewest of any rank if even_ranks),
        exactly what iterating it from the epoch's start yields; the same in every epoch (a
        rank's share of samples does not change). Packed: micro-batches, the same number on
        every rank."""
        planner = self._packed()
        if planner is not None:
            return len(planner.plan(self.epoch)[0])
        spec = self.dataset.spec
        # Shares differ by at most one sample, the last rank's is the smallest.
        rank = spec.world_size - 1 if self.even_ranks else spec.rank
        return spec.plan(self.epoch, rank=rank).num_batches(self.batch_size, self.drop_last)

    def _packed(self) -> PackedPlanner | None:
        """The packed planner of the dataset's current snapshot (a resume may replace it)."""
        if self._planner is not None:
            self._planner = self._planner.for_spec(self.dataset.spec)
        return self._planner

    def _stream(self, epoch: int, start: int, total: int) -> _BatchStream | PackedStream:
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
        # As torchdata's StatefulDataLoader: a state loaded applies to the next iterator,
        # which continues from it; any other new iterator starts the epoch over, so that a
        # peek (next(iter(loader))) or a loop left early loses no batch.
        if not self._resume:
            self.batches_yielded = 0
        self._resume = False
        total = len(self)
        for built in self._built(self.epoch, self.batches_yielded, total):
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

    def _built(self, epoch: int, start: int, total: int) -> Iterator[dict[str, Any]]:
        """Batches ``start..total-1`` of ``epoch`` as built (in workers, or here), a
        worker's error raised, shared buffers tracked."""
        if self.persistent_workers:
            yield from self._persistent().batches(epoch, start, total)
            return
        stream = self._stream(epoch, start, total)
        buffers = self._batch_buffers()
        if self.num_workers and takes_tensors(self.dataset.adapter.image_processor):
            warm_decoder()  # imported once here, not once in each worker it forks (~50 ms)
        loader = DataLoader(
            WorkerStream(stream, buffers) if self.num_workers else stream,
            batch_size=None,
            **self._worker_options(),
        )
        for built in loader:
            reraise(built)
            if buffers is not None:
                buffers.track(built)
            yield built

    def _worker_options(self) -> dict[str, Any]:
        return worker_options(
            self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            multiprocessing_context=self.multiprocessing_context,
            worker_threads=self.worker_threads,
        )

    def _persistent(self) -> PersistentWorkers:
        """The workers kept across passes: the living ones, or new ones for the dataset's
        current snapshot (a resume may have replaced it: the workers hold their spec)."""
        spec = self.dataset.spec
        if self._workers is not None and self._workers.spec is not spec:
            self.close()
        if self._workers is None:
            context = self.multiprocessing_context
            self._workers = PersistentWorkers(
                self._stream(self.epoch, 0, len(self)),
                spec,
                self._worker_options(),
                functools.partial(
                    batch_buffers, self.num_workers, start_method(context), self.prefetch_factor
                ),
                warm=takes_tensors(self.dataset.adapter.image_processor),
            )
        return self._workers

    def close(self) -> None:
        """Stop the persistent workers (``persistent_workers=True``); the next iteration
        starts new ones. Without them, nothing to do: each pass's workers end with it."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - at interpreter exit even contextlib may be gone
            self.close()
        except Exception:
            pass

    def _batch_buffers(self) -> BatchBuffers | None:
        """Reusable shared memory for the workers' batches (:mod:`.buffers`): forked
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
            # how padded batches share the epoch by rank (packed: every rank plans it all)
            **({"sharding": SHARDING} if self.max_tokens is None else {}),
        }

    def _comparable(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as this version records it. A padded state saved before ranks shared
        the epoch by samples (state versions 1 and 2: row groups dealt round-robin) names
        the same batches only with one rank: it gains the sharding there, and is refused
        with more (its position would name other samples: some trained twice, some never).
        """
        if (
            "sharding" in state
            or self.max_tokens is not None
            or state.get("max_tokens") is not None
        ):
            return state
        if state.get("world_size") == 1:
            return {**state, "sharding": SHARDING}
        raise InvalidArgumentError(
            f"loader state version {state.get('version')!r} was taken when ranks were dealt "
            f"row groups ({state.get('world_size')!r} ranks); ranks now share each epoch by "
            "samples, so its position would skip or repeat samples on this rank. Start its "
            "epoch over instead: a new loader and set_epoch(state['epoch']) (that epoch's "
            "batches already trained are trained again), or finish the epoch with the mmstore "
            "that saved the state",
            version=state.get("version"),
            world_size=state.get("world_size"),
        )

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
        state = self._comparable(state)
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
        self._resume = True  # the next iterator continues from here
