"""The wire-ref resolver serves video refs (``mmvid:``) as it serves image refs: the video
half's tensors, equal to the real video processor on the ref's decoded frames, in request
order beside the images; a structured error at the failing ref's index for every forged or
malformed video ref, before any decode where the ref alone shows it."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

import mmstore
from mmstore import synth, wire
from mmstore._format.media import content_hash, media_path
from mmstore._format.video import decode_frames
from mmstore.integrations import vllm
from mmstore.integrations.vllm import RefResolver, resolve_wire_refs
from tests.families_common import word_level_tokenizer
from tests.family_cases import QWEN_VL, WORDS, token_ids
from tests.test_video_loading import IMAGE_TEXT, SMALL_VIDEO, VIDEO_TEXT, small_video


@pytest.fixture(scope="module")
def processor() -> Any:
    return small_video(QWEN_VL.small())


@pytest.fixture(scope="module")
def full_adapter(processor: Any) -> Any:
    return mmstore.adapter_for(processor)


@pytest.fixture
def clips(store: mmstore.Store) -> list[mmstore.MediaRef]:
    """Two clips: 24 frames of 168x112 at 12 fps, 9 frames of 64x96 at 30 fps."""
    return [
        store.put_video(synth.screen_recording(1, num_frames=24, width=168, height=112)),
        store.put_video(synth.screen_recording(2, num_frames=9, width=64, height=96, fps=30)),
    ]


@pytest.fixture
def video_refs(processor, full_adapter, clips) -> list[mmstore.VideoRef]:
    ids = token_ids(processor, f"hello {VIDEO_TEXT} and {VIDEO_TEXT} look")
    return full_adapter.expand_media(ids, videos=clips, fps=2.0).videos


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, result
    return result


def refused(result: dict[str, Any], index: int | None, reason: str) -> None:
    assert result.get("error") == "invalid_mm_image_ref", result
    assert (result["index"], result["reason"]) == (index, reason), result
    assert isinstance(result["detail"], str) and result["detail"]
    assert set(result) == {"error", "index", "reason", "detail"}


def direct(store: mmstore.Store, adapter: Any, ref: mmstore.VideoRef) -> dict[str, np.ndarray]:
    """The video processor on the ref's decoded frames, as the resolver must give them."""
    data = store.read_media(ref.uri, ref.hash)
    frames = decode_frames(data, ref.frames, max_pixels=store.max_image_pixels)
    return {k: np.asarray(v) for k, v in adapter.video.process(frames, ref).items()}


