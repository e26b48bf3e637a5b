"""Video layouts whose spans hold timestamps as text: GLM-4.1V, Qwen3-VL and Kimi-K2.5.

Each family's processor writes, per frame slab (or chunk), the slab's time as text inside
the video span; the tokenizer turns it into ids, so the adapter's layout (segments of fixed
ids and text, :meth:`mmstore._families.VideoFamily.segments`) tokenizes the text with the
full processor's tokenizer. Checked here against the real full processors, clip by clip:
the expanded tokens equal the processor's ``input_ids`` (timestamps included), the video
tensors equal the processor's, a layout-only family (no tokenizer) accepts the right span
and refuses forged ones by structure, and each family's tiny random-weight model takes a
loader batch with a video and computes the same logits as from the processor's own inputs.

The offline tokenizers here split digits and punctuation into pieces (``<1.5 seconds>`` is
``< 1 . 5 seconds >``), so timestamp text spans several tokens, as in real tokenizers.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers.video_utils import VideoMetadata

import mmstore
from mmstore._families import layout_from_record, video_family_for_layout
from mmstore._families._video import VideoFamily
from mmstore._loading.collate import token_types
from tests.families_common import model_inputs, tiny_model
from tests.family_cases import (
    GLM4V_SMALL,
    KIMI_K25_SMALL,
    KIMI_K25_WORDS,
    QWEN_VL_SMALL,
    WORDS,
    glm4v_model,
    kimi_k25_model,
    token_ids,
)
from tests.rows import commit_existing
from tests.video_clips import decode_all, make_clip

NTSC = Fraction(30000, 1001)  # 29.97
FILM = Fraction(24000, 1001)  # 23.976

# -- offline processors -----------------------------------------------------------------------

# Timestamp pieces: digits, the punctuation of "<1.5 seconds>" and "00:00:01.500", and words.
PIECES = (*"0123456789", ":", ".", "<", ">", "seconds", "video")


def timestamp_tokenizer(vocab: Mapping[str, int], specials: Mapping[str, int], pad: str) -> Any:
    """A WordLevel tokenizer that splits on white space, punctuation and each digit; the
    timestamp pieces get the free ids below 32 (the tiny models' vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**vocab, **specials}
    free = iter(i for i in range(32) if i not in vocab.values())
    for piece in PIECES:
        vocab.setdefault(piece, next(free))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation(),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token=pad)


@functools.cache
def glm4v_processor() -> Any:
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    return Glm4vProcessor(
        image_processor=Glm4vImageProcessorPil(
            size={"shortest_edge": 112 * 112, "longest_edge": 2 * 28 * 28 * 16}
        ),
        tokenizer=timestamp_tokenizer(WORDS, GLM4V_SMALL, "<|endoftext|>"),
        # 4..16 merged patches per frame slab
        video_processor=Glm4vVideoProcessor(
            size={"shortest_edge": 2 * 28 * 28 * 4, "longest_edge": 2 * 28 * 28 * 16}
        ),
    )


@functools.cache
def qwen3_vl_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 16},
        ),
        tokenizer=timestamp_tokenizer(WORDS, QWEN_VL_SMALL, "<|endoftext|>"),
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": 2 * 32 * 32 * 2, "longest_edge": 2 * 32 * 32 * 8},
            cap_pixels_per_frame=False,
        ),
    )


@functools.cache
def kimi_k25_processor() -> Any:
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    return Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(
            max_patches=64, size={"max_height": 16, "max_width": 16}
        ),
        tokenizer=timestamp_tokenizer(KIMI_K25_WORDS, KIMI_K25_SMALL, "[PAD]"),
        video_processor=Kimi_K25VideoProcessor(max_patches=64),
    )


def qwen3_vl_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=QWEN_VL_SMALL["<|image_pad|>"],
        video_token_id=QWEN_VL_SMALL["<|video_pad|>"],
        vision_start_token_id=QWEN_VL_SMALL["<|vision_start|>"],
        vision_end_token_id=QWEN_VL_SMALL["<|vision_end|>"],
    )
    return tiny_model(Qwen3VLForConditionalGeneration, config, dtype, attn=attn)


