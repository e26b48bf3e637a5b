"""Synthetic images and rollouts, for tutorials, demos and tests of code built on mmstore.

``screenshot(seed, width, height)`` draws a deterministic UI-like screenshot (compressible
like real ones), ``photo(seed, width, height)`` a photo-like image (incompressible), and
``grpo_rollouts(store, adapter, groups=...)`` yields GRPO groups of :class:`mmstore.Rollout`
whose samples share their prompt images, written through the public path: ``put_image``,
``adapter.expand``, ``Rollout``. Rewards are 0 or 1 at random, advantages ``reward - 0.5``.
``write_grpo_steps(store, adapter, run_id=..., steps=range(2))`` commits such groups as a
rollout side does: one file per step.

Also used by the demo, the benchmarks and the tests. Screenshots are compressible like real
ones; photos (smooth noise) are incompressible like real ones.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from mmstore._families import Family
from mmstore._format.models import MediaRef, Rollout
from mmstore._format.video import _av
from mmstore._rows.store import Store

# Qwen chat-template tokens around an image (ids from the Qwen2-VL tokenizer).
VISION_START, VISION_END = 151652, 151653
TEXT_VOCAB = 150_000

__all__ = ["grpo_rollouts", "photo", "screen_recording", "screenshot", "write_grpo_steps"]


def screenshot(seed: int, width: int = 1920, height: int = 1080) -> Image.Image:
    """A deterministic UI-like screenshot: title bar, sidebar, panels, buttons, text lines."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (rng.randint(225, 250),) * 3)
    draw = ImageDraw.Draw(image)
    accent = (rng.randint(0, 120), rng.randint(60, 160), rng.randint(150, 255))
    draw.rectangle([0, 0, width, max(2, height // 20)], fill=accent)
    draw.rectangle([0, height // 20, width // 6, height], fill=(40, 44, 52))
    for _ in range(rng.randint(4, 9)):
        x0 = rng.randint(width // 6, max(width // 6, width - 40))
        y0 = rng.randint(height // 20, max(height // 20, height - 30))
        x1 = min(width - 1, x0 + rng.randint(2, max(2, width // 3)))
        y1 = min(height - 1, y0 + rng.randint(2, max(2, height // 4)))
        draw.rectangle([x0, y0, x1, y1], fill=(255, 255, 255), outline=(200, 200, 200))
        for line in range(y0 + 6, y1 - 6, 12):
            draw.line(
                [x0 + 6, line, x0 + 6 + rng.randint(10, max(11, x1 - x0 - 12)), line],
                fill=(rng.randint(20, 90),) * 3,
                width=3,
            )
    for _ in range(rng.randint(2, 6)):
        x0, y0 = rng.randint(0, max(0, width - 60)), rng.randint(0, max(0, height - 30))
        draw.rounded_rectangle([x0, y0, x0 + 80, y0 + 28], radius=6, fill=accent)
    return image


def screen_recording(
    seed: int, num_frames: int = 24, width: int = 640, height: int = 400, fps: int = 12
) -> bytes:
    """A deterministic screen recording: a :func:`screenshot` whose cursor moves across it
    and whose text lines appear one by one, as an MP4 (MPEG-4 Part 2, a keyframe every 12
    frames); what ``store.put_video`` takes. Needs PyAV (the ``video`` extra: without it,
    :class:`InvalidArgumentError` says how to install it); ``width`` and ``height`` are
    rounded down to even numbers (yuv420p)."""
    import io

    av = _av()  # the video extra, or the error that names it

    width, height = max(2, width - width % 2), max(2, height - height % 2)
    base = screenshot(seed, width, height)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = 12
        stream.options = {"qscale": "3"}  # near-lossless and deterministic
        for index in range(num_frames):
            frame = base.copy()
            draw = ImageDraw.Draw(frame)
            x = (index * 37) % max(1, width - 12)
            y = (index * 23) % max(1, height - 18)
            draw.polygon([(x, y), (x + 12, y + 10), (x + 5, y + 11), (x, y + 18)], fill=0)
            draw.rectangle([width // 5, height - 12, width // 5 + index * 6, height - 6], fill=0)
            video_frame = av.VideoFrame.from_image(frame)
            container.mux(stream.encode(video_frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def photo(seed: int, width: int = 640, height: int = 480) -> Image.Image:
    """A deterministic photo-like image: smooth colour fields plus sensor-like noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(
        0, 256, size=(max(2, height // 64), max(2, width // 64), 3), dtype=np.uint8
    )
    base = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16
    )
    noise = rng.integers(-12, 13, size=(height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def prompt_tokens(rng: random.Random, n_text: int, n_images: int) -> list[int]:
    """Text tokens with ``<vision_start><image_pad><vision_end>`` for each image."""
    out: list[int] = []
    for _ in range(n_images):
        out += [rng.randrange(TEXT_VOCAB) for _ in range(rng.randint(1, n_text))]
        out += [VISION_START, -1, VISION_END]  # -1: the adapter's image token, set below
    out += [rng.randrange(TEXT_VOCAB) for _ in range(n_text)]
    return out


def grpo_rollouts(
    store: Store,
    adapter: Family,
    *,
    groups: int,
    group_size: int = 8,
    images_per_sample: int = 2,
    image_size: tuple[int, int] = (1920, 1080),
    kind: str = "screenshot",
    completion_len: int = 64,
    seed: int = 0,
    share_images: bool = True,
) -> Iterator[Rollout]:
    """GRPO groups: samples of a group share their prompt images (if ``share_images``)."""
    rng = random.Random(seed)
    draw = screenshot if kind == "screenshot" else photo
    fmt = "png" if kind == "screenshot" else "jpeg"

    def put(image_seed: int) -> MediaRef:
        return store.put_image(draw(image_seed, *image_size), format=fmt)

    for g in range(groups):
        shared = (
            [put(seed * 1_000_003 + g * 97 + i) for i in range(images_per_sample)]
            if share_images
            else []
        )
        prompt = prompt_tokens(rng, 24, images_per_sample)
        for k in range(group_size):
            if share_images:
                media = shared
            else:
                media = [
                    put(seed * 1_000_003 + (g * group_size + k) * 97 + i + 50_000_000)
                    for i in range(images_per_sample)
                ]
            ids = [adapter.image_token_id if t == -1 else t for t in prompt]
            tokens, refs = adapter.expand(ids, media)
            completion = [rng.randrange(TEXT_VOCAB) for _ in range(rng.randint(8, completion_len))]
            reward = float(rng.random() < 0.5)
            yield Rollout(
                sample_id=f"g{seed}-{g:05d}-{k:02d}",
                group_id=f"g{seed}-{g:05d}",
                tokens=tokens + completion,
                prompt_len=len(tokens),
                loss_mask=[False] * len(tokens) + [True] * len(completion),
                logprobs=[-rng.random() for _ in range(len(tokens) + len(completion))],
                reward=reward,
                advantage=reward - 0.5,
                images=refs,
                metadata={"turns": images_per_sample, "kind": kind},
            )


def write_grpo_steps(
    store: Store,
    adapter: Family,
    *,
    run_id: str,
    steps: Iterable[int] = range(2),
    row_group_size: int | None = None,
    **groups: Any,
) -> list[Rollout]:
    """Commit :func:`grpo_rollouts` for each of ``steps``, one file per step, seeded by the
    step (so steps differ, and a step is the same every time). ``groups`` are
    :func:`grpo_rollouts`' arguments (``groups=`` is required); returns the rows, in order.
    """
    written: list[Rollout] = []
    for step in steps:
        with store.writer(
            run_id=run_id, step=step, adapter=adapter, row_group_size=row_group_size
        ) as writer:
            for rollout in grpo_rollouts(store, adapter, seed=step, **groups):
                writer.write(rollout)
                written.append(rollout)
    return written
