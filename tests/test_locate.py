"""``adapter.locate``: the spans of ids whose media are expanded already (issue 40, item 1).

Against the real transformers processors of every family (``tests/family_cases.py``,
``tests/video_cases.py``): the processor's own ``input_ids`` for a prompt, located, are the
tokens ``expand_media`` gives for the unexpanded prompt, with the same refs field for field;
for images at many sizes, several images in later turns, videos (timestamps as text inside
Qwen3-VL's, GLM-4.1V's and Kimi-K2.5's spans) and videos between images. Forged spans (one
token short or long, a wrong token, another image's size, other frames, a missing span, an
extra image or video) are refused with a typed error naming the media index, or the position
of a token no span accounts for.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import mmstore
from mmstore.errors import InvalidRolloutError
from tests.families_common import gradient, media_ref, noise
from tests.family_cases import CASES, FamilyCase, token_ids
from tests.test_video_contract import clip_bytes, decoded, metadata, processor_output
from tests.video_cases import VIDEO_CASES, ClipCase, VideoCase

ALL = list(CASES.values())
VIDEOS = list(VIDEO_CASES.values())


@functools.cache
def adapter_of(processor: Any) -> Any:
    return mmstore.adapter_for(processor)


def ids_of(out: Any) -> list[int]:
    return [int(t) for t in np.asarray(out["input_ids"][0])]


def assert_located(adapter: Any, ids: list[int], prompt: list[int], **media: Any) -> Any:
    """``locate`` on the processor's ids equals ``expand_media`` on the unexpanded prompt."""
    expanded = adapter.expand_media(prompt, **media)
    located = adapter.locate(ids, **media)
    assert expanded.tokens == ids  # the premise: expand_media is the processor's layout
    assert located.tokens == ids and isinstance(located.tokens, list)
    assert located.images == expanded.images
    assert located.videos == expanded.videos
    for ref in [*located.images, *located.videos]:
        assert ref.length > 0 and ref.offset + ref.length <= len(ids)
    return located


# -- images ------------------------------------------------------------------------------------


LARGE = 600_000  # pixels: the processors take a while on images this large


def quick_sizes(case: FamilyCase) -> list[tuple[int, int]]:
    """Every other of the case's sizes under ``LARGE``: tiny, odd, extreme aspect ratios."""
    return [(w, h) for w, h in case.sizes if w * h < LARGE][::2]


def large_sizes(case: FamilyCase) -> list[tuple[int, int]]:
    """The case's sizes from ``LARGE`` up: around the pixel budgets, screens, 4K."""
    return [(w, h) for w, h in case.sizes if w * h >= LARGE]


def check_sizes(case: FamilyCase, layout: str, sizes: Sequence[tuple[int, int]]) -> None:
    processor = case.published(layout)
    adapter = adapter_of(processor)
    text = case.text(1)
    checked = 0
    for width, height in sizes:
        try:
            adapter.expansion(width, height)
        except mmstore.ImageSizeError:  # the processor refuses it too (the contract suite)
            continue
        out = processor(text=[text], images=[gradient(width, height)], return_tensors="np")
        media = [media_ref(width, height)]
        (ref,) = assert_located(
            adapter, ids_of(out), token_ids(processor, text), images=media
        ).images
        assert (ref.width, ref.height) == (width, height)
        checked += 1
    assert checked > len(sizes) // 2  # (Pixtral-12B refuses two: a side of 0 pixels)


LAYOUTS = [(case, name) for case in ALL for name in case.published_layouts]


@pytest.mark.parametrize(("case", "layout"), LAYOUTS, ids=[f"{c}-{n}" for c, n in LAYOUTS])
def test_one_image_at_many_sizes(case, layout):
    check_sizes(case, layout, quick_sizes(case))


@pytest.mark.slow
@pytest.mark.parametrize(("case", "layout"), LAYOUTS, ids=[f"{c}-{n}" for c, n in LAYOUTS])
def test_one_large_image_at_many_sizes(case, layout):
    check_sizes(case, layout, large_sizes(case))


def turns(case: FamilyCase, groups: Sequence[int]) -> str:
    """A prompt of image groups (``groups[i]`` images each, adjacent), words between them:
    images in later turns."""
    words = [*case.words, *case.words]
    parts = [words[0]]
    for n, count in enumerate(groups, start=1):
        parts += [case.image_text] * count + [words[n]]
    return " ".join(parts)


GROUPS = [(2,), (1, 1), (1, 2, 1), (3, 1)]