@dataclass(frozen=True)
class Family:
    name: str
    processor: Callable[[], Any]
    #: the chat template's text for one video (its video token is the span)
    video_text: str
    model: Callable[..., Any]
    #: the per-token type tensor the processor and model use, if any
    token_types: bool
    #: a family token that no timestamp holds (replaces a timestamp token in a forgery)
    marker: str
    #: the layout's extra refusals: settings of the video processor that move the fingerprint
    layout_changes: Sequence[Mapping[str, Any]] = field(default_factory=tuple)


FAMILIES = {
    "glm4v": Family(
        "glm4v",
        glm4v_processor,
        "hello <|begin_of_video|><|video|><|end_of_video|> look",
        glm4v_model,
        True,
        "<|begin_of_image|>",
        (
            {"patch_size": 16},
            {"temporal_patch_size": 1},
            {"merge_size": 1},
            {"size": {"shortest_edge": 28 * 28, "longest_edge": 2 * 28 * 28 * 16}},
            {"size": {"shortest_edge": 2 * 28 * 28 * 4, "longest_edge": 2 * 28 * 28 * 32}},
        ),
    ),
    "qwen3-vl": Family(
        "qwen3-vl",
        qwen3_vl_processor,
        "hello <|vision_start|><|video_pad|><|vision_end|> look",
        qwen3_vl_model,
        True,
        "<|vision_start|>",
        (
            {"patch_size": 14},
            {"temporal_patch_size": 1},
            {"merge_size": 1},
            {"size": {"shortest_edge": 32 * 32, "longest_edge": 2 * 32 * 32 * 8}},
            {"size": {"shortest_edge": 2 * 32 * 32 * 2, "longest_edge": 2 * 32 * 32 * 16}},
            {"cap_pixels_per_frame": True},
            {"max_video_tokens": 100},
        ),
    ),
    "kimi-k25": Family(
        "kimi-k25",
        kimi_k25_processor,
        "a <|kimi_k25_video_placeholder|> b",
        kimi_k25_model,
        False,
        "<|media_content|>",
        (
            {"patch_size": 16},
            {"temporal_patch_size": 2},
            {"merge_size": 1},
            {"max_patches": 128},
            {"size": {"max_height": 256, "max_width": 256}},
        ),
    ),
}


@dataclass(frozen=True)
class Clip:
    num_frames: int
    width: int
    height: int
    fps: float | Fraction
    sampling: Mapping[str, Any]

    def __str__(self) -> str:
        how = ",".join(f"{k}={v}" for k, v in self.sampling.items())
        return f"{self.num_frames}f-{self.width}x{self.height}@{float(self.fps):.3g}-{how}"


CLIPS = [
    Clip(24, 168, 112, 12, {"fps": 2}),
    Clip(31, 100, 60, NTSC, {"fps": 3}),
    Clip(7, 57, 91, 10, {"fps": 1}),  # odd sizes; GLM samples one frame
    Clip(50, 320, 64, 25, {"fps": 4}),  # 5:1
    Clip(100, 64, 64, NTSC, {"fps": 5}),
    Clip(45, 200, 30, 15, {"fps": 2}),  # wide, short side scaled up
    Clip(16, 30, 240, 8, {"fps": 8}),  # tall
    Clip(90, 176, 144, NTSC, {"fps": 1}),
    Clip(13, 111, 77, FILM, {"fps": 6}),
    Clip(60, 80, 80, 60, {"fps": 0.5}),  # one second at half a frame a second
    Clip(40, 96, 54, NTSC, {"fps": 29.97}),  # every frame
    Clip(33, 72, 40, 30, {"num_frames": 5}),  # a frame count instead of a rate
]
CASES = [(f, c) for f in FAMILIES for c in CLIPS]
IDS = [f"{f}-{c}" for f, c in CASES]


@functools.cache
def adapter_of(name: str) -> Any:
    return mmstore.adapter_for(FAMILIES[name].processor())


