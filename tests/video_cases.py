"""One case per video family: what the video contract suite runs every family through.

``tests/test_video_contract.py`` runs the same tests on every :class:`VideoCase` in
:data:`VIDEO_CASES` (as ``tests/family_cases.py`` does for images: one suite, every
implementation). A case holds the family's full transformers processor over an offline
tokenizer at the tiny model's token ids, with a SMALL video processor (a few tokens per frame
slab, so the loader and the model tests are fast; its per-frame pixel cap set explicitly, as
the layout records it), the chat template's text for one video, the tiny random-weight model
and the clips (length, rate, size, sampling) whose layout is checked against the real
processor. Adding a video family to the suite is adding one case (GLM-4.1V, Qwen3-VL and
Kimi-K2.5 plug in the same way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from tests.families_common import tiny_model, tiny_qwen2_vl_config, word_level_tokenizer
from tests.family_cases import QWEN_VL, QWEN_VL_SMALL, WORDS, FamilyCase


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cache key
class ClipCase:
    """One clip to encode (``tests/video_clips.make_clip``) and how a rollout samples it:
    ``sampling`` holds ``fps=`` or ``num_frames=`` (the processor's own ``sample_frames``),
    ``frames=`` (explicit indices, given to the processor pre-sampled), or nothing (the
    processor's default: every frame)."""

    num_frames: int
    width: int
    height: int
    fps: float | Fraction
    sampling: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __str__(self) -> str:  # the pytest id
        how = ",".join(f"{k}={v}" for k, v in self.sampling.items()) or "all"
        return f"{self.num_frames}f-{self.width}x{self.height}@{float(self.fps):g}-{how}"

    @property
    def rate(self) -> float:
        return float(self.fps)

    @property
    def expand_kwargs(self) -> dict[str, Any]:
        """``adapter.expand_media``'s sampling arguments for this clip (one video)."""
        if "frames" in self.sampling:
            return {"frames": [list(self.sampling["frames"])]}
        return dict(self.sampling)


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cache key
class VideoCase:
    """Everything the video contract suite needs to know of one video family."""

    #: the pytest id (one family may have several video cases: Qwen2-VL, Qwen2.5-VL)
    name: str
    #: ``adapter.family`` (the image family's name)
    family: str
    #: the image case of the same family (its words, image text, image sizes)
    image_case: FamilyCase
    #: builds the full processor over an offline tokenizer at the tiny model's token ids,
    #: with a small video processor
    full: Callable[[], Any]
    #: what the chat template writes for one video
    video_text: str
    #: ``tiny_model(dtype, attn)``: a random-weight model taking the small processor's batches
    tiny_model: Callable[[torch.dtype, str], Any]
    #: the clips whose layout is checked against the real processor
    clips: tuple[ClipCase, ...]
    #: the model's video inputs the processor returns, besides the adapter's video tensors
    #: (e.g. Qwen2.5-VL's ``second_per_grid_ts``)
    extra_inputs: tuple[str, ...] = ()
    #: whether the model takes a batch holding images and videos (transformers' GLM-4V does
    #: not: its placeholder mask counts each image token as a video token too, and the
    #: processor's own inputs fail alike); without, the loader tests keep them apart
    images_with_videos: bool = True

    def __str__(self) -> str:
        return self.name

    def small(self) -> Any:
        """The full processor the tiny model takes (built once)."""
        return _cached_small(self)

    def text(self, *media: str) -> str:
        """A prompt's text: ``media`` ("image"/"video") in order, between two words."""
        first, last, _, _ = self.image_case.words
        parts = {"image": self.image_case.image_text, "video": self.video_text}
        return " ".join([first, *[parts[m] for m in media], last])

    @property
    def completion_text(self) -> str:
        return " ".join(self.image_case.words[2:])


@functools.cache
def _cached_small(case: VideoCase) -> Any:
    return case.full()


# -- Qwen2-VL and Qwen2.5-VL ---------------------------------------------------------------------

# A few tokens per two-frame slab: frames resized into 56*56..128*128 pixels.
QWEN_VIDEO_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 128 * 128}


def qwen_video_processor() -> Any:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(size=dict(QWEN_VIDEO_SIZE), cap_pixels_per_frame=False)


def _qwen_tokenizer() -> Any:
    return word_level_tokenizer(
        {**WORDS, **QWEN_VL_SMALL}, QWEN_VL_SMALL, unk="[UNK]", pad="<|endoftext|>"
    )


def qwen2_vl_full() -> Any:
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    return Qwen2VLProcessor(
        image_processor=QWEN_VL.image_processor(),
        tokenizer=_qwen_tokenizer(),
        video_processor=qwen_video_processor(),
    )


def qwen2_5_vl_full() -> Any:
    # Qwen2.5-VL has no image or video processor of its own: its hub configs name
    # Qwen2VLImageProcessor and Qwen2VLVideoProcessor under a Qwen2_5_VLProcessor.
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    return Qwen2_5_VLProcessor(
        image_processor=QWEN_VL.image_processor(),
        tokenizer=_qwen_tokenizer(),
        video_processor=qwen_video_processor(),
    )


def qwen2_vl_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
    return QWEN_VL.tiny_model(dtype, attn)


def qwen2_5_vl_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = tiny_qwen2_vl_config(num_hidden_layers=2, vocab_size=32).text_config.to_dict()
    config = Qwen2_5_VLConfig(
        text_config={k: text[k] for k in _TEXT_KEYS if k in text},
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,  # two merged patches: windowed attention has windows to form
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        image_token_id=QWEN_VL_SMALL["<|image_pad|>"],
        video_token_id=QWEN_VL_SMALL["<|video_pad|>"],
        vision_start_token_id=QWEN_VL_SMALL["<|vision_start|>"],
    )
    return tiny_model(Qwen2_5_VLForConditionalGeneration, config, dtype, attn=attn)


_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rope_scaling",
    "rope_parameters",
)