def counting(resolver: RefResolver, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the resolver's video processor calls (a list: one entry per call)."""
    video = resolver.adapter.video
    calls: list[int] = []
    real = video.process

    def process(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(video, "process", process)
    return calls


def test_video_refs_resolve_to_the_video_processors_tensors(
    store, processor, full_adapter, video_refs
):
    chosen = [video_refs[1], video_refs[0]]
    result = ok(resolve_wire_refs(store, [wire.encode(r) for r in chosen], processor))

    expected = [direct(store, full_adapter, r) for r in chosen]
    assert result["pixel_values_videos"].dtype == np.float32
    assert result["pixel_values_videos"].shape[0] > 0
    assert np.array_equal(
        result["pixel_values_videos"],
        np.concatenate([e["pixel_values_videos"] for e in expected]),
    )
    assert result["video_grid_thw"].dtype == np.int64
    assert result["video_grid_thw"].tolist() == [
        full_adapter.video.integer_tensors(r)["video_grid_thw"][0].tolist() for r in chosen
    ]
    assert result["video_uuids"] == [vllm.video_uuid(r) for r in chosen]
    # No image refs: the image keys are there, empty, as for a request without refs.
    assert result["pixel_values"].shape[0] == 0 and result["hashes"] == []


def test_images_and_videos_in_one_request_keep_their_order(
    store, processor, full_adapter, video_refs
):
    image = synth.screenshot(3, 60, 40)
    media = store.put_image(image)
    ids = token_ids(processor, f"a {IMAGE_TEXT} b")
    image_ref = full_adapter.expand_media(ids, images=[media]).images[0]
    texts = [wire.encode(video_refs[0]), wire.encode(image_ref), wire.encode(video_refs[1])]
    result = ok(resolve_wire_refs(store, texts, processor))

    assert np.array_equal(
        result["pixel_values"],
        full_adapter.process([store.open_image(media.uri, media.hash)])["pixel_values"],
    )
    assert result["hashes"] == [image_ref.hash]
    videos = [direct(store, full_adapter, r) for r in video_refs]
    assert np.array_equal(
        result["pixel_values_videos"],
        np.concatenate([v["pixel_values_videos"] for v in videos]),
    )
    assert result["video_uuids"] == [vllm.video_uuid(r) for r in video_refs]
    # A failing ref's index is its place in the whole request, images and videos counted.
    forged = video_refs[1].model_copy(update={"layout_fingerprint": "0123456789abcdef"})
    refused(
        resolve_wire_refs(store, [*texts[:2], wire.encode(forged)], processor),
        2,
        "fingerprint_mismatch",
    )


def test_an_image_only_request_has_no_video_keys(store, processor, full_adapter):
    media = store.put_image(synth.screenshot(4, 60, 40))
    ids = token_ids(processor, f"a {IMAGE_TEXT} b")
    image_ref = full_adapter.expand_media(ids, images=[media]).images[0]
    result = ok(resolve_wire_refs(store, [wire.encode(image_ref)], processor))
    assert set(result) == {"pixel_values", "image_grid_thw", "hashes"}


def _write(store: mmstore.Store, data: bytes, ext: str = "mp4") -> tuple[str, str]:
    """``data`` at its content address (bypassing put_video's checks): (uri, hash)."""
    digest = content_hash(data)
    uri = media_path(digest, ext)
    path = store.backend.abspath(uri)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return uri, digest


def _forge(store: mmstore.Store, ref: mmstore.VideoRef, case: str) -> str:
    """A video wire ref that fails in one way; written media is set up here where needed."""
    if case == "forged_hash":
        return wire.encode(ref.model_copy(update={"hash": "f" * 32}))
    if case == "changed_bytes":  # the clip at the ref's uri is another clip now
        other = synth.screen_recording(7, num_frames=24, width=168, height=112)
        with open(store.backend.abspath(ref.uri), "wb") as f:
            f.write(other)
        return wire.encode(ref)
    if case == "fingerprint":
        return wire.encode(ref.model_copy(update={"layout_fingerprint": "0123456789abcdef"}))
    if case == "image_fingerprint":  # the image layout's fingerprint on a video ref
        image_fp = mmstore.adapter_for(QWEN_VL.small()).fingerprint
        return wire.encode(ref.model_copy(update={"layout_fingerprint": image_fp}))
    if case == "family":
        return wire.encode(ref.model_copy(update={"family": "llava"}))
    if case == "span_length":
        return wire.encode(ref.model_copy(update={"length": ref.length + 1}))
    if case == "frames_dropped":  # frames dropped, the span kept
        return wire.encode(ref.model_copy(update={"frames": ref.frames[:-2]}))
    if case == "num_frames":  # the span does not depend on it: only the probe sees the lie
        return wire.encode(ref.model_copy(update={"num_frames": ref.num_frames + 6}))
    if case == "fps":
        return wire.encode(ref.model_copy(update={"fps": ref.fps * 2}))
    if case == "size":  # a size whose layout is the same span, not the clip's own
        return wire.encode(ref.model_copy(update={"width": ref.width + 2}))
    if case == "huge":
        return wire.encode(ref.model_copy(update={"width": 100_000, "height": 100_000}))
    if case == "endless":
        return wire.encode(ref.model_copy(update={"num_frames": 2**21}))
    if case == "untrusted_file":
        return wire.encode(ref.model_copy(update={"uri": "file:///etc/hosts"}))
    if case == "dotdot":
        return wire.encode(ref.model_copy(update={"uri": "media/../mmstore.json"}))
    if case == "missing":
        os.remove(store.backend.abspath(ref.uri))
        return wire.encode(ref)
    if case == "undecodable":
        uri, digest = _write(store, b"\x00\x00\x00\x18ftypmp42" + b"not really a video" * 8)
        return wire.encode(ref.model_copy(update={"uri": uri, "hash": digest}))
    if case == "image_bytes":  # a video ref naming an image
        image = store.put_image(synth.screenshot(5, 168, 112))
        return wire.encode(ref.model_copy(update={"uri": image.uri, "hash": image.hash}))
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("forged_hash", "hash_mismatch"),
        ("changed_bytes", "hash_mismatch"),
        ("fingerprint", "fingerprint_mismatch"),
        ("image_fingerprint", "fingerprint_mismatch"),
        ("family", "family_mismatch"),
        ("span_length", "span_length_mismatch"),
        ("frames_dropped", "span_length_mismatch"),
        ("num_frames", "clip_mismatch"),
        ("fps", "clip_mismatch"),
        ("size", "size_mismatch"),
        ("huge", "image_too_large"),
        ("endless", "image_too_large"),
        ("untrusted_file", "untrusted_uri"),
        ("dotdot", "untrusted_uri"),
        ("missing", "media_not_found"),
        ("undecodable", "undecodable_video"),
        ("image_bytes", "undecodable_video"),
    ],
)
def test_bad_video_ref_is_a_structured_error_at_its_index(
    store, processor, full_adapter, video_refs, case, reason
):
    if case == "size":  # the forged size must keep the span, so only the clip shows it
        lie = video_refs[0].model_copy(update={"width": video_refs[0].width + 2})
        assert len(full_adapter.video.expansion(lie)) == video_refs[0].length
    good = wire.encode(video_refs[1])
    bad = _forge(store, video_refs[0], case)
    refused(resolve_wire_refs(store, [good, bad, good], processor), 1, reason)
    refused(resolve_wire_refs(store, [bad], processor), 0, reason)


