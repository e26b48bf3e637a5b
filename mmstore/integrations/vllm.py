"""vLLM (and SGLang) requests from stored rollouts; a verified resolver for wire refs.

Importable without vLLM: everything here builds plain dicts and never imports ``vllm``.

Prompt format — vLLM >= 0.19.1 (the first release that installs beside transformers 5,
which mmstore requires; pinned in the ``vllm`` extra). The keys follow
``vllm.inputs.TokensPrompt`` — ``prompt_token_ids``, ``multi_modal_data``,
``multi_modal_uuids`` (the last documented since v0.10.2, "Stable UUIDs for Caching") — and
are unchanged from v0.10.2 through current main.

Caching: vLLM uses a uuid as the item's cache key as given (``_hash_mm_items``) unless the
request also carries ``mm_processor_kwargs``, in which case it hashes the uuid with them.

Placeholders: vLLM expands image placeholders in *token* prompts itself. In
``vllm/multimodal/processing`` (read at v0.12 and in main's ``processing/processor.py``:
``BaseMultiModalProcessor._apply_hf_processor_main``) a
token prompt goes through ``_apply_hf_processor_tokens_only`` (identity) and comes back
with ``is_update_applied=False``, so ``_apply_prompt_updates`` runs; Qwen2-VL's
``_get_prompt_updates`` is ``PromptReplacement(target=[<|image_pad|>], replacement=
[<|image_pad|>] * (grid_thw.prod() // merge_size**2))``, applied to the first unmatched pad
for each image. Handed an already-expanded span, vLLM would expand its first pad again and
leave the rest as stray text tokens: silently wrong. So :func:`to_vllm_prompt` collapses
each stored span back to one ``<|image_pad|>``; vLLM re-expands it to exactly the stored
span when its processor's layout equals the store's (check ``RequestOutput.
prompt_token_ids`` against ``rollout.tokens``).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from mmstore._families import (
    Family,
    VideoFamily,
    expansion_array,
    family_for_layout,
    is_video_layout,
    layout_for_fingerprint,
    video_family_for_layout,
)
from mmstore._format.media import upright_bytes
from mmstore._format.models import MAX_CLIP_FRAMES, ImageRef, MediaRef, Rollout, VideoRef
from mmstore._format.video import clip_mismatch, decode_frames, probe_video
from mmstore._rows.check import MAX_ROW_IMAGES, MAX_ROW_TOKENS
from mmstore._rows.invariants import check_video_spans
from mmstore._rows.store import Store
from mmstore.errors import InvalidArgumentError, InvalidRolloutError, MmstoreError, RefRefused
from mmstore.integrations._generation import Completion, completion_rollouts, topk_columns
from mmstore.integrations._resolver import (
    DEFAULT_CACHE_BYTES,
    Materialized,
    RefResolver,
    resolve_wire_refs,
    video_uuid,
)

T = TypeVar("T")
R = TypeVar("R", ImageRef, VideoRef)
Size = tuple[int, int]

__all__ = [
    "rollouts",
    "topk_columns",
    "DEFAULT_CACHE_BYTES",
    "Materialized",
    "RefRefused",
    "RefResolver",
    "resolve_wire_refs",
    "to_prefill_request",
    "to_vllm_prefill",
    "to_vllm_prompt",
    "video_uuid",
]


def to_vllm_prompt(store: Store, rollout: Rollout, upto: int | None = None) -> dict[str, Any]:
    """vLLM's token prompt for ``rollout.tokens[:upto]`` with its whole images and videos.

    ``{"prompt_token_ids": [...], "multi_modal_data": {"image": [PIL RGB, ...]},
    "multi_modal_uuids": {"image": [content hash, ...]}}``, one image and one uuid per span in
    span order (the key and item are the family's: Kimi-K2.5 takes ``"vision_chunk"``
    items); the two multimodal keys are absent when the prefix holds no image. Each span
    becomes one placeholder token (vLLM expands it, see the module notes). Images are decoded
    from hash-verified bytes, upright (EXIF orientation applied, no tag left for vLLM to apply
    again: the pixels the trainer gets, whichever vLLM); the content hash as uuid lets vLLM's
    multimodal cache skip an image it has processed. ``upto`` cutting inside a span is an
    :class:`InvalidRolloutError`.

    Videos go under ``"video"`` as vLLM takes pre-sampled clips: ``(frames, metadata)``, the
    ref's frames (uint8 ``[T, H, W, 3]``, decoded from the hash-verified clip) and a metadata
    dict naming them (``frames_indices``, ``fps``, ``total_num_frames``, ``duration``,
    ``do_sample_frames=False``: vLLM must not sample again); each video's uuid is
    :func:`video_uuid` (its clip's hash and its frames), and its span becomes the one video
    token the chat template emits.
    """
    tokens, refs = _prefix(rollout, upto)
    videos = _inside(rollout, rollout.videos, len(tokens), "video")
    prompt: dict[str, Any] = {"prompt_token_ids": _collapse(tokens, refs, rollout, videos)}
    data: dict[str, list[Any]] = {}
    uuids: dict[str, list[str]] = {}
    for i, ref in enumerate(refs):
        # The family names vLLM's key and item (Kimi-K2.5: "vision_chunk" dicts).
        family = _family(ref, rollout.sample_id, i)
        image = _verified(store, rollout, i, ref, _decode)
        data.setdefault(family.vllm_modality, []).append(family.vllm_item(image, ref.hash))
        uuids.setdefault(family.vllm_modality, []).append(ref.hash)
    for i, video in enumerate(videos):
        data.setdefault("video", []).append(_video_item(store, rollout, i, video))
        uuids.setdefault("video", []).append(video_uuid(video))
    if data:
        prompt["multi_modal_data"], prompt["multi_modal_uuids"] = data, uuids
    return prompt


def to_prefill_request(
    store: Store, rollout: Rollout, *, temperature: float = 1.0
) -> dict[str, Any]:
    """SGLang ``/generate`` payload that recomputes the logprobs of a stored rollout.

    Mirrors miles (``miles/rollout/generate_utils/prefill_logprobs.py``): ``max_new_tokens=0``,
    ``return_logprob``, ``logprob_start_len = prompt_len - 1`` so the returned
    ``input_token_logprobs`` tail covers every response token. The stored tokens are already
    expanded, so the request also sets ``mm_token_expansion_start_len = len(tokens)``: SGLang
    leaves that prefix as is and only finds the images' offsets in it
    (``expand_token_placeholders``: "Unchanged prefix length"); without it SGLang expands each
    placeholder of the expanded sequence again. Images travel as ``data:`` URLs of their
    verified stored bytes. Text-only rows omit the multimodal fields (older SGLang servers
    refuse the unknown field).
    """
    n, prompt_len = len(rollout.tokens), rollout.prompt_len
    if not 0 < prompt_len < n:
        raise InvalidRolloutError(
            f"prefill scoring needs a prompt and a response; prompt_len={prompt_len} of {n}",
            sample_id=rollout.sample_id,
        )
    tokens, refs = _prefix(rollout, None)
    _collapse(tokens, refs, rollout)  # the same span checks SGLang's offset search relies on
    payload: dict[str, Any] = {
        "input_ids": list(tokens),
        "sampling_params": {
            "max_new_tokens": 0,
            "temperature": temperature,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": prompt_len - 1,
    }
    if refs:
        payload["image_data"] = [
            _verified(store, rollout, i, ref, _data_url) for i, ref in enumerate(refs)
        ]
        payload["mm_token_expansion_start_len"] = n
    return payload


def to_vllm_prefill(store: Store, rollout: Rollout) -> dict[str, Any]:
    """vLLM's equivalent of :func:`to_prefill_request`: ``{"prompt", "sampling_params"}``.

    vLLM has no "already expanded" flag: the prompt carries one placeholder per image and vLLM
    re-expands it (see the module notes). Pass ``SamplingParams(**sampling_params)``; then
    ``output.prompt_token_ids == rollout.tokens`` and ``output.prompt_logprobs[prompt_len:]``
    are the response tokens' logprobs.
    """
    return {
        "prompt": to_vllm_prompt(store, rollout),
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False},
    }


# -- helpers -----------------------------------------------------------------------------


def _prefix(rollout: Rollout, upto: int | None) -> tuple[list[int], list[ImageRef]]:
    """Tokens ``[:upto]`` and the images lying wholly inside them."""
    _check_bounds(rollout)
    n = len(rollout.tokens)
    cut = n if upto is None else upto
    if isinstance(cut, bool) or not isinstance(cut, int) or not 0 <= cut <= n:
        raise InvalidRolloutError(
            f"upto={upto!r} must be an int in [0, {n}]", sample_id=rollout.sample_id
        )
    return rollout.tokens[:cut], _inside(rollout, rollout.images, cut, "image")


def _inside(rollout: Rollout, refs: Sequence[R], cut: int, kind: str) -> list[R]:
    """The ``refs`` (images or videos) lying wholly inside ``tokens[:cut]``; a cut inside
    one is refused, naming it."""
    kept = []
    for index, ref in enumerate(refs):
        end = ref.offset + ref.length
        if end <= cut:
            kept.append(ref)
        elif ref.offset < cut:
            raise InvalidRolloutError(
                f"upto={cut} cuts {kind} span [{ref.offset}, {end}); cut before or after it",
                sample_id=rollout.sample_id,
                **{f"{kind}_index": index},
            )
    return kept


def _check_bounds(rollout: Rollout) -> None:
    """The loader's caps on a row (:data:`MAX_ROW_TOKENS`, :data:`MAX_ROW_IMAGES`), before a
    forged row's tokens are copied or its images decoded."""
    n, images = len(rollout.tokens), len(rollout.images)
    if n > MAX_ROW_TOKENS:
        raise InvalidRolloutError(
            f"{n} tokens exceed the {MAX_ROW_TOKENS} any row may hold (a forged row?)",
            sample_id=rollout.sample_id,
        )
    if images > min(n, MAX_ROW_IMAGES):
        raise InvalidRolloutError(
            f"{images} images for {n} tokens: more than the tokens (or {MAX_ROW_IMAGES}) can hold",
            sample_id=rollout.sample_id,
        )


def _video_family(ref: VideoRef, sid: str, index: int) -> VideoFamily:
    layout = layout_for_fingerprint(ref.layout_fingerprint)
    if layout is None or not is_video_layout(layout) or layout.family != ref.family:
        raise InvalidRolloutError(
            f"unknown video layout {ref.layout_fingerprint!r} ({ref.family}): build its "
            "adapter's video half (mmstore.adapter_for(processor).video) in this process first",
            sample_id=sid,
            video_index=index,
        )
    return video_family_for_layout(layout)


def _video_item(
    store: Store, rollout: Rollout, index: int, ref: VideoRef
) -> tuple[np.ndarray, dict[str, Any]]:
    """One video as vLLM takes a pre-sampled clip: its frames and their metadata."""
    limit = store.max_image_pixels
    try:
        data = store.read_media(ref.uri, ref.hash)
        info = probe_video(data, max_pixels=limit, max_frames=MAX_CLIP_FRAMES, where=ref.uri)
        frames = decode_frames(data, ref.frames, max_pixels=limit, where=ref.uri)
    except MmstoreError as exc:
        raise exc.with_context(sample_id=rollout.sample_id, video_index=index) from exc
    # The metadata vLLM lays the span out with comes from the ref: it must be the clip's.
    if (problem := clip_mismatch(info, ref)) is not None:
        raise InvalidRolloutError(
            problem, sample_id=rollout.sample_id, video_index=index, uri=ref.uri
        )
    metadata = {
        "total_num_frames": ref.num_frames,
        "fps": ref.fps,
        "duration": ref.num_frames / ref.fps,
        "frames_indices": list(ref.frames),
        "video_backend": "pyav",
        "do_sample_frames": False,
    }
    return frames, metadata


def _collapse(
    tokens: Sequence[int],
    refs: Sequence[ImageRef],
    rollout: Rollout,
    videos: Sequence[VideoRef] = (),
) -> list[int]:
    """Each span -> the one image (video) token its family's chat template emits (vLLM
    expands it back); refuse spans an engine would misread."""
    sid = rollout.sample_id
    ids = np.asarray(tokens, dtype=np.int64)
    if videos:  # the writer's video span rule, against the layouts of this process
        check_video_spans(
            ids,
            videos,
            lambda i: _video_family(videos[i], sid, i),
            [(r.offset, r.length) for r in refs],
        )
        ids = ids.copy()
        for video in videos:  # their tokens are the videos' own: not stray image tokens
            ids[video.offset : video.offset + video.length] = -1
    in_span = np.zeros(len(ids), dtype=bool)
    special: set[int] = set()
    out: list[int] = []
    cursor = 0
    spans: list[tuple[int, ImageRef | VideoRef]] = [*enumerate(refs)]
    if videos:  # (checked apart from the images above) merged in, images kept in their order
        for number, clip in enumerate(videos):
            at = next((k for k, (_, r) in enumerate(spans) if r.offset > clip.offset), None)
            spans.insert(len(spans) if at is None else at, (number, clip))
    for index, ref in spans:
        if isinstance(ref, VideoRef):
            out.extend(tokens[cursor : ref.offset])
            out.append(_video_family(ref, sid, index).video_token_id)
            cursor = ref.offset + ref.length
            continue
        family = _family(ref, sid, index)
        end = ref.offset + ref.length
        if ref.offset < cursor:
            raise InvalidRolloutError(
                f"span [{ref.offset}, {end}) overlaps or precedes the previous image",
                sample_id=sid,
                image_index=index,
            )
        expected = expansion_array(family, ref.width, ref.height)
        span = ids[ref.offset : end]
        if span.shape != expected.shape or (span != expected).any():
            raise InvalidRolloutError(
                f"span [{ref.offset}, {end}) is not the {family.family} expansion of a "
                f"{ref.width}x{ref.height} image",
                sample_id=sid,
                image_index=index,
            )
        out.extend(tokens[cursor : ref.offset])
        out.append(family.image_token_id)
        in_span[ref.offset : end] = True
        special |= family.special_token_ids
        cursor = end
    out.extend(tokens[cursor:])
    # The engine binds images to image tokens in order: one outside a span would take the
    # next image's place.
    stray = np.flatnonzero(~in_span & np.isin(ids, sorted(special)))
    if stray.size:
        raise InvalidRolloutError(
            f"image token {int(ids[stray[0]])} at position {int(stray[0])} lies outside "
            "every image span",
            sample_id=sid,
        )
    return out


def _family(ref: ImageRef, sid: str, index: int) -> Family:
    """The family that laid ``ref`` out: an adapter built in this process must know it."""
    layout = layout_for_fingerprint(ref.layout_fingerprint)
    if layout is None or layout.family != ref.family:
        raise InvalidRolloutError(
            f"unknown layout {ref.layout_fingerprint!r} ({ref.family}): build its adapter "
            "(mmstore.adapter_for) in this process first",
            sample_id=sid,
            image_index=index,
        )
    return family_for_layout(layout)


def _decode(store: Store, ref: ImageRef) -> tuple[Image.Image, Size]:
    image = store.open_image(ref.uri, ref.hash)
    return image, image.size


def _data_url(store: Store, ref: ImageRef) -> tuple[str, Size]:
    # The upright image's bytes: a phone photo's own bytes would show an engine that ignores
    # EXIF orientation (SGLang) other pixels than the trainer and vLLM see.
    data = store.read_media(ref.uri, ref.hash)
    data, fmt, width, height = upright_bytes(data, max_pixels=store.max_image_pixels, where=ref.uri)
    mime = Image.MIME.get(fmt, "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}", (width, height)


def _verified(
    store: Store,
    rollout: Rollout,
    index: int,
    ref: ImageRef,
    load: Callable[[Store, ImageRef], tuple[T, Size]],
) -> T:
    """``load(store, ref)``'s value after checking the image has the size its span assumes;
    store errors re-raised with the sample and image index added."""
    try:
        value, size = load(store, ref)
    except MmstoreError as exc:
        raise exc.with_context(sample_id=rollout.sample_id, image_index=index) from exc
    if size != (ref.width, ref.height):
        raise InvalidRolloutError(
            f"image is {size[0]}x{size[1]} but the ref (and its span) says "
            f"{ref.width}x{ref.height}",
            sample_id=rollout.sample_id,
            image_index=index,
            uri=ref.uri,
        )
    return value


# -- generation outputs -> rows ----------------------------------------------------------


def rollouts(
    output: Any,
    adapter: Family,
    images: Sequence[MediaRef] = (),
    videos: Sequence[MediaRef] = (),
    *,
    group_id: str | None = None,
    sample_ids: Sequence[str] | None = None,
    policy_version: int | None = None,
    topk: int | None = None,
    frames: Sequence[Sequence[int]] | None = None,
    **fields: Any,
) -> list[Rollout]:
    """One :class:`Rollout` per completion of a vLLM ``RequestOutput`` (a GRPO group: the
    request's ``n`` completions). ``output.prompt_token_ids`` hold the prompt's media spans
    expanded (vLLM expands them), located for ``images``/``videos`` (the media of the
    prompt, in order, as the store holds them: ``store.put_image`` of what was sent) by
    :meth:`Family.locate`; each completion's ``token_ids`` are trained on, with the logprob
    vLLM gave each sampled token (``SamplingParams(logprobs=k)``; without, no logprobs).
    ``topk``: also the top-``topk`` ids and logprobs at each position, as the per-token
    columns ``topk_ids``/``topk_logprobs`` (declare them: ``columns=topk_columns(k)``).
    Other ``fields`` (``reward``, ``metadata``...) go to every row.

    Read from vLLM's documented shapes: ``CompletionOutput.token_ids`` and ``.logprobs``, a
    list (one per generated token) of mappings token id -> ``Logprob`` (``.logprob``,
    ``.rank``), holding the sampled token and the top-k by rank.
    """
    completions = [_completion(c, topk) for c in output.outputs]
    return completion_rollouts(
        adapter,
        list(output.prompt_token_ids),
        completions,
        images=images,
        videos=videos,
        frames=frames,
        sample_ids=sample_ids,
        group_id=group_id,
        policy_version=policy_version,
        **fields,
    )


def _completion(output: Any, topk: int | None) -> Completion:
    tokens = [int(t) for t in output.token_ids]
    positions = output.logprobs
    if positions is None:
        if topk:
            raise InvalidArgumentError(
                "topk= needs the completions' logprobs: sample with SamplingParams(logprobs=k)"
            )
        return Completion(tokens)
    positions = list(positions)
    if len(positions) != len(tokens):
        raise InvalidRolloutError(
            f"the completion has {len(tokens)} tokens and {len(positions)} logprob entries"
        )
    sampled = [float(p[t].logprob) for p, t in zip(positions, tokens, strict=True)]
    if not topk:
        return Completion(tokens, sampled)
    ids = np.zeros((len(tokens), topk), np.int32)
    values = np.full((len(tokens), topk), -np.inf, np.float32)
    for i, position in enumerate(positions):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:topk]
        if len(ranked) < topk:
            raise InvalidArgumentError(
                f"position {i} holds {len(ranked)} logprobs, fewer than topk={topk}: sample "
                f"with SamplingParams(logprobs={topk})"
            )
        ids[i] = [token for token, _ in ranked]
        values[i] = [lp.logprob for _, lp in ranked]
    return Completion(tokens, sampled, (ids, values))
