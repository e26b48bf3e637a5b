"""The video contract every video family meets (one suite, every :class:`VideoCase` of
``tests/video_cases.py``; issue 32's "Must show").

- Layout: for every clip of the case (lengths, rates, sizes, odd aspect ratios) and its
  sampling (fps, a frame count, explicit frames, every frame), the adapter's tokens are the
  real full processor's ``input_ids`` for the same decoded frames, the ref's frames are the
  processor's sampled indices, and the video half's tensors are the processor's, bit for bit;
  rows holding an image and a video, in either order, too.
- Loader and model: a store of video, image, mixed and text-only rows loads into batches the
  tiny random-weight model takes, each video sample's inputs and logits equal to those of the
  processor's own output for the same clip; in bf16, floats in the train dtype, grids int64.
- Trust: forged video refs are refused with typed errors naming file, run, step, sample and
  video index, by the loader and (where the row alone shows it) the writer; a video bomb is
  refused before a frame is decoded.
- Missing video media: zero placeholders of the exact shapes (loss masked), or an error
  naming where.
- Families without video (Gemma 3, Pixtral) refuse video; refs read back equal.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata

import mmstore
import mmstore._format.video as video_module
import mmstore._storage.store as storage_module
from mmstore._format.models import VideoRef
from mmstore._rows import writer as writer_module
from mmstore.errors import InvalidRolloutError
from tests.families_common import model_inputs, noise, train_loss
from tests.family_cases import CASES, token_ids
from tests.video_cases import VIDEO_CASES, ClipCase, VideoCase
from tests.video_clips import decode_all, make_clip

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

CASE_LIST = list(VIDEO_CASES.values())


@pytest.fixture(params=CASE_LIST, ids=str, scope="module")
def case(request) -> VideoCase:
    return request.param


# -- clips, processors, models (built once) ------------------------------------------------


@functools.cache
def clip_bytes(clip: ClipCase) -> bytes:
    return make_clip(clip.num_frames, clip.width, clip.height, clip.fps, seed=clip.seed, gop=4)


@functools.cache
def decoded(clip: ClipCase) -> np.ndarray:
    """Every frame of the clip, as a full sequential decode gives them (read-only)."""
    frames = decode_all(clip_bytes(clip))
    frames.flags.writeable = False
    return frames


@functools.cache
def tiny(case: VideoCase, dtype: torch.dtype) -> Any:
    return case.tiny_model(dtype, "sdpa")


def metadata(media: mmstore.MediaRef) -> VideoMetadata:
    """What transformers' own video decoding reports of the clip."""
    assert media.num_frames is not None and media.fps is not None
    return VideoMetadata(
        total_num_frames=media.num_frames,
        fps=media.fps,
        width=media.width,
        height=media.height,
        duration=media.num_frames / media.fps,
    )


def processor_output(
    processor: Any,
    text: str,
    clip: ClipCase,
    media: mmstore.MediaRef,
    *,
    images: Sequence[Any] = (),
) -> Any:
    """The real full processor's output for ``text`` with the clip's decoded frames: it
    samples them itself (``do_sample_frames=True`` with the clip's fps/num_frames), or takes
    explicit frames (or all) pre-sampled (``do_sample_frames=False``, their indices in the
    metadata)."""
    meta = metadata(media)
    frames = decoded(clip)
    if "frames" in clip.sampling or not clip.sampling:
        # Explicit frames, pre-sampled; or every frame (as the processor takes a clip when it
        # does not sample: its Qwen-VL sample_frames fails given neither fps nor num_frames).
        picked = list(clip.sampling.get("frames", range(len(frames))))
        meta.frames_indices = picked
        video, kwargs = frames[picked], {"do_sample_frames": False}
    else:
        # num_frames= alone: a processor with a default fps (Qwen3-VL's 2) refuses both.
        sampling = (
            {"fps": None, **clip.sampling} if "num_frames" in clip.sampling else clip.sampling
        )
        video, kwargs = frames, {"do_sample_frames": True, **sampling}
    return processor(
        text=[text],
        images=list(images) or None,
        videos=[np.array(video)],
        videos_kwargs={"video_metadata": [meta], **kwargs},
        return_metadata=True,
        return_tensors="pt",
    )


