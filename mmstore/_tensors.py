"""Tensor helpers shared by the families and the loader (a leaf: imports nothing of mmstore).

Needs torch; only modules that run the processor or build batches import it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def cast_floats(outputs: Mapping[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of a processor output; floating ones cast to ``dtype``, integer ones kept."""
    out = {}
    for key, value in outputs.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def casting_after_normalize(image_processor: Any, dtype: torch.dtype) -> Any:
    """A shallow copy of a torchvision image (or video) processor that casts its floats to
    ``dtype`` right after ``rescale_and_normalize``.

    Every family's processor only moves data after normalizing (patch shuffles, the temporal
    copy of Qwen-VL and GLM-4V, Pixtral's zero padding; the video processors' patchify and
    concatenation), and a cast commutes with moving
    data: the output is bit for bit the processor's cast afterwards (tested for every
    family), but the moves carry half the bytes, and Qwen-VL's temporal copy doubles them
    after the cast rather than before: 26 against 31 ms for a 1080p screenshot here. A copy
    per call, so that the caller's processor is never changed and later changes to it count.

    Where the processor normalizes as transformers' torchvision backend does, the
    normalization itself runs in cache-sized blocks (:func:`normalize_in_blocks`): the same
    operations on the same values, so the same bits.
    """
    processor = copy.copy(image_processor)
    normalize = processor.rescale_and_normalize
    blocks = _normalizes_as_torchvision(image_processor)

    def rescale_and_normalize(
        images: Any,
        do_rescale: Any,
        rescale_factor: Any,
        do_normalize: Any,
        image_mean: Any,
        image_std: Any,
    ) -> Any:
        if blocks and do_normalize and _blockable(images):
            mean, std, _ = processor._fuse_mean_std_and_rescale_factor(
                do_normalize=do_normalize,
                image_mean=image_mean,
                image_std=image_std,
                do_rescale=do_rescale,
                rescale_factor=rescale_factor,
                device=images.device,
            )
            out = normalize_in_blocks(images, mean, std, dtype)
            if out is not None:
                return out
        images = normalize(images, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
        return images.to(dtype) if images.is_floating_point() else images

    processor.rescale_and_normalize = rescale_and_normalize
    return processor


# Elements of one block of :func:`normalize_in_blocks` (1 MiB of float32: it stays in a
# core's cache through the conversion, both operations and the cast). A 10 s clip's 20
# frames at 392x644 normalize in 15 instead of 38 ms here (bf16 out, one thread); a 1080p
# screenshot takes the same 5.5 ms either way.
BLOCK_ELEMENTS = 1 << 18


def normalize_in_blocks(
    images: torch.Tensor, mean: Any, std: Any, dtype: torch.dtype
) -> torch.Tensor | None:
    """``((images as float32) - mean) / std`` cast to ``dtype``, as torchvision's
    ``normalize`` computes it (per channel, the third dimension from the end), a block of
    rows of one image at a time; None where torchvision would refuse (a zero std)."""
    mean_t = torch.as_tensor(mean, dtype=torch.float32)
    std_t = torch.as_tensor(std, dtype=torch.float32)
    if not bool(torch.all(std_t != 0)):
        return None
    if mean_t.ndim == 1:
        mean_t = mean_t.view(-1, 1, 1)
    if std_t.ndim == 1:
        std_t = std_t.view(-1, 1, 1)
    flat = images.reshape(-1, *images.shape[-3:])
    out = torch.empty(flat.shape, dtype=dtype)
    channels, height, width = flat.shape[1:]
    rows = max(1, BLOCK_ELEMENTS // max(1, channels * width))
    for n in range(flat.shape[0]):
        for top in range(0, height, rows):
            # (contiguous: a channels-last source, as decoded frames are, would leave the
            # channel innermost, and a per-channel operation on it runs 3 values at a time)
            block = flat[n, :, top : top + rows].to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
            block.sub_(mean_t).div_(std_t)
            out[n, :, top : top + rows].copy_(block)
    return out.view(images.shape)


def _normalizes_as_torchvision(processor: Any) -> bool:
    """Whether ``processor`` rescales and normalizes with transformers' torchvision backend
    unchanged (what :func:`normalize_in_blocks` reproduces)."""
    try:
        from transformers.image_processing_backends import TorchvisionBackend
    except ImportError:  # another transformers: its own path
        return False
    kind = type(processor)
    return (
        isinstance(processor, TorchvisionBackend)
        and kind.rescale_and_normalize is TorchvisionBackend.rescale_and_normalize
        and kind.normalize is TorchvisionBackend.normalize
        and kind._fuse_mean_std_and_rescale_factor
        is TorchvisionBackend._fuse_mean_std_and_rescale_factor
    )


def _blockable(images: Any) -> bool:
    """A CPU tensor of images (``[..., C, H, W]``) of integers or float32."""
    return (
        isinstance(images, torch.Tensor)
        and images.device.type == "cpu"
        and images.ndim >= 3
        and (not images.is_floating_point() or images.dtype == torch.float32)
    )