def metadata(media: mmstore.MediaRef, frames: Sequence[int] | None = None) -> VideoMetadata:
    assert media.num_frames is not None and media.fps is not None
    return VideoMetadata(
        total_num_frames=media.num_frames,
        fps=media.fps,
        width=media.width,
        height=media.height,
        duration=media.num_frames / media.fps,
        frames_indices=None if frames is None else list(frames),
    )


def processor_output(
    processor: Any,
    text: str,
    data: bytes,
    media: mmstore.MediaRef,
    *,
    sampling: Mapping[str, Any] | None = None,
    frames: Sequence[int] | None = None,
) -> Any:
    """The real full processor on the decoded clip: it samples itself (``sampling``), or it
    is given the frames pre-sampled with their indices in the metadata (``frames``)."""
    decoded = decode_all(data)
    if frames is not None:
        video = torch.from_numpy(decoded[list(frames)]).permute(0, 3, 1, 2)
        return processor(
            text=text,
            videos=[video],
            video_metadata=[metadata(media, frames)],
            do_sample_frames=False,
            return_tensors="pt",
            return_metadata=True,
        )
    video = torch.from_numpy(decoded).permute(0, 3, 1, 2)
    sampling = dict(sampling or {})
    if "num_frames" in sampling:  # else the processor adds its default fps, and refuses both
        sampling["fps"] = None
    return processor(
        text=text,
        videos=[video],
        video_metadata=[metadata(media)],
        return_tensors="pt",
        return_metadata=True,
        **sampling,
    )


def span_of(tokens: Sequence[int], ref: Any) -> list[int]:
    return list(tokens[ref.offset : ref.offset + ref.length])


def layout_only(adapter: Any) -> VideoFamily:
    """The family a reader without the processor gets (verify, debug, read_checked)."""
    family = video_family_for_layout(adapter.video.layout)
    assert family.tokenizer is None
    return family


def assert_same_tensors(adapter: Any, frames: np.ndarray, ref: Any, expected: Any) -> None:
    got = adapter.video.process(frames, ref)
    assert set(got) == set(adapter.video.video_inputs)
    for key, value in got.items():
        assert value.shape == tuple(expected[key].shape), key
        np.testing.assert_array_equal(value, expected[key].numpy(), err_msg=key)
    adapter.video.check_output(got, ref, sample_id="s", video_index=0)


# -- spans and tensors equal the real processor's -----------------------------------------------


@pytest.mark.parametrize(("name", "clip"), CASES, ids=IDS)
def test_span_equals_processor(store: mmstore.Store, name: str, clip: Clip) -> None:
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    data = make_clip(clip.num_frames, clip.width, clip.height, clip.fps, seed=clip.num_frames)
    media = store.put_video(data)
    prompt = token_ids(processor, family.video_text)
    expanded = adapter.expand_media(prompt, videos=[media], **clip.sampling)
    out = processor_output(processor, family.video_text, data, media, sampling=clip.sampling)
    (ref,) = expanded.videos

    assert expanded.tokens == out["input_ids"][0].tolist()
    sampled = [int(i) for i in out["video_metadata"][0].frames_indices]
    if name == "glm4v" and len(ref.frames) % 2:  # GLM's sampler repeats the last of odd
        assert sampled == [*ref.frames, ref.frames[-1]]
    else:
        assert sampled == list(ref.frames)
    assert ref.length == len(adapter.video.expansion(ref))
    # The timestamps are there, as text: tokens that are no family token.
    span = span_of(expanded.tokens, ref)
    assert set(span) - adapter.video.family_token_ids
    if family.token_types:
        types = token_types(adapter, torch.tensor([expanded.tokens]))["mm_token_type_ids"]
        assert types[0].tolist() == out["mm_token_type_ids"][0].tolist()
        assert 2 in types[0].tolist()
    assert_same_tensors(adapter, decode_all(data)[list(ref.frames)], ref, out)
    for key, zeros in adapter.video.placeholder(ref).items():  # a missing clip's stand-in
        assert zeros.shape == tuple(out[key].shape), key
        if zeros.dtype.kind != "f":
            np.testing.assert_array_equal(zeros, out[key].numpy())
    # Both checks accept it: exact (the tokenizer) and structural (layout only).
    assert adapter.video.check_span(span, ref) is None
    assert layout_only(adapter).check_span(span, ref) is None


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("frames", [(0, 3, 5, 9, 10, 17), (1, 2, 4, 8, 16)], ids=["even", "odd"])
def test_explicit_frames(store: mmstore.Store, name: str, frames: tuple[int, ...]) -> None:
    """Explicit frames: the processor given exactly those frames, pre-sampled (GLM: with the
    last repeated to an even count, as its own sampler gives)."""
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    data = make_clip(18, 130, 50, NTSC, seed=3)
    media = store.put_video(data)
    expanded = adapter.expand_media(
        token_ids(processor, family.video_text), videos=[media], frames=[list(frames)]
    )
    given = [*frames, frames[-1]] if name == "glm4v" and len(frames) % 2 else list(frames)
    out = processor_output(processor, family.video_text, data, media, frames=given)
    (ref,) = expanded.videos
    assert ref.frames == frames
    assert expanded.tokens == out["input_ids"][0].tolist()
    assert_same_tensors(adapter, decode_all(data)[list(frames)], ref, out)