# Lengths 1..40 frames, rates 1/12/24/29.97/30, sizes from 16x16 to 482x90 and 64x480, each
# sampled by fps, by a frame count, explicitly, or whole.
QWEN_CLIPS = (
    ClipCase(24, 168, 112, 12, {"fps": 2}),
    ClipCase(1, 16, 16, 1, {"frames": (0,)}),
    ClipCase(40, 64, 480, 30, {"num_frames": 8}, seed=1),
    ClipCase(9, 482, 90, 24, {"fps": 8}, seed=2),
    ClipCase(30, 96, 72, Fraction(30000, 1001), {"fps": 4}, seed=3),
    ClipCase(7, 16, 16, 1, {}, seed=4),
    ClipCase(13, 90, 482, 24, {"frames": (0, 4, 5, 12)}, seed=5),
    ClipCase(40, 200, 56, 30, {"fps": 30}, seed=6),
    ClipCase(3, 28, 28, 12, {"num_frames": 2}, seed=7),
    ClipCase(16, 160, 160, Fraction(30000, 1001), {"num_frames": 6}, seed=8),
    ClipCase(10, 480, 60, 12, {"frames": (1, 2, 3, 7, 9)}, seed=9),
    ClipCase(12, 34, 62, 24, {"fps": 12}, seed=10),
)

QWEN2_VL_VIDEO = VideoCase(
    name="qwen2-vl",
    family="qwen-vl",
    image_case=QWEN_VL,
    full=qwen2_vl_full,
    video_text="<|vision_start|><|video_pad|><|vision_end|>",
    tiny_model=qwen2_vl_model,
    clips=QWEN_CLIPS,
)

QWEN2_5_VL_VIDEO = VideoCase(
    name="qwen2.5-vl",
    family="qwen-vl",
    image_case=QWEN_VL,
    full=qwen2_5_vl_full,
    video_text="<|vision_start|><|video_pad|><|vision_end|>",
    tiny_model=qwen2_5_vl_model,
    clips=QWEN_CLIPS,
    extra_inputs=("second_per_grid_ts",),
)

