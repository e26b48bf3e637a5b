"""Ray Data: read a store and materialize its images on a pool of CPU actors, across nodes.

Optional extra ``ray``; importing mmstore never imports Ray.

Two entry points:

- :func:`read_rollouts` is a ``ray.data.Dataset`` of materialized samples, one row each. The
  files and their row groups are planned in the driver (the table version's files, their
  footers); an actor pool of CPU workers, each with its own processor, cache and dtype cast,
  reads its row groups through the loader's own read (every page's checksum verified, the
  footer's value counts checked, the columns cast to the v1 types) and turns the rows into
  model inputs through the loader's own row checks and bounds (a bad row raises naming its
  file, run, step and sample). Use it for offline preprocessing, evaluation and analysis:
  its order is Ray's.
- :func:`iter_batches` feeds a trainer rank: it yields exactly the batches (or packed
  micro-batches) that ``loader`` would yield itself, in the same order, with the
  materialization done by Ray actors, possibly on other nodes. The rank's share comes from
  mmstore's deterministic plan (a pure function of snapshot, seed, epoch and settings), so
  ranks are disjoint and cover each sample once, and ``loader.state_dict()`` stays exact:
  every yielded batch advances the loader's position as its own iteration does.

Where Ray's guarantees stop and mmstore's begin: Ray Data has no exact resume for training
(ray-project/ray#48224) and ``streaming_split(equal=True)`` may drop rows (#63285). Here Ray
only executes: the plan (which sample lands in which batch on which rank) is mmstore's, Ray
is asked to preserve order, and each output carries its batch index, checked on arrival, so
a reordered or lost batch is an error, never a silent gap. Resume is ``loader.state_dict()``.

Errors: an actor's error reaches the caller as the mmstore error it raised. Ray Data would
wrap it (``RayTaskError(UserCodeException)``: not an ``MmstoreError``, its context gone);
:func:`iter_batches` raises the original itself, and iterating :func:`read_rollouts`'s
dataset raises Ray's ``RayTaskError`` made an instance of the original's class (``except
mmstore.CorruptFileError as err: err.file`` works; ``err.cause`` is the original).

Pool size: the actors do all the work (no read tasks wait for a CPU the pool holds), and the
pool is checked against the cluster before anything runs: ``concurrency=None`` takes what the
cluster holds, up to :data:`DEFAULT_ACTORS`; a pool the cluster cannot hold raises
:class:`InvalidArgumentError` at once, instead of waiting forever for CPUs.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mmstore._families import adapter_for
from mmstore._rows.snapshot import WorkUnit, read_units, take_snapshot
from mmstore._rows.store import Store
from mmstore.errors import InvalidArgumentError, MmstoreError

if TYPE_CHECKING:
    import ray.data
    import torch

    from mmstore._loading.dataset import RolloutLoader  # torch: only for type checks
    from mmstore._loading.settings import Materialize

__all__ = ["DEFAULT_ACTORS", "iter_batches", "read_rollouts"]

#: Actors in a pool whose ``concurrency`` is None, where the cluster holds that many.
DEFAULT_ACTORS = 2


def _ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the environment
        raise MmstoreError(
            "mmstore.integrations.ray needs Ray Data: pip install 'mmstore[ray]'"
        ) from None
    return ray


# -- the actor pool -----------------------------------------------------------------------


def _pool_size(
    ray: Any, concurrency: int | None, num_cpus: float, resources: Mapping[str, float] | None
) -> int:
    """How many actors to start: ``concurrency`` if the cluster can hold that many (else
    :class:`InvalidArgumentError` saying what fits), or with None as many as it holds, up
    to :data:`DEFAULT_ACTORS`.

    Ray waits rather than fails: work that needs resources nobody will free waits with no
    error and no end (before the actors read for themselves, two 1-CPU actors on a 2-CPU
    cluster starved the read tasks forever). So a pool is checked against the cluster's
    totals, what can ever run at once (an autoscaler's future nodes are not counted).
    """
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise InvalidArgumentError(
            f"concurrency must be a positive int or None, got {concurrency!r}"
        )
    each = {"CPU": float(num_cpus), **{k: float(v) for k, v in (resources or {}).items()}}
    held = ray.cluster_resources()
    fits = _how_many_fit(each, held)
    wanted = concurrency or (DEFAULT_ACTORS if fits is None else min(DEFAULT_ACTORS, fits))
    if fits is None or 1 <= wanted <= fits:
        return wanted
    asked = "one actor" if concurrency is None else f"concurrency={concurrency} actors"
    raise InvalidArgumentError(
        f"the Ray cluster cannot hold {asked} of {_amounts(each)} each: it holds "
        f"{_amounts({k: held.get(k, 0.0) for k in each})} in all, room for {fits}; pass "
        "concurrency=None (the pool sized to the cluster) or a smaller one, lower num_cpus, "
        "or add nodes",
        concurrency=concurrency,
        fits=fits,
    )


def _how_many_fit(each: Mapping[str, float], held: Mapping[str, float]) -> int | None:
    """How many actors needing ``each`` the totals ``held`` can hold; None: no limit."""
    counts = [
        math.floor(held.get(name, 0.0) / need + 1e-9) for name, need in each.items() if need > 0
    ]
    return min(counts) if counts else None


def _amounts(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())


def _typed_errors(dataset: ray.data.Dataset) -> None:
    """Make an actor's error reach this dataset's consumer as its own type.

    Ray Data wraps an error raised in a map function in ``UserCodeException`` (the original
    is left behind in the worker: its type and context are lost); with this flag the
    original crosses and Ray raises it as ``RayTaskError(<its class>)``. Set on this
    dataset's own context (a copy made when it was created), never the process's.
    """
    dataset.context.raise_original_map_exception = True


def _original(err: BaseException) -> BaseException:
    """The error a Ray task raised, out of Ray's wrapper (Ray's own errors stay as they are)."""
    ray = _ray()
    cause = getattr(err, "cause", None)
    if not isinstance(err, ray.exceptions.RayTaskError) or not isinstance(cause, Exception):
        return err
    return err if isinstance(cause, ray.exceptions.RayError) else cause


# -- samples as a Ray dataset -------------------------------------------------------------


class _Materialize:
    """A Ray actor: slices of row groups -> materialized samples (numpy), with its own cache.

    Each slice is read and checked on the actor, through the loader's own path:
    :func:`read_units` opens the file with every page checksum verified, checks the
    footer's value counts and casts the columns to the v1 types (or raises naming the file),
    and :meth:`~mmstore._loading.materialize.Materializer.samples` runs the reader's row
    checks and bounds (spans, sizes, trust, the token and image caps) row by row on Arrow
    views.
    """

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        settings: Materialize,
        units: Sequence[WorkUnit],
    ) -> None:
        from mmstore._loading.collate import collate_videos
        from mmstore._loading.materialize import Materializer
        from mmstore._loading.stack import batch_images

        self.batch_images = batch_images
        self.collate_videos = collate_videos
        self.store = store
        self.units = units
        self.materializer = Materializer(
            store,
            adapter_for(image_processor),
            dtype=settings.dtype,  # type: ignore[arg-type]  # a torch.dtype once checked
            missing=settings.missing,
            max_len=settings.max_len,
            cache_bytes=settings.cache_bytes,
        )
        self.columns = settings.columns
        # The last row group read: its slices usually come to the same actor one by one.
        self._read: tuple[int, pa.Table] | None = None

    def _rows(self, unit: int) -> pa.Table:
        if self._read is None or self._read[0] != unit:
            self._read = (unit, read_units(self.store, [self.units[unit]], self.columns))
        return self._read[1]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        slices = zip(
            batch["unit"].tolist(), batch["start"].tolist(), batch["stop"].tolist(), strict=True
        )
        for unit, start, stop in slices:
            rows = self._rows(unit).slice(start, stop - start)
            for sample in self.materializer.samples(rows):
                self._append(out, self.units[unit], sample)
        return out

    def _append(self, out: dict[str, list[Any]], unit: WorkUnit, sample: Any) -> None:
        adapter = self.materializer.adapter
        images = self.batch_images(adapter, sample.images)
        record = {
            "run_id": unit.run_id,
            "step": unit.step,
            "sample_id": sample.sample_id,
            "group_id": sample.group_id,
            "input_ids": sample.input_ids.numpy(),
            "loss_mask": sample.loss_mask.numpy(),
            "advantage": sample.advantage,
            "reward": sample.reward,
            "policy_version": sample.policy_version,
            **{k: v if isinstance(v, str) else v.numpy() for k, v in sample.columns.items()},
            **{k: _numpy(v) for k, v in images.items()},
            **{k: _numpy(v) for k, v in self.collate_videos(adapter, sample.videos).items()},
        }
        for key, value in record.items():
            out.setdefault(key, []).append(value)


# What an actor applies of the Materialize settings (it materializes samples, not batches).
APPLIED = ("dtype", "missing", "max_len", "columns", "cache_bytes")


def _settings(materialize: Any, flat: dict[str, Any]) -> Materialize:
    """The actors' settings; float32 unless asked (numpy, which they hand over, has no bf16)."""
    import torch

    from mmstore._loading.settings import Materialize, settings_from

    base = Materialize(dtype=torch.float32)
    settings = settings_from(
        materialize,
        flat,
        reader="read_rollouts",
        base=base,
        accepted=("dtype", "missing", "columns"),
    )
    settings.refuse_all_but(APPLIED, reader="read_rollouts")
    return settings


