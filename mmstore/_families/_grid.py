"""The patch-grid families' shared half: Qwen-VL, GLM-4V and Kimi-K2.5.

Each resizes an image to a ``(t, h, w)`` grid of patches its own way (:meth:`grid`); from
there they agree: every ``merge_size**2`` patches become one image token (the expansion is
that token repeated), the model takes ``pixel_values`` (patch rows) and ``image_grid_thw``,
and the processor's grid tells how many tokens its output fills.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MethodType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from ._base import Collation, Family


class GridFamily(Family):
    image_inputs: ClassVar[Mapping[str, Collation]] = {
        "pixel_values": "cat",
        "image_grid_thw": "cat",
    }

    @abstractmethod
    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of one image, exactly as the processor computes it."""

    def pixel_shape(self, width: int, height: int) -> tuple[int, ...]:
        """Shape of this image's rows of ``pixel_values``: (patches, channels*t*p*p), as
        Qwen-VL and GLM-4V flatten them (Kimi-K2.5 keeps the patch's axes)."""
        t, h, w = self.grid(width, height)
        p = self.layout.param
        return t * h * w, 3 * p("temporal_patch_size") * p("patch_size") ** 2

    def num_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid(width, height)
        return t * h * w // self.layout.param("merge_size") ** 2

    def expansion(self, width: int, height: int) -> list[int]:
        return [self.image_token_id] * self.num_tokens(width, height)

    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        return {
            "pixel_values": np.zeros(self.pixel_shape(width, height), dtype=np.float32),
            **self.integer_tensors(width, height),
        }

    def integer_tensors(self, width: int, height: int) -> dict[str, np.ndarray]:
        return {"image_grid_thw": np.array([self.grid(width, height)], dtype=np.int64)}

    @property
    def dummy_size(self) -> tuple[int, int]:
        # One merge window: the resize rules scale it to their minimum; nothing is cheaper.
        side = self.layout.param("patch_size") * self.layout.param("merge_size")
        return side, side

    def process(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        out = super().process(images)
        out["image_grid_thw"] = out["image_grid_thw"].astype(np.int64)
        return out

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        t, h, w = (int(x) for x in np.asarray(outputs["image_grid_thw"]).reshape(-1, 3)[0])
        return t * h * w // self.layout.param("merge_size") ** 2


def weightless_rope_index(model_cls: Any, merge_size: int) -> Callable[..., Any]:
    """``model_cls.get_rope_index`` (a transformers M-RoPE model) bound to a stand-in.

    The function reads ``self.config.vision_config.spatial_merge_size`` and calls
    ``self.get_vision_position_ids`` (pure index math), nothing else of the model: bound to
    this stand-in it runs the model's own code without building any weights.
    """
    owner = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge_size))
    )
    owner.get_vision_position_ids = MethodType(model_cls.get_vision_position_ids, owner)
    return MethodType(model_cls.get_rope_index, owner)