@pytest.mark.parametrize(
    "text",
    [
        "<|vision_start|><|video_pad|><|vision_end|>",  # the chat template's
        "<|video_pad|>",  # a bare video token
        "<|vision_start|><|video_pad|> a <|video_pad|><|vision_end|>",  # neither wrapped
        "<|video_pad|> <|vision_start|><|video_pad|><|vision_end|>",  # one of two wrapped
    ],
    ids=["wrapped", "bare", "half-wrapped", "one-of-two"],
)
def test_qwen3_vl_wrapper_as_the_processor_treats_it(store: mmstore.Store, text: str) -> None:
    """Whether the processor replaces the template's <|vision_start|>...<|vision_end|> with
    the video token (transformers 5.25 does; 5.24 keeps the pair), expand_media gives its
    tokens: a span never keeps a pair the processor dropped, nor drops one it kept."""
    family, adapter = FAMILIES["qwen3-vl"], adapter_of("qwen3-vl")
    processor = family.processor()
    data = make_clip(8, 64, 64, 8, seed=2)
    media = store.put_video(data)
    count = text.count("<|video_pad|>")
    frames = [(0, 3, 5, 7)] * count
    expanded = adapter.expand_media(
        token_ids(processor, text), videos=[media] * count, frames=frames
    )
    decoded = torch.from_numpy(decode_all(data)[list(frames[0])]).permute(0, 3, 1, 2)
    out = processor(
        text=text,
        videos=[decoded] * count,
        video_metadata=[metadata(media, frames[0]) for _ in range(count)],
        do_sample_frames=False,
        return_tensors="pt",
        return_metadata=True,
    )
    assert expanded.tokens == out["input_ids"][0].tolist()
    for ref in expanded.videos:
        assert adapter.video.check_span(span_of(expanded.tokens, ref), ref) is None


def test_qwen3_vl_needs_two_frames(store: mmstore.Store) -> None:
    """Qwen3-VL's resize refuses fewer frames than a slab (ValueError in transformers): the
    layout refuses the ref with a typed error before any span exists."""
    family, adapter = FAMILIES["qwen3-vl"], adapter_of("qwen3-vl")
    media = store.put_video(make_clip(1, 64, 64, 24))
    with pytest.raises(mmstore.ImageSizeError, match="1 frames of a 64x64 video"):
        adapter.expand_media(token_ids(family.processor(), family.video_text), videos=[media])


def test_glm4v_single_frame(store: mmstore.Store) -> None:
    """GLM's sampler gives one frame twice; the ref names it once and lays out two."""
    family, adapter = FAMILIES["glm4v"], adapter_of("glm4v")
    processor = family.processor()
    data = make_clip(1, 90, 60, 24)
    media = store.put_video(data)
    expanded = adapter.expand_media(token_ids(processor, family.video_text), videos=[media])
    out = processor_output(processor, family.video_text, data, media, sampling={})
    assert expanded.videos[0].frames == (0,)
    assert expanded.tokens == out["input_ids"][0].tolist()
    assert_same_tensors(adapter, decode_all(data)[[0]], expanded.videos[0], out)


