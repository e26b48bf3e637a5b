"""Kimi-K2.5: MoonViT's native-resolution ("navit") layout, torchvision backend only.

An image is scaled down (never up) until it has at most ``max_patches`` patches and at most
``max_size_per_side`` patches on a side, then zero-padded on the bottom and right to multiples
of ``patch_size * merge_size`` (transformers' own ``navit_resize``); each ``merge_size**2``
patches become one ``<|media_pad|>``. The chat template wraps the image as
``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` and the processor (and
vLLM) replace only the ``<|media_pad|>``: the expansion is that one token repeated, and the
begin/content/end tokens stay outside the span as ordinary text.

The model takes ``pixel_values`` (one ``[3, patch, patch]`` row per patch, concatenated over
the batch's images) and ``image_grid_thw``; the DeepSeek-V3 text model uses 1-D RoPE.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from mmstore._families._base import Collation, Token, size_value
from mmstore._families._grid import GridFamily
from mmstore._families._video import Clip, Segment, VideoFamily
from mmstore._format.models import VideoRef
from mmstore.errors import UnsupportedProcessorError


class KimiK25(GridFamily):
    name = "kimi-k25"
    title = "Kimi-K2.5"
    # The processor attributes navit_resize and patchify read; nothing else moves a token.
    parameter_names = ("patch_size", "merge_size", "max_patches", "max_size_per_side")
    # Kimi-K2.5's published ids: `image_token_id` is transformers' Kimi_K25Config default and
    # the checkpoint's config.json `media_placeholder_token_id` (163605, `<|media_pad|>`);
    # `pad_token_id` is that config.json's `pad_token_id` (163839, the Kimi-K2 tokenizer's
    # `[PAD]`, also transformers' KimiLinearConfig default for the same tokenizer). The
    # chat template's `<|media_begin|>` (163602) and `<|media_end|>` (163604) are the
    # config's vision_start/end_token_id; they lie outside spans, so mmstore needs neither.
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<|media_pad|>", 163605),
        "pad_token_id": Token("[PAD]", 163839),
    }
    # vLLM's Kimi-K2.5 (config `use_unified_vision_chunk`) takes images and video chunks as
    # one "vision_chunk" modality, each image a `VisionChunkImage` dict; its prompt update
    # replaces each `<|media_pad|>` by the image's count of `<|media_pad|>` (vLLM's
    # model_executor/models/kimi_k25.py, `_get_prompt_updates`).
    vllm_modality = "vision_chunk"

    @classmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        # Without navit_resize nothing pads the image to whole merge windows.
        cls.require_resize(
            image_processor, "images must be resized and padded to multiples of patch*merge"
        )
        size = image_processor.size
        side = size_value(size, "max_height")
        if size_value(size, "max_width") != side:
            # transformers refuses this too, but only when the first image is processed.
            raise UnsupportedProcessorError(
                f"{type(image_processor).__name__} size {size!r}: max_height and max_width "
                "must be equal (navit_resize has one per-side limit)"
            )
        return {
            "patch_size": int(image_processor.patch_size),
            "merge_size": int(image_processor.merge_size),
            "max_patches": int(image_processor.max_patches),
            "max_size_per_side": side,
        }

    # -- layout math --------------------------------------------------------------------

    def resize(self, width: int, height: int) -> tuple[int, int]:
        """Resized, then padded to whole merge windows: the padded size is what is cut."""
        p = self.layout.param
        _, (pad_h, pad_w) = _navit_resize()(
            height,
            width,
            patch_size=p("patch_size"),
            merge_kernel_size=p("merge_size"),
            max_patches=p("max_patches"),
            max_size_per_side=p("max_size_per_side"),
        )
        return pad_h, pad_w

    def pixel_shape(self, width: int, height: int) -> tuple[int, int, int, int]:
        """Shape of this image's rows of ``pixel_values``: (patches, channels, p, p)."""
        t, h, w = self.grid(width, height)
        patch = self.layout.param("patch_size")
        return t * h * w, 3, patch, patch

    # -- the processor ------------------------------------------------------------------

    def vllm_item(self, image: Any, uuid: str) -> dict[str, Any]:
        return {"type": "image", "image": image, "uuid": uuid}


