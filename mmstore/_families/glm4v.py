"""GLM-4.1V and GLM-4.5V: one layout, either transformers backend (PIL or torchvision).

The chat template emits ``<|begin_of_image|><|image|><|end_of_image|>`` per image, and
``Glm4vProcessor`` (like vLLM's ``glm4_1v``) replaces only the ``<|image|>`` between them: by
``<|image|>`` repeated once per merged patch. So the *expansion* is that one token repeated,
and the begin/end-of-image tokens are ordinary text around the span (a row keeps them where
the template put them; they are not image features and may appear outside spans).

GLM's resize is its own ``smart_resize`` (transformers' ``glm4v`` module): images smaller
than ``patch*merge`` on a side are scaled up first, and the pixel budget counts the
``temporal_patch_size`` frames an image is repeated into, so ``max_pixels`` admits half as
many image pixels as Qwen's rule would. The model takes ``pixel_values`` (patch rows),
``image_grid_thw`` and ``mm_token_type_ids``; positions are M-RoPE (the model's own
``get_rope_index``).

Token ids. GLM-4.1V and GLM-4.5V share the image processor but not the image token:
``<|image|>`` is 151343 in GLM-4.1V's tokenizer and 151363 in GLM-4.5V's (transformers'
``Glm4vConfig`` / ``Glm4vMoeConfig`` defaults, as in the checkpoints' config.json). An image
processor alone cannot tell them apart, so the published ids are GLM-4.1V's; for GLM-4.5V
build the adapter from the full processor (its tokenizer supplies the ids) or pass
``image_token_id=151363``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mmstore._exceptions import InvalidRolloutError
from mmstore._families._base import Token
from mmstore._families._grid import SmartResizeFamily, weightless_rope_index

if TYPE_CHECKING:
    import torch


class Glm4v(SmartResizeFamily):
    name = "glm4v"
    title = "GLM-4V"
    # GLM-4.1V-9B's tokenizer (zai-org/GLM-4.1V-9B-Thinking): `<|image|>` 151343 is its config's
    # image_token_id (transformers' Glm4vConfig default); `<|begin_of_image|>` 151339 and
    # `<|end_of_image|>` 151340 are its image_start/end_token_id; `<|endoftext|>` 151329 is the
    # tokenizer's pad token (the first of the GLM-4 tokenizer's added special tokens).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<|image|>", 151343),
        "image_start_token_id": Token("<|begin_of_image|>", 151339),
        "image_end_token_id": Token("<|end_of_image|>", 151340),
        "pad_token_id": Token("<|endoftext|>", 151329),
    }
    # The processor's resize reads exactly these two keys (and refuses a size without them).
    size_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "min_pixels": ("shortest_edge",),
        "max_pixels": ("longest_edge",),
    }

    # -- layout math --------------------------------------------------------------------

    def smart_resize(self, width: int, height: int) -> tuple[int, int]:
        p = self.layout.param
        temporal = p("temporal_patch_size")
        resized: tuple[int, int] = _smart_resize()(
            num_frames=temporal,  # an image is `temporal` identical frames
            height=height,
            width=width,
            temporal_factor=temporal,
            factor=p("patch_size") * p("merge_size"),
            min_pixels=p("min_pixels"),
            max_pixels=p("max_pixels"),
        )
        return resized

    # -- positions ----------------------------------------------------------------------

    def position_ids(
        self, input_ids: torch.Tensor, images: Sequence[Mapping[str, torch.Tensor]]
    ) -> torch.Tensor:
        """M-RoPE positions ``[3, L]`` of one sample, from the model's own ``get_rope_index``."""
        import torch
        from transformers.models.glm4v.modeling_glm4v import Glm4vModel

        ids = input_ids.reshape(1, -1)
        types_ = (ids == self.feature_token_id).to(torch.int32)
        grids = [image["image_grid_thw"].reshape(-1, 3) for image in images]
        # get_rope_index binds the i-th run of image tokens to the i-th grid: two spans with no
        # text between them (the template's end/begin-of-image tokens) would merge into one.
        runs = sum(1 for key, _ in itertools.groupby(types_[0].tolist()) if key == 1)
        if runs != len(grids):
            raise InvalidRolloutError(
                f"{runs} runs of image tokens for {len(grids)} images: GLM-4V needs text (its "
                "chat template's <|end_of_image|><|begin_of_image|>) between adjacent images"
            )
        rope_index = weightless_rope_index(Glm4vModel, self.layout.param("merge_size"))
        position_ids, _ = rope_index(
            ids,
            types_,
            image_grid_thw=torch.cat(grids) if grids else None,
        )
        return position_ids[:, 0]


def _smart_resize() -> Any:
    """transformers' GLM-4V ``smart_resize``, imported on first use.

    The PIL module's copy ("Copied from" the torchvision module's, so both backends resize
    alike) keeps torchvision out of layout math; ``import mmstore`` imports neither.
    """
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    return smart_resize
