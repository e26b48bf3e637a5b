"""The processor a worker runs: mmstore's cast inside (normalizing in blocks) against the
family's own processor followed by the cast, on screenshots and a clip's frames.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_process --scale 1 --reps 3

What a worker does per image once it is decoded: Qwen2-VL's torchvision image processor
(published sizes) through ``adapter.process(images, torch.bfloat16)``, which casts right
after normalizing and normalizes a block of rows at a time
(:func:`mmstore._tensors.casting_after_normalize`), against the baseline a trainer without
mmstore runs: the same processor's own output (``processor(images=...)``, float32), cast to
bf16 afterwards. Both give the same bits (checked here, on every input). Inputs: decoded
screenshots (uint8, channels first, as the loader decodes them) of 640x360, 1280x720 and
1920x1080, and a clip's 20 frames at 640x400 (``Qwen2VLVideoProcessor``, channels last, as
decoded frames are). One thread (a DataLoader worker's), both contenders in one process,
alternating call by call, ``30 * reps * scale`` calls each (at least 3); no start-up in the
figures (the first call of each is not timed).

Figures: baseline seconds / mmstore seconds per input (median of the calls; higher =
mmstore better).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import mmstore
from benchmarks._common import cli, single_threaded
from mmstore._format.media import decode_rgb_tensor, encode_image
from mmstore._tensors import cast_floats, casting_after_normalize
from mmstore.synth import screenshot

SIZES = [(640, 360), (1280, 720), (1920, 1080)]
FRAMES = (20, 400, 640)  # a 10 s clip sampled at 2 fps, as benchmarks/bench_video.py

HEADLINE = [
    (f"processor {w}x{h}: its own, then the cast / mmstore's", f"{w}x{h}.speedup", "excluded")
    for w, h in SIZES
]
HEADLINE.append(
    ("video processor, 20 frames: its own, then the cast / mmstore's", "video.speedup", "excluded")
)


def _compare(ours: Callable[[], Any], theirs: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Both, alternating, after one untimed call each: equal outputs, median seconds."""
    mine, base = ours(), theirs()
    assert mine.keys() == base.keys()
    for key, value in mine.items():
        assert torch.equal(value, base[key]), key  # the same bits
    times: dict[str, list[float]] = {"mmstore": [], "baseline": []}
    for _ in range(calls):
        for name, fn in (("mmstore", ours), ("baseline", theirs)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "seconds": med,
        "calls": calls,
        "speedup": med["baseline"] / med["mmstore"],
    }


def _cast(outputs: Any, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The model's tensors of a processor output, floats cast to bf16 afterwards."""
    return cast_floats({key: outputs[key] for key in keys}, torch.bfloat16)


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    calls = max(3, round(30 * reps * scale))
    processor = Qwen2VLImageProcessor()
    adapter = mmstore.adapter_for(processor)
    keys = tuple(adapter.image_inputs)
    result: dict[str, Any] = {
        "direction": "speedup: the processor's own then the cast / mmstore's (higher = better)",
        "threads": 1,
    }
    kwargs = {"return_tensors": "pt", "input_data_format": "channels_first"}
    with single_threaded():
        for w, h in SIZES:
            image = decode_rgb_tensor(encode_image(screenshot(7, w, h))[0])
            result[f"{w}x{h}"] = _compare(
                lambda im=image: adapter.process([im], torch.bfloat16),
                lambda im=image: _cast(processor(images=[im], **kwargs), keys),
                calls,
            )
        video_processor = Qwen2VLVideoProcessor(cap_pixels_per_frame=True)
        rng = np.random.default_rng(0)
        frames = torch.from_numpy(rng.integers(0, 256, (*FRAMES, 3), dtype=np.uint8))
        video = frames.permute(0, 3, 1, 2)  # [T, C, H, W] over channels-last memory
        cast = casting_after_normalize(video_processor, torch.bfloat16)
        video_kwargs = {"return_tensors": "pt", "do_sample_frames": False}
        video_keys = ("pixel_values_videos", "video_grid_thw")
        result["video"] = _compare(
            lambda: _cast(cast(videos=[video], **video_kwargs), video_keys),
            lambda: _cast(video_processor(videos=[video], **video_kwargs), video_keys),
            calls,
        )
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        "| input | mmstore ms | processor then cast ms | speed-up (higher = mmstore better) |",
        "|---|---|---|---|",
    ]
    for name in [f"{w}x{h}" for w, h in SIZES] + ["video"]:
        r = result[name]
        lines.append(
            f"| {name} | {1000 * r['seconds']['mmstore']:.1f} | "
            f"{1000 * r['seconds']['baseline']:.1f} | {r['speedup']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    cli(run, __doc__, table=table, name="process")
