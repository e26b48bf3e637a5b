"""Loader images/s vs the physical limit, a naive Dataset and HF datasets; memory fp32/bf16.

    python -m benchmarks.bench_loader --scale 1

Workloads (benchmarks/_common.py): "screenshots" (GRPO groups of 8 sharing 2 screenshots
per sample), "screenshots_distinct" (the same shape, nothing shared) and "photos" (one JPEG
per sample, nothing shared). Measured in one run, interleaved, several repetitions:

- physical limit: ``workers / (decode + processor seconds per image)``, measured here on
  the same images, single-threaded;
- naive: a map-style torch Dataset that opens each image path and runs the processor;
- HF datasets: an ``Image`` column over the same files, ``set_transform`` running the same
  processor, through a DataLoader with the same workers.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import mmstore
from benchmarks._common import WORKLOADS, cli, interleaved, processor, single_threaded, timed
from mmstore.synth import grpo_rollouts

BATCH = 8


def build(
    root: str, spec: dict[str, Any], samples: int, proc: Any
) -> tuple[mmstore.Store, list[list[str]]]:
    """A store, plus each sample's media file paths for the baselines."""
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(proc)
    paths = []
    groups = max(1, samples // spec["group_size"])
    with store.writer(run_id="bench", step=0, row_group_size=64) as w:
        for r in grpo_rollouts(store, adapter, groups=groups, **spec):
            w.write(r)
            paths.append([store.backend.abspath(ref.uri) for ref in r.images])
    return store, paths


class NaiveDataset(Dataset[dict[str, torch.Tensor]]):
    """Open each path and run the processor per sample: no cache, no verification."""

    def __init__(self, paths: list[list[str]], proc: Any) -> None:
        self.paths, self.proc = paths, proc

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out = self.proc(
            images=[Image.open(p).convert("RGB") for p in self.paths[i]], return_tensors="pt"
        )
        return {
            "pixel_values": out["pixel_values"].to(torch.bfloat16),
            "image_grid_thw": out["image_grid_thw"],
        }


def _cat(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([it[k] for it in items]) for k in items[0]}


def hf_dataset(paths: list[list[str]], proc: Any) -> Any:
    import datasets

    datasets.disable_progress_bars()  # its progress output stays out of the report
    ds = datasets.Dataset.from_dict({"images": paths}).cast_column(
        "images", datasets.Sequence(datasets.Image())
    )

    def transform(batch: dict[str, list[Any]]) -> dict[str, Any]:
        outs = [
            proc(images=[im.convert("RGB") for im in ims], return_tensors="pt")
            for ims in batch["images"]
        ]
        return {
            "pixel_values": [o["pixel_values"].to(torch.bfloat16) for o in outs],
            "image_grid_thw": [o["image_grid_thw"] for o in outs],
        }

    ds.set_transform(transform)
    return ds


def images_per_s(loader: Any) -> float:
    return loader_rate(loader)[0]


def loader_rate(loader: Any) -> tuple[float, int]:
    """A pass of ``loader``: images/s and the images it gave."""
    seconds, images = timed(lambda: sum(int(b["image_grid_thw"].shape[0]) for b in loader))
    return images / seconds, images


def per_image_seconds(paths: list[list[str]], proc: Any, n: int = 6) -> float:
    costs = []
    with single_threaded():
        for p in sorted({p for ps in paths for p in ps})[:n]:
            start = time.perf_counter()
            proc(images=[Image.open(p).convert("RGB")], return_tensors="pt")
            costs.append(time.perf_counter() - start)
    return statistics.median(costs)


def peak_batch_bytes(store: mmstore.Store, proc: Any, dtype: torch.dtype) -> int:
    ds = mmstore.RolloutDataset(store, proc, dtype=dtype, seed=0)
    return max(
        b["pixel_values"].numel() * b["pixel_values"].element_size()
        for b in mmstore.RolloutLoader(ds, batch_size=BATCH)
    )


def _hf_collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return _cat([{k: r[k] for k in ("pixel_values", "image_grid_thw")} for r in rows])


def measure(
    store: mmstore.Store, paths: list[list[str]], proc: Any, workers: int, reps: int
) -> dict[str, Any]:
    """mmstore vs naive vs HF datasets vs the physical limit on one workload, interleaved."""
    hf = hf_dataset(paths, proc)
    expected = sum(len(p) for p in paths)
    ds = mmstore.RolloutDataset(store, proc, seed=0)
    got = sum(
        int(b["image_grid_thw"].shape[0]) for b in mmstore.RolloutLoader(ds, batch_size=BATCH)
    )
    assert got == expected, f"loader produced {got} images, expected {expected}"

    def limit() -> float:  # images/s if every worker's core only decoded and processed
        return workers / per_image_seconds(paths, proc, n=16)

    def ours() -> float:
        loader = mmstore.RolloutLoader(ds, batch_size=BATCH, num_workers=workers)
        return images_per_s(loader)

    def naive() -> float:
        dataset = NaiveDataset(paths, proc)
        return images_per_s(
            DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=_cat)
        )

    def hugging_face() -> float:
        return images_per_s(
            DataLoader(hf, batch_size=BATCH, num_workers=workers, collate_fn=_hf_collate)
        )

    timings = {"limit": limit, "mmstore": ours, "naive": naive, "hf_datasets": hugging_face}
    figures = interleaved(timings, reps)
    med = {k: v["median"] for k, v in figures.items()}
    return {
        "images_per_s": figures,
        "physical_limit_images_per_s": med["limit"],
        "mmstore_over_limit": med["mmstore"] / med["limit"],
        "mmstore_over_naive": med["mmstore"] / med["naive"],
        "mmstore_over_hf_datasets": med["mmstore"] / med["hf_datasets"],
    }


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    samples = max(8, round(64 * scale))
    workers = min(2, os.cpu_count() or 1)
    proc = processor()
    specs = {
        "screenshots": WORKLOADS["screenshots"],
        "screenshots_distinct": {**WORKLOADS["screenshots"], "share_images": False},
        "photos": WORKLOADS["photos"],
    }
    results: dict[str, Any] = {"samples": samples, "workers": workers, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in specs.items():
            if scale < 0.5:
                w, h = spec["image_size"]
                spec = {**spec, "image_size": (w // 3, h // 3)}
            store, paths = build(f"{tmp}/{name}", spec, samples, proc)
            results[name] = measure(store, paths, proc, workers, reps)
        store = mmstore.Store.open(f"{tmp}/screenshots")
        peaks = {
            str(d).removeprefix("torch."): peak_batch_bytes(store, proc, d)
            for d in (torch.float32, torch.bfloat16)
        }
        results["peak_batch_pixel_bytes"] = peaks
        results["bf16_over_fp32_memory"] = peaks["bfloat16"] / peaks["float32"]
    return results


if __name__ == "__main__":
    cli(run, __doc__, reps=3)