def test_glm4v_token_types_with_an_image(store: mmstore.Store) -> None:
    """GLM lays video frames out with its image token: the per-token types are 1 on the
    image's, 2 on the video's (between begin/end of video), as the processor's."""
    from tests.families_common import noise

    family, adapter = FAMILIES["glm4v"], adapter_of("glm4v")
    processor = family.processor()
    text = "hello <|begin_of_image|><|image|><|end_of_image|> " + family.video_text
    image = noise(90, 70, 1)
    data = make_clip(20, 100, 70, 10)
    media = store.put_video(data)
    expanded = adapter.expand_media(
        token_ids(processor, text), images=[store.put_image(image)], videos=[media], fps=2
    )
    decoded = torch.from_numpy(decode_all(data)).permute(0, 3, 1, 2)
    out = processor(
        text=text,
        images=[image],
        videos=[decoded],
        video_metadata=[metadata(media)],
        fps=2,
        return_tensors="pt",
    )
    assert expanded.tokens == out["input_ids"][0].tolist()
    types = token_types(adapter, torch.tensor([expanded.tokens]))["mm_token_type_ids"][0]
    assert types.tolist() == out["mm_token_type_ids"][0].tolist()
    assert {1, 2} <= set(types.tolist())


# -- the layout-only (structural) check ----------------------------------------------------------


def _slabs(video: VideoFamily, ref: Any) -> list[list[int]]:
    """The span's tokens per slab (a slab's segments: Qwen3 starts with its text, GLM ends
    with it, Kimi has two texts), from the bound family's segments."""
    per_slab = {"glm4v": 2, "qwen-vl": 2, "kimi-k25": 4}[video.family]
    segments = video.segments(ref)
    out = []
    for i in range(0, len(segments), per_slab):
        slab: list[int] = []
        for segment in segments[i : i + per_slab]:
            slab += video.text_ids(segment) if isinstance(segment, str) else segment
        out.append(slab)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_structural_check_refuses_forged_spans(store: mmstore.Store, name: str) -> None:
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    tokenizer = processor.tokenizer
    media = store.put_video(make_clip(40, 120, 80, NTSC, seed=5))
    expanded = adapter.expand_media(token_ids(processor, family.video_text), videos=[media], fps=4)
    (ref,) = expanded.videos
    span = span_of(expanded.tokens, ref)
    bound, plain = adapter.video, layout_only(adapter)
    slabs = _slabs(bound, ref)
    assert [t for slab in slabs for t in slab] == span and len(slabs) >= 2
    assert plain.check_span(span, ref) is None
    marker = tokenizer.convert_tokens_to_ids(family.marker)
    digit = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    text_at = [i for i, t in enumerate(span) if t not in bound.family_token_ids]

    # a timestamp token replaced by a special token of the family
    forged = list(span)
    forged[text_at[0]] = marker
    assert plain.check_span(forged, ref) is not None
    assert bound.check_span(forged, ref) is not None
    # one frame slab short
    short = [t for slab in slabs[:-1] for t in slab]
    assert plain.check_span(short, ref) is not None
    assert bound.check_span(short, ref) is not None
    # a marker missing (the first family token that is not a feature token)
    features = {bound.feature_token_id}
    at = next(i for i, t in enumerate(span) if t in bound.family_token_ids and t not in features)
    missing = span[:at] + span[at + 1 :]
    assert plain.check_span(missing, ref) is not None
    assert bound.check_span(missing, ref) is not None
    # a feature token too many, and timestamp text far too long
    at = span.index(bound.feature_token_id)
    assert plain.check_span([*span[:at], span[at], *span[at:]], ref) is not None
    long = [*span[: text_at[0]], *[min(digit)] * 20, *span[text_at[0] :]]
    assert plain.check_span(long, ref) is not None
    # Another digit in a timestamp is well formed: only the tokenizer can tell it is wrong.
    other = list(span)
    first_digit = next(i for i in text_at if span[i] in digit)
    other[first_digit] = next(d for d in sorted(digit) if d != span[first_digit])
    assert plain.check_span(other, ref) is None
    assert "not the" in (bound.check_span(other, ref) or "")