def processor_frames(out: Mapping[str, Any]) -> tuple[int, ...]:
    """The distinct frame indices the processor took (its returned metadata), in order. A
    sampler may repeat the last (GLM-4.1V's, to an even count); a ref names each frame once
    and its family repeats it as the processor does (the tensors are compared too)."""
    (meta,) = out["video_metadata"]
    return tuple(dict.fromkeys(int(i) for i in np.asarray(meta.frames_indices).tolist()))


def assert_same_video_tensors(case: VideoCase, got: Mapping[str, Any], want: Mapping[str, Any]):
    video = mmstore.adapter_for(case.small()).video
    for key in (*video.video_inputs, *case.extra_inputs):
        ours, theirs = torch.as_tensor(got[key]), torch.as_tensor(want[key])
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, key
        assert torch.equal(ours, theirs), key


# -- rows ------------------------------------------------------------------------------------


def video_row(
    case: VideoCase,
    adapter: Any,
    sample_id: str,
    order: Sequence[str],
    *,
    images: Sequence[mmstore.MediaRef] = (),
    video: tuple[mmstore.MediaRef, ClipCase] | None = None,
) -> mmstore.Rollout:
    """A row as a rollout writes it: the chat template's prompt (``order``: "image" and
    "video" placeholders), expanded, then a completion (the only tokens in the loss)."""
    processor = case.small()
    prompt = token_ids(processor, case.text(*order))
    kwargs: dict[str, Any] = {}
    if video is not None:
        kwargs = {"videos": [video[0]], **video[1].expand_kwargs}
    expanded = adapter.expand_media(prompt, images=list(images), **kwargs)
    completion = token_ids(processor, case.completion_text)
    n = len(expanded.tokens)
    return mmstore.Rollout(
        sample_id=sample_id,
        group_id="g",
        tokens=expanded.tokens + completion,
        prompt_len=n,
        loss_mask=[False] * n + [True] * len(completion),
        images=expanded.images,
        videos=expanded.videos,
        reward=1.0,
        advantage=0.5,
    )


class Filled:
    """One store per case: video, image, mixed and text-only rows in one file."""

    def __init__(self, case: VideoCase, root: Any) -> None:
        self.case = case
        self.store = mmstore.Store.open(root, create=True)
        self.processor = case.small()
        self.adapter = mmstore.adapter_for(self.processor)
        clips = case.clips
        # (sample id, prompt order, image size or None, clip or None)
        plan: list[tuple[str, tuple[str, ...], Any, ClipCase | None]] = [
            ("video", ("video",), None, clips[0]),
            ("explicit", ("video",), None, clips[6]),
            ("image", ("image",), case.image_case.store_sizes[0], None),
            ("text", (), None, None),
            ("mixed", ("image", "video"), case.image_case.store_sizes[1], clips[2]),
            ("shared", ("video",), None, clips[0]),  # a group's shared clip: a cache hit
        ]
        if not case.images_with_videos:
            plan = [entry for entry in plan if entry[0] != "mixed"]
        self.rows: dict[str, mmstore.Rollout] = {}
        self.images: dict[str, list[Any]] = {}
        self.clips: dict[str, tuple[mmstore.MediaRef, ClipCase]] = {}
        self.orders = {sample_id: order for sample_id, order, _, _ in plan}
        with self.store.writer("r", 0, adapter=self.adapter) as writer:
            for seed, (sample_id, order, size, clip) in enumerate(plan):
                pictures = [noise(*size, seed)] if size else []
                media = [self.store.put_image(p) for p in pictures]
                video = None
                if clip is not None:
                    video = (self.store.put_video(clip_bytes(clip)), clip)
                    self.clips[sample_id] = video
                self.images[sample_id] = pictures
                row = video_row(case, self.adapter, sample_id, order, images=media, video=video)
                self.rows[sample_id] = row
                writer.write(row)

    def full_text(self, sample_id: str) -> str:
        """The row's whole text: its prompt, then its completion."""
        return f"{self.case.text(*self.orders[sample_id])} {self.case.completion_text}"


@pytest.fixture(scope="module")
def filled(case, tmp_path_factory) -> Filled:
    return Filled(case, tmp_path_factory.mktemp(f"video-{case.name}") / "s")


def loader(store: mmstore.Store, processor: Any, *, batch_size: int, **kwargs: Any):
    ds = mmstore.RolloutDataset(store, processor, shuffle=False, **kwargs)
    return mmstore.RolloutLoader(ds, batch_size=batch_size)


# -- layout: the real processor's tokens, frames and tensors --------------------------------


LAYOUT_CASES = [
    pytest.param(case, clip, id=f"{case}-{clip}") for case in CASE_LIST for clip in case.clips
]


@pytest.mark.parametrize(("case", "clip"), LAYOUT_CASES, indirect=["case"])
def test_the_layout_is_the_real_processors(case, clip, tmp_path):
    assert len(case.clips) >= 10
    store = mmstore.Store.open(tmp_path / "s", create=True)
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    media = store.put_video(clip_bytes(clip))
    assert (media.width, media.height, media.num_frames) == (
        clip.width,
        clip.height,
        clip.num_frames,
    )
    assert media.fps == pytest.approx(clip.rate, rel=1e-6)
    text = case.text("video")
    expanded = adapter.expand_media(
        token_ids(processor, text), videos=[media], **clip.expand_kwargs
    )
    out = processor_output(processor, text, clip, media)
    # Token for token what the full processor lays out.
    assert expanded.tokens == out["input_ids"][0].tolist()
    (ref,) = expanded.videos
    # The frames the processor sampled (or was given), and the ref's facts, the clip's.
    assert ref.frames == processor_frames(out)
    if "frames" in clip.sampling:
        assert ref.frames == tuple(clip.sampling["frames"])
    assert (ref.uri, ref.hash, ref.width, ref.height, ref.num_frames, ref.fps) == (
        media.uri, media.hash, media.width, media.height, media.num_frames, media.fps
    )  # fmt: skip
    video = adapter.video
    # The span replaces the prompt's one video token (with the chat template's tokens around
    # it, where the processor replaces those too: Qwen3-VL from transformers 5.25); the
    # video's features land inside it.
    prompt = token_ids(processor, text)
    at = prompt.index(video.video_token_id)
    around = 1 if video.wrapper else 0
    end = ref.offset + ref.length
    assert ref.offset == at - around and expanded.tokens[end:] == prompt[at + 1 + around :]
    feature = [i for i, t in enumerate(expanded.tokens) if t == video.feature_token_id]
    assert feature and ref.offset <= feature[0] and feature[-1] < end
    assert len(feature) == video.output_tokens(out)
    # The video half's processor call on the ref's frames: the processor's tensors, bit for
    # bit (and any extra model inputs: Qwen2.5-VL's second_per_grid_ts).
    got = video.process(decoded(clip)[list(ref.frames)], ref)
    assert_same_video_tensors(case, {**got, **video.extras(ref)}, out)
    assert video.input_names == (*video.video_inputs, *case.extra_inputs)
    video.check_output(out, ref, sample_id="s", video_index=0)
    # The placeholder has the processor's shapes and grids; its floats are zeros.
    for key, zeros in video.placeholder(ref).items():
        theirs = out[key].numpy()
        assert zeros.shape == theirs.shape and zeros.dtype == theirs.dtype, key
        if zeros.dtype.kind == "f":
            assert not zeros.any()
        else:
            np.testing.assert_array_equal(zeros, theirs)
    # A ref of more frames (a longer span) does not fit the output.
    longer = _more_frames(video, ref)
    with pytest.raises(mmstore.LayoutMismatchError):
        video.check_output(out, longer, sample_id="s", video_index=0)


