"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one layout, either transformers backend.

An image is resized to multiples of ``patch_size * merge_size`` within [min_pixels,
max_pixels] (transformers' own ``smart_resize``), cut into ``temporal_patch_size`` x patch x
patch patches, and each ``merge_size**2`` patches become one ``<|image_pad|>`` token: the
expansion is that one token repeated. The model takes ``pixel_values`` (patch rows),
``image_grid_thw`` and ``mm_token_type_ids``; positions are M-RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mmstore._families._base import Token
from mmstore._families._grid import SmartResizeFamily, weightless_rope_index

if TYPE_CHECKING:
    import torch


class QwenVL(SmartResizeFamily):
    name = "qwen-vl"
    title = "Qwen-VL"
    # Qwen2-VL / 2.5-VL / 3-VL tokenizers: `<|image_pad|>` and `<|endoftext|>` (the pad token).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<|image_pad|>", 151655),
        "pad_token_id": Token("<|endoftext|>", 151643),
    }
    # Either key of each bound: the processor's resize accepts both spellings.
    size_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "min_pixels": ("shortest_edge", "min_pixels"),
        "max_pixels": ("longest_edge", "max_pixels"),
    }

    # -- layout math --------------------------------------------------------------------

    def smart_resize(self, width: int, height: int) -> tuple[int, int]:
        p = self.layout.param
        resized: tuple[int, int] = _smart_resize()(
            height,
            width,
            factor=p("patch_size") * p("merge_size"),
            min_pixels=p("min_pixels"),
            max_pixels=p("max_pixels"),
        )
        return resized

    # -- positions ----------------------------------------------------------------------

    def position_ids(
        self, input_ids: torch.Tensor, images: Sequence[Mapping[str, torch.Tensor]]
    ) -> torch.Tensor:
        """M-RoPE positions of one sample run alone, ``[3, L]``, by transformers' own
        ``Qwen2VLModel.get_rope_index`` (run on a stand-in holding only the merge size, which
        is all that function reads of the model; see :func:`weightless_rope_index`). Qwen2.5-VL
        and Qwen3-VL lay images out the same way; their functions differ only for videos."""
        import torch

        ids = input_ids.reshape(1, -1).to(torch.int64)
        types = (ids == self.feature_token_id).to(torch.int32)
        grids = [image["image_grid_thw"].reshape(-1, 3) for image in images]
        grid = torch.cat(grids).to(torch.int64) if grids else None
        if grid is None:  # text only: get_rope_index expects vision; plain 1-D positions
            return torch.arange(ids.shape[1], dtype=torch.int64)[None].expand(3, -1).clone()
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

        rope_index = weightless_rope_index(Qwen2VLModel, self.layout.param("merge_size"))
        positions, _ = rope_index(ids, types, grid)
        return positions[:, 0]


def _smart_resize() -> Any:
    """transformers' own ``smart_resize``, imported on first use.

    Importing it pulls in transformers' image stack (and torch, ~4 s): the CLI, polars
    notebooks and the rollout side's ``import mmstore`` should not pay that up front.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize
