"""``mmstore demo``: write a store of synthetic screenshot rollouts and train-read it.

Multi-turn computer-use style samples (PIL-drawn 1080p UI screenshots), GRPO groups whose
samples share their screenshots, streamed through :class:`RolloutLoader` with the real
Qwen2-VL image processor (PIL backend, default settings), cast to bf16.

The store is kept (``./mmstore-demo`` unless told otherwise) so the README's commands have
one to work on; a rerun replaces the demo run in it. ``tmp=True`` writes to a temporary
directory and deletes it afterwards, saying so.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from mmstore import debug
from mmstore._families import adapter_for
from mmstore._lifecycle.gc import release_run
from mmstore._progress import bar
from mmstore._rows.store import Store
from mmstore.synth import grpo_rollouts

DEFAULT_ROOT = "mmstore-demo"
DEMO_RUN = "demo"


def main(
    root: str | None = None,
    *,
    groups: int = 8,
    group_size: int = 8,
    turns: int = 2,
    steps: int = 2,
    batch_size: int = 8,
    num_workers: int = 2,
    tmp: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Run the demo; print and return its summary.

    The store goes to ``root`` (default ``./mmstore-demo``) and stays there; an earlier demo
    run in it is released first. ``tmp=True`` uses a temporary directory, deleted at the end.
    """
    import torch

    # The torchvision backend, as the README and examples use: twice PIL's speed, same layout.
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from mmstore import Materialize, RolloutDataset, RolloutLoader  # torch: only when the demo runs

    workdir = None
    if tmp:
        workdir = tempfile.mkdtemp(prefix="mmstore-demo-")
        root = f"{workdir}/store"
    root = root or DEFAULT_ROOT
    try:
        processor = Qwen2VLImageProcessor()
        adapter = adapter_for(processor)
        store = Store.open(root, create=True)
        _replace_earlier_demo(store)
        started = time.perf_counter()
        for step in bar(range(steps), desc="writing steps", unit="step", progress=progress):
            with store.writer(run_id=DEMO_RUN, step=step) as writer:
                for rollout in grpo_rollouts(
                    store,
                    adapter,
                    groups=groups,
                    group_size=group_size,
                    images_per_sample=turns,
                    seed=step,
                ):
                    writer.write(rollout)
        write_s = time.perf_counter() - started

        settings = Materialize(dtype=torch.bfloat16)
        dataset = RolloutDataset(store, processor, materialize=settings, seed=0)
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

        summary = _summary(store, seen, hits, misses, write_s, read_s, peak_batch)
        _print(summary, root, kept=workdir is None)
        return {**summary, "root": root, "kept": workdir is None}
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _replace_earlier_demo(store: Any) -> None:
    """A rerun into the same store starts from a clean demo run (its rows would repeat)."""
    if any(f.run_id == DEMO_RUN for f in store.files()):
        release_run(store, DEMO_RUN, grace_seconds=0)
        print(f"replaced the earlier demo run in {store.root}")


def _summary(
    store: Any,
    seen: int,
    hits: int,
    misses: int,
    write_s: float,
    read_s: float,
    peak_batch: int,
) -> dict[str, Any]:
    """The store's figures (from ``debug.summary``) beside the training read's."""
    stored = debug.summary(store, by=(), progress=False).row(0, named=True)
    on_disk = stored["media_bytes"] + stored["parquet_bytes"]
    return {
        "rows": stored["samples"],
        "images": stored["images"],
        "unique_images": stored["unique_images"],
        "samples_read": seen,
        "media_bytes": stored["media_bytes"],
        "parquet_bytes": stored["parquet_bytes"],
        "dense_fp32_bytes": stored["dense_fp32_bytes"],
        "dense_over_stored": stored["dense_fp32_bytes"] / max(1, on_disk),
        "write_seconds": round(write_s, 2),
        "read_seconds": round(read_s, 2),
        "images_per_second": round(stored["images"] / read_s, 1) if read_s else None,
        "cache_hit_rate": round(hits / max(1, hits + misses), 3),
        "peak_batch_pixel_bytes": peak_batch,
    }


def _print(summary: dict[str, Any], root: str, *, kept: bool) -> None:
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
    if kept:
        print(f"  store kept at {root}: try `mmstore stats {root}` or `mmstore inspect {root}`")
    else:
        print(f"  store deleted (it was the temporary {root}; omit --tmp to keep one)")