@pytest.mark.parametrize("order", [("image", "video"), ("video", "image")], ids="-then-".join)
def test_a_row_with_an_image_and_a_video_is_the_real_processors(case, order, tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    clip = case.clips[0]
    media = store.put_video(clip_bytes(clip))
    picture = noise(*case.image_case.store_sizes[1], 3)
    image = store.put_image(picture)
    text = case.text(*order)
    expanded = adapter.expand_media(
        token_ids(processor, text), images=[image], videos=[media], **clip.expand_kwargs
    )
    out = processor_output(processor, text, clip, media, images=[picture])
    assert expanded.tokens == out["input_ids"][0].tolist()
    (image_ref,), (video_ref,) = expanded.images, expanded.videos
    assert (image_ref.offset < video_ref.offset) == (order[0] == "image")
    assert video_ref.frames == processor_frames(out)
    got = adapter.video.process(decoded(clip)[list(video_ref.frames)], video_ref)
    assert_same_video_tensors(case, {**got, **adapter.video.extras(video_ref)}, out)
    pixels = adapter.process([picture])
    for key in adapter.image_inputs:
        np.testing.assert_array_equal(np.asarray(pixels[key]), out[key].numpy(), err_msg=key)
    # And the writer takes the row.
    completion = token_ids(processor, case.completion_text)
    row = mmstore.Rollout(
        sample_id="mixed",
        tokens=expanded.tokens + completion,
        prompt_len=len(expanded.tokens),
        loss_mask=[False] * len(expanded.tokens) + [True] * len(completion),
        images=expanded.images,
        videos=expanded.videos,
    )
    with store.writer("r", 0, adapter=adapter) as writer:
        writer.write(row)
    (back,) = store.rollouts("r")
    assert back.videos == row.videos and back.images == row.images


# -- the loader and the model ----------------------------------------------------------------


def test_every_batch_feeds_the_tiny_model(case, filled):
    model = tiny(case, torch.float32)
    # Pairs: two video rows, an image and a text-only row (no video: its video inputs None),
    # a mixed row and a video row.
    batches = loader(filled.store, filled.processor, batch_size=2, dtype=torch.float32)
    seen, without_video = [], 0
    names = batches.model_input_names
    assert set(names) >= {"pixel_values_videos", "video_grid_thw", *case.extra_inputs}
    with torch.no_grad():
        for batch in batches:
            seen += batch["sample_ids"]
            has_video = any(filled.rows[s].videos for s in batch["sample_ids"])
            assert (batch["pixel_values_videos"] is not None) == has_video
            without_video += not has_video
            loss = train_loss(model, batches, batch)
            assert torch.isfinite(loss)
    assert sorted(seen) == sorted(filled.rows) and without_video == 1


@pytest.mark.parametrize("sample_id", ["video", "explicit", "mixed", "shared"])
def test_a_video_sample_is_the_processors_own_inputs(case, filled, sample_id):
    """One sample alone: its tokens, token types and video tensors are what the full
    processor gives for the same text and clip (decoded by seeking in a worker, the real
    video processor on the ref's frames), so the model's vision features and logits are
    those of the processor's own output."""
    if sample_id not in filled.rows:
        pytest.skip(f"{case}'s model takes no batch of images and videos")
    media, clip = filled.clips[sample_id]
    out = processor_output(
        filled.processor,
        filled.full_text(sample_id),
        clip,
        media,
        images=filled.images[sample_id],
    )
    one = loader(filled.store, filled.processor, batch_size=1, dtype=torch.float32)
    (batch,) = [b for b in one if b["sample_ids"] == [sample_id]]
    assert batch["input_ids"].tolist() == out["input_ids"].tolist()
    types = filled.adapter.token_type_input
    if types is not None:  # the video features' token type, as the processor marks them
        assert batch[types].tolist() == out[types].tolist()
        assert filled.adapter.video.token_type in batch[types][0].tolist()
    assert_same_video_tensors(case, batch, out)
    for key in filled.adapter.image_inputs if filled.images[sample_id] else ():
        assert torch.equal(batch[key], out[key]), key
    model = tiny(case, torch.float32)
    theirs = {k: v for k, v in out.items() if k != "video_metadata"}
    assert set(theirs) <= set(one.model_input_names)
    with torch.no_grad():
        ours_features = model.model.get_video_features(
            batch["pixel_values_videos"], batch["video_grid_thw"]
        ).pooler_output
        their_features = model.model.get_video_features(
            out["pixel_values_videos"], out["video_grid_thw"]
        ).pooler_output
        for a, b in zip(ours_features, their_features, strict=True):
            assert torch.equal(a, b)
        ours = model(**model_inputs(one, batch)).logits
        expected = model(**theirs).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_bf16_batches_cast_floats_and_keep_grids(case, filled):
    """Pairs of rows (a video pair, an image and a text-only row, a mixed and a video row)."""
    want = {
        tuple(b["sample_ids"]): b
        for b in loader(filled.store, filled.processor, batch_size=2, dtype=torch.float32)
    }
    batches = loader(filled.store, filled.processor, batch_size=2, dtype=torch.bfloat16)
    model = tiny(case, torch.bfloat16)
    video = filled.adapter.video
    grids = [
        k
        for k, v in video.placeholder(filled.rows["video"].videos[0]).items()
        if v.dtype.kind != "f"
    ]
    assert grids, "a video family has integer inputs (grids)"
    checked = set()
    for batch in batches:
        fp32 = want[tuple(batch["sample_ids"])]
        for key in batches.model_input_names:
            value = batch[key]
            if value is None:
                continue
            checked.add(key)
            if key in case.extra_inputs:  # times feed position ids: kept in float32
                assert value.dtype == torch.float32 and torch.equal(value, fp32[key]), key
            elif value.is_floating_point():  # pixels: the train dtype, fp32's values cast
                assert value.dtype == torch.bfloat16, key
                assert torch.equal(value, fp32[key].to(torch.bfloat16)), key
            else:  # ids, masks, grids: untouched
                assert value.dtype == fp32[key].dtype and torch.equal(value, fp32[key]), key
                if key in grids:
                    assert value.dtype == torch.int64, key
        with torch.no_grad():
            assert torch.isfinite(train_loss(model, batches, batch))
    assert checked >= set(video.input_names)


def test_refs_read_back_equal(filled):
    back = {row.sample_id: row for row in filled.store.rollouts("r")}
    assert back.keys() == filled.rows.keys()
    for sample_id, row in filled.rows.items():
        assert back[sample_id].videos == row.videos, sample_id
        assert back[sample_id].images == row.images, sample_id
        assert all(isinstance(v, VideoRef) for v in back[sample_id].videos)


# -- missing video media -----------------------------------------------------------------------


def _one_video_store(case: VideoCase, root: Any) -> tuple[mmstore.Store, dict[str, Any]]:
    store = mmstore.Store.open(root, create=True)
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    rows = {}
    with store.writer("r", 0, adapter=adapter) as writer:
        for sample_id, clip in (("lost", case.clips[0]), ("kept", case.clips[3])):
            video = (store.put_video(clip_bytes(clip)), clip)
            rows[sample_id] = video_row(case, adapter, sample_id, ("video",), video=video)
            writer.write(rows[sample_id])
    return store, rows


def test_missing_video_media(case, tmp_path):
    store, rows = _one_video_store(case, tmp_path / "s")
    processor = case.small()
    gone = rows["lost"].videos[0]
    os.remove(os.path.join(store.root, gone.uri))
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        list(loader(store, processor, batch_size=2))
    err = info.value
    (path,) = [f.path for f in store.rollout_files()]
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "r", 0, "lost")
    assert err.video_index == 0 and err.uri == gone.uri

    dtype = torch.bfloat16
    batches = loader(store, processor, batch_size=2, dtype=dtype, missing="placeholder_zero_loss")
    with pytest.warns(UserWarning, match="missing media"):
        (batch,) = list(batches)
    assert batch["sample_ids"] == ["lost", "kept"] and batch["missing_uris"] == [gone.uri]
    assert not batch["loss_mask"][0].any() and batch["loss_mask"][1].any()
    video = mmstore.adapter_for(processor).video
    zeros = video.placeholder(gone)
    kept = rows["kept"].videos[0]
    real = video.process(decoded(case.clips[3])[list(kept.frames)], kept, dtype)
    # The lost clip's rows: zeros of its placeholder's exact shapes; the kept clip's follow.
    for key, value in zeros.items():
        got, theirs = batch[key], real[key]
        assert got.shape == (value.shape[0] + theirs.shape[0], *value.shape[1:]), key
        assert got.dtype == (dtype if value.dtype.kind == "f" else torch.int64), key
        if value.dtype.kind == "f":
            assert not got[: value.shape[0]].any(), key
        else:
            assert got[: value.shape[0]].tolist() == value.tolist(), key
        assert torch.equal(got[value.shape[0] :], theirs), key
    for key in case.extra_inputs:
        assert batch[key].tolist() == [
            *video.extras(gone)[key].tolist(),
            *video.extras(kept)[key].tolist(),
        ]
    assert torch.isfinite(train_loss(tiny(case, dtype), batches, batch))