def _navit_resize() -> Any:
    """transformers' own ``navit_resize``, imported on first use (it pulls in torchvision)."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

    return navit_resize


class KimiK25Video(VideoFamily):
    """Kimi-K2.5 videos (``Kimi_K25VideoProcessor`` inside ``Kimi_K25Processor``).

    The frames are cut into chunks of ``temporal_patch_size`` (the last may be shorter);
    every frame is resized and padded as an image is (``navit_resize``). The processor
    replaces the prompt's ``<|kimi_k25_video_placeholder|>`` (the span) by, per chunk, its
    first frame's time as text (``HH:MM:SS.mmm``), ``<|media_begin|>``, the text ``video``,
    ``<|media_content|>``, the placeholder once per merged patch of one frame (the model
    pools a chunk's frames into one frame's tokens) and ``<|media_end|>``. The model takes
    ``pixel_values_videos`` (``[3, patch, patch]`` rows) and one ``video_grid_thw`` row per
    chunk, ``[frames in chunk, h, w]``.
    """

    name = "kimi-k25"
    has_text = True
    # What navit_resize, the chunking and patchify read; fps only samples.
    parameter_names = (
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "max_patches",
        "max_size_per_side",
    )
    # `video_token_id`: transformers' Kimi_K25Config default; the media markers: the
    # Kimi-K2 tokenizer's (as KimiK25's docstring says); `[PAD]` the config's pad token.
    token_table: ClassVar[Mapping[str, Token]] = {
        "video_token_id": Token("<|kimi_k25_video_placeholder|>", 163840),
        "media_begin_token_id": Token("<|media_begin|>", 163602),
        "media_content_token_id": Token("<|media_content|>", 163603),
        "media_end_token_id": Token("<|media_end|>", 163604),
        "pad_token_id": Token("[PAD]", 163839),
    }
    video_inputs: ClassVar[Mapping[str, Collation]] = {
        "pixel_values_videos": "cat",
        "video_grid_thw": "cat",
    }
    token_type = 2  # unused: Kimi-K2.5's model takes no per-token types

    @classmethod
    def read_parameters(cls, video_processor: Any, processor: Any) -> dict[str, Any]:
        name = type(video_processor).__name__
        if name != "Kimi_K25VideoProcessor":
            raise UnsupportedProcessorError(
                f"{name}: mmstore lays out Kimi_K25VideoProcessor videos"
            )
        if not getattr(video_processor, "do_resize", True):
            raise UnsupportedProcessorError(
                f"{name} has do_resize=False: frames must be resized and padded to multiples "
                "of patch*merge"
            )
        size = video_processor.size
        side = size_value(size, "max_height")
        if size_value(size, "max_width") != side:
            raise UnsupportedProcessorError(
                f"{name} size {size!r}: max_height and max_width must be equal"
            )
        return {
            "patch_size": int(video_processor.patch_size),
            "merge_size": int(video_processor.merge_size),
            "temporal_patch_size": int(video_processor.temporal_patch_size),
            "max_patches": int(video_processor.max_patches),
            "max_size_per_side": side,
        }

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset({self.video_token_id})

    # -- layout math ----------------------------------------------------------------------

    def frame_grid(self, ref: VideoRef | Clip) -> tuple[int, int]:
        """``(h, w)`` patches of one resized, padded frame."""
        p = self.layout.param
        _, (pad_h, pad_w) = _navit_resize()(
            ref.height,
            ref.width,
            patch_size=p("patch_size"),
            merge_kernel_size=p("merge_size"),
            max_patches=p("max_patches"),
            max_size_per_side=p("max_size_per_side"),
        )
        return pad_h // p("patch_size"), pad_w // p("patch_size")

    def chunks(self, ref: VideoRef | Clip) -> list[list[int]]:
        size = self.layout.param("temporal_patch_size")
        frames = list(ref.frames)
        return [frames[i : i + size] for i in range(0, len(frames), size)]

    @staticmethod
    def timestamp(seconds: float) -> str:
        """``Kimi_K25Processor.replace_video_token``'s time text, expression for expression."""
        return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"

    def segments(self, ref: VideoRef | Clip) -> list[Segment]:
        h, w = self.frame_grid(ref)
        tid = self.layout.token_id
        body = (
            tid("media_content_token_id"),
            *[self.video_token_id] * (h * w // self.layout.param("merge_size") ** 2),
            tid("media_end_token_id"),
        )
        out: list[Segment] = []
        for chunk in self.chunks(ref):
            seconds = float(chunk[0] / ref.fps)
            out += [self.timestamp(seconds), (tid("media_begin_token_id"),), "video", body]
        return out

    def integer_tensors(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        h, w = self.frame_grid(ref)
        rows = [[len(chunk), h, w] for chunk in self.chunks(ref)]
        return {"video_grid_thw": np.asarray(rows, dtype=np.int64)}

    def placeholder(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        h, w = self.frame_grid(ref)
        patch = self.layout.param("patch_size")
        rows = len(ref.frames) * h * w
        return {
            "pixel_values_videos": np.zeros((rows, 3, patch, patch), dtype=np.float32),
            **self.integer_tensors(ref),
        }

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        grid = np.asarray(outputs["video_grid_thw"]).reshape(-1, 3)
        return int(grid[:, 1:].prod(axis=1).sum()) // self.layout.param("merge_size") ** 2
