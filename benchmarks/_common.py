"""Shared pieces of the benchmarks: workloads and side-by-side timing."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore.synth import grpo_rollouts

WORKLOADS = {
    # PIL-drawn UI screenshots, multi-turn (2 per sample), GRPO groups of 8 sharing them.
    "screenshots": dict(
        kind="screenshot",
        images_per_sample=2,
        group_size=8,
        share_images=True,
        image_size=(1920, 1080),
    ),
    # Photo-like JPEGs, one per sample, nothing shared.
    "photos": dict(
        kind="photo", images_per_sample=1, group_size=1, share_images=False, image_size=(800, 600)
    ),
}


def processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor with its published defaults."""
    return Qwen2VLImageProcessorPil()


def write_workload(
    root: str,
    name: str,
    samples: int,
    *,
    small_images: bool = False,
    steps: int = 1,
    epochs: int = 1,
) -> mmstore.Store:
    """A store holding ``samples`` rows of workload ``name`` per epoch over ``steps`` steps.

    Epochs repeat the same prompts (and images), each epoch in its own steps.
    """
    spec = dict(WORKLOADS[name])
    if small_images:
        w, h = spec["image_size"]
        spec["image_size"] = (w // 3, h // 3)
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(processor())
    groups = max(1, samples // spec["group_size"] // steps)
    for epoch in range(epochs):
        for step in range(steps):
            with store.writer(
                run_id=f"{name}-e{epoch}", step=epoch * steps + step, row_group_size=64
            ) as writer:
                for rollout in grpo_rollouts(store, adapter, groups=groups, seed=step, **spec):
                    writer.write(rollout)
    return store


def interleaved(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, dict[str, Any]]:
    """Run each timing function ``reps`` times, A B A B …; median and spread of each, and
    every repetition's value in order (``values``: for :func:`paired_ratio`)."""
    values: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            values[key].append(fn())
    return {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v), "values": v}
        for k, v in values.items()
    }


def paired_ratio(figures: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, float]:
    """Median and spread of ``a / b`` taken within each repetition of :func:`interleaved`.

    The two ran minutes apart at most, so a ratio of one repetition is free of the machine's
    slow and fast phases (on 2026-12-01 the same limit measured 40 to 53 images/s within one
    run), which a ratio of the two medians is not.
    """
    ratios = [x / y for x, y in zip(figures[a]["values"], figures[b]["values"], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


@contextmanager
def single_threaded() -> Iterator[None]:
    """Torch on one thread, as in a DataLoader worker, then as it was.

    A limit of ``workers / seconds per image`` counts one core per worker: timed with
    torch's default threads (every core), the processor's resize and copies run in parallel
    and the limit counted the cores twice (on 2 cores: 21.5 against 26-28 ms per 1080p
    screenshot, a limit about 25% too high).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def cli(
    run: Callable[..., dict[str, Any]],
    doc: str | None,
    reps: int = 3,
    *,
    table: Callable[[dict[str, Any]], str] | None = None,
    name: str = "",
) -> dict[str, Any]:
    """``python -m benchmarks.NAME [--scale S] [--reps N]``: run and print the JSON.

    With ``table``: ``[--out DIR]`` too; the result goes to ``DIR/<name>.json`` and its
    table to ``DIR/<name>.md`` (default: a scratch folder, never ``benchmarks/results/``),
    and the table is printed instead of the JSON."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=reps)
    if table is not None:
        parser.add_argument("--out", default=None, help=f"folder for {name}.json/.md (scratch)")
    args = parser.parse_args()
    result = run(args.scale, args.reps)
    if table is None:
        print(json.dumps(result, indent=2))
        return result
    out = args.out or tempfile.mkdtemp(prefix=f"mmstore-bench-{name}-")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table(result) + "\n")
    print(table(result))
    print(f"written to {out}")
    return result