def test_checks_that_need_no_bytes_run_before_any_decode(store, processor, video_refs, monkeypatch):
    for case in ("fingerprint", "family", "span_length", "huge", "untrusted_file"):
        resolver = RefResolver(store, processor)
        calls = counting(resolver, monkeypatch)
        text = _forge(store, video_refs[0], case)
        assert resolver.resolve([wire.encode(video_refs[1]), text])["index"] == 1
        assert calls == [] and resolver.stats()["misses"] == 0, case


def test_a_processor_without_video_refuses_video_refs(store, small_processor, video_refs):
    result = resolve_wire_refs(store, [wire.encode(video_refs[0])], small_processor)
    refused(result, 0, "video_unsupported")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda f: {**f, "frames": 5},
        lambda f: {**f, "frames": None},
        lambda f: {**f, "frames": []},
        lambda f: {**f, "frames": [1.0]},
        lambda f: {**f, "frames": list(reversed(f["frames"]))},
        lambda f: {**f, "frames": [f["num_frames"]]},
        lambda f: {**f, "fps": "2"},
        lambda f: {**f, "pixel_values_videos": [1.0]},
        lambda f: {k: v for k, v in f.items() if k != "frames"},
    ],
)
def test_malformed_video_wire_refs(store, processor, video_refs, mutate):
    fields = json.loads(wire.encode(video_refs[0])[len(wire.VIDEO_PREFIX) :])
    text = wire.VIDEO_PREFIX + json.dumps(mutate(fields))
    result = resolve_wire_refs(store, [wire.encode(video_refs[1]), text], processor)
    refused(result, 1, "malformed_ref")


def test_wire_kinds_do_not_mix(store, processor, video_refs):
    # A video ref's JSON behind the image prefix is a malformed image ref, not a video.
    body = wire.encode(video_refs[0])[len(wire.VIDEO_PREFIX) :]
    refused(resolve_wire_refs(store, [wire.PREFIX + body], processor), 0, "malformed_ref")


