"""Family adapters: what one model family's image layout is, computed without the image.

A :class:`Layout` is pure data (family + the processor parameters that decide the token
layout); its fingerprint is a short hash of exactly those parameters. An adapter wraps a live
transformers image processor and its layout: the rollout side uses it to expand placeholder
tokens, the writer to check span lengths, the reader to run the processor and to build zero
placeholders of the right shape.

Layouts register themselves by fingerprint when an adapter is built, so a writer can check
the spans of refs made by any adapter of this process without being handed it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ._exceptions import (
    ImageSizeError,
    InvalidRolloutError,
    LayoutMismatchError,
    UnsupportedProcessorError,
)

if TYPE_CHECKING:
    from PIL import Image

    from ._models import ImageRef, MediaRef

QWEN_VL_FAMILY = "qwen-vl"
# `<|image_pad|>` in the Qwen2-VL, Qwen2.5-VL and Qwen3-VL tokenizers.
QWEN_VL_IMAGE_TOKEN_ID = 151655
# Image processor classes whose layout is the Qwen-VL one: the torchvision and the PIL backend
# (transformers 5 maps Qwen2.5-VL and Qwen3-VL checkpoints to these same classes).
_QWEN_VL_MODULE = "transformers.models.qwen2_vl."
_QWEN_VL_PROCESSORS = {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil"}


@dataclass(frozen=True)
class Layout:
    """The parameters that decide how an image becomes placeholder tokens."""

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int = QWEN_VL_IMAGE_TOKEN_ID

    @property
    def fingerprint(self) -> str:
        # The token id is a tokenizer fact, not layout math: it stays out of the hash.
        params = asdict(self)
        del params["image_token_id"]
        canonical = json.dumps(params, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(canonical.encode())

    def params(self) -> dict[str, Any]:
        return asdict(self)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of one image, exactly as the processor computes it."""
        if width <= 0 or height <= 0:
            raise ImageSizeError(f"image size must be positive, got {width}x{height}")
        factor = self.patch_size * self.merge_size
        try:
            resized_h, resized_w = _smart_resize()(
                height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
            )
        except ValueError as exc:  # transformers refuses aspect ratios above 200
            raise ImageSizeError(
                f"{self.family} cannot lay out a {width}x{height} image: {exc}"
            ) from None
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid(width, height)
        return t * h * w // (self.merge_size**2)

    def pixel_shape(self, width: int, height: int) -> tuple[int, int]:
        """Shape of this image's rows of ``pixel_values``: (patches, channels*t*p*p)."""
        t, h, w = self.grid(width, height)
        return t * h * w, 3 * self.temporal_patch_size * self.patch_size**2


_LAYOUTS: dict[str, Layout] = {}
# The placeholder token of each family's published tokenizers.
_FAMILY_IMAGE_TOKEN_IDS = {QWEN_VL_FAMILY: QWEN_VL_IMAGE_TOKEN_ID}


def register_layout(layout: Layout) -> None:
    # The fingerprint leaves the token id out, so two adapters of one layout may differ in it;
    # the registry holds the family's published id, never whichever adapter came last. Rows of
    # a custom tokenizer are checked against their own adapter (``store.writer(adapter=...)``).
    token_id = _FAMILY_IMAGE_TOKEN_IDS.get(layout.family, layout.image_token_id)
    _LAYOUTS[layout.fingerprint] = replace(layout, image_token_id=token_id)


def known_layouts() -> list[Layout]:
    """Every layout an adapter of this process has registered."""
    return list(_LAYOUTS.values())


def layout_for_fingerprint(fingerprint: str) -> Layout | None:
    """The layout of an adapter built in this process, or None."""
    return _LAYOUTS.get(fingerprint)


