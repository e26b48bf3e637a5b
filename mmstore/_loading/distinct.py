"""Batches that carry each distinct image once (``RolloutLoader(distinct_images=True)``).

A GRPO group's samples show the same image: a plain batch of such a group holds its pixels
once per sample (8 copies of a 1080p screenshot's 11.5 MB of bf16, written by the worker,
sent through shared memory, copied to the GPU, and run through the vision tower 8 times).
A distinct batch holds each image the worker served from the same processed tensors once,
in order of first appearance, and says where each image of the batch is among them:

- ``image_index``: int64 ``[images]``, for each image of the batch in model order (sample by
  sample, image by image) the index of its distinct image;
- ``image_rows``: for each image input, int64 ``[distinct]``, how many leading rows each
  distinct image fills in it (Qwen-VL's ``pixel_values``: its patches; a grid: 1);
- ``video_index`` and ``video_rows``: the same for the batch's videos (the same frames of
  the same clip, served by the worker from one processed entry).

:func:`expand_images` repeats the rows back into the plain batch, on whatever device the
tensors are (after ``.to("cuda")`` one concatenation on the GPU): the batch equals the plain
batch tensor for tensor. A trainer may instead run the vision tower once per distinct image
and gather its features with ``image_index``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from mmstore._loading.batch_keys import IMAGE_INDEX, IMAGE_ROWS, VIDEO_INDEX, VIDEO_ROWS

# The keys, declared with the batch's others in :mod:`.batch_keys`.
INDEX_KEY = IMAGE_INDEX.name
ROWS_KEY = IMAGE_ROWS.name
# The same for a batch's videos: a GRPO group's shared clip carried once.
VIDEO_INDEX_KEY = VIDEO_INDEX.name
VIDEO_ROWS_KEY = VIDEO_ROWS.name


def distinct(images: Sequence[Any]) -> tuple[list[Any], torch.Tensor]:
    """Each image object of ``images`` once, in first-appearance order, and ``image_index``.

    Identity, not content: the same object is the same processed tensors (the worker's cache
    hands out one object per hash), so nothing is compared and nothing can be confused.
    """
    first: dict[int, int] = {}
    kept: list[Any] = []
    index = []
    for image in images:
        slot = first.setdefault(id(image), len(kept))
        if slot == len(kept):
            kept.append(image)
        index.append(slot)
    return kept, torch.tensor(index, dtype=torch.int64)


def rows(keys: Iterable[str], images: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """``image_rows`` of ``images`` (processed: each a dict of the family's image tensors)."""
    return {
        key: torch.tensor([int(image[key].shape[0]) for image in images], dtype=torch.int64)
        for key in keys
    }


def expand_images(batch: dict[str, Any]) -> dict[str, Any]:
    """A distinct batch (``distinct_images=True``) as the plain batch the model takes: each
    image input's rows repeated in model order, ``image_index`` and ``image_rows`` removed.

    Runs where the tensors are (move the batch to the GPU first: the copy there is 1/k of
    the bytes for k samples per image, and this concatenation is one kernel). Without a GPU
    it costs what the plain batch's copies cost, in this process. A plain batch is returned
    as it is.
    """
    for index_key, rows_key in ((INDEX_KEY, ROWS_KEY), (VIDEO_INDEX_KEY, VIDEO_ROWS_KEY)):
        if index_key not in batch:
            continue
        index = batch.pop(index_key).tolist()
        for key, counts in batch.pop(rows_key).items():
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                parts = value.split(counts.tolist())  # views: each distinct item's rows
                batch[key] = torch.cat([parts[i] for i in index]) if index else value[:0]
    return batch
