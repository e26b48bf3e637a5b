"""What a loader's batches pass the family's model: the input keys, and for a packed
micro-batch that needs one, its attention mask built for the model.

A padded batch and a packed micro-batch without shared prefixes pass their keys as they
are (packed: position ids, from which transformers derives each sample's block mask, so
flash-attention's varlen kernels work too). Two packed forms need a mask built for the
model instead (:func:`mmstore.forest_attention_mask`, on the batch's device):

- a prefix forest (``prefix_sharing=True``): position ids cannot say which branch a token
  is on;
- a micro-batch of a family whose image tokens attend both ways (Gemma 3): transformers
  5.25 builds the sliding-window layers' mask of a packed row with its image blocks one
  token off (a text token sees the next image, an image's last token is hidden from the
  rest of it), so samples past the first window get other logits than alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmstore._families import Family
from mmstore._loading.collate import model_input_names
from mmstore._loading.forest import forest_attention_mask
from mmstore._loading.microbatch import packed_input_names
from mmstore.errors import InvalidArgumentError


def needs_mask(family: Family, *, packed: bool, prefix_sharing: bool) -> bool:
    """Whether this form's batches need :func:`model_inputs` (a mask built for the model)."""
    return packed and (prefix_sharing or family.images_attend_both_ways)


def input_names(family: Family, *, packed: bool, prefix_sharing: bool) -> tuple[str, ...]:
    """The batch keys the model takes as they are; refused for a form that needs a mask."""
    if needs_mask(family, packed=packed, prefix_sharing=prefix_sharing):
        why = "a prefix forest" if prefix_sharing else f"a packed {family.name} micro-batch"
        raise InvalidArgumentError(
            f"{why} needs an attention mask built for the model: call "
            "model(**loader.model_inputs(batch, model))"
        )
    return packed_input_names(family) if packed else model_input_names(family)


def model_inputs(
    batch: Mapping[str, Any],
    family: Family,
    model: Any,
    *,
    packed: bool,
    prefix_sharing: bool,
) -> dict[str, Any]:
    """The keyword arguments to call ``model`` with on ``batch``."""
    if not needs_mask(family, packed=packed, prefix_sharing=prefix_sharing):
        return {k: batch[k] for k in input_names(family, packed=packed, prefix_sharing=False)}
    if model is None:
        raise InvalidArgumentError(
            "model_inputs of this batch needs the model: its attention mask is built for the "
            "model's layers (sliding windows) on the batch's device"
        )
    mask = forest_attention_mask(batch, model)
    return {**{k: batch[k] for k in packed_input_names(family)}, "attention_mask": mask}