class QwenVLAdapter:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one layout, any transformers backend."""

    def __init__(self, image_processor: Any, image_token_id: int = QWEN_VL_IMAGE_TOKEN_ID):
        if not getattr(image_processor, "do_resize", True):
            # Without smart_resize the grid is the raw size, which the layout cannot promise.
            raise UnsupportedProcessorError(
                f"{type(image_processor).__name__} has do_resize=False: its token layout is not "
                "the Qwen-VL one (images must be resized to multiples of patch*merge)"
            )
        self.image_processor = image_processor
        size = image_processor.size
        self.layout = Layout(
            family=QWEN_VL_FAMILY,
            patch_size=int(image_processor.patch_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            merge_size=int(image_processor.merge_size),
            min_pixels=int(_size_get(size, "shortest_edge", "min_pixels")),
            max_pixels=int(_size_get(size, "longest_edge", "max_pixels")),
            image_token_id=image_token_id,
        )
        register_layout(self.layout)

    def __repr__(self) -> str:
        return (
            f"QwenVLAdapter({type(self.image_processor).__name__}, "
            f"fingerprint={self.fingerprint!r})"
        )

    family = property(lambda self: self.layout.family)
    fingerprint = property(lambda self: self.layout.fingerprint)
    image_token_id = property(lambda self: self.layout.image_token_id)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        return self.layout.grid(width, height)

    def num_tokens(self, width: int, height: int) -> int:
        return self.layout.num_tokens(width, height)

    def expand(
        self, token_ids: Sequence[int], media: Sequence[MediaRef | ImageRef]
    ) -> tuple[list[int], list[ImageRef]]:
        """Expand each single image token into its span; return the tokens and the refs.

        The i-th image token stands for ``media[i]``. The returned refs carry their spans,
        this adapter's family and fingerprint.
        """
        from ._models import ImageRef

        token_list = [int(t) for t in token_ids]
        positions = [i for i, t in enumerate(token_list) if t == self.image_token_id]
        if len(positions) != len(media):
            raise InvalidRolloutError(
                f"{len(positions)} image placeholder tokens ({self.image_token_id}) "
                f"but {len(media)} images to expand"
            )
        out: list[int] = []
        refs: list[ImageRef] = []
        start = 0
        for pos, item in zip(positions, media, strict=True):
            out.extend(token_list[start:pos])
            length = self.num_tokens(item.width, item.height)
            refs.append(
                ImageRef(
                    uri=item.uri,
                    hash=item.hash,
                    width=item.width,
                    height=item.height,
                    nbytes=item.nbytes,
                    offset=len(out),
                    length=length,
                    family=self.family,
                    layout_fingerprint=self.fingerprint,
                    payload=getattr(item, "payload", None),
                )
            )
            out.extend([self.image_token_id] * length)
            start = pos + 1
        out.extend(token_list[start:])
        return out, refs

    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        """Zero ``pixel_values`` and the grid of one image of this size, without the image."""
        t, h, w = self.grid(width, height)
        return {
            "pixel_values": np.zeros(self.layout.pixel_shape(width, height), dtype=np.float32),
            "image_grid_thw": np.array([[t, h, w]], dtype=np.int64),
        }

    def process(self, images: Sequence[Image.Image]) -> dict[str, np.ndarray]:
        """Run the real image processor; float32 ``pixel_values`` and int64 grids."""
        out = self.image_processor(images=list(images), return_tensors="np")
        return {
            "pixel_values": np.asarray(out["pixel_values"]),
            "image_grid_thw": np.asarray(out["image_grid_thw"], dtype=np.int64),
        }

    def check_grid(
        self, grid_thw: Sequence[int], ref: ImageRef, *, sample_id: str | None, image_index: int
    ) -> None:
        """Refuse processor output whose patch grid does not fill the stored span."""
        t, h, w = (int(x) for x in grid_thw)
        produced = t * h * w // (self.layout.merge_size**2)
        if produced != ref.length:
            raise LayoutMismatchError(
                f"processor produced {produced} image tokens (grid {t}x{h}x{w}) for a span of "
                f"{ref.length}",
                sample_id=sample_id,
                image_index=image_index,
                uri=ref.uri,
            )


def _size_get(size: Any, *keys: str) -> int:
    for key in keys:
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if value is not None:
            return int(value)
    raise UnsupportedProcessorError(f"image processor size has none of {keys}: {size!r}")


def adapter_for(processor: Any, *, image_token_id: int | None = None) -> QwenVLAdapter:
    """The family adapter for a transformers image processor (or a full processor).

    A full ``ProcessorMixin`` (image processor + tokenizer) also supplies the image token id.
    A subclass of a supported processor is refused; if it keeps Qwen's resize rule, build
    ``QwenVLAdapter(image_processor)`` directly.
    """
    image_processor = getattr(processor, "image_processor", processor)
    if image_token_id is None:
        image_token_id = getattr(processor, "image_token_id", None)
    cls = type(image_processor)
    # Exact classes, not subclasses: another model's processor deriving from these may resize
    # differently, and a wrong layout would fail silently.
    if cls.__name__ in _QWEN_VL_PROCESSORS and cls.__module__.startswith(_QWEN_VL_MODULE):
        token_id = QWEN_VL_IMAGE_TOKEN_ID if image_token_id is None else int(image_token_id)
        return QwenVLAdapter(image_processor, image_token_id=token_id)
    raise UnsupportedProcessorError(
        f"no mmstore family adapter for {cls.__module__}.{cls.__name__}; supported: "
        f"{sorted(_QWEN_VL_PROCESSORS)} from transformers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)"
    )


def _smart_resize() -> Any:
    """transformers' own ``smart_resize``, imported on first use.

    Importing it pulls in transformers' image stack (and torch, ~4 s): the CLI, polars
    notebooks and the rollout side's ``import mmstore`` should not pay that up front.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize
