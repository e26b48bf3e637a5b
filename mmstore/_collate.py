"""Samples -> one batch as a Qwen-VL trainer consumes it (right padding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import get_worker_info

from ._materialize import Sample, cast_floats

if TYPE_CHECKING:
    from ._adapters import QwenVLAdapter

# `<|endoftext|>` in the Qwen2-VL tokenizer, its pad token.
QWEN_PAD_TOKEN_ID = 151643
IMAGE_TOKEN_TYPE = 1  # mm_token_type_ids: 0 text, 1 image, 2 video


def collate(
    samples: Sequence[Sample],
    *,
    pad_token_id: int = QWEN_PAD_TOKEN_ID,
    dummy_image: QwenVLAdapter | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Pad and stack ``samples``.

    With ``dummy_image`` set (an adapter), a batch without any image gets one tiny zero image
    appended after the first sample's tokens, attended (so M-RoPE sees it) but never in the
    loss, so every FSDP rank runs the vision tower.
    """
    samples = list(samples)
    extra = _dummy(samples, dummy_image, dtype) if dummy_image is not None else None
    lengths = [len(s.input_ids) for s in samples]
    if extra is not None:
        lengths[0] += extra[0]
    width = max(lengths)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((batch, width), dtype=torch.int64)
    loss_mask = torch.zeros((batch, width), dtype=torch.bool)
    mm_token_type_ids = torch.zeros((batch, width), dtype=torch.int32)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    pixel_values: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = s.input_ids
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = s.loss_mask
        mm_token_type_ids[i, :n] = s.image_mask.to(torch.int32) * IMAGE_TOKEN_TYPE
        if s.logprobs is not None:
            logprobs[i, :n] = s.logprobs
        pixel_values.extend(s.pixel_values)
        grids.extend(s.image_grid_thw)
    if extra is not None:
        tokens, pixels, grid, token_id = extra
        n = len(samples[0].input_ids)
        input_ids[0, n : n + tokens] = token_id
        attention_mask[0, n : n + tokens] = 1
        mm_token_type_ids[0, n : n + tokens] = IMAGE_TOKEN_TYPE
        pixel_values.append(pixels)
        grids.append(grid)
    dim = pixel_values[0].shape[-1] if pixel_values else 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": _cat(pixel_values) if pixel_values else torch.zeros((0, dim), dtype=dtype),
        "image_grid_thw": torch.stack(grids) if grids else torch.zeros((0, 3), dtype=torch.int64),
        "logprobs": logprobs,
        "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "reward": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "prompt_lens": torch.tensor([s.prompt_len for s in samples], dtype=torch.int64),
        "sample_ids": [s.sample_id for s in samples],
        "group_ids": [s.group_id for s in samples],
        "images_missing": sum(1 for s in samples if s.missing_uris),
        "missing_uris": [uri for s in samples for uri in s.missing_uris],
        "dummy_image": extra is not None,
    }


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat``, straight into shared memory inside a DataLoader worker.

    A batch leaves a worker through shared memory; concatenating there (as torch's
    default_collate does) saves one copy of the largest tensor of the batch.
    """
    out = None
    if get_worker_info() is not None:
        first = tensors[0]
        storage = first._typed_storage()._new_shared(sum(t.numel() for t in tensors))
        out = first.new(storage).resize_(sum(t.shape[0] for t in tensors), *first.shape[1:])
    return torch.cat(tensors, out=out)


def _dummy(
    samples: Sequence[Sample], adapter: QwenVLAdapter, dtype: torch.dtype
) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
    if not samples or any(s.pixel_values for s in samples):
        return None
    side = adapter.layout.patch_size * adapter.layout.merge_size
    outputs = cast_floats(adapter.placeholder(side, side), dtype)
    return (
        adapter.num_tokens(side, side),
        outputs["pixel_values"],
        outputs["image_grid_thw"][0],
        adapter.image_token_id,
    )
