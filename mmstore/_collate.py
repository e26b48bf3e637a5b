"""Samples -> one right-padded batch, in the tensors the sample's model family takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data import get_worker_info

from . import _buffers
from ._device import collate_images
from ._distinct import INDEX_KEY, ROWS_KEY
from ._materialize import Sample, cast_floats

if TYPE_CHECKING:
    from ._families import Family


def collate(
    samples: Sequence[Sample],
    family: Family,
    *,
    pad_token_id: int | None = None,
    dummy_image: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    distinct_images: bool = False,
) -> dict[str, Any]:
    """Pad and stack ``samples``; image tensors batched as ``family`` says.

    With ``dummy_image``, a batch without any image gets one tiny zero image appended after
    the first sample's tokens, attended (so position ids see it) but never in the loss, so
    every FSDP rank runs the vision tower. ``distinct_images``: see :mod:`._distinct`.
    """
    samples = list(samples)
    pad = family.pad_token_id if pad_token_id is None else pad_token_id
    extra = dummy(family, dtype) if dummy_image and not any(s.images for s in samples) else None
    lengths = [len(s.input_ids) for s in samples]
    if extra is not None and samples:
        lengths[0] += len(extra[0])
    width = max(lengths, default=0)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad, dtype=torch.int64)
    attention_mask = torch.zeros((batch, width), dtype=torch.int64)
    loss_mask = torch.zeros((batch, width), dtype=torch.bool)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    images: list[dict[str, torch.Tensor]] = []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = s.input_ids
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = s.loss_mask
        if s.logprobs is not None:
            logprobs[i, :n] = s.logprobs
        images.extend(s.images)
    if extra is not None and samples:
        tokens, tensors = extra
        n = len(samples[0].input_ids)
        input_ids[0, n : n + len(tokens)] = tokens
        attention_mask[0, n : n + len(tokens)] = 1
        images.append(tensors)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        **family.token_types(input_ids),
        **(
            collate_images(family, images, distinct_images=distinct_images)
            if images
            else no_images(family, distinct_images)
        ),
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


def dummy(family: Family, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The family's smallest image as zeros: its expansion and its tensors (train dtype)."""
    width, height = family.dummy_size
    tokens = torch.tensor(family.expansion_array(width, height), dtype=torch.int64)
    return tokens, cast_floats(family.placeholder(width, height), dtype)


def no_images(family: Family, distinct_images: bool) -> dict[str, Any]:
    """The image inputs of a batch without images: None, every model's own "no images"
    (their vision towers cannot run on zero images: Qwen-VL, GLM-4V and Mistral 3 cat an
    empty list, SigLIP and MoonViT reshape an empty batch)."""
    out: dict[str, Any] = dict.fromkeys(family.image_inputs)
    if distinct_images:
        out.update({INDEX_KEY: torch.zeros(0, dtype=torch.int64), ROWS_KEY: {}})
    return out


def concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` on the first axis, straight into shared memory inside a DataLoader worker.

    A batch leaves a worker through shared memory; concatenating there (as torch's
    default_collate does) saves one copy of the largest tensor of the batch, and
    concatenating into a buffer the trainer is done with (:mod:`._buffers`) saves faulting
    fresh pages in.
    """
    out = None
    if get_worker_info() is not None:
        first = tensors[0]
        shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
        # A buffer an earlier batch of this worker left (its pages in), else fresh ones.
        out = _buffers.active.empty(first, shape) if _buffers.active is not None else None
        if out is None:
            storage = first._typed_storage()._new_shared(sum(t.numel() for t in tensors))
            out = first.new(storage).resize_(shape)
    return torch.cat(list(tensors), out=out)


def pad_and_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Zero-pad every trailing axis to the largest of the batch, then :func:`concat`."""
    target = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        widths: list[int] = []
        for d in reversed(range(1, t.dim())):  # F.pad takes the last axis first
            widths += [0, target[d - 1] - t.shape[d]]
        padded.append(F.pad(t, widths) if any(widths) else t)
    return concat(padded)