def _numpy(tensor: torch.Tensor | None) -> np.ndarray | None:
    # numpy has no bfloat16: floating tensors travel as float32 (cast on the device). None:
    # a sample without videos, where its family takes them.
    if tensor is None:
        return None
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


def _slices(units: Sequence[WorkUnit], rows: int) -> list[dict[str, int]]:
    """Each unit (row group) cut into slices of at most ``rows`` rows: the pool's work items,
    so that one large row group is spread over the actors too."""
    return [
        {"unit": k, "start": start, "stop": min(start + rows, unit.num_rows)}
        for k, unit in enumerate(units)
        for start in range(0, unit.num_rows, rows)
    ]


def read_rollouts(
    store: Store,
    image_processor: Any,
    runs: Any = None,
    steps: Any = None,
    *,
    materialize: Any = None,
    concurrency: int | None = None,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    batch_size: int = 16,
    version: int | None = None,
    **flat_settings: Any,
) -> ray.data.Dataset:
    """The selected rollouts of table ``version`` (None: the latest) as a Ray dataset of
    materialized samples. The files and row groups are those the version lists (planned
    here, in the driver); the actors read them with the loader's checks.

    Columns: ``run_id`` (str), ``step`` (int), ``sample_id``, ``group_id``, ``input_ids``,
    ``loss_mask``, ``advantage``, ``reward``, ``policy_version`` (-1 unknown), the extra
    ``columns`` asked for (their own names) and the family's image tensors (numpy; floats
    as float32). Materialization runs in ``concurrency`` actors of ``num_cpus`` CPUs each
    (None: as many as the cluster holds, up to :data:`DEFAULT_ACTORS`; more than it holds
    raises :class:`InvalidArgumentError`), each call on at most ``batch_size`` rows;
    ``resources`` pins them to nodes that offer those custom resources. An error on an
    actor is raised, while the dataset is consumed, as an instance of the mmstore error's
    own class (see the module's docstring).

    ``materialize``: a :class:`mmstore.Materialize` (its ``dtype``, ``missing``,
    ``max_len``, ``columns`` and ``cache_bytes`` apply; other settings moved from their defaults are
    refused); ``None``: its defaults with ``dtype=float32``. For one release ``dtype=`` and
    ``missing=`` are also taken as flat keywords.
    """
    ray = _ray()
    settings = _settings(materialize, flat_settings)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    size = _pool_size(ray, concurrency, num_cpus, resources)
    snapshot = take_snapshot(store, runs, steps, version=version)
    if not snapshot.units:
        raise InvalidArgumentError(f"no committed rollout rows match runs={runs} steps={steps}")
    work = ray.data.from_items(_slices(snapshot.units, batch_size))
    _typed_errors(work)
    return work.map_batches(
        _Materialize,
        fn_constructor_kwargs={
            "store": store,
            "image_processor": image_processor,
            "settings": settings,
            "units": snapshot.units,
        },
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=num_cpus,
        resources=resources,
    )


