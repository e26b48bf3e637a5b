"""The image tensors of a batch, stacked as the family says, into shared memory in workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import get_worker_info

from mmstore._families import Family
from mmstore._loading import buffers as _buffers


def batch_images(
    family: Family, images: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The image tensors of a batch, in image order, batched as ``family.image_inputs`` says:
    "cat" concatenates on the first axis, "pad" zero-pads trailing axes to the largest first.
    No images: zero-length tensors of the family's shapes."""
    if not images:
        w, h = family.dummy_size
        empty = family.placeholder(w, h)
        return {k: torch.from_numpy(empty[k][:0]) for k in family.image_inputs}
    out: dict[str, torch.Tensor] = {}
    for key, how in family.image_inputs.items():
        tensors = [image[key] for image in images]
        out[key] = concat(tensors) if how == "cat" else pad_and_concat(tensors)
    return out


def concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` on the first axis, straight into shared memory inside a DataLoader worker.

    A batch leaves a worker through shared memory; concatenating there (as torch's
    default_collate does) saves one copy of the largest tensor of the batch, and
    concatenating into a buffer the trainer is done with (:mod:`.buffers`) saves faulting
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
