"""The patch-grid families' shared half: Qwen-VL, GLM-4V and Kimi-K2.5.

Each resizes an image its own way (:meth:`GridFamily.resize`) and cuts it into a
``(1, h, w)`` grid of patches; from there they agree: every ``merge_size**2`` patches become
one image token (the expansion is that token repeated), the model takes ``pixel_values``
(patch rows) and ``image_grid_thw``, and the processor's grid tells how many tokens its
output fills. Qwen-VL and GLM-4V agree further (:class:`SmartResizeFamily`): the same
processor parameters, a ``smart_resize`` into a pixel budget, M-RoPE positions.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from types import MethodType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from mmstore._exceptions import ImageSizeError, UnsupportedProcessorError
from mmstore._families._base import Collation, Family, size_value


class GridFamily(Family):
    #: the family's name in messages ("Qwen-VL")
    title: ClassVar[str]
    image_inputs: ClassVar[Mapping[str, Collation]] = {
        "pixel_values": "cat",
        "image_grid_thw": "cat",
    }

    @classmethod
    def require_resize(cls, image_processor: Any, how: str) -> None:
        """Refuse a processor that does not resize: the grid would be the raw size (or the
        processor fails), which the layout cannot promise; ``how`` is how it must resize."""
        if not getattr(image_processor, "do_resize", True):
            raise UnsupportedProcessorError(
                f"{type(image_processor).__name__} has do_resize=False: its token layout is not "
                f"the {cls.title} one ({how})"
            )

    @abstractmethod
    def resize(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` in pixels the processor resizes (and pads) a positive size to."""

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of one image, exactly as the processor computes it."""
        if width <= 0 or height <= 0:
            raise ImageSizeError(f"image size must be positive, got {width}x{height}")
        resized_h, resized_w = self.resize(width, height)
        patch = self.layout.param("patch_size")
        return 1, resized_h // patch, resized_w // patch

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

    def select_outputs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        selected = super().select_outputs(out)
        selected["image_grid_thw"] = np.asarray(selected["image_grid_thw"]).astype(np.int64)
        return selected

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        t, h, w = (int(x) for x in np.asarray(outputs["image_grid_thw"]).reshape(-1, 3)[0])
        return t * h * w // self.layout.param("merge_size") ** 2


class SmartResizeFamily(GridFamily):
    """Qwen-VL and GLM-4V: an image is resized to multiples of ``patch_size * merge_size``
    within [min_pixels, max_pixels] by the family's ``smart_resize``, cut into
    ``temporal_patch_size`` x patch x patch patches; M-RoPE positions and per-token types."""

    parameter_names = (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "min_pixels",
        "max_pixels",
    )
    #: the processor ``size`` keys each pixel bound (min_pixels, max_pixels) is read from,
    #: the first one set wins
    size_keys: ClassVar[Mapping[str, tuple[str, ...]]]
    token_type_input = "mm_token_type_ids"
    position_rows = 3

    @classmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        cls.require_resize(image_processor, "images must be resized to multiples of patch*merge")
        size = image_processor.size
        return {
            "patch_size": int(image_processor.patch_size),
            "temporal_patch_size": int(image_processor.temporal_patch_size),
            "merge_size": int(image_processor.merge_size),
            **{name: size_value(size, *keys) for name, keys in cls.size_keys.items()},
        }

    @abstractmethod
    def smart_resize(self, width: int, height: int) -> tuple[int, int]:
        """The family's ``smart_resize`` of a positive size: ``(height, width)``, or the
        ``ValueError`` transformers raises for a size it refuses."""

    def resize(self, width: int, height: int) -> tuple[int, int]:
        try:
            return self.smart_resize(width, height)
        except ValueError as exc:  # transformers refuses aspect ratios above 200
            raise ImageSizeError(
                f"{self.family} cannot lay out a {width}x{height} image: {exc}"
            ) from None


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
