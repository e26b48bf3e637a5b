"""``mmstore demo``: write a store of synthetic screenshot rollouts and train-read it.

Multi-turn computer-use style samples (PIL-drawn 1080p UI screenshots), GRPO groups whose
samples share their screenshots, streamed through :class:`RolloutLoader` with the real
Qwen2-VL image processor (PIL backend, default settings), cast to bf16.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from ._progress import bar


def main(
    root: str | None = None,
    *,
    groups: int = 8,
    group_size: int = 8,
    turns: int = 2,
    steps: int = 2,
    batch_size: int = 8,
    num_workers: int = 2,
    keep: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Run the demo; print and return its summary. A temporary store unless ``root``."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from . import RolloutDataset, RolloutLoader, Store, adapter_for
    from ._synth import grpo_rollouts

    workdir = None
    if root is None:
        workdir = tempfile.mkdtemp(prefix="mmstore-demo-")
        root = f"{workdir}/store"
    try:
        processor = Qwen2VLImageProcessorPil()
        adapter = adapter_for(processor)
        store = Store.open(root, create=True)
        started = time.perf_counter()
        rows = images = 0
        hashes: set[str] = set()
        for step in bar(range(steps), desc="writing steps", unit="step", progress=progress):
            with store.writer(run_id="demo", step=step) as writer:
                for rollout in grpo_rollouts(
                    store,
                    adapter,
                    groups=groups,
                    group_size=group_size,
                    images_per_sample=turns,
                    seed=step,
                ):
                    writer.write(rollout)
                    rows += 1
                    images += len(rollout.images)
                    hashes.update(ref.hash for ref in rollout.images)
        write_s = time.perf_counter() - started

        dataset = RolloutDataset(store, processor, dtype=torch.bfloat16, seed=0)
        loader = RolloutLoader(dataset, batch_size=batch_size, num_workers=num_workers)
        started = time.perf_counter()
        seen = hits = misses = 0
        peak_batch = 0
        for batch in bar(
            loader, total=len(loader), desc="training read", unit="batch", progress=progress
        ):
            seen += len(batch["sample_ids"])
            hits += batch["cache_hits"]
            misses += batch["cache_misses"]
            peak_batch = max(
                peak_batch, batch["pixel_values"].numel() * batch["pixel_values"].element_size()
            )
        read_s = time.perf_counter() - started

        summary = _summary(
            store,
            adapter,
            rows,
            images,
            len(hashes),
            seen,
            hits,
            misses,
            write_s,
            read_s,
            peak_batch,
        )
        _print(summary, root if keep or workdir is None else None)
        return summary
    finally:
        if workdir is not None and not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _summary(
    store: Any,
    adapter: Any,
    rows: int,
    images: int,
    unique: int,
    seen: int,
    hits: int,
    misses: int,
    write_s: float,
    read_s: float,
    peak_batch: int,
) -> dict[str, Any]:
    import pyarrow.parquet as pq

    media = store.backend.list("media")
    media_bytes = sum(f.size for f in media)
    parquet_bytes = sum(f.size for f in store.rollout_files())
    dense = 0
    for f in store.rollout_files():
        table = pq.ParquetFile(store.backend.fs.open_input_file(store.backend.abspath(f.path)))
        for refs in table.read(columns=["images"]).column("images").to_pylist():
            for ref in refs:
                patches, dim = adapter.layout.pixel_shape(ref["width"], ref["height"])
                dense += patches * dim * 4
    return {
        "rows": rows,
        "images": images,
        "unique_images": unique,
        "samples_read": seen,
        "media_bytes": media_bytes,
        "parquet_bytes": parquet_bytes,
        "dense_fp32_bytes": dense,
        "dense_over_stored": dense / max(1, media_bytes + parquet_bytes),
        "write_seconds": round(write_s, 2),
        "read_seconds": round(read_s, 2),
        "images_per_second": round(images / read_s, 1) if read_s else None,
        "cache_hit_rate": round(hits / max(1, hits + misses), 3),
        "peak_batch_pixel_bytes": peak_batch,
    }


def _print(summary: dict[str, Any], root: str | None) -> None:
    mib = 2**20
    lines = [
        ("rows", f"{summary['rows']}"),
        ("image refs", f"{summary['images']}  ({summary['unique_images']} unique)"),
        (
            "bytes on disk",
            f"{(summary['media_bytes'] + summary['parquet_bytes']) / mib:.1f} MiB "
            f"(media {summary['media_bytes'] / mib:.1f}, parquet "
            f"{summary['parquet_bytes'] / mib:.2f})",
        ),
        (
            "dense fp32 pixels",
            f"{summary['dense_fp32_bytes'] / mib:.1f} MiB  "
            f"({summary['dense_over_stored']:.0f}x the store)",
        ),
        ("write", f"{summary['write_seconds']} s"),
        ("training read", f"{summary['read_seconds']} s, {summary['images_per_second']} images/s"),
        ("cache hit rate", f"{summary['cache_hit_rate']:.1%}"),
        ("largest batch pixels", f"{summary['peak_batch_pixel_bytes'] / mib:.1f} MiB (bf16)"),
    ]
    width = max(len(k) for k, _ in lines)
    print("mmstore demo: synthetic computer-use rollouts, Qwen2-VL processor, bf16")
    for key, value in lines:
        print(f"  {key:<{width}}  {value}")
    if root:
        print(f"  store kept at {root}")