@pytest.mark.parametrize("name", FAMILIES)
def test_writer_refuses_a_span_one_slab_short(store: mmstore.Store, name: str) -> None:
    """The write-time check (check_video_spans) runs the family's check_span."""
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    media = store.put_video(make_clip(30, 96, 64, 15, seed=2))
    expanded = adapter.expand_media(token_ids(processor, family.video_text), videos=[media], fps=3)
    (ref,) = expanded.videos
    last = _slabs(adapter.video, ref)[-1]
    end = ref.offset + ref.length
    tokens = expanded.tokens[: end - len(last)] + expanded.tokens[end:]
    forged = ref.model_copy(update={"length": ref.length - len(last)})

    def row(sid: str, tokens: list[int], ref: Any) -> mmstore.Rollout:
        return mmstore.Rollout(
            sample_id=sid,
            tokens=tokens,
            prompt_len=len(tokens),
            loss_mask=[False] * len(tokens),
            videos=[ref],
        )

    with store.writer("r", 0, adapter=adapter) as writer:
        writer.write(row("good", expanded.tokens, ref))
        with pytest.raises(mmstore.InvalidRolloutError, match=r"video span \[") as err:
            writer.write(row("forged", tokens, forged))
    assert err.value.video_index == 0


# -- layouts: records, fingerprints ---------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_layout_record_and_fingerprint(name: str) -> None:
    import copy

    family, adapter = FAMILIES[name], adapter_of(name)
    video = adapter.video
    expected = {"glm4v": "Glm4vVideo", "qwen3-vl": "Qwen3VLVideo", "kimi-k25": "KimiK25Video"}
    assert type(video).__name__ == expected[name]
    record = video.layout.params()
    rebuilt = layout_from_record(record)
    assert rebuilt.fingerprint == video.fingerprint
    assert type(video_family_for_layout(rebuilt)) is type(video)
    fingerprints = {video.fingerprint}
    for change in family.layout_changes:
        processor = copy.deepcopy(family.processor())
        for key, value in change.items():
            setattr(processor.video_processor, key, value)
        moved = mmstore.adapter_for(processor).video.fingerprint
        assert moved not in fingerprints, change
        fingerprints.add(moved)


def test_qwen2_vl_video_is_still_qwen_vl_video() -> None:
    from tests.family_cases import QWEN_VL

    video = mmstore.adapter_for(QWEN_VL.small("pil")).video
    assert type(video).__name__ == "QwenVLVideo"
    assert not video.has_text
    assert type(video_family_for_layout(layout_from_record(video.layout.params()))) is type(video)


