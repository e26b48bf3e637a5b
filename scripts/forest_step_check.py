"""A GRPO-8 training step with a screenshot prompt: prefix forest vs unshared packing.

Issue 41 (e): a Qwen2-VL-2B-sized model (its published architecture, random weights, bf16,
sdpa) takes one GRPO group (a 1920x1080 screenshot prompt of 300 + 2,691 + 40 tokens, 8
responses of ``--response-tokens``) as one packed micro-batch, loaded by ``RolloutLoader``
with ``prefix_sharing=True`` and without; each runs forward and backward of a per-sample
loss (token-mean over each response, mean over samples, read through ``forest_index``).

Reports, per mode: tokens the model ran, vision-tower images, seconds per step (median and
spread over ``--reps``, interleaved, the device synchronized before each clock stops; the
batch is loaded outside the clock), peak device memory (``torch.cuda.max_memory_allocated``
over the step); ratios unshared / forest (higher = mmstore better); and whether the two
losses agree (bf16: relative 2e-2). Exits 1 if they do not. A mode the device cannot hold
is reported as ``out_of_memory`` (a finding, not a failure, unless it is the forest's);
``--checkpointing`` turns on gradient checkpointing in both modes.

Measured on one H200 (2026-12-04, 256-token responses): without checkpointing the forest
step (3,612 tokens, 1 image) took 0.33 s at a 51.9 GB peak and the unshared one (14,560
tokens, 8 images) ran out of the card's 140 GB; with it, forest 0.40 s at 32.4 GB,
unshared 2.17 s at 40.2 GB (5.5x the time), losses equal.

GPU machine: ``python scripts/forest_step_check.py --device cuda``. On CPU, to check the
script itself: ``python scripts/forest_step_check.py --device cpu --tiny --reps 1`` (about
2.5 minutes on 2 cores: the 151,936-token vocabulary's logits dominate; forest 2,456 tokens
and 1 image, unshared 5,312 and 8, 1.54x faster, losses equal).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore.synth import screenshot

GROUP = 8


def config(tiny: bool) -> Qwen2VLConfig:
    """Qwen2-VL-2B's architecture (or a tiny one), published token ids."""
    if tiny:
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    else:
        text = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2)  # fmt: skip
        vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)
    return Qwen2VLConfig(
        text_config=dict(vocab_size=151936, rope_scaling={"type": "mrope",
                         "mrope_section": [16, 24, 24] if not tiny else [2, 3, 3]}, **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, **vision),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    )  # fmt: skip


def write_group(root: str, processor: Any, size: tuple[int, int], response: int) -> Any:
    store = mmstore.Store.open(f"{root}/store", create=True)
    adapter = mmstore.adapter_for(processor)
    rng = np.random.default_rng(0)

    def text(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, 150_000, n)]

    media = store.put_image(screenshot(0, *size))
    prompt, refs = adapter.expand([*text(300), 151652, adapter.image_token_id, 151653,
                                   *text(40)], [media])  # fmt: skip
    with store.writer("grpo", 0, adapter=adapter) as writer:
        for k in range(GROUP):
            answer = text(response)
            writer.write(mmstore.Rollout(
                sample_id=f"s{k}", group_id="g", tokens=prompt + answer, prompt_len=len(prompt),
                loss_mask=[False] * len(prompt) + [True] * response, images=refs,
            ))  # fmt: skip
    return store


def loss_of(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    index = batch["forest_index"]
    logits, ids = logits[0, index].float(), batch["input_ids"][0, index]
    mask, bounds = batch["loss_mask"][0], batch["cu_seqlens"].tolist()
    per_sample = []
    for lo, hi in itertools.pairwise(bounds):
        on = mask[lo + 1 : hi]
        if on.any():
            nll = torch.nn.functional.cross_entropy(logits[lo : hi - 1], ids[lo + 1 : hi],
                                                    reduction="none")  # fmt: skip
            per_sample.append(nll[on].mean())
    return torch.stack(per_sample).mean()


def step(model: Any, loader: Any, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = model(**loader.model_inputs(batch, model))
    loss = loss_of(out.logits, batch)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"seconds": seconds, "peak_bytes": peak, "loss": float(loss.detach())}


def on_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    moved = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            value = value.to(device)
            if value.is_floating_point() and key not in ("loss_mask", "logprobs"):
                value = value.to(dtype)
        moved[key] = value
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and screenshot")
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--checkpointing", action="store_true", help="gradient checkpointing in both modes"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    size = (320, 180) if args.tiny else (1920, 1080)
    processor = Qwen2VLImageProcessor()
    torch.manual_seed(0)
    cfg = config(args.tiny)
    cfg._attn_implementation = "sdpa"
    model = Qwen2VLForConditionalGeneration(cfg).to(device=device, dtype=dtype).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    with tempfile.TemporaryDirectory() as root:
        store = write_group(root, processor, size, args.response_tokens)
        ds = mmstore.RolloutDataset(store, processor, dtype=dtype, shuffle=False)
        loaders = {
            mode: mmstore.RolloutLoader(
                ds, batch_size=GROUP, max_tokens=32768, prefix_sharing=mode == "forest"
            )
            for mode in ("forest", "unshared")
        }
        batches = {mode: on_device(next(iter(loader)), device, dtype)
                   for mode, loader in loaders.items()}  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in loaders}
        step(model, loaders["forest"], batches["forest"], device)  # warm-up (kernels, allocator)
        out_of_memory: set[str] = set()  # a mode the device cannot hold is a finding too
        for _ in range(args.reps):
            for mode, loader in loaders.items():
                if mode in out_of_memory:
                    continue
                try:
                    runs[mode].append(step(model, loader, batches[mode], device))
                except torch.OutOfMemoryError:
                    out_of_memory.add(mode)
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
    report: dict[str, Any] = {
        "device": str(device),
        "tiny": args.tiny,
        "dtype": str(dtype),
        "checkpointing": args.checkpointing,
        "direction": "unshared_over_forest: higher = mmstore better",
    }
    for mode, batch in batches.items():
        grid = batch["image_grid_thw"]
        report[mode] = {
            "tokens": int(batch["input_ids"].shape[1]),
            "images": 0 if grid is None else int(grid.shape[0]),
        }
        if mode in out_of_memory:
            report[mode]["out_of_memory"] = True
            continue
        report[mode] |= {
            "seconds": statistics.median(r["seconds"] for r in runs[mode]),
            "seconds_min_max": [
                min(r["seconds"] for r in runs[mode]),
                max(r["seconds"] for r in runs[mode]),
            ],
            "peak_bytes": max(r["peak_bytes"] for r in runs[mode]),
            "loss": runs[mode][-1]["loss"],
        }
    ok = "forest" not in out_of_memory
    if out_of_memory:  # no ratio and no loss to compare: the report says which did not fit
        report["out_of_memory"] = sorted(out_of_memory)
    else:
        forest, unshared = report["forest"], report["unshared"]
        report["unshared_over_forest"] = {
            "tokens": unshared["tokens"] / forest["tokens"],
            "seconds": unshared["seconds"] / forest["seconds"],
            "peak_bytes": unshared["peak_bytes"] / forest["peak_bytes"]
            if forest["peak_bytes"]
            else None,
        }
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        ok = abs(forest["loss"] - unshared["loss"]) <= tolerance * abs(unshared["loss"])
        report["losses_agree"] = ok
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
