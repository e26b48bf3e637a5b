"""Worker preprocessing vs preprocessing on a device (``RolloutLoader(preprocess_device=)``).

Builds a store of distinct screenshots (1920x1080 by default, one per sample, nothing shared),
then, with Qwen2-VL's torchvision image processor at its published defaults:

1. ``equal``: the first ``--check-batches`` batches of both paths agree: every tensor but the
   pixels identical (grids, tokens, masks), image tensors on the device, pixel values equal
   to bf16 precision (within two 8-bit gray levels: CUDA's resampling rounds apart from the
   CPU's uint8 kernels). Exits 1 if not.
   The same holds for the device path with ``distinct_images=True``, expanded on the device.
2. ``images_per_s``: loader throughput of the paths, interleaved, median and spread over
   ``--reps`` (the device paths synchronize the device before their clocks stop).
   ``--group-size 8`` shares each image across a GRPO group of 8 samples: the device then
   processes each image once per batch, and with ``distinct_images`` it travels once.

GPU machine: ``python scripts/device_preprocess_check.py --device cuda``. It runs on CPU too,
at a tiny scale, to check the script itself::

    python scripts/device_preprocess_check.py --device cpu --samples 4 --size 320x180 --reps 1
    python scripts/device_preprocess_check.py --device cuda --group-size 8 --samples 256

Prints a JSON report (and writes it to ``--out`` if given).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore.synth import grpo_rollouts

STATS = {"cache_hits", "cache_misses", "node_cache_hits", "node_cache_misses"}


def build_store(
    root: str, processor: Any, samples: int, size: tuple[int, int], group_size: int = 1
) -> mmstore.Store:
    store = mmstore.Store.open(f"{root}/store", create=True)
    adapter = mmstore.adapter_for(processor)
    with store.writer(run_id="screens", step=0) as w:
        for rollout in grpo_rollouts(
            store,
            adapter,
            groups=max(1, samples // group_size),
            group_size=group_size,
            images_per_sample=1,
            image_size=size,
        ):
            w.write(rollout)
    return store


def loader(
    store: mmstore.Store, processor: Any, args: Any, device: str | None, distinct: bool = False
) -> Any:
    settings = mmstore.Materialize(
        node_cache_bytes=0, preprocess_device=device, distinct_images=distinct
    )
    ds = mmstore.RolloutDataset(store, processor, seed=0, materialize=settings)
    return mmstore.RolloutLoader(
        ds,
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=device is not None and device.startswith("cuda"),
    )


def expanded(batches: Any) -> Any:
    """A distinct loader's batches as the model takes them, expanded where they are."""
    return (mmstore.expand_images(batch) for batch in batches)


def compare(cpu: dict[str, Any], dev: dict[str, Any], levels: float, device: str) -> dict[str, Any]:
    """How one batch of the device path differs from the worker path's."""
    problems = []
    for key in ("pixel_values", "image_grid_thw"):
        if dev[key].device.type != torch.device(device).type:
            problems.append(f"{key} is on {dev[key].device}, not {device}")
    for key in cpu.keys() - STATS - {"pixel_values"}:
        a, b = cpu[key], dev[key]
        if isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or not torch.equal(a, b.cpu()):
                problems.append(f"{key} differs")
        elif a != b:
            problems.append(f"{key} differs")
    a, b = cpu["pixel_values"].float(), dev["pixel_values"].cpu().float()
    diff = (a - b).abs()
    try:
        torch.testing.assert_close(b, a, atol=2 * levels, rtol=0.016)
    except AssertionError as exc:
        problems.append(f"pixel_values: {str(exc).splitlines()[0]}")
    on_device = {k: str(dev[k].device) for k in ("pixel_values", "image_grid_thw")}
    return {
        "problems": problems,
        "devices": on_device,
        "pixel_max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "pixel_bf16_equal_fraction": float((a == b).float().mean()) if a.numel() else 1.0,
    }


def images_per_s(make: Any, device: str | None) -> float:
    start, images = time.perf_counter(), 0
    for batch in make():
        images += int(batch["image_grid_thw"].shape[0])
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize()
    return images / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT of the screenshots")
    parser.add_argument(
        "--group-size", type=int, default=1, help="samples per GRPO group, sharing its image"
    )
    parser.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-batches", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.lower().split("x"))
    processor = Qwen2VLImageProcessor()
    levels = 1 / 255 / min(processor.image_std)  # one 8-bit gray level after normalization
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        started = time.perf_counter()
        store = build_store(root, processor, args.samples, (width, height), args.group_size)
        built_s = time.perf_counter() - started

        makers = {
            "workers": (lambda: loader(store, processor, args, None), None),
            "device": (lambda: loader(store, processor, args, args.device), args.device),
            "device_distinct": (
                lambda: expanded(loader(store, processor, args, args.device, distinct=True)),
                args.device,
            ),
        }
        # Equality first (this also warms the device: CUDA context, kernels): each device
        # path's first batches against the workers' (distinct: expanded on the device).
        checks = [
            compare(a, b, levels, args.device)
            for name in ("device", "device_distinct")
            for a, b in itertools.islice(
                zip(makers["workers"][0](), makers[name][0](), strict=True), args.check_batches
            )
        ]

        runs: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(args.reps):  # interleaved: drift hits all alike
            for name, (make, device) in makers.items():
                runs[name].append(images_per_s(make, device))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ok = all(not c["problems"] for c in checks) and bool(checks)
    report = {
        "ok": ok,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "image_size": [width, height],
        "samples": args.samples,
        "group_size": args.group_size,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "store_build_s": round(built_s, 2),
        "equal": checks,
        "images_per_s": {
            k: {"median": med[k], "min": min(v), "max": max(v), "runs": v} for k, v in runs.items()
        },
        "device_over_workers": med["device"] / med["workers"],
        "device_distinct_over_workers": med["device_distinct"] / med["workers"],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
