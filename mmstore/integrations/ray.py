"""Ray Data: read a store and materialize its images on a pool of CPU actors, across nodes.

Optional extra ``ray``; importing mmstore never imports Ray.

Two entry points:

- :func:`read_rollouts` is a ``ray.data.Dataset`` of materialized samples, one row each: Ray
  reads the committed Parquet files (hive partitions typed: ``run_id`` a string, ``step`` an
  integer; only the columns the trainer needs), and an actor pool of CPU workers, each with
  its own processor, cache and dtype cast, turns its Arrow batches into model inputs through
  the loader's own checks (a bad row raises naming its file, run, step and sample). Use it
  for offline preprocessing, evaluation and analysis: its order is Ray's.
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
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mmstore._exceptions import InvalidArgumentError, MmstoreError
from mmstore._families import adapter_for
from mmstore._format.schema import FILE_COLUMN, ROW_COLUMNS
from mmstore._rows.files import conform
from mmstore._rows.snapshot import take_snapshot
from mmstore._rows.store import Store

if TYPE_CHECKING:
    import ray.data
    import torch

    from mmstore._loading.dataset import RolloutLoader  # torch: only for type checks

__all__ = ["iter_batches", "read_rollouts"]

PATH_COLUMN = "path"  # the file of each row, added by read_parquet(include_paths=True)


def _ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the environment
        raise MmstoreError(
            "mmstore.integrations.ray needs Ray Data: pip install 'mmstore[ray]'"
        ) from None
    return ray


# -- samples as a Ray dataset -------------------------------------------------------------


class _Materialize:
    """A Ray actor: Arrow batches -> materialized samples (numpy), with its own cache.

    The batch goes through the loader's own path: :func:`._rowcheck.conform` casts each
    file's rows to the v1 types (or refuses them naming the file), and
    :meth:`Materializer.samples` runs the reader's checks (spans, sizes, trust) row by row
    on Arrow views, so no row becomes Python values first.
    """

    def __init__(self, store: Store, image_processor: Any, dtype: str, missing: str) -> None:
        import torch

        from mmstore._loading.materialize import Materializer
        from mmstore._loading.stack import batch_images

        self.batch_images = batch_images

        self.materializer = Materializer(
            store,
            adapter_for(image_processor),
            dtype=getattr(torch, dtype),
            missing=missing,  # type: ignore[arg-type]
        )
        self.base = store.backend.abspath("")

    def __call__(self, batch: pa.Table) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        if batch.num_rows == 0:
            return out
        table = _conformed(batch, self.base)
        runs, steps = batch.column("run_id").to_pylist(), batch.column("step").to_pylist()
        samples = self.materializer.samples(table)
        for run_id, step, sample in zip(runs, steps, samples, strict=True):
            images = self.batch_images(self.materializer.adapter, sample.images)
            record = {
                "run_id": run_id,
                "step": step,
                "sample_id": sample.sample_id,
                "group_id": sample.group_id,
                "input_ids": sample.input_ids.numpy(),
                "loss_mask": sample.loss_mask.numpy(),
                "advantage": sample.advantage,
                "reward": sample.reward,
                **{k: _numpy(v) for k, v in images.items()},
            }
            for key, value in record.items():
                out.setdefault(key, []).append(value)
        return out


def _conformed(batch: pa.Table, base: str) -> pa.Table:
    """The loader's columns of ``batch`` cast to the v1 types file by file (a batch may
    span files), each row's store-relative file in ``_file`` for the errors' context."""
    parts, start = [], 0
    for path, rows in itertools.groupby(batch.column(PATH_COLUMN).to_pylist()):
        n = len(list(rows))
        file = _relative(path, base)
        part = conform(batch.slice(start, n), ROW_COLUMNS, file=file)
        parts.append(part.append_column(FILE_COLUMN, pa.array([file] * n, pa.string())))
        start += n
    return pa.concat_tables(parts)


def _relative(path: str, base: str) -> str:
    """Ray's ``path`` (as the store's filesystem names it) -> the store-relative path."""
    prefix = base.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: floating tensors travel as float32 (cast on the device).
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


def read_rollouts(
    store: Store,
    image_processor: Any,
    runs: Any = None,
    steps: Any = None,
    *,
    dtype: str = "float32",
    missing: str = "error",
    concurrency: int = 2,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    batch_size: int = 16,
) -> ray.data.Dataset:
    """The selected committed rollouts as a Ray dataset of materialized samples.

    Columns: ``run_id`` (str), ``step`` (int), ``sample_id``, ``group_id``, ``input_ids``,
    ``loss_mask``, ``advantage``, ``reward`` and the family's image tensors (numpy; floats
    as float32). Materialization runs in ``concurrency`` actors of ``num_cpus`` CPUs each;
    ``resources`` pins them to nodes that offer those custom resources.
    """
    ray = _ray()
    from ray.data.datasource import Partitioning
    from ray.data.datasource.partitioning import PartitionStyle

    snapshot = take_snapshot(store, runs, steps)
    if not snapshot.files:
        raise InvalidArgumentError(f"no committed rollout files match runs={runs} steps={steps}")
    backend = store.backend
    data = ray.data.read_parquet(
        [backend.abspath(path) for path in snapshot.files],
        filesystem=backend.fs,
        partitioning=Partitioning(
            PartitionStyle.HIVE,
            base_dir=backend.abspath("rollouts"),
            field_types={"run_id": str, "step": int},
        ),
        include_paths=True,
    ).select_columns([*ROW_COLUMNS, "run_id", "step", PATH_COLUMN])  # pushed into the read
    return data.map_batches(
        _Materialize,
        fn_constructor_kwargs={
            "store": store,
            "image_processor": image_processor,
            "dtype": dtype,
            "missing": missing,
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=concurrency),
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
    concurrency: int = 2,
    num_cpus: float = 1,
    resources: dict[str, float] | None = None,
    prefetch: int = 2,
) -> Iterator[dict[str, Any]]:
    """The batches ``loader`` would yield from its current position, built on Ray actors.

    Same order, same contents, same resume point: after ``k`` batches,
    ``loader.state_dict()`` resumes at batch ``k`` (locally or through Ray again). At the
    end of the epoch the loader moves to the next epoch, as its own iteration does.
    """
    ray = _ray()
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the plan's order, not arrival order
    epoch, start, total = loader.epoch, loader.batches_yielded, len(loader)
    indices = ray.data.from_items([{"index": k} for k in range(start, total)])
    built = indices.map_batches(
        _BuildBatches,
        fn_constructor_kwargs={"loader": loader, "epoch": epoch},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=concurrency),
        num_cpus=num_cpus,
        resources=resources,
    )
    expected = start
    rows = built.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=prefetch)
    for row in rows:
        index = int(row["index"][0])
        if index != expected:
            raise MmstoreError(f"Ray delivered batch {index} where batch {expected} was due")
        # Built on an actor; with preprocess_device, processed on the device here.
        batch = loader.finish_batch(pickle.loads(row["payload"][0]))
        loader.batches_yielded = expected = expected + 1
        yield batch
    if loader.batches_yielded >= total:
        loader.set_epoch(epoch + 1)
