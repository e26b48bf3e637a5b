"""Samples -> one right-padded batch, in the tensors the sample's model family takes.

Its keys, their dtypes and shapes are declared in :mod:`.batch_keys` (the per-sample ones
built there, by :func:`.batch_keys.sample_fields`, for packed micro-batches too). Also what
every family's batch shares, whatever the family: the keys its model takes
(:func:`model_input_names`) and its per-token types (:func:`token_types`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmstore._families import Family, expansion_array, video_half
from mmstore._loading.batch_keys import sample_fields
from mmstore._loading.device import collate_images
from mmstore._loading.distinct import VIDEO_INDEX_KEY, VIDEO_ROWS_KEY, distinct, rows
from mmstore._loading.extra import padded_columns
from mmstore._loading.materialize import Materialized
from mmstore._loading.stack import concat
from mmstore._tensors import cast_floats
from mmstore.errors import InvalidArgumentError


def model_input_names(family: Family) -> tuple[str, ...]:
    """The padded batch's keys that the family's transformers model takes (video inputs
    too where the adapter's processor has a video half; None in a batch without videos)."""
    extra = (family.token_type_input,) if family.token_type_input else ()
    video = video_half(family)
    videos = video.input_names if video is not None else ()
    return ("input_ids", "attention_mask", *family.image_inputs, *videos, *extra)


def token_types(family: Family, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token type tensors the family's model takes, from the ids alone (1 on the tokens
    that receive image features, the video half's type on video features, as its
    :meth:`~mmstore._families.VideoFamily.mark_token_types` says); none for a family
    without them."""
    if family.token_type_input is None:
        return {}
    types = (input_ids == family.feature_token_id).to(torch.int32)
    video = video_half(family)
    if video is not None:
        video.mark_token_types(input_ids, types)
    return {family.token_type_input: types}


def check_media_mix(
    family: Family, images: Sequence[Any], videos: Sequence[Any], sample_ids: Sequence[str]
) -> None:
    """Refuse a batch holding images and videos for a family whose model cannot take one
    (GLM-4.1V), naming its samples: the model would fail on it, less clearly."""
    video = video_half(family) if images and videos else None
    if video is not None and not video.batches_with_images:
        raise InvalidArgumentError(
            f"{family.family}'s model cannot take images and videos in one batch (transformers "
            f"counts its image token inside videos as both): samples {list(sample_ids)}; "
            "write image and video rows to different runs, or batch them apart"
        )


def collate_videos(
    family: Family, videos: Sequence[dict[str, torch.Tensor]], *, distinct_videos: bool = False
) -> dict[str, Any]:
    """The batch's video tensors, concatenated in order (None for each without videos).

    ``distinct_videos``: each processed clip once, with ``video_index`` and ``video_rows``
    (as ``distinct_images``, :mod:`.distinct`). In a worker they go straight into shared
    memory, a buffer the trainer is done with where there is one (:func:`.stack.concat`):
    a 10 s clip is 30 MB of bf16, and a batch concatenated elsewhere is copied into fresh
    shared memory again when the worker sends it."""
    video = video_half(family)
    if video is None:
        return {}
    if not videos:
        return dict.fromkeys(video.input_names)
    extra: dict[str, Any] = {}
    if distinct_videos:
        videos, extra[VIDEO_INDEX_KEY] = distinct(videos)
        extra[VIDEO_ROWS_KEY] = rows(video.input_names, videos)
    return {key: concat([v[key] for v in videos]) for key in video.input_names} | extra


def collate(
    samples: Sequence[Materialized],
    family: Family,
    *,
    pad_token_id: int | None = None,
    dummy_image: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    distinct_images: bool = False,
) -> dict[str, Any]:
    """Pad and stack ``samples``; image tensors batched as ``family`` says. The keys are
    :func:`.batch_keys.built_keys` ``(family, "padded")``.

    With ``dummy_image``, a batch without any image gets one tiny zero image appended after
    the first sample's tokens, attended (so position ids see it) but never in the loss, so
    every FSDP rank runs the vision tower. ``distinct_images``: see :mod:`.distinct`.
    """
    samples = list(samples)
    check_media_mix(
        family,
        [i for s in samples for i in s.images],
        [v for s in samples for v in s.videos],
        [s.sample_id for s in samples],
    )
    pad = family.layout.pad_token_id if pad_token_id is None else pad_token_id
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
        **token_types(family, input_ids),
        **collate_images(family, images, distinct_images=distinct_images),
        **collate_videos(
            family, [v for s in samples for v in s.videos], distinct_videos=distinct_images
        ),
        "logprobs": logprobs,
        **sample_fields(samples),
        **padded_columns(samples, width),
        "dummy_image": extra is not None,
    }


def dummy(family: Family, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The family's smallest image as zeros: its expansion and its tensors (train dtype)."""
    width, height = family.dummy_size
    tokens = torch.tensor(expansion_array(family, width, height), dtype=torch.int64)
    return tokens, cast_floats(family.placeholder(width, height), dtype)
