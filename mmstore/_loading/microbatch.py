"""Samples -> one packed micro-batch: ``[1, T]`` rows of several samples, each a segment.

A segment is exactly one sample's tokens, with its own position ids (the family's, from 0, as
if it ran alone) and its own ``cu_seqlens`` entry. Filler (a dummy image, or the token of a
rank's padding micro-batch) is a segment of its own, with its own ``sample_ids`` entry, zero
loss and ``is_filler`` set. M-RoPE families get a text row (0..len-1 per segment) before their
3 rows, ``[4, 1, T]``: transformers reads sample boundaries from that row (a position that
does not follow its predecessor by 1 starts a new sequence), for sdpa and eager masks alike.

Its keys, their dtypes and shapes are declared in :mod:`.batch_keys`; the per-sample ones are
built there (:func:`.batch_keys.sample_fields`), as for padded batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmstore._families import Family, video_half
from mmstore._loading.batch_keys import sample_fields
from mmstore._loading.collate import (
    check_media_mix,
    collate_videos,
    dummy,
    model_input_names,
    token_types,
)
from mmstore._loading.device import collate_images
from mmstore._loading.extra import packed_columns
from mmstore._loading.forest import (
    ATTENTION_BLOCKS,
    FOREST_INDEX,
    VISIBLE_UNTIL,
    build_forest,
    check_positions,
    image_blocks,
    token_keys,
)
from mmstore._loading.materialize import Materialized
from mmstore.errors import MmstoreError


def packed_input_names(family: Family) -> tuple[str, ...]:
    """What the family's model takes from a packed micro-batch: position ids, no padding mask,
    and ``use_cache=False``: transformers derives the per-sample block mask from the position
    ids only without a KV cache, and an eval-mode model builds one by default, silently letting
    packed samples attend to each other."""
    names = [name for name in model_input_names(family) if name != "attention_mask"]
    return (names[0], "position_ids", *names[1:], "use_cache")


def positions(
    family: Family, ids: torch.Tensor, images: Sequence[Any], videos: Sequence[Any] = ()
) -> torch.Tensor:
    """One segment's position ids: ``[1, L]`` (1-D RoPE) or ``[4, L]`` (text row + M-RoPE)."""
    rows = family.position_ids(ids, images, videos) if videos else family.position_ids(ids, images)
    if family.position_rows == 1:
        return rows.reshape(1, -1)
    text = torch.arange(ids.shape[-1], dtype=torch.int64)[None]
    return torch.cat([text, rows.to(torch.int64)])


def _positions(
    family: Family,
    ids: torch.Tensor,
    images: Sequence[Any],
    videos: Sequence[Any],
    where: dict[str, Any],
) -> torch.Tensor:
    """:func:`positions`, a family's refusal naming the sample (file, run, step, sample)."""
    try:
        return positions(family, ids, images, videos)
    except MmstoreError as exc:
        raise exc.with_context(**where) from None


