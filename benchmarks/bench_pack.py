"""Packing: efficiency and rank balance of mmstore's plan vs padded and naive greedy batches,
and the time to plan an epoch.

    python -m benchmarks.bench_pack --scale 1      # 1M rows

Lengths follow multi-turn computer-use rollouts: 1-8 screenshots of 1280x720 (Qwen2-VL
layout: 1196 tokens each) plus log-uniform text, 1k-32k tokens a sample. Steps of 64 samples
per rank on 8 ranks, micro-batches of at most 32768 tokens (every sample fits).

- efficiency = real tokens / (micro-batches x max_tokens), micro-batches counted on every rank
  (lock-step: a rank with fewer runs filler), higher is better;
- rank load = real tokens per rank per step, max/mean (1 = perfect), per step, then averaged
  and the worst full step;
- padded: each rank's 64 samples in micro-batches of a fixed count, the largest that always
  fits (max_tokens // longest sample), padded;
- greedy: each rank's 64 consecutive samples, packed in order (next fit), no balancing;
- plan time: the whole epoch's plan for one rank (global order, packing, this rank's share),
  from per-row lengths, as every rank computes it; wall and CPU seconds (on a shared machine
  the CPU time is the fairer figure).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks._common import cli, processor
from mmstore import adapter_for
from mmstore._planning.pack import budget_for, epoch_order, plan_epoch
from mmstore._rows.snapshot import Snapshot, WorkUnit

BATCH, WORLD, MAX_TOKENS, ROW_GROUP = 64, 8, 32768, 128


def lengths(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    adapter = adapter_for(processor())
    per_image = adapter.num_tokens(1280, 720)
    rng = np.random.default_rng(seed)
    images = rng.integers(1, 9, rows)
    text = np.exp(rng.uniform(np.log(300), np.log(24_000), rows)).astype(np.int64)
    budget = budget_for(MAX_TOKENS, adapter.num_tokens(*adapter.dummy_size), True)
    return np.clip(text + images * per_image, 1000, budget), images


def padded_micro(step_lengths: np.ndarray, longest: int) -> int:
    per_micro = max(1, MAX_TOKENS // longest)
    return -(-len(step_lengths) // per_micro)


def greedy_micro(step_lengths: np.ndarray) -> int:
    count, load = 0, MAX_TOKENS
    for n in step_lengths.tolist():
        if load + n > MAX_TOKENS:
            count, load = count + 1, 0
        load += n
    return count


def baselines(lens: np.ndarray) -> dict[str, Any]:
    per_step = BATCH * WORLD
    longest = int(lens.max())
    padded = greedy = 0
    loads = []
    for lo in range(0, len(lens), per_step):
        ranks = [lens[lo + r * BATCH : lo + (r + 1) * BATCH] for r in range(WORLD)]
        ranks = [r for r in ranks if len(r)]
        padded += WORLD * max(padded_micro(r, longest) for r in ranks)
        greedy += WORLD * max(greedy_micro(r) for r in ranks)
        tokens = np.array([r.sum() for r in ranks] + [0] * (WORLD - len(ranks)))
        loads.append(tokens.max() / tokens.mean())
    real = int(lens.sum())
    return {
        "padded_efficiency": real / (padded * MAX_TOKENS),
        "greedy_efficiency": real / (greedy * MAX_TOKENS),
        "greedy_load": _loads(np.array(loads)),
    }


def _loads(ratios: np.ndarray) -> dict[str, float]:
    full = ratios[:-1] if len(ratios) > 1 else ratios  # the last step may be partial
    return {"mean": float(full.mean()), "worst": float(full.max())}


def plan_one_rank(lens: np.ndarray, images: np.ndarray) -> tuple[float, Any]:
    """Time everything a rank computes: the global order from units, the packing, its share."""
    units = tuple(
        WorkUnit(f"f{i // 8}", i % 8, min(ROW_GROUP, len(lens) - lo), "r", 0)
        for i, lo in enumerate(range(0, len(lens), ROW_GROUP))
    )
    snapshot = Snapshot(tuple(sorted({u.file for u in units})), units, version=0)
    offsets = np.arange(0, len(lens) + ROW_GROUP, ROW_GROUP).clip(max=len(lens))
    block_start = np.zeros(len(lens), dtype=bool)
    block_start[::8] = True  # GRPO groups of 8
    start, cpu = time.perf_counter(), time.process_time()
    order = epoch_order(
        snapshot, offsets, block_start, seed=0, epoch=0, shuffle=True, window_units=4
    )
    budget = MAX_TOKENS - 1
    plan = plan_epoch(
        lens[order], images[order] > 0, batch_size=BATCH, world_size=WORLD, budget=budget
    )
    plan.for_rank(0)
    return time.perf_counter() - start, (plan, order, time.process_time() - cpu)


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    rows = max(20_000, round(1_000_000 * scale))
    lens, images = lengths(rows)
    seconds, cpu = [], []
    for _ in range(reps):
        elapsed, (plan, order, cpu_seconds) = plan_one_rank(lens, images)
        seconds.append(elapsed)
        cpu.append(cpu_seconds)
    ordered = lens[order]
    real = int(lens.sum())
    micro = int(plan.num_micro.sum()) * WORLD
    loads = plan.rank_tokens.max(axis=1) / plan.rank_tokens.mean(axis=1)
    # every rank's share checked: budget, exactly once, the same micro-batch count
    seen = np.zeros(rows, dtype=np.int64)
    for rank in range(WORLD):
        share = plan.for_rank(rank)
        assert len(share) == int(plan.num_micro.sum())
        micro_of = np.repeat(np.arange(len(share)), np.diff(share.ptr))
        sums = np.bincount(micro_of, weights=ordered[share.positions], minlength=len(share))
        assert (sums <= MAX_TOKENS).all()
        seen[share.positions] += 1
    assert (seen == 1).all()
    base = baselines(ordered)
    mmstore_eff = real / (micro * MAX_TOKENS)
    mm_load = _loads(loads)
    return {
        "rows": rows,
        "mean_tokens": float(lens.mean()),
        "mmstore_efficiency": mmstore_eff,
        **base,
        "mmstore_load": mm_load,
        "mmstore_over_padded": mmstore_eff / base["padded_efficiency"],
        "mmstore_over_greedy": mmstore_eff / base["greedy_efficiency"],
        "greedy_over_mmstore_load": base["greedy_load"]["worst"] / mm_load["worst"],
        "plan_seconds": {"median": float(np.median(seconds)), "min": float(min(seconds))},
        # CPU time of the planning process: its wall time on an uncontended core
        "plan_cpu_seconds": float(np.median(cpu)),
    }


if __name__ == "__main__":
    cli(run, __doc__)
