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
    """
    processor = copy.copy(image_processor)
    normalize = processor.rescale_and_normalize

    def rescale_and_normalize(*args: Any, **kwargs: Any) -> Any:
        images = normalize(*args, **kwargs)
        return images.to(dtype) if images.is_floating_point() else images

    processor.rescale_and_normalize = rescale_and_normalize
    return processor