# -- a rank's batches, in the loader's order ----------------------------------------------


class _BuildBatches:
    """A Ray actor that builds batch ``k`` of a loader's epoch, as a DataLoader worker does."""

    def __init__(self, loader: RolloutLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"index": [], "payload": []}
        for index in batch["index"].tolist():
            built = self.loader.build_batch(self.epoch, int(index))
            out["index"].append(index)
            out["payload"].append(pickle.dumps(built, protocol=pickle.HIGHEST_PROTOCOL))
        return out


def iter_batches(
    loader: RolloutLoader,
    *,
    concurrency: int | None = None,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    prefetch: int = 2,
) -> Iterator[dict[str, Any]]:
    """The batches ``loader`` would yield from its current position, built on Ray actors.

    Same order, same contents, same resume point: after ``k`` batches,
    ``loader.state_dict()`` resumes at batch ``k`` (locally or through Ray again). At the
    end of the epoch the loader moves to the next epoch, as its own iteration does. The
    pool is sized as :func:`read_rollouts`'s; an error on an actor is raised here as the
    mmstore error the actor raised, itself.
    """
    ray = _ray()
    # Checked now, not at the first batch: a pool the cluster cannot hold fails at the call.
    size = _pool_size(ray, concurrency, num_cpus, resources)
    return _batches(ray, loader, size, num_cpus, resources, prefetch)


def _batches(
    ray: Any,
    loader: RolloutLoader,
    size: int,
    num_cpus: float,
    resources: dict[str, float] | None,
    prefetch: int,
) -> Iterator[dict[str, Any]]:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the plan's order, not arrival order
    epoch, start, total = loader.epoch, loader.batches_yielded, len(loader)
    indices = ray.data.from_items([{"index": k} for k in range(start, total)])
    _typed_errors(indices)
    built = indices.map_batches(
        _BuildBatches,
        fn_constructor_kwargs={"loader": loader, "epoch": epoch},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=num_cpus,
        resources=resources,
    )
    rows = built.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=prefetch)
    try:
        yield from _in_order(loader, rows, start)
    except ray.exceptions.RayTaskError as err:
        raise _original(err) from err
    if loader.batches_yielded >= total:
        loader.set_epoch(epoch + 1)


def _in_order(
    loader: RolloutLoader, rows: Iterator[dict[str, np.ndarray]], start: int
) -> Iterator[dict[str, Any]]:
    """The built batches, each checked to be the one due, finished and counted."""
    expected = start
    for row in rows:
        index = int(row["index"][0])
        if index != expected:
            raise MmstoreError(f"Ray delivered batch {index} where batch {expected} was due")
        # Built on an actor; with preprocess_device, processed on the device here.
        batch = loader.finish_batch(pickle.loads(row["payload"][0]))
        loader.batches_yielded = expected = expected + 1
        yield batch
