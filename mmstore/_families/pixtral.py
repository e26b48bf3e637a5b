"""Pixtral and Mistral 3 (Mistral-Small-3.1/3.2): native resolution, rows of image tokens.

An image keeps its aspect ratio: it is shrunk (never grown) to fit ``longest_edge``, then its
sides are rounded up to multiples of ``patch_size * spatial_merge_size`` (transformers' own
``get_resize_output_image_size``, which ``PixtralProcessor`` calls with that merged patch).
Each merged patch is one ``[IMG]`` token; every row of them ends with ``[IMG_BREAK]`` and the
last row's break is ``[IMG_END]`` (``PixtralProcessor.replace_image_token``). Pixtral-12B has
merge 1, Mistral 3 merge 2 (its patch merger folds 2x2 patches into one token).

The model (``Mistral3ForConditionalGeneration``, or Llava for Pixtral-12B) takes
``pixel_values`` zero-padded at the bottom and right to the largest image of the batch, as the
image processor pads a batch, and ``image_sizes`` (``[n, 2]``, height and width) to crop each
image back out. Positions are 1-D RoPE.

The token layout depends on the *processor's* patch size and merge, not on the image
processor's own ``patch_size``: ``PixtralProcessor`` passes ``patch_size * merge`` to the image
processor on every call, and so does :meth:`Pixtral.processor_kwargs`.

An image processor alone does not know the merge (Pixtral-12B's 1 and Mistral 3's 2 share
the image processor class; with its defaults a 1920x1080 image is 594 tokens at merge 2 and
2340 at merge 1). It is never guessed: an image processor alone must carry it
(``PixtralImageProcessor(..., spatial_merge_size=2)``, which transformers keeps and saves
with its config), else the adapter is refused and asks for the full processor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from mmstore._families._base import Collation, Family, Layout, Token, size_value
from mmstore._format.models import ImageRef
from mmstore.errors import ImageSizeError, LayoutMismatchError, UnsupportedProcessorError

PIXTRAL_PROCESSOR = "transformers.models.pixtral.processing_pixtral.PixtralProcessor"


class Pixtral(Family):
    name = "pixtral"
    parameter_names = ("patch_size", "spatial_merge_size", "longest_edge")
    # The Tekken tokenizer of Pixtral-12B and Mistral-Small-3.x: control tokens by rank
    # (mistral_common `Tekkenizer` special tokens: 10 [IMG], 11 <pad>, 12 [IMG_BREAK],
    # 13 [IMG_END]); the same ids as the models' config.json `image_token_index` (10) and
    # params.json "vision_encoder" `image_break_token_id` / `image_end_token_id` (12, 13).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("[IMG]", 10),
        "image_break_token_id": Token("[IMG_BREAK]", 12),
        "image_end_token_id": Token("[IMG_END]", 13),
        "pad_token_id": Token("<pad>", 11),
    }
    image_inputs: ClassVar[Mapping[str, Collation]] = {
        "pixel_values": "pad",
        "image_sizes": "cat",
    }

    @classmethod
    def from_processor(cls, processor: Any, *, image_token_id: int | None = None) -> Family:
        family = super().from_processor(processor, image_token_id=image_token_id)
        # PixtralProcessor may be built with its own break/end token strings; the ids it
        # resolved for them are what it lays out, whatever the tokenizer calls "[IMG_BREAK]".
        own: dict[str, int] = {}
        if processor is not family.image_processor:
            for key in ("image_break_token_id", "image_end_token_id"):
                value = getattr(processor, key, None)
                if isinstance(value, int) and value != family.layout.token_id(key):
                    own[key] = value
        if not own:
            return family
        layout = Layout.make(
            cls.name, dict(family.layout.parameters), {**dict(family.layout.token_ids), **own}
        )
        return cls(layout, family.image_processor)

    @classmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        kind = type(image_processor).__name__
        if not getattr(image_processor, "do_resize", True):
            raise UnsupportedProcessorError(
                f"{kind} has do_resize=False: images would keep sizes that are not multiples "
                "of the patch, which the Pixtral layout cannot promise"
            )
        if getattr(image_processor, "do_center_crop", False):
            raise UnsupportedProcessorError(
                f"{kind} has do_center_crop=True: the crop changes the token grid"
            )
        # PixtralProcessor and vLLM size images by longest_edge only; a height/width box is a
        # layout neither of them counts tokens for.
        longest_edge = size_value(image_processor.size, "longest_edge")
        own_merge = getattr(image_processor, "spatial_merge_size", None)
        if processor is image_processor:
            patch_size = _square(image_processor.patch_size, kind)
            merge = _merge_of_image_processor(own_merge, kind)
        elif _qualname(type(processor)) == PIXTRAL_PROCESSOR:
            patch_size = _square(processor.patch_size, type(processor).__name__)
            merge = int(processor.spatial_merge_size)
            if own_merge is not None and own_merge != merge:
                raise UnsupportedProcessorError(
                    f"{kind} says spatial_merge_size={own_merge!r} but its "
                    f"{type(processor).__name__} merges {merge}: the layout is ambiguous"
                )
        else:
            # Other processors wrap Pixtral's image processor with their own token math
            # (LightOnOCR sizes images by the image processor's patch): exact class only.
            raise UnsupportedProcessorError(
                f"{_qualname(type(processor))} wraps a Pixtral image processor, but only "
                "PixtralProcessor's token layout is known (pass it or the image processor)"
            )
        if patch_size <= 0 or merge <= 0 or longest_edge <= 0:
            raise UnsupportedProcessorError(
                f"Pixtral layout parameters must be positive: patch_size={patch_size}, "
                f"spatial_merge_size={merge}, longest_edge={longest_edge}"
            )
        return {"patch_size": patch_size, "spatial_merge_size": merge, "longest_edge": longest_edge}

    # -- identity -----------------------------------------------------------------------

    @property
    def special_token_ids(self) -> frozenset[int]:
        t = self.layout.token_id
        return frozenset({t("image_token_id"), t("image_break_token_id"), t("image_end_token_id")})

    # -- layout math --------------------------------------------------------------------

    @property
    def token_side(self) -> int:
        """Pixels per token along each axis: the patch times the spatial merge."""
        return int(self.layout.param("patch_size") * self.layout.param("spatial_merge_size"))

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` the processor resizes an image to, as ``image_sizes`` has it."""
        if width <= 0 or height <= 0:
            raise ImageSizeError(f"image size must be positive, got {width}x{height}")
        resize, channels_last = _resize_helper()
        longest, side = self.layout.param("longest_edge"), self.token_side
        # A zero-stride view: the helper reads only the shape, at no cost even for 8K images.
        shape_only = np.broadcast_to(np.zeros((), dtype=np.uint8), (height, width, 3))
        h, w = resize(
            shape_only,
            size=(longest, longest),
            patch_size=(side, side),
            input_data_format=channels_last,
        )
        if h <= 0 or w <= 0:  # one side floors to 0 pixels when fitted into longest_edge
            raise ImageSizeError(
                f"{self.family} cannot lay out a {width}x{height} image: fitting it into "
                f"longest_edge={longest} leaves a side of 0 pixels"
            )
        return int(h), int(w)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(rows, columns)`` of ``[IMG]`` tokens of one image."""
        h, w = self.resized(width, height)
        return h // self.token_side, w // self.token_side

    def num_tokens(self, width: int, height: int) -> int:
        rows, cols = self.grid(width, height)
        return rows * (cols + 1)

    def expansion(self, width: int, height: int) -> list[int]:
        rows, cols = self.grid(width, height)
        t = self.layout.token_id
        tokens = ([t("image_token_id")] * cols + [t("image_break_token_id")]) * rows
        tokens[-1] = t("image_end_token_id")
        return tokens

    def pixel_shape(self, width: int, height: int) -> tuple[int, int, int, int]:
        """One image's ``pixel_values``: ``(1, channels, height, width)``, unpadded."""
        return (1, 3, *self.resized(width, height))

    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        return {
            "pixel_values": np.zeros(self.pixel_shape(width, height), dtype=np.float32),
            **self.integer_tensors(width, height),
        }

    def integer_tensors(self, width: int, height: int) -> dict[str, np.ndarray]:
        return {"image_sizes": np.array([self.resized(width, height)], dtype=np.int64)}

    @property
    def dummy_size(self) -> tuple[int, int]:
        # One row of two tokens, not one token: Mistral3's get_image_features squeezes the
        # token axis of a batch's features away when they are a single token, and fails.
        return 2 * self.token_side, self.token_side

    # -- the processor ------------------------------------------------------------------

    def processor_kwargs(self) -> dict[str, Any]:
        # What PixtralProcessor._process_images passes: resize to multiples of patch * merge.
        return {**super().processor_kwargs(), "patch_size": self.token_side}

    def select_outputs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        selected = super().select_outputs(out)
        selected["image_sizes"] = np.asarray(selected["image_sizes"]).astype(np.int64)
        return selected

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        h, w = (int(x) for x in np.asarray(outputs["image_sizes"]).reshape(-1, 2)[0])
        return (h // self.token_side) * (w // self.token_side + 1)

    def check_output(
        self, outputs: Mapping[str, Any], ref: ImageRef, *, sample_id: str | None, image_index: int
    ) -> None:
        # The token count alone would pass a transposed or differently rounded grid; the
        # pixels' own shape too, which the base check of the sizes does not look at.
        expected = self.resized(ref.width, ref.height)
        got = tuple(int(x) for x in np.asarray(outputs["image_sizes"]).reshape(-1, 2)[0])
        pixels = tuple(outputs["pixel_values"].shape[-2:])
        if got != expected or pixels != expected:
            raise LayoutMismatchError(
                f"processor resized a {ref.width}x{ref.height} image to {got} (pixels "
                f"{pixels}), the span was laid out for {expected}",
                sample_id=sample_id,
                image_index=image_index,
                uri=ref.uri,
            )
        super().check_output(outputs, ref, sample_id=sample_id, image_index=image_index)


def _merge_of_image_processor(merge: Any, kind: str) -> int:
    """The spatial merge an image processor alone carries; refused if it carries none."""
    if merge is None:
        raise UnsupportedProcessorError(
            f"{kind} alone does not say how many patches one [IMG] token merges (Pixtral-12B: "
            "1, Mistral 3: 2x2), and the token layout depends on it: pass the full "
            "PixtralProcessor (AutoProcessor.from_pretrained), or give the image processor "
            f"the model's spatial_merge_size ({kind}(..., spatial_merge_size=2))"
        )
    if isinstance(merge, bool) or not isinstance(merge, int):
        raise UnsupportedProcessorError(
            f"{kind} has spatial_merge_size={merge!r}: a positive int is needed"
        )
    return merge


def _square(patch_size: Any, owner: str) -> int:
    """A patch size given as an int or a ``{"height", "width"}`` dict / SizeDict."""
    if isinstance(patch_size, int):
        return patch_size
    height = size_value(patch_size, "height")
    if size_value(patch_size, "width") != height:
        raise UnsupportedProcessorError(f"{owner} has a non-square patch size {patch_size!r}")
    return height


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _resize_helper() -> tuple[Any, Any]:
    """transformers' ``get_resize_output_image_size`` (the PIL backend's copy; the torchvision
    one is the same function) and ``ChannelDimension.LAST``, imported on first use so that
    ``import mmstore`` does not import transformers."""
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        get_resize_output_image_size,
    )

    return get_resize_output_image_size, ChannelDimension.LAST