# -- forged refs and bombs ---------------------------------------------------------------------


def _shorter_span(video: Any, ref: VideoRef) -> list[int]:
    """The span of the ref's frames short of one temporal slab (Qwen-VL: two frames; Kimi: a
    chunk): the expansion of the fewest frames dropped from the end that shortens it."""
    for keep in range(len(ref.frames) - 1, 0, -1):
        span = video.expansion(_forged(ref, frames=ref.frames[:keep]))
        if len(span) < ref.length:
            return span
    raise AssertionError("no shorter span")


def _more_frames(video: Any, ref: VideoRef) -> VideoRef:
    """The ref with the fewest frames added after its last that lengthen its span."""
    n = ref.num_frames
    for more in range(1, 9):
        longer = _forged(ref, frames=(*ref.frames, *range(n, n + more)), num_frames=n + more)
        if len(video.expansion(longer)) > ref.length:
            return longer
    raise AssertionError("no longer span")


def _forged(ref: VideoRef, **changes: Any) -> VideoRef:
    """``ref`` with ``changes``, unvalidated (as a row written by another engine holds it)."""
    return VideoRef.model_construct(**{**dict(ref), **changes})


def _with_span(row: mmstore.Rollout, ref: VideoRef, span: list[int]) -> mmstore.Rollout:
    """``row`` with its one video's span replaced by ``span`` (the ref's offset kept)."""
    old = row.videos[0]
    tokens = row.tokens[: old.offset] + span + row.tokens[old.offset + old.length :]
    n = len(tokens) - (len(row.tokens) - row.prompt_len)
    return row.model_copy(
        update={
            "sample_id": "bad",
            "tokens": tokens,
            "prompt_len": n,
            "loss_mask": [False] * n + row.loss_mask[row.prompt_len :],
            "videos": [ref],
        }
    )


