"""Prefix forests: a packed micro-batch whose samples share prefixes, each shared token once.

A GRPO group repeats its prompt (often mostly screenshot tokens) in every sample; a
multi-turn agent stored one sample per turn repeats its whole history in each. Packed with
``prefix_sharing=True``, a micro-batch's samples become a forest: the samples' token
sequences merged into a trie, each node one token the model runs once. Two tokens merge
only when their whole prefixes are equal, token for token *and* image for image (an image
span's tokens carry the image's content hash: the same placeholder tokens of two different
screenshots never merge), so every token sees exactly the context it sees in its own sample,
and its hidden states, logits and gradients are the sample's.

The forest lays its tokens out in depth-first order (the samples in lexicographic order of
their keys, each adding the tokens past its longest common prefix with the one before it),
so the tokens below any token are a contiguous range after it. That gives the compact
attention structure (:data:`VISIBLE_UNTIL`): key token ``j`` is seen by the queries
``j .. visible_until[j] - 1``, its descendants and itself, which is exactly "a token attends
to its ancestors and itself". :func:`forest_attention_mask` expands it on the device into
the 4-D additive mask eager and sdpa attention take (a FlexAttention ``mask_mod`` is the
same one-line comparison). ``attention_blocks`` adds what a family attends to both ways
(Gemma 3: the tokens of one image), and a sliding window layer's mask counts distance in
each token's own sample positions.

Positions are each sample's own (the family's rope function on the sample alone, as
unshared packing gives them); a shared token has the same position in every sample through
it, because a rope index of a prefix depends on that prefix only (checked, per micro-batch).

What a loss reads stays laid out per sample as in an unshared packed micro-batch
(``loss_mask``, ``logprobs``, columns, ``cu_seqlens``); ``forest_index`` maps each of those
token slots to its forest token: ``logits[:, forest_index]`` are the unshared micro-batch's
logits, and ``input_ids[:, forest_index]`` its tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmstore.errors import InvalidArgumentError, MmstoreError

#: The batch keys of a prefix forest (declared in :mod:`.batch_keys`).
FOREST_INDEX = "forest_index"
VISIBLE_UNTIL = "visible_until"
ATTENTION_BLOCKS = "attention_blocks"


@dataclass(frozen=True)
class Forest:
    """The forest of some token sequences (each a key array: equal keys, equal tokens).

    ``index``: for each token of the sequences laid end to end, its forest token;
    ``source``: for each forest token, one of those tokens that is it; ``visible_until``:
    for each forest token, the end of the range of forest tokens below it (itself included).
    """

    index: np.ndarray  # int64 [T]
    source: np.ndarray  # int64 [N]
    visible_until: np.ndarray  # int64 [N]

    @property
    def num_tokens(self) -> int:
        return len(self.source)


def build_forest(keys: Sequence[np.ndarray]) -> Forest:
    """Merge ``keys`` (one int64 array per sequence) into a depth-first prefix forest."""
    starts = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys], out=starts[1:])
    lists = [k.tolist() for k in keys]
    order = sorted(range(len(keys)), key=lists.__getitem__)
    index = np.empty(int(starts[-1]), dtype=np.int64)
    visible_until = np.zeros(int(starts[-1]), dtype=np.int64)
    size = 0
    previous: np.ndarray | None = None  # the forest path of the sequence before, in order
    previous_keys = np.zeros(0, dtype=np.int64)
    for s in order:
        own = keys[s]
        shared = 0 if previous is None else _common_prefix(own, previous_keys)
        fresh = len(own) - shared
        path = np.concatenate(
            [previous[:shared] if previous is not None else np.zeros(0, np.int64),
             np.arange(size, size + fresh, dtype=np.int64)]
        )  # fmt: skip
        size += fresh
        index[starts[s] : starts[s + 1]] = path
        if len(path):
            # The path's last token is its largest: everything on it reaches at least there.
            visible_until[path] = np.maximum(visible_until[path], path[-1] + 1)
        previous, previous_keys = path, own
    source = np.empty(size, dtype=np.int64)
    source[index] = np.arange(len(index), dtype=np.int64)
    return Forest(index, source, visible_until[:size])


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def token_keys(
    ids: torch.Tensor, spans: Sequence[tuple[int, int, str]], media: dict[str, int]
) -> np.ndarray:
    """One sample's key array: its token ids, except that a media span's tokens all read
    ``-1 - m`` for the span's media key ``m`` (numbered in ``media``, shared by the
    micro-batch; a key of ``""`` is never shared: it gets a number of its own)."""
    keys = ids.numpy().astype(np.int64, copy=True)
    for offset, length, key in spans:
        number = media.setdefault(key, len(media)) if key else _fresh(media)
        keys[offset : offset + length] = -1 - number
    return keys


def _fresh(media: dict[str, int]) -> int:
    number = len(media)
    media[f"\0unshared{number}"] = number
    return number


def check_positions(flat: torch.Tensor, forest: Forest) -> torch.Tensor:
    """The forest's position ids (``flat``'s, ``[rows, T]``, gathered); refuses a family
    whose positions of a shared prefix differ between the samples through it."""
    shared = flat[:, torch.from_numpy(forest.source)]
    if not torch.equal(shared[:, torch.from_numpy(forest.index)], flat):
        raise MmstoreError(
            "prefix sharing: samples that share a prefix got different position ids for it "
            "(this family's positions of a token depend on more than its prefix); load "
            "without prefix_sharing"
        )
    return shared


def image_blocks(token_types: torch.Tensor) -> torch.Tensor:
    """``attention_blocks`` of a family whose image tokens attend to each other both ways
    (Gemma 3): each run of image tokens (type 1) numbered from 1, others 0; transformers
    builds its mask from the same runs (``get_block_sequence_ids_for_mask``)."""
    image = token_types.reshape(-1) == 1
    starts = image & ~torch.cat([torch.zeros(1, dtype=torch.bool), image[:-1]])
    return torch.where(image, torch.cumsum(starts.to(torch.int64), 0), 0)


def forest_attention_mask(
    batch: Mapping[str, Any], model: Any, *, dtype: torch.dtype | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask to pass a model with a prefix-forest micro-batch: ``[1, 1, N, N]``
    additive (0 where a query token may see a key token, the dtype's minimum elsewhere),
    built on the batch's device from :data:`VISIBLE_UNTIL` (ancestors and itself),
    :data:`ATTENTION_BLOCKS` (both ways within a block) and, for a model whose layers
    slide a window, the window in each token's own sample positions: then a dict by layer
    type (``{"full_attention": ..., "sliding_attention": ...}``, as Gemma 3 takes it).

    ``model``: the model (or its config); ``dtype``: the mask's, by default the model's.
    """
    if VISIBLE_UNTIL not in batch:
        raise InvalidArgumentError(
            "this batch is no prefix forest (no visible_until): load it with "
            "prefix_sharing=True, or pass the model no attention mask"
        )
    config = getattr(model, "config", model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "use_bidirectional_attention", False):
        raise InvalidArgumentError(
            "prefix sharing needs a causal model; this one attends both ways "
            "(use_bidirectional_attention)"
        )
    if dtype is None:  # a model's; a config's may be a name, or None
        found = getattr(model, "dtype", None)
        dtype = found if isinstance(found, torch.dtype) else torch.float32
    until = batch[VISIBLE_UNTIL].reshape(-1)
    n = until.shape[0]
    k = torch.arange(n, device=until.device)
    q = k[:, None]
    allowed = (k[None, :] <= q) & (q < until[None, :])
    blocks = batch[ATTENTION_BLOCKS].reshape(-1).to(until.device)
    allowed |= (blocks[:, None] == blocks[None, :]) & (blocks[:, None] > 0)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or ()
    slides = window is not None and getattr(text, "use_sliding_window", True)
    if not slides:
        return _additive(allowed, dtype)
    positions = batch["position_ids"].reshape(-1, n)[0].to(until.device)
    near = (positions[:, None] - positions[None, :]) < window
    if "sliding_attention" not in layer_types:  # every layer slides (Mistral)
        return _additive(allowed & near, dtype)
    return {
        "full_attention": _additive(allowed, dtype),
        "sliding_attention": _additive(allowed & near, dtype),
    }


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
