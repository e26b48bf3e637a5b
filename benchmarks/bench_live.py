"""Live consumption: how soon a trainer has its first micro-batch after a step is committed,
with :class:`mmstore.LiveLoader` against building a :class:`mmstore.RolloutLoader` per step
(before the live loader, the only way), and what a waiting LiveLoader costs.

Workload (issue 29's): each commit is one training step, a GRPO group of 4 sharing one
1920x1080 screenshot; ``batch_size=4``, 2 workers, no node cache, ``distinct_images=True``
(the group's image travels once per batch) on both sides; Qwen2-VL's image processor, with
the PIL backend (the issue's figures) and with the torchvision backend (transformers'
default), each measured on its own. A producer process commits a step every ``interval``
seconds (every step's rows made beforehand, see :func:`produce`); the consumer is already
waiting for it. Latency = first micro-batch in hand minus the commit's log timestamp (the
trainer's step start, warm: see ``warm`` in :func:`run`).

The floor is the least the step needs after its commit: decoding and processing its one
distinct image once, done as a worker does it (one torch thread, freed memory kept, the
loader's own decode and processor call, cast to bf16), back to back on distinct
screenshots in a process of its own, once beside each rep's trials (the median is used:
this machine's speed drifts by a third over minutes).

Trials alternate between the two consumers (a fresh run and producer each), so both see the
same machine. Ratios, per backend: ``per_step_over_live_p50`` / ``_p99`` (higher = mmstore
better); ``live_p50_over_floor`` (lower = better: 1 is the floor). ``idle_cpu_percent``: CPU
of a LiveLoader waiting on an idle store, main process and workers, in % of one core.

Run: ``PYTHONPATH=. .venv/bin/python -m benchmarks.bench_live --scale 1 --reps 3``.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from benchmarks._common import cli, processor
from mmstore._families import takes_tensors
from mmstore._format.media import decode_rgb, decode_rgb_tensor
from mmstore._loading.workers import keep_freed_memory
from mmstore.synth import grpo_rollouts, screenshot

GROUP = 4
WORKERS = 2
# No node cache (no step is served from an earlier one); a GRPO group's image once a batch.
SETTINGS = mmstore.Materialize(node_cache_bytes=0, distinct_images=True)
IMAGE = (1920, 1080)
# Qwen2-VL's image processor with either backend (the same layout: one fingerprint).
BACKENDS = {"pil": processor, "torchvision": Qwen2VLImageProcessor}


def produce(root: str, run: str, steps: int, interval: float) -> None:
    """Commit ``steps`` steps of ``run``, one every ``interval`` seconds.

    Every step's rows are made (and their images put) before the first commit: drawing and
    PNG-encoding synthetic 1080p screenshots takes a core for a fifth of a second per step,
    which in a real run is inference on GPUs, not CPU beside the trainer's workers.
    """
    store = mmstore.Store.open(root)
    adapter = mmstore.adapter_for(processor())
    steps_rows = [
        list(
            grpo_rollouts(
                store,
                adapter,
                groups=1,
                group_size=GROUP,
                images_per_sample=1,
                image_size=IMAGE,
                seed=step * 7919 + zlib.crc32(run.encode()) % 100_000,  # unlike any other
            )
        )
        for step in range(steps)
    ]
    for step, rows in enumerate(steps_rows):
        time.sleep(interval)
        with store.writer(run, step) as writer:
            writer.write_many(rows)


def _producer(root: str, run: str, steps: int, interval: float) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "benchmarks.bench_live", "produce", root, run]
    return subprocess.Popen([*command, str(steps), str(interval)])


def _commit_times(store: mmstore.Store, run: str) -> dict[int, float]:
    """Each step's commit time (its log entry's timestamp, seconds)."""
    return {
        f.step: (entry.timestamp_ms or 0) / 1000
        for entry in store.table.entries_after(-1)
        for f in entry.added
        if f.run_id == run
    }


def live_trial(
    store: mmstore.Store, backend: str, run: str, steps: int, idle: float
) -> dict[str, Any]:
    firsts = []
    with mmstore.LiveLoader(
        store,
        BACKENDS[backend](),
        runs=[run],
        batch_size=GROUP,
        num_workers=WORKERS,
        materialize=SETTINGS,
    ) as live:
        for _ in range(steps):
            batches = live.next_step(timeout=120)
            next(batches)
            firsts.append(time.time())
            for _ in batches:
                pass
        cpu = _idle_cpu(live, idle)
    return {"firsts": firsts, "idle_cpu": cpu}


def _idle_cpu(live: mmstore.LiveLoader, seconds: float) -> float:
    """CPU seconds per second (main process and its workers) while waiting for a step that
    never comes."""
    workers = _worker_pids(live)
    before = _cpu_self(), [_cpu_of(pid) for pid in workers]
    start = time.monotonic()
    with contextlib.suppress(mmstore.LiveTimeoutError):
        live.next_step(timeout=seconds)
    wall = time.monotonic() - start
    used = _cpu_self() - before[0]
    used += sum(_cpu_of(pid) - b for pid, b in zip(workers, before[1], strict=True))
    return used / wall


def _worker_pids(live: mmstore.LiveLoader) -> list[int]:
    iterator = getattr(live._loader, "_iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", [])]


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_step_trial(
    store: mmstore.Store, backend: str, run: str, steps: int, first: int
) -> dict[str, Any]:
    """Today's way: poll until the step is committed, build a loader, take its batches (from
    step ``first`` on: a loader per step has nothing to warm up)."""
    firsts = [0.0] * first
    for step in range(first, steps):
        while True:
            try:
                dataset = mmstore.RolloutDataset(
                    store, BACKENDS[backend](), runs=[run], steps=[step], materialize=SETTINGS
                )
                break
            except mmstore.NoMatchError:
                time.sleep(0.01)
        loader = mmstore.RolloutLoader(dataset, batch_size=GROUP, num_workers=WORKERS)
        batches = iter(loader)
        next(batches)
        firsts.append(time.time())
        for _ in batches:
            pass
        del batches, loader
    return {"firsts": firsts}


def floor_seconds(backend: str, images: int = 12) -> float:
    """The median time to decode and process one distinct 1080p screenshot (PNG) as a
    worker does, in a process of its own (see the module's docstring)."""
    command = [sys.executable, "-m", "benchmarks.bench_live", "floor", backend, str(images)]
    return float(subprocess.run(command, check=True, capture_output=True).stdout.split()[-1])


def _floor_here(backend: str, images: int) -> float:
    torch.set_num_threads(1)
    keep_freed_memory()
    pngs = []
    for seed in range(images + 2):
        buffer = io.BytesIO()
        screenshot(seed, *IMAGE).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    adapter = mmstore.adapter_for(BACKENDS[backend]())
    tensors = takes_tensors(adapter.image_processor)
    decode = decode_rgb_tensor if tensors else decode_rgb
    times = []
    for data in pngs:
        start = time.perf_counter()
        adapter.process([decode(data, where="floor")], torch.bfloat16)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first two warm the decoder up


def _latencies(store: mmstore.Store, run: str, firsts: list[float], warm: int) -> list[float]:
    """Commit to first micro-batch, of the steps from ``warm`` on."""
    commits = _commit_times(store, run)
    return [first - commits[step] for step, first in enumerate(firsts)][warm:]


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    # Steps measured after ``warm`` steps: the first starts the live loader's workers, and
    # until a worker's image cache (256 MiB: 22 processed 1080p screenshots) is full each
    # step's image takes fresh memory; once it is, evicted images' memory is reused (a long
    # run's steady state, 10-15 ms sooner here).
    warm = max(1, int(24 * scale))
    steps = warm + max(4, int(20 * scale))
    interval = 0.5
    idle = max(2.0, 10 * scale)  # /proc counts workers' CPU in 10 ms ticks
    samples = {(b, mode): [] for b in BACKENDS for mode in ("live", "per_step")}
    floors: dict[str, list[float]] = {b: [] for b in BACKENDS}
    idle_cpu = []
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        store = mmstore.Store.open(root, create=True)
        for rep in range(reps):
            for backend in BACKENDS:
                floor = floor_seconds(backend, images=max(3, int(12 * scale)))
                floors[backend].append(floor * 1000)  # beside its trials
                order = ["live", "per_step"] if rep % 2 == 0 else ["per_step", "live"]
                for mode in order:
                    run_id = f"{backend}-{mode}-{rep}"
                    producer = _producer(root, run_id, steps, interval)
                    try:
                        if mode == "live":
                            trial = live_trial(store, backend, run_id, steps, idle)
                            idle_cpu.append(trial["idle_cpu"])
                        else:
                            trial = per_step_trial(store, backend, run_id, steps, warm - 1)
                    finally:
                        if producer.wait(timeout=300):
                            raise RuntimeError("the producer failed")
                    samples[backend, mode] += _latencies(store, run_id, trial["firsts"], warm)
    result: dict[str, Any] = {
        "workload": f"1 group of {GROUP} sharing a {IMAGE[0]}x{IMAGE[1]} screenshot per "
        f"step, {WORKERS} workers, a commit every {interval} s, {steps - warm} steps "
        f"measured after {warm} x {reps} trials per backend and consumer",
        "direction": "per_step_over_live_*: higher = mmstore better; live_p50_over_floor: "
        "lower = better (1 = the floor)",
    }
    for backend in BACKENDS:
        floor = statistics.median(floors[backend])
        live = _summary(samples[backend, "live"])
        per_step = _summary(samples[backend, "per_step"])
        result[backend] = {
            "latency_ms": {"live": live, "per_step": per_step},
            "floor_ms": round(floor, 1),
            "per_step_over_live_p50": round(per_step["p50"] / live["p50"], 2),
            "per_step_over_live_p99": round(per_step["p99"] / live["p99"], 2),
            "live_p50_over_floor": round(live["p50"] / floor, 2),
        }
    result["idle_cpu_percent"] = round(100 * statistics.median(idle_cpu), 3)
    return result


def _summary(values: list[float]) -> dict[str, float]:
    ms = np.array(values) * 1000
    return {
        "p50": round(float(np.percentile(ms, 50)), 1),
        "p99": round(float(np.percentile(ms, 99)), 1),
        "n": len(values),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "produce":
        produce(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "floor":
        print(_floor_here(sys.argv[2], int(sys.argv[3])))
        return
    cli(run, __doc__)


if __name__ == "__main__":
    main()
