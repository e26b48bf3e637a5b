"""Live consumption of video steps: how soon a trainer has its first micro-batch after a step
of video rollouts is committed, against decoding and processing that step's clip once.

Workload (issue 43 item 3): each commit is one training step, a GRPO group of 4 sharing one
synthetic screen recording (:func:`benchmarks.bench_video.clip_shape`: 10 s of 640x400 at
scale >= 0.5, sampled at 2 fps); Qwen2-VL's video processor; ``batch_size=4``, 2 workers, no
node cache, ``distinct_images=True`` (the group's clip travels once per batch). A producer
process commits a step every ``interval`` seconds (every step's rows and clips made
beforehand); the live loader is already waiting. Latency = first micro-batch in hand minus
the commit's log timestamp, for the steps after ``warm`` (the first starts the workers).

The floor is the least the step needs after its commit: decoding the clip's sampled frames
and processing them once, as a worker does (one thread, cast to bf16), on distinct clips in
a process of its own, beside each rep's trial (median). ``live_p50_over_floor``: lower =
better, 1 is the floor (issue 43's goal: <= 1.5). Start-up is excluded (warm steps).

Run: ``PYTHONPATH=. .venv/bin/python -m benchmarks.bench_live_video --scale 1 --reps 3``.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import mmstore
from benchmarks._common import cli, single_threaded
from benchmarks.bench_live import _commit_times, _summary
from benchmarks.bench_video import FPS, clip_shape, video_adapter, video_processor
from mmstore.synth import TEXT_VOCAB, VISION_END, VISION_START, screen_recording

GROUP = 4
WORKERS = 2
SETTINGS = mmstore.Materialize(node_cache_bytes=0, distinct_images=True)


def _clip(seed: int, shape: dict[str, Any]) -> bytes:
    fps = shape["fps"][seed % len(shape["fps"])]
    return screen_recording(seed, shape["seconds"] * fps, shape["width"], shape["height"], fps)


def _group(store: mmstore.Store, adapter: Any, data: bytes, seed: int) -> list[mmstore.Rollout]:
    """A GRPO group of ``GROUP`` samples whose prompt holds one clip."""
    rng = random.Random(seed)
    media = store.put_video(data)
    prompt = [rng.randrange(TEXT_VOCAB) for _ in range(8)]
    prompt += [VISION_START, adapter.video.video_token_id, VISION_END]
    expanded = adapter.expand_media(prompt, videos=[media], fps=FPS)
    rows = []
    for k in range(GROUP):
        completion = [rng.randrange(TEXT_VOCAB) for _ in range(rng.randint(8, 64))]
        tokens = expanded.tokens + completion
        rows.append(
            mmstore.Rollout(
                sample_id=f"s{seed}-{k}",
                group_id=f"s{seed}",
                tokens=tokens,
                prompt_len=len(expanded.tokens),
                loss_mask=[False] * len(expanded.tokens) + [True] * len(completion),
                reward=float(k % 2),
                advantage=float(k % 2) - 0.5,
                videos=expanded.videos,
            )
        )
    return rows


def produce(root: str, run: str, steps: int, interval: float, scale: float) -> None:
    """Commit ``steps`` steps of ``run``, one every ``interval`` seconds (all made first:
    encoding clips is the rollout side's work, not CPU beside the trainer's)."""
    store = mmstore.Store.open(root)
    adapter = video_adapter(video_processor())
    shape = clip_shape(scale)
    base = sum(map(ord, run)) * 1_000
    groups = [_group(store, adapter, _clip(base + s, shape), base + s) for s in range(steps)]
    for step, rows in enumerate(groups):
        time.sleep(interval)
        with store.writer(run, step, adapter=adapter) as writer:
            writer.write_many(rows)


def live_trial(store: mmstore.Store, run: str, steps: int) -> list[float]:
    firsts = []
    adapter = video_adapter(video_processor())
    with mmstore.LiveLoader(
        store, adapter, runs=[run], batch_size=GROUP, num_workers=WORKERS, materialize=SETTINGS
    ) as live:
        for _ in range(steps):
            batches = live.next_step(timeout=300)
            batch = next(batches)
            firsts.append(time.time())
            assert batch["pixel_values_videos"].dtype == torch.bfloat16
            for _ in batches:
                pass
    return firsts


def floor_seconds(scale: float, clips: int) -> float:
    """The median time to decode and process one distinct clip as a worker does, in a
    process of its own."""
    command = [sys.executable, "-m", "benchmarks.bench_live_video", "floor", str(scale)]
    done = subprocess.run([*command, str(clips)], check=True, capture_output=True)
    return float(done.stdout.split()[-1])


def _floor_here(scale: float, clips: int) -> float:
    from mmstore._format.video import decode_frames

    adapter = video_adapter(video_processor())
    shape = clip_shape(scale)
    with tempfile.TemporaryDirectory() as tmp:
        store = mmstore.Store.open(os.path.join(tmp, "store"), create=True)
        made = []
        for seed in range(clips + 1):
            data = _clip(10_000 + seed, shape)
            (ref,) = _group(store, adapter, data, 10_000 + seed)[0].videos
            made.append((data, ref))
    times = []
    with single_threaded():
        for data, ref in made:
            start = time.perf_counter()
            adapter.video.process(decode_frames(data, ref.frames), ref, torch.bfloat16)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first warms the decoder up


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    warm = max(1, int(4 * scale))
    steps = warm + max(3, int(12 * scale))
    interval = 1.0
    latencies: list[float] = []
    floors = []
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        store = mmstore.Store.open(root, create=True)
        for rep in range(reps):
            floors.append(floor_seconds(scale, clips=max(2, int(6 * scale))) * 1000)
            run_id = f"video-{rep}"
            command = [sys.executable, "-m", "benchmarks.bench_live_video", "produce", root]
            producer = subprocess.Popen([*command, run_id, str(steps), str(interval), str(scale)])
            try:
                firsts = live_trial(store, run_id, steps)
            finally:
                if producer.wait(timeout=600):
                    raise RuntimeError("the producer failed")
            commits = _commit_times(store, run_id)
            latencies += [first - commits[s] for s, first in enumerate(firsts)][warm:]
    live = _summary(latencies)
    floor = statistics.median(floors)
    shape = clip_shape(scale)
    return {
        "workload": f"1 group of {GROUP} sharing a {shape['seconds']} s "
        f"{shape['width']}x{shape['height']} clip per step ({FPS:g} fps sampled), {WORKERS} "
        f"workers, a commit every {interval} s, {steps - warm} steps measured after {warm} "
        f"x {reps} trials",
        "direction": "live_p50_over_floor: lower = better (1 = the floor); start-up excluded",
        "latency_ms": live,
        "floor_ms": round(floor, 1),
        "live_p50_over_floor": round(live["p50"] / floor, 2),
        "live_p99_over_floor": round(live["p99"] / floor, 2),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "produce":
        root, run_id, steps, interval, scale = sys.argv[2:7]
        produce(root, run_id, int(steps), float(interval), float(scale))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "floor":
        print(_floor_here(float(sys.argv[2]), int(sys.argv[3])))
        return
    cli(run, __doc__)


if __name__ == "__main__":
    main()
