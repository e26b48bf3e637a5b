"""Invariants a rollout row must hold before it is committed, and span-safe truncation.

Pure functions: they read a row and the layouts of its images, and raise
:class:`InvalidRolloutError` naming the sample and the image index at the first violation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ._adapters import Layout, layout_for_fingerprint
from ._exceptions import InvalidArgumentError, InvalidRolloutError
from ._models import Rollout

LayoutLookup = Callable[[str], "Layout | None"]


def check_rollout(
    rollout: Rollout,
    layouts: LayoutLookup = layout_for_fingerprint,
    *,
    image_token_ids: Sequence[int] = (),
) -> None:
    """Refuse a row whose masks, spans or placeholder tokens are inconsistent.

    ``layouts`` maps a ref's fingerprint to its :class:`Layout`. ``image_token_ids`` are
    placeholder ids that must not appear outside spans even in rows without images (the
    writer passes the ids of the layouts it knows).
    """
    sid = rollout.sample_id
    n = len(rollout.tokens)
    _check_lengths(rollout, n)
    tokens = np.asarray(rollout.tokens, dtype=np.int64)
    in_span = np.zeros(n, dtype=bool)
    placeholder_ids = set(image_token_ids)
    end_of_previous = 0
    for index, ref in enumerate(rollout.images):
        if index and ref.offset < rollout.images[index - 1].offset:
            raise InvalidRolloutError(
                "images are not sorted by offset", sample_id=sid, image_index=index
            )
        if ref.offset < end_of_previous:
            raise InvalidRolloutError(
                f"span [{ref.offset}, {ref.offset + ref.length}) overlaps the previous image "
                f"ending at {end_of_previous}",
                sample_id=sid,
                image_index=index,
            )
        if ref.offset + ref.length > n:
            raise InvalidRolloutError(
                f"span [{ref.offset}, {ref.offset + ref.length}) is outside the {n} tokens",
                sample_id=sid,
                image_index=index,
            )
        layout = _layout_of(ref.layout_fingerprint, ref.family, layouts, sid, index)
        expected = layout.num_tokens(ref.width, ref.height)
        if ref.length != expected:
            raise InvalidRolloutError(
                f"span length {ref.length} != {expected} tokens that {layout.family} lays out "
                f"for a {ref.width}x{ref.height} image",
                sample_id=sid,
                image_index=index,
            )
        span = tokens[ref.offset : ref.offset + ref.length]
        wrong = np.flatnonzero(span != layout.image_token_id)
        if wrong.size:
            pos = ref.offset + int(wrong[0])
            raise InvalidRolloutError(
                f"token {int(tokens[pos])} at position {pos} inside the span is not the image "
                f"placeholder {layout.image_token_id}",
                sample_id=sid,
                image_index=index,
            )
        in_span[ref.offset : ref.offset + ref.length] = True
        placeholder_ids.add(layout.image_token_id)
        end_of_previous = ref.offset + ref.length
    if placeholder_ids:
        stray = np.flatnonzero(~in_span & np.isin(tokens, sorted(placeholder_ids)))
        if stray.size:
            pos = int(stray[0])
            raise InvalidRolloutError(
                f"image placeholder token {int(tokens[pos])} at position {pos} lies outside "
                "every image span",
                sample_id=sid,
            )


def _check_lengths(rollout: Rollout, n: int) -> None:
    sid = rollout.sample_id
    if len(rollout.loss_mask) != n:
        raise InvalidRolloutError(
            f"loss_mask has {len(rollout.loss_mask)} entries for {n} tokens", sample_id=sid
        )
    if rollout.logprobs is not None and len(rollout.logprobs) != n:
        raise InvalidRolloutError(
            f"logprobs has {len(rollout.logprobs)} entries for {n} tokens", sample_id=sid
        )
    if rollout.prompt_len > n:
        raise InvalidRolloutError(
            f"prompt_len {rollout.prompt_len} exceeds the {n} tokens", sample_id=sid
        )


def _layout_of(
    fingerprint: str, family: str, layouts: LayoutLookup, sid: str, index: int
) -> Layout:
    layout = layouts(fingerprint)
    if layout is None:
        raise InvalidRolloutError(
            f"unknown layout fingerprint {fingerprint!r}: build the family adapter "
            "(mmstore.adapter_for) in this process or pass adapter= to the writer",
            sample_id=sid,
            image_index=index,
        )
    if layout.family != family:
        raise InvalidRolloutError(
            f"ref says family {family!r} but fingerprint {fingerprint!r} is {layout.family!r}",
            sample_id=sid,
            image_index=index,
        )
    return layout


def truncation_point(
    offsets: Sequence[int], lengths: Sequence[int], n_tokens: int, max_len: int
) -> tuple[int, int]:
    """Where to cut ``n_tokens`` at ``max_len`` without splitting a span.

    Returns ``(cut, images_kept)``: tokens ``[:cut]`` and the first ``images_kept`` images.
    An image straddling ``max_len`` moves the cut to its start.
    """
    if max_len <= 0:
        raise InvalidArgumentError(f"max_len must be positive, got {max_len}")
    cut = min(n_tokens, max_len)
    kept = 0
    for offset, length in zip(offsets, lengths, strict=True):
        if offset + length <= cut:
            kept += 1
        else:
            cut = min(cut, offset)
            break
    return cut, kept


def truncate(rollout: Rollout, max_len: int) -> Rollout:
    """A prefix of at most ``max_len`` tokens holding only whole images."""
    offsets = [ref.offset for ref in rollout.images]
    lengths = [ref.length for ref in rollout.images]
    cut, kept = truncation_point(offsets, lengths, len(rollout.tokens), max_len)
    if cut == len(rollout.tokens):
        return rollout
    if cut == 0:
        raise InvalidRolloutError(
            f"truncation to {max_len} tokens leaves nothing: the first image spans "
            f"[{offsets[0]}, {offsets[0] + lengths[0]})",
            sample_id=rollout.sample_id,
            image_index=0,
        )
    return rollout.model_copy(
        update={
            "tokens": rollout.tokens[:cut],
            "loss_mask": rollout.loss_mask[:cut],
            "logprobs": None if rollout.logprobs is None else rollout.logprobs[:cut],
            "prompt_len": min(rollout.prompt_len, cut),
            "images": rollout.images[:kept],
        }
    )
