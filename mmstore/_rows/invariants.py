"""Invariants a rollout row must hold before it is committed, and span-safe truncation.

Pure functions: they read a row and the layouts of its images, and raise
:class:`InvalidRolloutError` naming the sample and the image index at the first violation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from mmstore._families import (
    Family,
    Layout,
    VideoFamily,
    expansion_array,
    family_for_layout,
    is_video_layout,
    layout_for_fingerprint,
    video_family_for_layout,
)
from mmstore._format.columns import Column
from mmstore._format.models import Rollout, VideoRef, list_array
from mmstore.errors import ImageSizeError, InvalidArgumentError, InvalidRolloutError

LayoutLookup = Callable[[str], "Layout | None"]


def check_rollout(
    rollout: Rollout,
    layouts: LayoutLookup = layout_for_fingerprint,
    *,
    image_token_ids: Iterable[int] = (),
    video: VideoFamily | None = None,
) -> None:
    """Refuse a row whose masks, spans or placeholder tokens are inconsistent.

    ``layouts`` maps a ref's fingerprint to its :class:`Layout`. Each span must hold exactly
    its family's expansion of that image. ``image_token_ids`` are image tokens that must not
    appear outside spans even in rows without images (the writer passes those of the
    families it knows); the special tokens of every family a row uses are added. ``video``:
    a video half bound to its tokenizer (the writer's adapter's), which checks the spans of
    its fingerprint token for token, timestamps included; a layout alone checks their
    structure (:meth:`VideoFamily.check_span`).
    """
    sid = rollout.sample_id
    _check_lengths(rollout, len(rollout.tokens))
    refs = rollout.images
    tokens = list_array(rollout, "tokens")  # the int32 array validation made; the writer's too
    assert tokens is not None  # a required field

    def family_of(index: int) -> Family:
        ref = refs[index]
        return _family_of(ref.layout_fingerprint, ref.family, layouts, sid, index)

    try:
        check_spans(
            tokens,
            [r.offset for r in refs],
            [r.length for r in refs],
            [r.width for r in refs],
            [r.height for r in refs],
            family_of,
            image_token_ids,
            exempt=[(v.offset, v.length) for v in rollout.videos],
        )
        if rollout.videos:
            check_video_spans(
                tokens,
                rollout.videos,
                lambda i: _video_family_of(rollout.videos[i], layouts, sid, i, video),
                [(r.offset, r.length) for r in refs],
            )
    except InvalidRolloutError as exc:
        raise exc.with_context(sample_id=sid) from None


def check_video_spans(
    tokens: np.ndarray,
    refs: Sequence[VideoRef],
    family_of: Callable[[int], VideoFamily],
    image_spans: Sequence[tuple[int, int]],
) -> None:
    """The span rule for videos, shared by the writer and the reader.

    Video spans are sorted, inside ``tokens``, overlap no other span (image or video), and
    each holds its family's layout of the ref's frames (:meth:`VideoFamily.check_span`:
    exactly its expansion, or, where a layout-only family cannot tokenize the span's
    timestamp text, its structure); no video-only token occurs outside them. Raises
    :class:`InvalidRolloutError` with the video index.
    """
    n = len(tokens)
    taken = sorted((int(o), int(o) + int(length)) for o, length in image_spans)
    special: set[int] = set()
    end_of_previous = 0
    for index, ref in enumerate(refs):
        offset, length = ref.offset, ref.length
        span = f"video span [{offset}, {offset + length})"
        if offset < end_of_previous:
            raise InvalidRolloutError(
                f"{span} is not after the previous video's end at {end_of_previous}",
                video_index=index,
            )
        if offset + length > n:
            raise InvalidRolloutError(f"{span} is outside the {n} tokens", video_index=index)
        # A ref built without validation (model_construct) reaches the writer unchecked.
        frames = np.asarray(ref.frames, dtype=np.int64)
        if (
            not frames.size
            or frames[0] < 0
            or frames[-1] >= ref.num_frames
            or (np.diff(frames) <= 0).any()
        ):
            raise InvalidRolloutError(
                f"video frames must be strictly increasing and lie within the clip's "
                f"{ref.num_frames} frames",
                video_index=index,
            )
        for start, end in taken:
            if start < offset + length and offset < end:
                raise InvalidRolloutError(
                    f"{span} overlaps the image span [{start}, {end})", video_index=index
                )
        family = family_of(index)
        problem = family.check_span(tokens[offset : offset + length], ref)
        if problem is not None:
            raise InvalidRolloutError(f"{span} {problem}", video_index=index)
        special.update(family.special_token_ids)
        end_of_previous = offset + length
    ids = sorted(special)
    inside = sum(_count(tokens[r.offset : r.offset + r.length], ids) for r in refs)
    if _count(tokens, ids) != inside:
        is_special = np.isin(tokens, ids)
        for r in refs:
            is_special[r.offset : r.offset + r.length] = False
        pos = int(np.flatnonzero(is_special)[0])
        raise InvalidRolloutError(
            f"video placeholder token {int(tokens[pos])} at position {pos} lies outside "
            "every video span"
        )


def _video_family_of(
    ref: VideoRef, layouts: LayoutLookup, sid: str, index: int, bound: VideoFamily | None
) -> VideoFamily:
    """The ref's video family: ``bound`` (tokenizer and all) when it laid the ref out, else
    a layout-only one. The lookup runs either way: the writer records the layouts it sees."""
    layout = layouts(ref.layout_fingerprint)
    if layout is None or not is_video_layout(layout):
        raise InvalidRolloutError(
            f"unknown video layout fingerprint {ref.layout_fingerprint!r}: build the adapter "
            "(mmstore.adapter_for(full processor).video) in this process or pass adapter=",
            sample_id=sid,
            video_index=index,
        )
    if layout.family != ref.family:
        raise InvalidRolloutError(
            f"video ref says family {ref.family!r} but its fingerprint is {layout.family!r}",
            sample_id=sid,
            video_index=index,
        )
    if bound is not None and bound.fingerprint == ref.layout_fingerprint:
        return bound
    return video_family_for_layout(layout)


def check_spans(
    tokens: np.ndarray,
    offsets: Sequence[int],
    lengths: Sequence[int],
    widths: Sequence[int],
    heights: Sequence[int],
    family_of: Callable[[int], Family],
    image_token_ids: Iterable[int] = (),
    *,
    exempt: Sequence[tuple[int, int]] = (),
) -> None:
    """The span rule, shared by the writer and the reader (one home for it).

    Spans are sorted, non-overlapping and inside ``tokens``; each holds exactly its family's
    expansion of its image's size (``family_of(i)`` gives image ``i``'s family, or raises);
    no image token of those families (nor ``image_token_ids``) occurs outside a span. Raises
    :class:`InvalidRolloutError` with the image index at the first violation, images in
    order; the caller adds where the row came from. ``exempt``: ``(offset, length)`` of
    video spans, whose tokens (a family may lay video frames out with its image token) are
    left to :func:`check_video_spans`.
    """
    if exempt:
        tokens = tokens.copy()
        for offset, length in exempt:
            tokens[int(offset) : int(offset) + int(length)] = -1
    if not len(offsets):  # text only: no image token may occur at all
        ids = list(image_token_ids)
        if ids and _count(tokens, ids):
            _check_no_stray(tokens, (), (), ids, 0)
        return
    n = len(tokens)
    special = set(image_token_ids)
    # What the spans hold: they equal their expansions once checked.
    expansions: list[np.ndarray] = []
    previous: Family | None = None
    end_of_previous = 0
    for index in range(len(offsets)):
        offset, length = int(offsets[index]), int(lengths[index])
        span = f"span [{offset}, {offset + length})"
        if offset < 0 or length <= 0:
            raise InvalidRolloutError(f"{span} is not a span of tokens", image_index=index)
        if index and offset < int(offsets[index - 1]):
            raise InvalidRolloutError("images are not sorted by offset", image_index=index)
        if offset < end_of_previous:
            raise InvalidRolloutError(
                f"{span} overlaps the previous image ending at {end_of_previous}",
                image_index=index,
            )
        if offset + length > n:
            raise InvalidRolloutError(f"{span} is outside the {n} tokens", image_index=index)
        family = family_of(index)
        expected = _expansion(family, int(widths[index]), int(heights[index]), index)
        if length != len(expected):
            raise InvalidRolloutError(
                f"span length {length} != {len(expected)} tokens that {family.family} lays "
                f"out for a {widths[index]}x{heights[index]} image",
                image_index=index,
            )
        wrong = np.flatnonzero(tokens[offset : offset + length] != expected)
        if wrong.size:
            pos = offset + int(wrong[0])
            raise InvalidRolloutError(
                f"token {int(tokens[pos])} at position {pos} inside the span is not the "
                f"{family.family} expansion's {int(expected[wrong[0]])}",
                image_index=index,
            )
        if previous is not None and offset == end_of_previous:
            _check_apart(expansions[-1], previous, expected, family, index)
        special.update(family.special_token_ids)
        expansions.append(expected)
        previous, end_of_previous = family, offset + length
    if special:
        ids = sorted(special)
        inside = sum(_count(e, ids) for e in expansions)
        _check_no_stray(tokens, offsets, lengths, ids, inside)


def _check_apart(
    before: np.ndarray, previous: Family, expected: np.ndarray, family: Family, index: int
) -> None:
    """Refuse two touching spans whose image features would touch: one rule for every family.

    A model finds an image's features as a run of its feature token (Qwen-VL's and GLM-4V's
    ``get_rope_index`` bind the i-th run to the i-th grid); spans of one repeated token
    (Qwen-VL, GLM-4V, Kimi-K2.5) that touch read as one image, and the packed loader's
    positions, the model's own and vLLM's would disagree. A family whose expansion closes on
    another token (Pixtral's ``[IMG_END]``, Gemma 3's "\\n\\n" after ``<end_of_image>``) keeps two
    touching images apart, as its chat template writes them: accepted (the contract suite
    trains such rows packed and alone).
    """
    if int(before[-1]) == previous.feature_token_id and int(expected[0]) == family.feature_token_id:
        raise InvalidRolloutError(
            f"image {index} starts right where image {index - 1} ends: the {family.family} "
            "model would read their image tokens as one image; keep text between them (the "
            "chat template's tokens around each image)",
            image_index=index,
        )


def _expansion(family: Family, width: int, height: int, index: int) -> np.ndarray:
    try:
        return expansion_array(family, width, height)
    except ImageSizeError as exc:  # e.g. an aspect ratio the family cannot lay out
        raise InvalidRolloutError(exc.message, image_index=index) from None


def _count(tokens: np.ndarray, ids: list[int]) -> int:
    # A family has one or two special ids: one comparison each beats np.isin's sort 10x.
    return sum(int(np.count_nonzero(tokens == t)) for t in ids)


def _check_no_stray(
    tokens: np.ndarray,
    offsets: Sequence[int],
    lengths: Sequence[int],
    ids: list[int],
    inside: int,
) -> None:
    # Counting is enough: every special token must be one the spans account for.
    if _count(tokens, ids) == inside:
        return
    is_special = np.isin(tokens, ids)
    for offset, length in zip(offsets, lengths, strict=True):
        is_special[int(offset) : int(offset) + int(length)] = False
    pos = int(np.flatnonzero(is_special)[0])
    raise InvalidRolloutError(
        f"image placeholder token {int(tokens[pos])} at position {pos} lies outside "
        "every image span"
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


def _family_of(
    fingerprint: str, family: str, layouts: LayoutLookup, sid: str, index: int
) -> Family:
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
    return family_for_layout(layout)


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


def truncate(
    rollout: Rollout, max_len: int, *, columns: Mapping[str, Column] | None = None
) -> Rollout:
    """A prefix of at most ``max_len`` tokens holding only whole images; the per-token
    values of its extra columns cut with the tokens. ``columns``: the run's declaration
    (``writer.columns``), needed for a row with column values unless the row was read
    back from a store (it knows its own)."""
    declared = _declaration(rollout, columns)
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
            "columns": {
                name: value[:cut] if declared[name].per == "token" else value
                for name, value in rollout.columns.items()
            },
        }
    )


def _declaration(rollout: Rollout, columns: Mapping[str, Column] | None) -> dict[str, Column]:
    known = dict(columns if columns is not None else rollout.declared_columns)
    missing = sorted(rollout.columns.keys() - known.keys())
    if missing:
        raise InvalidArgumentError(
            f"truncate does not know whether the columns {missing} hold a value per token: "
            "pass columns= (the run's declaration, writer.columns)"
        )
    return known