VIDEO_CASES: dict[str, VideoCase] = {c.name: c for c in (QWEN2_VL_VIDEO, QWEN2_5_VL_VIDEO)}


# -- GLM-4.1V, Qwen3-VL, Kimi-K2.5: timestamps as text inside the span ---------------------------
# Processors, tokenizers (digits and punctuation split, so timestamps are several tokens) and
# the Qwen3-VL tiny model live in tests/test_video_timestamped.py, which checks these families
# on its own clips. Their processors sample at 2 fps by default (none takes every frame
# unsampled), and GLM's sampler makes the count even: these clips sample explicitly, and GLM's
# explicit frame lists are even.
#
# The contract suite reads a span through the video half (its expansion, feature tokens,
# output_tokens), so timestamp text inside a span is laid out as the family does. GLM-4.1V:
# transformers' Glm4vModel cannot take images and videos in one batch (its
# get_placeholder_mask counts every <|image|> as both image and video tokens: the processor's
# own inputs fail too), so its loader tests keep image and video rows apart.


def _timestamped() -> Any:
    import tests.test_video_timestamped as timestamped

    return timestamped


TIMESTAMPED_CLIPS = (
    ClipCase(24, 168, 112, 12, {"fps": 2}),
    ClipCase(31, 100, 60, Fraction(30000, 1001), {"fps": 3}, seed=1),
    ClipCase(40, 64, 480, 30, {"num_frames": 8}, seed=2),
    ClipCase(9, 482, 90, 24, {"fps": 8}, seed=3),
    ClipCase(30, 96, 72, Fraction(30000, 1001), {"fps": 4}, seed=4),
    ClipCase(50, 320, 64, 25, {"fps": 4}, seed=5),
    ClipCase(13, 90, 482, 24, {"frames": (0, 4, 5, 12)}, seed=6),
    ClipCase(40, 200, 56, 30, {"fps": 30}, seed=7),
    ClipCase(100, 64, 64, Fraction(30000, 1001), {"fps": 5}, seed=8),
    ClipCase(16, 160, 160, Fraction(30000, 1001), {"num_frames": 6}, seed=9),
    ClipCase(10, 480, 60, 12, {"frames": (1, 2, 3, 7, 8, 9)}, seed=10),
    ClipCase(13, 111, 77, Fraction(24000, 1001), {"fps": 6}, seed=11),
)


def _timestamped_cases() -> tuple[VideoCase, ...]:
    from tests.family_cases import GLM4V, KIMI_K25, glm4v_model, kimi_k25_model

    def glm4v_full() -> Any:
        return _timestamped().glm4v_processor()

    def qwen3_vl_full() -> Any:
        return _timestamped().qwen3_vl_processor()

    def kimi_k25_full() -> Any:
        return _timestamped().kimi_k25_processor()

    def qwen3_vl_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
        return _timestamped().qwen3_vl_model(dtype, attn)

    return (
        VideoCase(
            name="glm4.1v",
            family="glm4v",
            image_case=GLM4V,
            full=glm4v_full,
            video_text="<|begin_of_video|><|video|><|end_of_video|>",
            tiny_model=glm4v_model,
            clips=TIMESTAMPED_CLIPS,
            images_with_videos=False,
        ),
        VideoCase(
            name="qwen3-vl",
            family="qwen-vl",
            image_case=QWEN_VL,
            full=qwen3_vl_full,
            video_text="<|vision_start|><|video_pad|><|vision_end|>",
            tiny_model=qwen3_vl_model,
            clips=TIMESTAMPED_CLIPS,
        ),
        VideoCase(
            name="kimi-k2.5",
            family="kimi-k25",
            image_case=KIMI_K25,
            full=kimi_k25_full,
            video_text="<|kimi_k25_video_placeholder|>",
            tiny_model=kimi_k25_model,
            clips=TIMESTAMPED_CLIPS,
        ),
    )


TIMESTAMPED_VIDEO_CASES: dict[str, VideoCase] = {c.name: c for c in _timestamped_cases()}
VIDEO_CASES.update(TIMESTAMPED_VIDEO_CASES)