@pytest.mark.parametrize("groups", GROUPS, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("case", ALL, ids=str)
def test_several_images_in_later_turns(case, groups):
    processor = case.small()
    adapter = adapter_of(processor)
    n = sum(groups)
    # Distinct sizes, and the same size twice (equal spans in a row: order alone tells them)
    sizes = [case.store_sizes[0], case.sizes[3], case.store_sizes[0], case.store_sizes[1]][:n]
    images = [noise(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    text = turns(case, groups)
    out = processor(text=[text], images=[images], return_tensors="np")
    media = [media_ref(w, h, k) for k, (w, h) in enumerate(sizes)]
    located = assert_located(adapter, ids_of(out), token_ids(processor, text), images=media)
    assert [ref.uri for ref in located.images] == [m.uri for m in media]
    offsets = [ref.offset for ref in located.images]
    assert offsets == sorted(offsets)


def test_text_alone_locates_nothing():
    case = CASES["qwen-vl"]
    processor = case.small()
    prompt = token_ids(processor, case.text(0))
    located = adapter_of(processor).locate(prompt)
    assert located == (prompt, [], [])


# -- forged image spans ------------------------------------------------------------------------


def two_images(case: FamilyCase) -> tuple[Any, list[int], list[mmstore.MediaRef]]:
    """The small processor, its ids for two images of different layouts with a word between
    them (spans apart), and their media refs."""
    processor = case.small()
    adapter = adapter_of(processor)
    first = case.store_sizes[0]
    # A second size of another token count, where the family has one (not Gemma 3).
    second = next(
        (s for s in [*case.store_sizes[1:], *case.sizes] if differ(adapter, first, s)),
        case.store_sizes[1],
    )
    sizes = [first, second]
    text = turns(case, (1, 1))
    images = [noise(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    out = processor(text=[text], images=[images], return_tensors="np")
    return processor, ids_of(out), [media_ref(w, h, k) for k, (w, h) in enumerate(sizes)]


def differ(adapter: Any, a: tuple[int, int], b: tuple[int, int]) -> bool:
    return bool(adapter.num_tokens(*a) != adapter.num_tokens(*b))


def refused(adapter: Any, ids: list[int], match: str = "", **media: Any) -> InvalidRolloutError:
    with pytest.raises(InvalidRolloutError, match=match) as info:
        adapter.locate(ids, **media)
    return info.value


def spliced(ids: list[int], ref: Any, span: list[int]) -> list[int]:
    return ids[: ref.offset] + span + ids[ref.offset + ref.length :]


def span_of(ids: list[int], ref: Any) -> list[int]:
    return ids[ref.offset : ref.offset + ref.length]


@pytest.fixture(params=ALL, ids=str, scope="module")
def honest(request) -> tuple[FamilyCase, Any, list[int], list[mmstore.MediaRef], list[Any]]:
    case = request.param
    processor, ids, media = two_images(case)
    adapter = adapter_of(processor)
    refs = adapter.locate(ids, images=media).images
    return case, adapter, ids, media, refs


def test_a_span_one_token_short_is_refused(honest):
    _, adapter, ids, media, refs = honest
    span = span_of(ids, refs[1])
    short = spliced(ids, refs[1], span[:-2] + span[-1:])  # its next-to-last token gone
    err = refused(adapter, short, "image 1 .*expected a span of", images=media)
    assert err.image_index == 1 and err.uri == media[1].uri
    assert f"{refs[1].length} tokens" in str(err)


def test_a_span_one_token_long_is_refused(honest):
    _, adapter, ids, media, refs = honest
    span = span_of(ids, refs[1])
    long = spliced(ids, refs[1], [*span, adapter.feature_token_id])
    err = refused(adapter, long, "image 1 .*is followed by an image token", images=media)
    assert err.image_index == 1


def test_a_wrong_token_inside_the_span_is_refused(honest):
    case, adapter, ids, media, refs = honest
    span = span_of(ids, refs[0])
    word = token_ids(case.small(), case.words[1])[0]
    middle = len(span) // 2
    wrong = spliced(ids, refs[0], [*span[:middle], word, *span[middle + 1 :]])
    err = refused(adapter, wrong, f"span position {middle} holds token {word}", images=media)
    assert err.image_index == 0


def test_a_swapped_marker_inside_the_span_is_refused(honest):
    _, adapter, ids, media, refs = honest
    span = span_of(ids, refs[1])
    feature = adapter.feature_token_id
    markers = [k for k, t in enumerate(span) if t != feature]
    if not markers:
        pytest.skip("the family's image span is its feature token repeated")
    k = markers[-1]  # Gemma 3's closing "\n\n", Pixtral's [IMG_END]
    swapped = spliced(ids, refs[1], [*span[:k], feature, *span[k + 1 :]])
    err = refused(adapter, swapped, "image 1 ", images=media)
    assert err.image_index == 1


def test_a_span_of_another_images_size_is_refused(honest):
    _, adapter, ids, media, refs = honest
    if span_of(ids, refs[0]) == span_of(ids, refs[1]):
        assert adapter.family == "gemma3"
        pytest.skip("every size lays out alike in this family")
    # The media in the other order: the first span is not the size the first ref says.
    err = refused(adapter, ids, "image 0 ", images=[media[1], media[0]])
    assert err.image_index == 0 and err.uri == media[1].uri
    err = refused(adapter, ids, "image 1 ", images=[media[0], media[0]])
    assert err.image_index == 1


def test_a_missing_span_is_refused(honest):
    case, adapter, ids, media, refs = honest
    one = ids[: refs[0].offset + refs[0].length]  # the prompt cut after the first span
    err = refused(adapter, one, "image 1 .*no image span", images=media)
    assert err.image_index == 1
    more = [*media, media_ref(*case.store_sizes[2], 2)]
    err = refused(adapter, ids, "image 2 .*fewer images than the 3 given", images=more)
    assert err.image_index == 2


def test_an_extra_expanded_image_is_refused(honest):
    _, adapter, ids, media, refs = honest
    err = refused(adapter, ids, "outside every located span", images=media[:1])
    first_special = next(
        k
        for k in range(refs[1].offset, refs[1].offset + refs[1].length)
        if ids[k] in adapter.special_token_ids
    )
    assert err.position == first_special
    err = refused(adapter, ids, "outside every located span")  # no images given at all
    assert err.position == next(k for k, t in enumerate(ids) if t in adapter.special_token_ids)


def test_an_extra_unexpanded_image_is_refused(honest):
    case, adapter, ids, media, _ = honest
    word = token_ids(case.small(), case.words[2])[0]
    extra = [*ids, word, adapter.image_token_id, word]  # one more image, never expanded
    err = refused(adapter, extra, f"image token \\({adapter.image_token_id}\\)", images=media)
    assert err.position == len(ids) + 1


def test_arguments_are_checked_as_expand_media_checks_them(honest):
    _, adapter, ids, media, _ = honest
    with pytest.raises(mmstore.InvalidArgumentError, match="frames= given without videos"):
        adapter.locate(ids, images=media, frames=[[0]])


# -- videos ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> mmstore.Store:
    return mmstore.Store.open(tmp_path_factory.mktemp("locate") / "s", create=True)


@functools.cache
def put(store: mmstore.Store, clip: ClipCase) -> mmstore.MediaRef:
    return store.put_video(clip_bytes(clip))


def explicit_clips(case: VideoCase) -> list[ClipCase]:
    """The case's clips sampled at explicit frames (several videos take them in one call),
    the most frames first."""
    clips = [clip for clip in case.clips if "frames" in clip.sampling]
    return sorted(clips, key=lambda clip: -len(clip.sampling["frames"]))


@pytest.mark.parametrize("case", VIDEOS, ids=str)
def test_a_video_is_located(case, store):
    processor = case.small()
    adapter = adapter_of(processor)
    text = case.text("video")
    for clip in (case.clips[0], explicit_clips(case)[0]):  # sampled by fps, and explicit
        media = put(store, clip)
        out = processor_output(processor, text, clip, media)
        kwargs = {"videos": [media], **clip.expand_kwargs}
        (ref,) = assert_located(adapter, ids_of(out), token_ids(processor, text), **kwargs).videos
        assert ref.frames and ref.uri == media.uri


def several_videos_output(
    processor: Any, text: str, clips: Sequence[ClipCase], media: Sequence[Any], images: Any
) -> Any:
    """The processor's output for ``text`` with several explicit-frame clips (and images)."""
    metas, videos = [], []
    for clip, m in zip(clips, media, strict=True):
        meta = metadata(m)
        meta.frames_indices = list(clip.sampling["frames"])
        metas.append(meta)
        videos.append(np.array(decoded(clip)[meta.frames_indices]))
    return processor(
        text=[text],
        images=list(images) or None,
        videos=videos,
        videos_kwargs={"video_metadata": metas, "do_sample_frames": False},
        return_tensors="pt",
    )


ORDERS: list[tuple[str, ...]] = [
    ("image", "video", "image"),
    ("video", "image", "video"),
    ("video", "video"),
]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
@pytest.mark.parametrize("case", VIDEOS, ids=str)
def test_videos_between_images_are_located(case, order, store):
    processor = case.small()
    adapter = adapter_of(processor)
    clips = explicit_clips(case)[: order.count("video")]
    clips += clips[:1] * (order.count("video") - len(clips))
    media = [put(store, clip) for clip in clips]
    sizes = case.image_case.store_sizes[: order.count("image")]
    pictures = [noise(w, h, k) for k, (w, h) in enumerate(sizes)]
    text = case.text(*order)
    out = several_videos_output(processor, text, clips, media, pictures)
    frames = [list(clip.sampling["frames"]) for clip in clips]
    images = [media_ref(w, h, k) for k, (w, h) in enumerate(sizes)]
    located = assert_located(
        adapter,
        ids_of(out),
        token_ids(processor, text),
        images=images,
        videos=media,
        frames=frames,
    )
    spans = sorted(
        [("image", r.offset) for r in located.images]
        + [("video", r.offset) for r in located.videos],
        key=lambda kind_offset: kind_offset[1],
    )
    assert tuple(kind for kind, _ in spans) == order


@pytest.fixture(params=VIDEOS, ids=str, scope="module")
def honest_video(request, store) -> tuple[Any, list[int], dict[str, Any], Any]:
    """Ids of an image then a video, from the processor; the media and the video's ref."""
    case = request.param
    processor = case.small()
    adapter = adapter_of(processor)
    clip = explicit_clips(case)[0]
    media = put(store, clip)
    picture_size = case.image_case.store_sizes[1]
    text = case.text("image", "video")
    out = several_videos_output(processor, text, [clip], [media], [noise(*picture_size)])
    kwargs = {
        "images": [media_ref(*picture_size)],
        "videos": [media],
        "frames": [list(clip.sampling["frames"])],
    }
    ids = ids_of(out)
    (ref,) = adapter.locate(ids, **kwargs).videos
    return adapter, ids, kwargs, ref


def test_a_video_span_one_token_short_is_refused(honest_video):
    adapter, ids, kwargs, ref = honest_video
    span = span_of(ids, ref)
    last = max(k for k, t in enumerate(span) if t == adapter.video.feature_token_id)
    short = spliced(ids, ref, span[:last] + span[last + 1 :])
    err = refused(adapter, short, "video 0 .*expected a span of", **kwargs)
    assert err.video_index == 0 and err.uri == kwargs["videos"][0].uri


def other_frames(adapter: Any, kwargs: dict[str, Any], span: list[int], fewer: bool) -> list[int]:
    """Fewer of the video's frames (the first), or the same count one later, whose span is
    not ``span`` (Qwen2-VL's spans count only slabs; timestamped ones hold frame times)."""
    frames, media = kwargs["frames"][0], kwargs["videos"][0]
    if fewer:
        candidates = [frames[:k] for k in range(len(frames) - 1, 0, -1)]
    else:
        candidates = [[f + 1 for f in frames[:k]] for k in range(len(frames), 0, -1)]
        candidates = [c for c in candidates if c[-1] < media.num_frames]
    video = adapter.video
    return next(c for c in candidates if video.expansion(video.ref(media, c, 0)) != span)


@pytest.mark.parametrize("fewer", [True, False], ids=["fewer", "later"])
def test_a_video_span_of_other_frames_is_refused(honest_video, fewer):
    adapter, ids, kwargs, ref = honest_video
    frames = other_frames(adapter, kwargs, span_of(ids, ref), fewer)
    # Refused at the span, or (its layout matching the span's first slabs) at the slabs
    # after it, which no span accounts for.
    err = refused(adapter, ids, "video 0", **{**kwargs, "frames": [frames]})
    assert err.context.get("video_index", 0) == 0
    assert "video_index" in err.context or err.position >= ref.offset


def test_a_missing_video_span_is_refused(honest_video):
    adapter, ids, kwargs, _ = honest_video
    two = {**kwargs, "videos": kwargs["videos"] * 2, "frames": kwargs["frames"] * 2}
    err = refused(adapter, ids, "video 1 .*no video span", **two)
    assert err.video_index == 1


def test_an_extra_video_is_refused(honest_video):
    adapter, ids, kwargs, ref = honest_video
    # Located as images alone, the video's tokens are strays (GLM-4.1V's video features are
    # its image token: the video markers around them make them a video's, as for the model).
    err = refused(
        adapter, ids, "a video token .* outside every located span", images=kwargs["images"]
    )
    assert ref.offset <= err.position < ref.offset + ref.length
    # and an unexpanded video token after the prompt
    video_token = adapter.video.video_token_id
    err = refused(adapter, [*ids, video_token], "video token", **kwargs)
    assert err.position == len(ids)


def test_a_video_needs_the_video_half():
    case = CASES["gemma3"]
    adapter = adapter_of(case.small())
    video = mmstore.MediaRef(
        hash="0" * 32, uri="media/v.mp4", width=16, height=16, kind="video", num_frames=4, fps=1
    )
    with pytest.raises(mmstore.UnsupportedProcessorError):
        adapter.locate([1, 2], videos=[video])