def honest_row(case: VideoCase, store: mmstore.Store, adapter: Any) -> mmstore.Rollout:
    """The honest row "ok": every other frame of the case's first clip (24 frames of 168x112),
    twelve: a few temporal slabs (two-frame, four-frame chunks) to be one short of."""
    first = case.clips[0]
    assert first.num_frames == 24 and (first.width, first.height) == (168, 112)
    clip = dataclasses.replace(first, sampling={"frames": tuple(range(0, 24, 2))})
    media = store.put_video(clip_bytes(first))
    return video_row(case, adapter, "ok", ("video",), video=(media, clip))


def _other_size(video: Any, ref: VideoRef) -> VideoRef:
    """The ref at another frame size whose layout is not the clip size's."""
    w, h = ref.width, ref.height
    for width, height in ((w * 3, h), (w, h * 3), (w * 8, h), (w, h * 8), (w // 4, h)):
        other = _forged(ref, width=width, height=height)
        if video.expansion(other) != video.expansion(ref):
            return other
    raise AssertionError("every size lays out alike")


def forge(kind: str, video: Any, row: mmstore.Rollout, other: mmstore.MediaRef) -> mmstore.Rollout:
    """``row`` (one video: the 24-frame 168x112 clip) as a forged row "bad"."""
    ref = row.videos[0]
    span = row.tokens[ref.offset : ref.offset + ref.length]
    if kind == "span_one_slab_short":  # the ref's frames, the span of fewer
        span = _shorter_span(video, ref)
        return _with_span(row, _forged(ref, length=len(span)), span)
    if kind == "size_span_kept":  # another size, the span of the clip's size kept
        return _with_span(row, _other_size(video, ref), span)
    if kind == "hash_of_another_clip":  # another clip's hash at this clip's name
        return _with_span(row, _forged(ref, hash=other.hash), span)
    # The ref's clip facts forged, its span laid out for what it says.
    n = ref.num_frames
    facts: dict[str, Any] = {
        "num_frames": {"num_frames": n - 1},  # frames still within
        "frames_past_the_end": {"frames": (*ref.frames[:-1], n)},  # an index it does not have
        "frames_past_the_clips_end": {"frames": (*ref.frames[:-1], n + 3), "num_frames": n + 4},
        "size_relaid": {"width": ref.height, "height": ref.width},
    }[kind]
    forged = _forged(ref, **facts)
    span = video.expansion(forged)
    return _with_span(row, _forged(forged, length=len(span)), span)


# kind -> (the loader's error, its message, the writer's error or None where the row alone
# cannot show the forgery: the writer does not read the clip)
FORGED = {
    "num_frames": (mmstore.LayoutMismatchError, "the ref says 23", None),
    "span_one_slab_short": (InvalidRolloutError, "holds", InvalidRolloutError),
    "frames_past_the_end": (InvalidRolloutError, "within the clip", InvalidRolloutError),
    "frames_past_the_clips_end": (mmstore.LayoutMismatchError, "the ref says 28", None),
    "size_relaid": (mmstore.LayoutMismatchError, "112x168", None),
    "size_span_kept": (InvalidRolloutError, "lays out", InvalidRolloutError),
    "hash_of_another_clip": (mmstore.HashMismatchError, "hash", mmstore.HashMismatchError),
}


def _forged_store(case: VideoCase, root: Any, kind: str, monkeypatch) -> tuple[Any, str, Any]:
    """A committed file of an honest row and a forged one ("bad"), the same clip: written
    through the writer with its row and clip checks waived for "bad" (the footer is the
    writer's)."""
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(case.small())
    other = store.put_video(clip_bytes(case.clips[3]))
    ok = honest_row(case, store, adapter)
    bad = forge(kind, adapter.video, ok, other)
    real = writer_module.check_rollout

    def waived(rollout, lookup, **kwargs):
        try:
            real(rollout, lookup, **kwargs)
        except InvalidRolloutError:
            if rollout.sample_id != "bad":
                raise

    with monkeypatch.context() as patch:
        patch.setattr(writer_module, "check_rollout", waived)
        patch.setattr(store, "check_clip", lambda ref, **where: None)  # the clip's facts too
        if FORGED[kind][2] is mmstore.HashMismatchError:  # the writer's media check too
            patch.setattr(store, "ensure_media", lambda ref, **where: None)
        with store.writer("forged", 0, adapter=adapter) as writer:
            writer.write(ok)
            writer.write(bad)
    (path,) = [f.path for f in store.rollout_files()]
    return store, path, bad


@pytest.mark.parametrize("kind", FORGED)
def test_a_forged_video_ref_is_refused_by_the_loader(case, kind, tmp_path, monkeypatch):
    store, path, _ = _forged_store(case, tmp_path / "s", kind, monkeypatch)
    error, match, _ = FORGED[kind]
    # batch_size 2: the honest row's tensors, of the same frames of the same clip, are in the
    # worker's cache when the forged row asks for them.
    with pytest.raises(error, match=match) as info:
        list(loader(store, case.small(), batch_size=2, node_cache_bytes=0))
    err = info.value
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "forged", 0, "bad"), err
    assert err.video_index == 0, err


@pytest.mark.parametrize("kind", [k for k, v in FORGED.items() if v[2] is not None])
def test_a_forged_video_ref_is_refused_by_the_writer(case, kind, tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(case.small())
    other = store.put_video(clip_bytes(case.clips[3]))
    bad = forge(kind, adapter.video, honest_row(case, store, adapter), other)
    writer = store.writer("forged", 0, adapter=adapter)
    with pytest.raises(FORGED[kind][2]) as info, writer as w:
        w.write(bad)
    err = info.value
    assert (err.run_id, err.step, err.sample_id, err.video_index) == ("forged", 0, "bad", 0), err
    assert store.rollout_files() == []


@pytest.mark.parametrize("kind", [k for k, v in FORGED.items() if v[2] is None])
def test_a_clip_inconsistent_ref_is_refused_by_the_writer(case, kind, tmp_path):
    """A ref whose frame count or size is not its clip's, its span laid out for what it
    says: the writer compares it with the clip's facts (put_video's, or a probe's)."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(case.small())
    ok = honest_row(case, store, adapter)
    bad = forge(kind, adapter.video, ok, store.put_video(clip_bytes(case.clips[3])))
    for writer_store in (store, mmstore.Store.open(store.root)):  # remembered, then probed
        writer = writer_store.writer("forged", 0, adapter=adapter)
        with pytest.raises(mmstore.InvalidRolloutError, match="another clip") as info, writer as w:
            w.write(bad)
        err = info.value
        assert (err.run_id, err.sample_id, err.video_index) == ("forged", "bad", 0), err
    assert store.rollout_files() == []


def test_a_clip_whose_bytes_changed_after_commit_is_refused(case, tmp_path):
    store, rows = _one_video_store(case, tmp_path / "s")
    changed = rows["lost"].videos[0]
    with open(os.path.join(store.root, changed.uri), "wb") as f:
        f.write(clip_bytes(case.clips[1]))  # another clip, at the ref's name
    with pytest.raises(mmstore.HashMismatchError) as info:
        list(loader(store, case.small(), batch_size=2, node_cache_bytes=0))
    err = info.value
    (path,) = [f.path for f in store.rollout_files()]
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "r", 0, "lost")
    assert err.video_index == 0 and err.uri == changed.uri


def test_a_video_bomb_is_refused_before_decoding(case, tmp_path, monkeypatch):
    clip = case.clips[0]
    data = clip_bytes(clip)
    # Rows of an honest store, read by one whose pixel limit the clip exceeds.
    honest, _ = _one_video_store(case, tmp_path / "honest")
    monkeypatch.setattr(video_module, "_decode", _refuse_decoding)
    limit = clip.width * clip.height - 1
    small = mmstore.Store.open(tmp_path / "bombs", create=True, max_image_pixels=limit)
    with pytest.raises(mmstore.VideoBombError, match="exceed the limit"):
        small.put_video(data)
    # Too many frames: refused from the container's packets, before a frame is decoded.
    monkeypatch.setattr(storage_module, "MAX_CLIP_FRAMES", clip.num_frames - 1)
    with pytest.raises(mmstore.DecompressionBombError, match="frames"):
        mmstore.Store.open(tmp_path / "frames", create=True).put_video(data)
    assert not os.path.exists(os.path.join(small.root, "media")) or not any(
        files for _, _, files in os.walk(os.path.join(small.root, "media"))
    )
    # A reader with a smaller limit refuses the committed refs before decoding them.
    reader = mmstore.Store.open(honest.root, max_image_pixels=limit)
    with pytest.raises(InvalidRolloutError, match="exceeds the store's limit") as info:
        list(loader(reader, case.small(), batch_size=2))
    err = info.value
    (path,) = [f.path for f in honest.rollout_files()]
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "r", 0, "lost")
    assert err.video_index == 0


def _refuse_decoding(stream, packet):
    raise AssertionError("a frame was decoded")


# -- families without video --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "pixtral"])
def test_families_without_video_refuse_it(name, tmp_path):
    image_case = CASES[name]
    adapter = mmstore.adapter_for(image_case.small())
    with pytest.raises(mmstore.UnsupportedProcessorError):
        adapter.video  # noqa: B018
    with pytest.raises(mmstore.UnsupportedProcessorError):
        adapter.expand_media([2, 3], videos=[_video_media()])
    store = mmstore.Store.open(tmp_path / "s", create=True)
    media = store.put_video(clip_bytes(VIDEO_CASES["qwen2-vl"].clips[0]))
    words = token_ids(image_case.small(), " ".join(image_case.words))
    ref = VideoRef(
        uri=media.uri,
        hash=media.hash,
        width=media.width,
        height=media.height,
        num_frames=media.num_frames,
        fps=media.fps,
        frames=(0, 6),
        offset=1,
        length=2,
        family=image_case.family,
        layout_fingerprint=adapter.fingerprint,
    )
    row = mmstore.Rollout(
        sample_id="v",
        tokens=words,
        prompt_len=2,
        loss_mask=[False, False, True, True],
        videos=[ref],
    )
    writer = store.writer("r", 0, adapter=adapter)
    with pytest.raises(InvalidRolloutError, match="video") as info, writer as w:
        w.write(row)
    assert (info.value.sample_id, info.value.video_index) == ("v", 0)
    assert store.rollout_files() == []


def _video_media() -> mmstore.MediaRef:
    return mmstore.MediaRef(
        hash="0" * 32,
        uri="media/00/00/" + "0" * 32 + ".mp4",
        width=16,
        height=16,
        kind="video",
        num_frames=2,
        fps=1.0,
    )
