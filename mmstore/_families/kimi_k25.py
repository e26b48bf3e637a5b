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

from collections.abc import Mapping
from typing import Any, ClassVar

from mmstore._exceptions import UnsupportedProcessorError
from mmstore._families._base import Token, size_value
from mmstore._families._grid import GridFamily


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
