"""Ray materialization vs RolloutLoader on this machine, the same number of processes.

    python -m benchmarks.bench_ray --scale 1

One local Ray node on loopback (``_node_ip_address=127.0.0.1``; started before timing), the
``screenshots`` workload at a third of its size, ``N`` = 2 processes each way, one pass each,
side by side (interleaved when ``--reps`` > 1), wall time, samples per second:

- ``loader``: ``RolloutLoader(num_workers=N)``;
- ``ray_iter_batches``: ``mmstore.integrations.ray.iter_batches(loader, concurrency=N)``,
  the same batches in the same order, built on N actors;
- ``ray_read_rollouts``: ``read_rollouts(concurrency=N)`` materialized in full (Ray's order).

Each Ray pass includes starting its actor pool, as a job would. Headline: each Ray figure /
the loader's (higher is better for Ray).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import mmstore
from benchmarks._common import cli, interleaved, processor, write_workload

HEADLINE = [
    ("Ray iter_batches / RolloutLoader, 2 processes", "iter_batches_over_loader"),
    ("Ray read_rollouts / RolloutLoader, 2 processes", "read_rollouts_over_loader"),
]
BATCH = 8
PROCESSES = 2


def _loader(store: mmstore.Store, proc: Any) -> mmstore.RolloutLoader:
    # No node cache: Ray's actors process every image, so the loader does too.
    settings = mmstore.Materialize(dtype="float32", node_cache_bytes=0)
    ds = mmstore.RolloutDataset(store, proc, seed=0, materialize=settings)
    return mmstore.RolloutLoader(ds, batch_size=BATCH, num_workers=PROCESSES)


def loader_rate(store: mmstore.Store, proc: Any) -> float:
    loader = _loader(store, proc)
    start = time.perf_counter()
    n = sum(len(b["sample_ids"]) for b in loader)
    return n / (time.perf_counter() - start)


def iter_batches_rate(store: mmstore.Store, proc: Any) -> float:
    from mmstore.integrations import ray as mmray

    loader = _loader(store, proc)
    start = time.perf_counter()
    n = sum(len(b["sample_ids"]) for b in mmray.iter_batches(loader, concurrency=PROCESSES))
    return n / (time.perf_counter() - start)


def read_rollouts_rate(store: mmstore.Store, proc: Any) -> float:
    from mmstore.integrations import ray as mmray

    start = time.perf_counter()
    data = mmray.read_rollouts(store, proc, concurrency=PROCESSES, batch_size=BATCH)
    n = data.materialize().count()
    return n / (time.perf_counter() - start)


def run(scale: float = 1.0, reps: int = 1) -> dict[str, Any]:
    # Keep Ray on loopback: set before ray is first imported.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        return {"skipped": "ray is not installed (pip install 'mmstore[ray]')"}
    samples = max(16, round(256 * scale))
    proc = processor()
    results: dict[str, Any] = {"samples": samples, "batch_size": BATCH, "processes": PROCESSES}
    with tempfile.TemporaryDirectory() as tmp:
        store = write_workload(f"{tmp}/store", "screenshots", samples, small_images=True)
        ray.init(
            # Its own node, even where another Ray runs on this machine (which ray.init()
            # would join, refusing num_cpus).
            address="local",
            num_cpus=PROCESSES + 1,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
        try:
            figures = interleaved(
                {
                    "loader": lambda: loader_rate(store, proc),
                    "ray_iter_batches": lambda: iter_batches_rate(store, proc),
                    "ray_read_rollouts": lambda: read_rollouts_rate(store, proc),
                },
                reps,
            )
        finally:
            ray.shutdown()
    med = {k: v["median"] for k, v in figures.items()}
    results.update(
        samples_per_s=figures,
        iter_batches_over_loader=med["ray_iter_batches"] / med["loader"],
        read_rollouts_over_loader=med["ray_read_rollouts"] / med["loader"],
    )
    return results


if __name__ == "__main__":
    cli(run, __doc__, reps=1)
