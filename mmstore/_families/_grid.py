"""The patch-grid families' shared half: Qwen-VL, GLM-4V and Kimi-K2.5.

Each resizes an image its own way (:meth:`GridFamily.resize`) and cuts it into a
``(1, h, w)`` grid of patches; from there they agree: every ``merge_size**2`` patches become
one image token (the expansion is that token repeated), the model takes ``pixel_values``
(patch rows) and ``image_grid_thw``, and the processor's grid tells how many tokens its
output fills. Qwen-VL and GLM-4V agree further (:class:`SmartResizeFamily`): the same
processor parameters, a ``smart_resize`` into a pixel budget, M-RoPE positions. Their
videos share :class:`PatchVideo` the same way.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from types import MethodType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np

from mmstore._families._base import Collation, Family, size_value
from mmstore._families._video import Clip, VideoFamily
from mmstore._format.models import VideoRef
from mmstore.errors import ImageSizeError, UnsupportedProcessorError


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


def weightless_rope_index(model_cls: Any, merge_size: int, **vision: Any) -> Callable[..., Any]:
    """``model_cls.get_rope_index`` (a transformers M-RoPE model) bound to a stand-in.

    The function reads ``self.config.vision_config.spatial_merge_size`` (and ``vision``'s
    settings: Qwen2.5-VL's ``tokens_per_second``) and calls ``self.get_vision_position_ids``
    (pure index math), nothing else of the model: bound to this stand-in it runs the model's
    own code without building any weights.
    """
    owner = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(spatial_merge_size=merge_size, **vision)
        )
    )
    owner.get_vision_position_ids = MethodType(model_cls.get_vision_position_ids, owner)
    return MethodType(model_cls.get_rope_index, owner)


class PatchVideo(VideoFamily):
    """The patch-grid video families' shared half: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V.

    Each resizes a ref's frames its own way (:meth:`resized`) and pads them to a multiple of
    ``temporal_patch_size`` by repeating the last; from there they agree: a ``(t, h, w)``
    grid of patches, ``merge_size**2`` patches of a slab per feature token, the model takes
    ``pixel_values_videos`` (patch rows) and one ``video_grid_thw`` row per video, and
    ``mm_token_type_ids`` is 2 on the video's features.
    """

    #: the transformers video processor class (its name) the family lays out
    processor_name: ClassVar[str]
    #: the family's name in messages ("Qwen-VL")
    title: ClassVar[str]
    video_inputs: ClassVar[Mapping[str, Collation]] = {
        "pixel_values_videos": "cat",
        "video_grid_thw": "cat",
    }
    token_type = 2

    @classmethod
    def grid_parameters(cls, video_processor: Any) -> dict[str, Any]:
        """The parameters every patch-grid video layout hashes; refuses another processor
        class, or one that does not resize."""
        name = type(video_processor).__name__
        if name != cls.processor_name:
            raise UnsupportedProcessorError(
                f"{name}: {cls.__name__} lays out {cls.processor_name} videos"
            )
        if not getattr(video_processor, "do_resize", True):
            raise UnsupportedProcessorError(
                f"{name} has do_resize=False: its video token layout is not the {cls.title} one"
            )
        size = video_processor.size
        return {
            "patch_size": int(video_processor.patch_size),
            "temporal_patch_size": int(video_processor.temporal_patch_size),
            "merge_size": int(video_processor.merge_size),
            "min_pixels": size_value(size, "shortest_edge", "min_pixels"),
            "max_pixels": size_value(size, "longest_edge", "max_pixels"),
        }

    @abstractmethod
    def resized(self, ref: VideoRef | Clip) -> tuple[int, int]:
        """``(height, width)`` the processor resizes the ref's frames to."""

    def num_frames(self, ref: VideoRef | Clip) -> int:
        """How many frames the processor gets for the ref (GLM-4.1V's are made even)."""
        return len(ref.frames)

    def grid(self, ref: VideoRef | Clip) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of the ref's frames, exactly as the processor's."""
        height, width = self.resized(ref)
        p = self.layout.param
        t = -(-self.num_frames(ref) // p("temporal_patch_size"))
        return t, height // p("patch_size"), width // p("patch_size")

    def slab_tokens(self, ref: VideoRef | Clip) -> int:
        """Feature tokens of one ``temporal_patch_size``-frame slab."""
        _, h, w = self.grid(ref)
        return h * w // self.layout.param("merge_size") ** 2

    def bracketed_slab(self, ref: VideoRef | Clip, start: str, end: str) -> tuple[int, ...]:
        """One slab's feature tokens between the tokens named ``start`` and ``end``."""
        tid = self.layout.token_id
        return (tid(start), *[self.feature_token_id] * self.slab_tokens(ref), tid(end))

    def integer_tensors(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        return {"video_grid_thw": np.asarray([self.grid(ref)], dtype=np.int64)}

    def placeholder(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        t, h, w = self.grid(ref)
        p = self.layout.param
        width = 3 * p("temporal_patch_size") * p("patch_size") ** 2
        return {
            "pixel_values_videos": np.zeros((t * h * w, width), dtype=np.float32),
            **self.integer_tensors(ref),
        }

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        grid = np.asarray(outputs["video_grid_thw"]).reshape(-1, 3)
        return int(grid.prod(axis=1).sum()) // self.layout.param("merge_size") ** 2

    def processor_kwargs(self, ref: VideoRef) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"do_sample_frames": False}  # the ref's frames, no others
        if "cap_pixels_per_frame" in dict(self.layout.parameters):  # Qwen's: as recorded
            kwargs["cap_pixels_per_frame"] = self.layout.param("cap_pixels_per_frame")
        return kwargs

    def resize_error(self, ref: VideoRef | Clip, exc: ValueError) -> ImageSizeError:
        """transformers' refusal (an aspect ratio beyond 200:1, too few frames), typed."""
        return ImageSizeError(
            f"{self.num_frames(ref)} frames of a {ref.width}x{ref.height} video: {exc}"
        )
