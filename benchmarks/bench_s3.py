"""Loader throughput on an S3 store at 0 and 30 ms added latency, with and without prefetch.

    python -m benchmarks.bench_s3 --scale 1

A store of photo-like JPEGs (one distinct image per sample: every image is a read) is
written to moto_server on loopback; the loader reads it through a proxy (``_s3.py``) that
adds ``0`` or ``30`` ms to every request. Four configurations, interleaved A B C D over the
repetitions after one untimed warm-up pass, each a fresh dataset (a cold cache, no node
cache), single process (``num_workers=0``), timed in wall seconds (latency is waiting):

- ``prefetch``: the default on a remote store (``._prefetch``: reads ahead, bounded);
- ``serial``: ``prefetch_requests=0``, one blocking read per image, the loader before it.

Headline: throughput at 30 ms / at 0 ms with prefetch (target >= 0.8; higher is better),
the same without, and prefetch / serial at 30 ms.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pyarrow.fs as pafs

import mmstore
from benchmarks import _s3
from benchmarks._common import WORKLOADS, cli, interleaved, processor
from mmstore.synth import grpo_rollouts

HEADLINE = [
    ("S3 loader 30 ms / 0 ms latency, prefetch", "prefetch_30_over_0"),
    ("S3 loader 30 ms / 0 ms latency, serial reads", "serial_30_over_0"),
    ("S3 loader prefetch / serial at 30 ms", "prefetch_over_serial_at_30"),
]
BATCH = 8
LATENCIES_MS = (0, 30)


def _write(port: int, bucket: str, samples: int, proc: Any) -> None:
    options = _s3.s3_options(port)
    pafs.S3FileSystem(**options).create_dir(bucket)  # type: ignore[arg-type]
    store = mmstore.Store.open(f"s3://{bucket}/store", create=True, s3_options=options)
    spec = dict(WORKLOADS["photos"])
    w, h = spec["image_size"]
    spec["image_size"] = (w // 3, h // 3)  # the reads, not the processor, are measured
    adapter = mmstore.adapter_for(proc)
    with store.writer(run_id="bench", step=0, row_group_size=64) as writer:
        for rollout in grpo_rollouts(store, adapter, groups=samples, **spec):
            writer.write(rollout)


def samples_per_s(port: int, bucket: str, proc: Any, prefetch: bool) -> float:
    store = mmstore.Store.open(f"s3://{bucket}/store", s3_options=_s3.s3_options(port))
    # No node cache: every pass reads every image from S3, which is what is measured.
    settings = mmstore.Materialize(node_cache_bytes=0, prefetch_requests=None if prefetch else 0)
    ds = mmstore.RolloutDataset(store, proc, seed=0, materialize=settings)
    start = time.perf_counter()
    n = sum(len(b["sample_ids"]) for b in mmstore.RolloutLoader(ds, batch_size=BATCH))
    return n / (time.perf_counter() - start)


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    if _s3.moto_executable() is None:
        return {"skipped": "moto_server is not installed (pip install 'moto[server]')"}
    samples = max(16, round(256 * scale))
    proc = processor()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {"samples": samples, "batch_size": BATCH, "workers": 0}
    with _s3.moto_server() as port:
        _write(port, bucket, samples, proc)
        with (
            _s3.LatencyProxy(port, 0.0) as fast,
            _s3.LatencyProxy(port, LATENCIES_MS[1] / 1000) as slow,
        ):
            ports = {0: fast.port, 30: slow.port}
            samples_per_s(fast.port, bucket, proc, True)  # warm-up: imports, connections
            figures = interleaved(
                {
                    f"{mode}_{ms}ms": (
                        lambda p=ports[ms], on=(mode == "prefetch"): samples_per_s(
                            p, bucket, proc, on
                        )
                    )
                    for ms in LATENCIES_MS
                    for mode in ("prefetch", "serial")
                },
                reps,
            )
    med = {k: v["median"] for k, v in figures.items()}
    results.update(
        samples_per_s=figures,
        prefetch_30_over_0=med["prefetch_30ms"] / med["prefetch_0ms"],
        serial_30_over_0=med["serial_30ms"] / med["serial_0ms"],
        prefetch_over_serial_at_30=med["prefetch_30ms"] / med["serial_30ms"],
    )
    return results


if __name__ == "__main__":
    cli(run, __doc__, reps=3)