# -- the tiny model takes a loader batch ----------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_model_takes_loader_batch(store: mmstore.Store, name: str) -> None:
    """A loader batch with a video runs the family's tiny model, and its logits over the
    prompt equal the model's on the processor's own inputs for the same clip."""
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    data = make_clip(20, 100, 60, NTSC, seed=7)
    media = store.put_video(data)
    prompt = token_ids(processor, family.video_text)
    expanded = adapter.expand_media(prompt, videos=[media], fps=3)
    completion = prompt[-1:] * 2
    with store.writer("r", 0, adapter=adapter) as writer:
        for sid in ("s0", "s1"):
            writer.write(
                mmstore.Rollout(
                    sample_id=sid,
                    tokens=expanded.tokens + completion,
                    prompt_len=len(expanded.tokens),
                    loss_mask=[False] * len(expanded.tokens) + [True] * len(completion),
                    videos=expanded.videos,
                    reward=1.0,
                    advantage=0.5,
                )
            )
    dataset = mmstore.RolloutDataset(store, processor, dtype=torch.float32)
    loader = mmstore.RolloutLoader(dataset, batch_size=2)
    batch = next(iter(loader))
    assert batch["pixel_values_videos"] is not None
    model = family.model(torch.float32)
    out = processor_output(processor, family.video_text, data, media, sampling={"fps": 3})
    names = ["input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw"]
    if family.token_types:
        names.append("mm_token_type_ids")
    own = {k: out[k] for k in names}
    with torch.no_grad():
        got = model(**model_inputs(loader, batch)).logits
        want = model(**own).logits
    n = len(expanded.tokens)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0, :n], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, :n], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_readers_check_by_structure_the_loader_exactly(store: mmstore.Store, name: str) -> None:
    """A row whose timestamp holds another digit is well formed: the writer, whose adapter
    tokenizes the timestamps, refuses it; committed by another engine, a reader without the
    processor (the footer's layout-only family) accepts it, and the loader, whose family
    tokenizes the timestamps, refuses it. The honest row passes all three."""
    family, adapter = FAMILIES[name], adapter_of(name)
    processor = family.processor()
    tokenizer = processor.tokenizer
    media = store.put_video(make_clip(30, 96, 64, NTSC, seed=4))
    expanded = adapter.expand_media(token_ids(processor, family.video_text), videos=[media], fps=2)
    (ref,) = expanded.videos
    digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    at = next(i for i in range(ref.offset, ref.offset + ref.length) if expanded.tokens[i] in digits)
    other = list(expanded.tokens)
    other[at] = next(d for d in sorted(digits) if d != other[at])

    def row(sid: str, tokens: list[int]) -> mmstore.Rollout:
        return mmstore.Rollout(
            sample_id=sid,
            tokens=[*tokens, tokens[-1]],
            prompt_len=len(tokens),
            loss_mask=[False] * len(tokens) + [True],
            videos=[ref],
        )

    with store.writer("r", 0, adapter=adapter) as writer:
        writer.write(row("ok", expanded.tokens))
        with pytest.raises(mmstore.InvalidRolloutError, match="not the") as refused:
            writer.write(row("other", other))
    assert refused.value.video_index == 0 and refused.value.sample_id == "other"
    # Another engine commits it anyway: the honest file with the other row's tokens.
    root = store.backend.abspath("rollouts")
    (honest,) = (
        os.path.relpath(p, os.path.dirname(root)) for p in glob.glob(f"{root}/*/*/*.parquet")
    )
    table = pq.ParquetFile(store.backend.abspath(honest)).read()
    tokens = pa.array([[*other, other[-1]]], table.schema.field("tokens").type)
    forged = table.set_column(table.schema.get_field_index("tokens"), "tokens", tokens)
    forged = forged.set_column(
        table.schema.get_field_index("sample_id"), "sample_id", pa.array(["other"])
    )
    path = honest.replace("step=0", "step=1")
    os.makedirs(os.path.dirname(store.backend.abspath(path)), exist_ok=True)
    pq.write_table(forged, store.backend.abspath(path))
    commit_existing(store, path)
    back = {r.sample_id: r for r in store.rollouts("r")}
    assert back["ok"].videos == [ref] and back["other"].tokens[:-1] == other
    dataset = mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False)
    loader = mmstore.RolloutLoader(dataset, batch_size=1)
    with pytest.raises(mmstore.InvalidRolloutError, match="not the") as err:
        for batch in loader:
            assert batch["sample_ids"] == ["ok"]
    assert err.value.sample_id == "other"


def test_kimi_k25_oversampling_is_a_typed_error(store: mmstore.Store) -> None:
    """Kimi-K2.5's sampler refuses more frames than the clip has (transformers raises
    ValueError): expand_media says so with a typed error naming the clip."""
    family, adapter = FAMILIES["kimi-k25"], adapter_of("kimi-k25")
    media = store.put_video(make_clip(10, 64, 64, 10))
    with pytest.raises(mmstore.InvalidArgumentError, match=r"cannot sample .*10 frames at 10 fps"):
        adapter.expand_media(
            token_ids(family.processor(), family.video_text), videos=[media], fps=30
        )
