"""Tensor helpers shared by the families and the loader (a leaf: imports nothing of mmstore).

Needs torch; only modules that run the processor or build batches import it.
"""

from __future__ import annotations

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