def test_a_request_over_the_byte_budget_is_refused_before_any_decode(
    store, processor, video_refs, monkeypatch
):
    text = wire.encode(video_refs[0])
    one = ok(resolve_wire_refs(store, [text], processor))
    size = one["pixel_values_videos"].nbytes + one["video_grid_thw"].nbytes
    # Its frames decoded at full size, and the processor's copy: one clip at a time.
    ref = video_refs[0]
    decoding = 2 * len(ref.frames) * ref.width * ref.height * 3

    resolver = RefResolver(store, processor, max_request_bytes=3 * size + decoding)
    calls = counting(resolver, monkeypatch)
    refused(resolver.resolve([text] * 4), 3, "request_too_large")
    assert calls == [] and resolver.stats()["misses"] == 0
    ok(resolver.resolve([text] * 3))
    assert len(calls) == 1  # the same frames of one clip: processed once
    refused(
        RefResolver(store, processor, max_request_bytes=size + decoding - 1).resolve([text]),
        0,
        "request_too_large",
    )
    # The decoded frames count: tensors that fit, frames that do not, are refused.
    refused(
        RefResolver(store, processor, max_request_bytes=size + decoding // 2).resolve([text]),
        0,
        "request_too_large",
    )


def test_the_longest_ref_is_bounded_from_its_layout(
    store, processor, full_adapter, clips, monkeypatch
):
    # A long clip's 4096 frames, 64 times over: short text asking for tens of GB.
    media = clips[0].model_copy(update={"num_frames": 8192})
    ref = full_adapter.video.ref(media, range(4096), offset=0)
    resolver = RefResolver(store, processor)
    calls = counting(resolver, monkeypatch)
    result = resolver.resolve([wire.encode(ref)] * 64)
    refused(result, result["index"], "request_too_large")
    assert calls == []


def test_cache_key_holds_every_checked_fact(
    store, processor, full_adapter, clips, video_refs, monkeypatch
):
    resolver = RefResolver(store, processor)
    calls = counting(resolver, monkeypatch)
    text = wire.encode(video_refs[0])
    first = ok(resolver.resolve([text, text]))
    assert len(calls) == 1 and resolver.stats()["hits"] == 1
    ok(resolver.resolve([text]))
    assert len(calls) == 1

    # Other frames of the cached clip are another entry, processed anew.
    other = full_adapter.video.ref(clips[0], video_refs[0].frames[:2], offset=0)
    got = ok(resolver.resolve([wire.encode(other)]))
    assert len(calls) == 2
    assert np.array_equal(
        got["pixel_values_videos"], direct(store, full_adapter, other)["pixel_values_videos"]
    )
    # A cached hash paired with another rate or frame count misses and is probed, refused.
    for case in ("fps", "num_frames"):
        refused(resolver.resolve([_forge(store, video_refs[0], case)]), 0, "clip_mismatch")
    # Trust is checked on a hit too.
    refused(resolver.resolve([_forge(store, video_refs[0], "dotdot")]), 0, "untrusted_uri")
    again = ok(resolver.resolve([text]))
    # The forged refs missed (refused at the probe, before the processor); the good one hits.
    assert len(calls) == 2 and resolver.stats()["misses"] == 4
    expected = direct(store, full_adapter, video_refs[0])["pixel_values_videos"]
    assert np.array_equal(again["pixel_values_videos"], expected)
    assert np.array_equal(first["pixel_values_videos"], np.concatenate([expected, expected]))


def test_qwen25_videos_carry_second_per_grid_ts(store, clips):
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    ids = {**WORDS, **QWEN_VL.small_ids}
    tokenizer = word_level_tokenizer(ids, QWEN_VL.small_ids, unk="[UNK]", pad="<|endoftext|>")
    processor = Qwen2_5_VLProcessor(
        image_processor=QWEN_VL.image_processor(),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=False, **SMALL_VIDEO),
    )
    adapter = mmstore.adapter_for(processor)
    prompt = token_ids(processor, f"hello {VIDEO_TEXT} {VIDEO_TEXT} look")
    refs = adapter.expand_media(prompt, videos=clips, fps=2.0).videos
    result = ok(resolve_wire_refs(store, [wire.encode(r) for r in refs], processor))
    expected = [float(adapter.video.extras(r)["second_per_grid_ts"][0]) for r in refs]
    assert result["second_per_grid_ts"].dtype == np.float32
    assert result["second_per_grid_ts"].tolist() == pytest.approx(expected)
    assert expected[0] != expected[1]  # the two clips' rates differ: a real check


def test_processor_output_that_misses_the_span_is_refused(
    store, processor, video_refs, monkeypatch
):
    resolver = RefResolver(store, processor)
    video = resolver.adapter.video
    real = video.process

    def fewer_frames(frames: np.ndarray, ref: mmstore.VideoRef, *args: Any) -> Any:
        return real(frames[:1], ref, *args)  # one slab short of the ref's two

    monkeypatch.setattr(video, "process", fewer_frames)
    assert len(video_refs[0].frames) > video.layout.param("temporal_patch_size")
    for _ in range(2):  # checked on the hit too
        refused(resolver.resolve([wire.encode(video_refs[0])]), 0, "grid_mismatch")