def pack(
    samples: Sequence[Materialized],
    family: Family,
    *,
    add_dummy: bool,
    dtype: torch.dtype,
    pad_token_id: int | None = None,
    distinct_images: bool = False,
    prefix_sharing: bool = False,
) -> dict[str, Any]:
    """One micro-batch of ``samples`` (in order), plus a filler segment when needed. The keys
    are :func:`.batch_keys.built_keys` ``(family, "packed")``.

    ``add_dummy`` appends the family's zero dummy image as its own segment (another rank's
    micro-batch of this index has images). An empty micro-batch without one gets a single pad
    token, so every rank runs a forward pass.

    ``prefix_sharing``: the model inputs are the segments' prefix forest (:mod:`.forest`):
    each shared prefix once; what a loss reads stays laid out per segment.
    """
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]] = [
        (s.input_ids, s.loss_mask, s.logprobs, list(s.images)) for s in samples
    ]
    spans = [list(s.spans) for s in samples]
    if add_dummy and any(s.videos for s in samples):
        video = video_half(family)
        # Its videos run the vision tower already; a family whose model cannot take an
        # image beside them (GLM-4.1V) gets no dummy image.
        add_dummy = video is None or video.batches_with_images
    filler = add_dummy or not samples
    if add_dummy:
        tokens, tensors = dummy(family, dtype)
        segments.append((tokens, torch.zeros(len(tokens), dtype=torch.bool), None, [tensors]))
        spans.append([(0, len(tokens), "")])
    elif not samples:
        pad = family.layout.pad_token_id if pad_token_id is None else pad_token_id
        segments.append((torch.tensor([pad]), torch.zeros(1, dtype=torch.bool), None, []))
        spans.append([])
    lengths = [len(seg[0]) for seg in segments]
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    input_ids = torch.cat([seg[0] for seg in segments])[None]
    check_media_mix(
        family,
        [image for s in samples for image in s.images],
        [v for s in samples for v in s.videos],
        [s.sample_id for s in samples],
    )
    wheres = [s.where for s in samples] + [{}] * (len(segments) - len(samples))
    segment_videos = [list(s.videos) for s in samples] + [[]] * (len(segments) - len(samples))
    pos = torch.cat(
        [
            _positions(family, seg[0], seg[3], videos, where)
            for seg, videos, where in zip(segments, segment_videos, wheres, strict=True)
        ],
        dim=1,
    )
    images = [image for seg in segments for image in seg[3]]
    videos = [video for videos in segment_videos for video in videos]
    forest = unshared(family, input_ids, lengths)
    if prefix_sharing:
        media = [
            (seg[3], seg_videos) for seg, seg_videos in zip(segments, segment_videos, strict=True)
        ]
        input_ids, pos, images, videos, forest = share_prefixes(
            family, [seg[0] for seg in segments], spans, media, pos
        )
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": pos if family.position_rows == 1 else pos[:, None, :],
        "cu_seqlens": cu,
        "use_cache": False,
        "max_seqlen": max(lengths),
        "loss_mask": torch.cat([seg[1] for seg in segments])[None],
        **token_types(family, input_ids),
        **collate_images(family, images, distinct_images=distinct_images),
        **collate_videos(family, videos, distinct_videos=distinct_images),
        **forest,
        **sample_fields(samples, fillers=int(filler)),
        **packed_columns(samples, lengths[len(samples) :]),
        "num_real_tokens": sum(lengths[: len(samples)]),
        "dummy_image": add_dummy,
    }
    if samples and all(s.logprobs is not None for s in samples):
        batch["logprobs"] = torch.cat(
            [seg[2] if seg[2] is not None else torch.zeros(len(seg[0])) for seg in segments]
        )[None].to(torch.float32)
    return batch


def unshared(family: Family, input_ids: torch.Tensor, lengths: Sequence[int]) -> dict[str, Any]:
    """The forest keys of a micro-batch that shares nothing: each segment a path of its own
    (so :func:`mmstore.forest_attention_mask` gives its block-diagonal mask)."""
    ends = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return {
        FOREST_INDEX: torch.arange(int(ends[-1]), dtype=torch.int64),
        VISIBLE_UNTIL: torch.repeat_interleave(ends, torch.tensor(lengths)),
        ATTENTION_BLOCKS: _blocks(family, input_ids),
    }


def _blocks(family: Family, input_ids: torch.Tensor) -> torch.Tensor:
    if not family.images_attend_both_ways:
        return torch.zeros(input_ids.shape[-1], dtype=torch.int64)
    return image_blocks((input_ids == family.feature_token_id).to(torch.int64))


def share_prefixes(
    family: Family,
    ids: Sequence[torch.Tensor],
    spans: Sequence[Sequence[tuple[int, int, str]]],
    media: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any], dict[str, Any]]:
    """The prefix forest of segments ``ids`` (each with its media ``spans``, images then
    videos, its ``media``: (images, videos), and its ``positions``, ``[rows, T]`` for all):
    the forest's ``[1, N]`` ids, positions, images and videos in forest order, and its keys
    (:mod:`.forest`)."""
    numbers: dict[str, int] = {}
    built = build_forest([token_keys(t, s, numbers) for t, s in zip(ids, spans, strict=True)])
    source = torch.from_numpy(built.source)
    forest_ids = torch.cat(list(ids))[source][None]
    # Each image and video of the forest: the one whose span starts at a forest token, in
    # forest order (a shared span's first occurrence stands for all).
    starts: dict[int, tuple[bool, Any]] = {}
    offset = 0
    for segment, segment_spans, (images, videos) in zip(ids, spans, media, strict=True):
        for k, (start, _, _) in enumerate(segment_spans):
            is_image = k < len(images)
            starts[offset + start] = (is_image, images[k] if is_image else videos[k - len(images)])
        offset += len(segment)
    kept = [starts[t] for t in built.source.tolist() if t in starts]
    keys = {
        FOREST_INDEX: torch.from_numpy(built.index),
        VISIBLE_UNTIL: torch.from_numpy(built.visible_until),
        ATTENTION_BLOCKS: _blocks(family, forest_ids),
    }
    return (
        forest_ids,
        check_positions(positions, built),
        [item for is_image, item in kept if is_image],
        [item for is_image, item in kept if not is_image],
        keys,
    )
