"""One case per model family: what the contract suite runs every family through.

``tests/test_family_contract.py`` runs the same tests on every :class:`FamilyCase` in
:data:`CASES` (shaped like fsspec's ``tests/abstract``: one suite, every implementation). A
case holds the family's real transformers processors (the PIL and the torchvision backend
where both exist), full processors over an offline tokenizer (the published token ids, and
small ids for the tiny model), the tiny random-weight model, the chat template's text for one
image, the sizes to check the layout at and the settings that move the fingerprint. What only
one family does is tested in its own file (``tests/test_family_<name>.py``, Qwen-VL's in
``tests/test_adapter.py``), which builds its processors from the same helpers here.

Adding a family to the suite is adding one case to :data:`CASES` (a third party's family
too: ``tests/test_family_registry.py`` says how).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from tests.conftest import SMALL_MAX_PIXELS
from tests.families_common import noise, tiny_model, tiny_qwen2_vl_config, word_level_tokenizer

Size = tuple[int, int]


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cache key
class FamilyCase:
    """Everything the contract suite needs to know of one family (the tests derive the rest
    from the adapter)."""

    #: ``adapter.family``
    family: str
    #: the image processor classes: {"pil": ..., "torchvision": ...} (the ones that exist)
    backends: Mapping[str, type]
    #: the small image processor's settings (fast to load and train on; its layout's
    #: fingerprint is moved by each of :attr:`layout_changes`)
    small_settings: Mapping[str, Any]
    #: ``full(image_processor, ids)``: the family's full transformers processor over an
    #: offline tokenizer holding these special token ids (:attr:`published_ids` or
    #: :attr:`small_ids`)
    full: Callable[[Any, Mapping[str, int]], Any]
    #: the family's special tokens at their published ids, and at the tiny model's ids
    published_ids: Mapping[str, int]
    small_ids: Mapping[str, int]
    #: which of those tokens is the one a chat template emits per image, the one the
    #: image features land on, the pad token, and the ones only image spans hold
    image_token: str
    feature_token: str
    pad_token: str
    special_tokens: tuple[str, ...]
    #: what the chat template writes for one image
    image_text: str
    #: four words of the tokenizer: text before and after the images, then a completion
    words: tuple[str, str, str, str]
    #: name -> builder of a full processor with published settings and ids; the layout is
    #: checked against each at every one of :attr:`sizes`; the first is the family's flagship
    published_layouts: Mapping[str, Callable[[], Any]]
    #: its flagship layout: ``dict(layout.parameters)`` and the fingerprint stores record
    layout_parameters: Mapping[str, Any]
    fingerprint: str
    #: sizes to check the expansion at (tiny, odd, extreme, screens)
    sizes: tuple[Size, ...]
    #: three image sizes for rows in a store (small: the tiny model trains on them)
    store_sizes: tuple[Size, Size, Size]
    #: ``tiny_model(dtype, attn)``: a random-weight model taking the small processor's batches
    tiny_model: Callable[[torch.dtype, str], Any]
    #: ``RolloutLoader.model_input_names`` of a padded batch
    model_input_names: tuple[str, ...]
    #: settings of the small image processor that each move the fingerprint
    layout_changes: tuple[Mapping[str, Any], ...]
    #: layout parameters the small *full* processor sets apart from its image processor
    small_full_parameters: Mapping[str, Any] = field(default_factory=dict)
    #: sizes the flagship processor refuses (so must the adapter, with this message)
    unrepresentable: tuple[Size, ...] = ()
    unrepresentable_match: str = ""
    #: sizes where the torchvision backend is compared with the PIL one, and how many 8-bit
    #: gray levels their resampling may differ by at a pixel
    backend_sizes: tuple[Size, ...] = ((1, 1), (3, 7), (641, 479), (1920, 1080), (5, 1000))
    backend_levels: float = 2
    #: whether that comparison runs on noise too, besides a gradient
    backend_noise: bool = True
    #: settings that do not move the fingerprint, besides the ones every family ignores
    neutral_changes: tuple[Mapping[str, Any], ...] = ()
    #: what an image processor alone must carry to know its layout, which otherwise only the
    #: full processor says (Pixtral's spatial merge); without them it is refused, never guessed
    alone_needs: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:  # the pytest id
        return self.family

    def image_processor(self, backend: str = "", **changes: Any) -> Any:
        """The small image processor (in ``backend``, else the family's first), with
        ``changes`` applied to its settings."""
        cls = self.backends[backend] if backend else next(iter(self.backends.values()))
        return cls(**{**copy.deepcopy(dict(self.small_settings)), **copy.deepcopy(changes)})

    def small(self, backend: str = "") -> Any:
        """The full processor the tiny model takes: small settings, small token ids."""
        return _cached_small(self, backend)

    def published(self, name: str = "") -> Any:
        """A published full processor (the flagship by default), built once."""
        return _cached_published(self, name or next(iter(self.published_layouts)))

    def text(self, n_images: int) -> str:
        """A prompt's text with ``n_images`` images, as the chat template writes them."""
        first, last, _, _ = self.words
        return " ".join([first, *[self.image_text] * n_images, last])

    @property
    def completion_text(self) -> str:
        return " ".join(self.words[2:])


@functools.cache
def _cached_small(case: FamilyCase, backend: str) -> Any:
    return case.full(case.image_processor(backend), case.small_ids)


@functools.cache
def _cached_published(case: FamilyCase, name: str) -> Any:
    return case.published_layouts[name]()


def token_ids(processor: Any, text: str) -> list[int]:
    """``text`` in the processor's tokenizer (the offline ones add no special tokens)."""
    return [int(t) for t in processor.tokenizer(text)["input_ids"]]


def rollout(
    case: FamilyCase,
    processor: Any,
    sample_id: str,
    media: Sequence[mmstore.MediaRef],
    *,
    adapter: Any = None,
) -> mmstore.Rollout:
    """A row as a rollout writes it: the chat template's prompt with one image per ``media``,
    expanded by the adapter, then a completion (the only tokens in the loss)."""
    adapter = adapter or mmstore.adapter_for(processor)
    tokens, refs = adapter.expand(token_ids(processor, case.text(len(media))), list(media))
    completion = token_ids(processor, case.completion_text)
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=tokens + completion,
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * len(completion),
        images=refs,
        reward=1.0,
        advantage=0.5,
    )


def write_rows(
    store: mmstore.Store,
    case: FamilyCase,
    processor: Any,
    rows: Sequence[tuple[str, Sequence[Image.Image]]],
    *,
    run_id: str = "r",
    step: int = 0,
) -> list[mmstore.Rollout]:
    """Put each row's images and commit the rows ``(sample_id, images)`` in one file."""
    adapter = mmstore.adapter_for(processor)
    written = []
    with store.writer(run_id=run_id, step=step, adapter=adapter) as writer:
        for sample_id, images in rows:
            media = [store.put_image(image) for image in images]
            written.append(rollout(case, processor, sample_id, media, adapter=adapter))
            writer.write(written[-1])
    return written


def store_images(case: FamilyCase) -> tuple[Image.Image, Image.Image, Image.Image]:
    """The case's three store images, each its own noise."""
    a, b, c = (noise(w, h, seed) for seed, (w, h) in enumerate(case.store_sizes, start=1))
    return a, b, c


# -- Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) --------------------------------------------------

QWEN_VL_PUBLISHED = {
    "<|endoftext|>": 151643,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
QWEN_VL_SMALL = {
    "<|endoftext|>": 1,
    "<|vision_start|>": 11,
    "<|vision_end|>": 12,
    "<|image_pad|>": 13,
    "<|video_pad|>": 14,
}
QWEN3_VL_SETTINGS = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
# Shared by the families with WordLevel test tokenizers of words.
WORDS = {"[UNK]": 0, "hello": 2, "look": 3, "answer": 4, "yes": 5}


def qwen_vl_processor(image_processor: Any, ids: Mapping[str, int]) -> Any:
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = word_level_tokenizer({**WORDS, **ids}, ids, unk="[UNK]", pad="<|endoftext|>")
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )


def qwen_vl_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import Qwen2VLForConditionalGeneration

    config = tiny_qwen2_vl_config(
        num_hidden_layers=2,
        vocab_size=32,
        image_token_id=QWEN_VL_SMALL["<|image_pad|>"],
        video_token_id=QWEN_VL_SMALL["<|video_pad|>"],
        vision_start_token_id=QWEN_VL_SMALL["<|vision_start|>"],
    )
    return tiny_model(Qwen2VLForConditionalGeneration, config, dtype, attn=attn)


QWEN_VL = FamilyCase(
    family="qwen-vl",
    backends={"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor},
    small_settings={"size": {"shortest_edge": 56 * 56, "longest_edge": SMALL_MAX_PIXELS}},
    full=qwen_vl_processor,
    published_ids=QWEN_VL_PUBLISHED,
    small_ids=QWEN_VL_SMALL,
    image_token="<|image_pad|>",
    feature_token="<|image_pad|>",
    pad_token="<|endoftext|>",
    special_tokens=("<|image_pad|>",),
    image_text="<|vision_start|><|image_pad|><|vision_end|>",
    words=("hello", "look", "answer", "yes"),
    published_layouts={
        "qwen2": lambda: qwen_vl_processor(Qwen2VLImageProcessorPil(), QWEN_VL_PUBLISHED),
        "qwen3": lambda: qwen_vl_processor(
            Qwen2VLImageProcessorPil(**copy.deepcopy(QWEN3_VL_SETTINGS)), QWEN_VL_PUBLISHED
        ),
    },
    layout_parameters={
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 1280,
    },
    fingerprint="e67b02d6e1613ce8",  # the first release's: stored Qwen-VL layouts keep it
    sizes=(
        # tiny and odd
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 7),
        (7, 3),
        (13, 13),
        (27, 29),
        (28, 28),
        (55, 57),
        (56, 56),
        (101, 37),
        (255, 257),
        (333, 777),
        (641, 479),
        (999, 1001),
        # extreme aspect ratios, up to exactly 1:200
        (1, 200),
        (200, 1),
        (3, 600),
        (5, 1000),
        (1000, 5),
        (28, 5600),
        (5600, 28),
        (8000, 40),
        # around Qwen2-VL's max_pixels (1280 * 28 * 28 = 1003520)
        (1280, 784),
        (1281, 785),
        # screens: 1080p, 1440p, 4K, and portrait phone screenshots
        (1920, 1080),
        (2560, 1440),
        (3840, 2160),
        (1080, 1920),
        (750, 1334),
        (1170, 2532),
        (1284, 2778),
        (1440, 3200),
    ),
    store_sizes=((112, 84), (57, 91), (64, 48)),
    tiny_model=qwen_vl_model,
    model_input_names=(
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        # the full processor's video half (None in a batch without videos)
        "pixel_values_videos",
        "video_grid_thw",
        "mm_token_type_ids",
    ),
    layout_changes=(
        {"patch_size": 16},
        {"temporal_patch_size": 1},
        {"merge_size": 1},
        {"size": {"shortest_edge": 28 * 28, "longest_edge": SMALL_MAX_PIXELS}},
        {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}},
        {"min_pixels": 65536},
        {"max_pixels": 16777216},
    ),
    unrepresentable=((1, 201), (201, 1), (2, 403), (5, 1001)),
    unrepresentable_match="aspect ratio",
    # PIL's and torchvision's bicubic kernels, scaling 5-pixel-wide noise up to 28, differ by
    # up to 21 gray levels at a pixel; on a gradient by at most 2.
    backend_noise=False,
)


# -- GLM-4.1V / GLM-4.5V ----------------------------------------------------------------------

# GLM-4.1V's tokenizer, as published (zai-org/GLM-4.1V-9B-Thinking).
GLM4V_PUBLISHED = {
    "<|endoftext|>": 151329,
    "<|begin_of_image|>": 151339,
    "<|end_of_image|>": 151340,
    "<|begin_of_video|>": 151341,
    "<|end_of_video|>": 151342,
    "<|image|>": 151343,
    "<|video|>": 151344,
}
GLM4V_SMALL = {
    "<|endoftext|>": 1,
    "<|begin_of_image|>": 12,
    "<|end_of_image|>": 13,
    "<|begin_of_video|>": 14,
    "<|end_of_video|>": 15,
    "<|image|>": 10,
    "<|video|>": 11,
}
GLM4V_IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"  # what GLM's chat template emits
# A small pixel budget: 8..16 image tokens per image, so the loader and model tests are fast.
GLM4V_SMALL_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 2 * 28 * 28 * 16}


def glm4v_processor(image_processor: Any, ids: Mapping[str, int]) -> Any:
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    return Glm4vProcessor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer({**WORDS, **ids}, ids, unk="[UNK]", pad="<|endoftext|>"),
        video_processor=Glm4vVideoProcessor(),
    )


def glm4v_model(dtype: torch.dtype, attn: str = "sdpa") -> Any:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(
        text_config=dict(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            # head_dim 16, half of it rotary: 4 frequencies split over (t, h, w)
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "partial_rotary_factor": 0.5,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            image_size=28,
        ),
        image_token_id=GLM4V_SMALL["<|image|>"],
        video_token_id=GLM4V_SMALL["<|video|>"],
        image_start_token_id=GLM4V_SMALL["<|begin_of_image|>"],
        image_end_token_id=GLM4V_SMALL["<|end_of_image|>"],
        video_start_token_id=GLM4V_SMALL["<|begin_of_video|>"],
        video_end_token_id=GLM4V_SMALL["<|end_of_video|>"],
    )
    return tiny_model(Glm4vForConditionalGeneration, config, dtype, attn=attn)


GLM4V = FamilyCase(
    family="glm4v",
    backends={"pil": Glm4vImageProcessorPil, "torchvision": Glm4vImageProcessor},
    small_settings={"size": GLM4V_SMALL_SIZE},
    full=glm4v_processor,
    published_ids=GLM4V_PUBLISHED,
    small_ids=GLM4V_SMALL,
    image_token="<|image|>",
    feature_token="<|image|>",
    pad_token="<|endoftext|>",
    special_tokens=("<|image|>",),
    image_text=GLM4V_IMAGE,
    words=("hello", "look", "answer", "yes"),
    published_layouts={
        "glm4.1v": lambda: glm4v_processor(Glm4vImageProcessorPil(), GLM4V_PUBLISHED),
    },
    layout_parameters={
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 112 * 112,
        "max_pixels": 28 * 28 * 15000,
    },
    fingerprint="3c64c507de6b3c79",
    sizes=(
        # tiny and odd: GLM scales sides under 28 up, then up to min_pixels
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 7),
        (13, 13),
        (27, 29),
        (28, 28),
        (55, 57),
        (101, 37),
        (255, 257),
        (641, 479),
        (999, 1001),
        # around min_pixels (12544 counts two frames: 6272 image pixels)
        (112, 56),
        (84, 56),
        # extreme aspect ratios, up to exactly 1:200 after the small side is scaled up
        (1, 200),
        (200, 1),
        (5, 1000),
        (1000, 5),
        (28, 5600),
        (5600, 28),
        # around max_pixels (11760000 over two frames: 2800x2100 fits exactly)
        (2800, 2100),
        (2801, 2101),
        # screens: 1080p, 1440p, 4K, portrait phones
        (1920, 1080),
        (2560, 1440),
        (3840, 2160),
        (1080, 1920),
        (1170, 2532),
    ),
    store_sizes=((300, 200), (57, 91), (640, 480)),
    tiny_model=glm4v_model,
    model_input_names=(
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        # the full processor's video half (None in a batch without videos)
        "pixel_values_videos",
        "video_grid_thw",
        "mm_token_type_ids",
    ),
    layout_changes=(
        {"patch_size": 16},
        {"temporal_patch_size": 1},
        {"merge_size": 1},
        {"size": {**GLM4V_SMALL_SIZE, "shortest_edge": 56 * 56}},
        {"size": {**GLM4V_SMALL_SIZE, "longest_edge": 2 * 28 * 28 * 32}},
    ),
    unrepresentable=((1, 201), (201, 1), (3, 700), (300, 1)),
    unrepresentable_match="aspect ratio",
)


# -- Kimi-K2.5 --------------------------------------------------------------------------------

KIMI_K25_PUBLISHED = {
    "[PAD]": 163839,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
}
# Small ids for the model tests (a 32-token vocabulary), read from the tokenizer.
KIMI_K25_SMALL = {
    "[PAD]": 1,
    "<|media_begin|>": 20,
    "<|media_content|>": 22,
    "<|media_end|>": 23,
    "<|media_pad|>": 24,
    "<|kimi_k25_video_placeholder|>": 25,
}
KIMI_K25_WORDS = {"[UNK]": 0, "a": 2, "b": 3, "c": 4, "image": 21}
# The chat template's per-image text: only the <|media_pad|> is expanded.
KIMI_K25_IMAGE = "<|media_begin|> image <|media_content|> <|media_pad|> <|media_end|>"


def kimi_k25_processor(image_processor: Any, ids: Mapping[str, int]) -> Any:
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    return Kimi_K25Processor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer({**KIMI_K25_WORDS, **ids}, ids, unk="[UNK]", pad="[PAD]"),
        video_processor=Kimi_K25VideoProcessor(),
    )


def kimi_k25_model(dtype: torch.dtype, attn: str = "eager") -> Any:
    """MoonViT and a DeepSeek-V3 (MoE, MLA) text model, each one layer or two."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    config = Kimi_K25Config(
        text_config=dict(
            model_type="deepseek_v3",
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,  # one dense layer, one MoE layer
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_shared_experts=1,
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            pad_token_id=KIMI_K25_SMALL["[PAD]"],
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            pos_emb_height=8,
            pos_emb_width=8,
            patch_size=14,
        ),
        projection_hidden_size=32,
        image_token_id=KIMI_K25_SMALL["<|media_pad|>"],
        video_token_id=KIMI_K25_SMALL["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=KIMI_K25_SMALL["<|media_begin|>"],
        vision_end_token_id=KIMI_K25_SMALL["<|media_end|>"],
    )
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration._from_config(config, attn_implementation=attn)
    return model.to(dtype).eval()


KIMI_K25 = FamilyCase(
    family="kimi-k25",
    backends={"torchvision": Kimi_K25ImageProcessor},  # the family has no PIL backend
    # A small patch budget keeps materialization fast; the layout code is the same.
    small_settings={"max_patches": 64, "size": {"max_height": 16, "max_width": 16}},
    full=kimi_k25_processor,
    published_ids=KIMI_K25_PUBLISHED,
    small_ids=KIMI_K25_SMALL,
    image_token="<|media_pad|>",
    feature_token="<|media_pad|>",
    pad_token="[PAD]",
    special_tokens=("<|media_pad|>",),
    image_text=KIMI_K25_IMAGE,
    words=("a", "b", "c", "a"),
    published_layouts={
        # patch 14, merge 2, 16384 patches, 512 a side
        "kimi-k2.5": lambda: kimi_k25_processor(Kimi_K25ImageProcessor(), KIMI_K25_PUBLISHED),
    },
    layout_parameters={
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": 16384,
        "max_size_per_side": 512,
    },
    fingerprint="da7ca0e64568e2dc",
    sizes=(
        (1, 1),
        (2, 3),
        (13, 13),
        (14, 14),
        (27, 29),
        (28, 28),
        (29, 27),
        (57, 31),
        (100, 1),
        (1, 100),
        (333, 77),
        (640, 480),
        (641, 479),
        (1000, 3),
        (3, 1000),
        (1280, 720),
        (1080, 1920),
        (1920, 1080),
        (2560, 1440),
        (3840, 2160),  # 4K: scaled down to the 16384-patch budget
        (9000, 20),  # scaled down to 512 patches on the long side
        (7169, 1),
    ),
    store_sizes=((56, 42), (90, 31), (20, 70)),
    tiny_model=kimi_k25_model,
    model_input_names=(
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",  # the full processor's video half (None without videos)
        "video_grid_thw",
    ),
    layout_changes=(
        {"max_patches": 1024},
        {"patch_size": 16},
        {"merge_size": 4},
        {"size": {"max_height": 256, "max_width": 256}},
    ),
    neutral_changes=({"resample": 2},),
)


# -- Gemma 3 ----------------------------------------------------------------------------------

# `<start_of_image>`, `<end_of_image>`, `<image_soft_token>`, "\n\n" and `<pad>` in the
# published Gemma 3 tokenizer; SMALL: the same tokens at ids a tiny model's vocabulary holds.
GEMMA3_PUBLISHED = {"boi": 255999, "eoi": 256000, "soft": 262144, "nl2": 108, "pad": 0}
GEMMA3_SMALL = {"boi": 7, "eoi": 8, "soft": 9, "nl2": 6, "pad": 0}
GEMMA3_WORDS = {"<unk>": 1, "<bos>": 2, "hi": 3, "there": 4, "ok": 5}
GEMMA3_NAMES = {
    "boi": "<start_of_image>",
    "eoi": "<end_of_image>",
    "soft": "<image_soft_token>",
    "nl2": "\n\n",
    "pad": "<pad>",
}
GEMMA3_SIDE = 28  # the tiny vision tower's image size: 4x4 patches of 7, pooled to 2x2
GEMMA3_SEQ = 4  # soft tokens per image of the tiny model
GEMMA3_PUBLISHED_SEQ = 256


def gemma3_tokenizer(ids: Mapping[str, int], *, with_nl2: bool = True) -> Any:
    vocab = {**GEMMA3_WORDS, **{GEMMA3_NAMES[k]: v for k, v in ids.items() if k != "nl2"}}
    if with_nl2:
        vocab["\n\n"] = ids["nl2"]
    tokenizer = word_level_tokenizer(
        vocab,
        unk="<unk>",
        pad="<pad>",
        # The attributes Gemma3Processor reads (boi_token, eoi_token, image_token and ids).
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    if with_nl2:
        tokenizer.add_tokens(["\n\n"])  # as in Gemma's vocabulary: one token
    return tokenizer


def gemma3_processor(
    image_processor: Any,
    ids: Mapping[str, int] = GEMMA3_PUBLISHED,
    seq: int | None = None,
    *,
    with_nl2: bool = True,
) -> Any:
    """Gemma3Processor over an offline tokenizer; ``seq`` soft tokens per image (the tiny
    model's with the small ids, the published count otherwise)."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    if seq is None:
        seq = GEMMA3_SEQ if ids == GEMMA3_SMALL else GEMMA3_PUBLISHED_SEQ
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=gemma3_tokenizer(ids, with_nl2=with_nl2),
        image_seq_length=seq,
    )


def gemma3_expansion(ids: Mapping[str, int], seq: int) -> list[int]:
    """``full_image_sequence`` in tokens: "\\n\\n", boi, ``seq`` soft tokens, eoi, "\\n\\n"."""
    return [ids["nl2"], ids["boi"], *[ids["soft"]] * seq, ids["eoi"], ids["nl2"]]


def gemma3_model(dtype: torch.dtype, attn: str = "eager") -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            vocab_size=16,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=8,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=GEMMA3_SIDE,
            patch_size=7,
        ),
        mm_tokens_per_image=GEMMA3_SEQ,  # the processor's image_seq_length
        boi_token_index=GEMMA3_SMALL["boi"],
        eoi_token_index=GEMMA3_SMALL["eoi"],
        image_token_index=GEMMA3_SMALL["soft"],
    )
    return tiny_model(Gemma3ForConditionalGeneration, config, dtype, attn=attn)


GEMMA3 = FamilyCase(
    family="gemma3",
    backends={"pil": Gemma3ImageProcessorPil, "torchvision": Gemma3ImageProcessor},
    small_settings={"size": {"height": GEMMA3_SIDE, "width": GEMMA3_SIDE}},
    full=gemma3_processor,
    published_ids=GEMMA3_PUBLISHED,
    small_ids=GEMMA3_SMALL,
    image_token="boi",
    feature_token="soft",
    pad_token="pad",
    special_tokens=("boi", "eoi", "soft"),
    image_text="<start_of_image>",
    words=("hi", "there", "ok", "hi"),
    published_layouts={
        # The published preprocessor_config.json sets 896x896 (the class default is 224).
        "gemma3": lambda: gemma3_processor(
            Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
        ),
    },
    layout_parameters={
        "image_seq_length": GEMMA3_PUBLISHED_SEQ,
        "resized_height": 896,
        "resized_width": 896,
    },
    fingerprint="02f944a0d6cce336",
    small_full_parameters={"image_seq_length": GEMMA3_SEQ},
    sizes=(
        # tiny and odd
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 7),
        (13, 13),
        (27, 29),
        (28, 28),
        (101, 37),
        (255, 257),
        (333, 777),
        (641, 479),
        (896, 896),
        (999, 1001),
        # extreme aspect ratios (Gemma 3 squashes every image to its fixed size)
        (1, 500),
        (500, 1),
        (5, 1000),
        (8000, 40),
        (40, 8000),
        # screens: 1080p, 1440p, 4K, portrait phone screenshots
        (1920, 1080),
        (1080, 1920),
        (2560, 1440),
        (3840, 2160),
        (1170, 2532),
    ),
    store_sizes=((40, 30), (17, 90), (64, 48)),
    tiny_model=gemma3_model,
    model_input_names=("input_ids", "attention_mask", "pixel_values", "token_type_ids"),
    layout_changes=({"size": {"height": 56, "width": 56}},),
    backend_sizes=((1, 1), (3, 7), (56, 56), (641, 479), (1920, 1080), (5, 1000)),
    backend_levels=1,
)


# -- Pixtral / Mistral 3 ----------------------------------------------------------------------

# A test tokenizer whose image tokens sit away from the published ids (10, 12, 13; pad 11),
# so a test can tell which ids an adapter took.
PIXTRAL_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
PIXTRAL_SMALL = {"[IMG]": 5, "[IMG_BREAK]": 6, "[IMG_END]": 7, "<pad>": 8}
PIXTRAL_PUBLISHED = {"[IMG]": 10, "<pad>": 11, "[IMG_BREAK]": 12, "[IMG_END]": 13}


def pixtral_processor(
    image_processor: Any,
    ids: Mapping[str, int] = PIXTRAL_SMALL,
    *,
    patch_size: int | None = None,
    merge: int = 2,
) -> Any:
    """PixtralProcessor over an offline tokenizer; the layout's patch is the processor's
    ``patch_size`` (the image processor's unless given), ``merge`` its spatial merge."""
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    # Special, so "[IMG][IMG][IMG_BREAK]" (what the processor writes) splits into tokens.
    tokenizer = word_level_tokenizer({**PIXTRAL_VOCAB, **ids}, ids, unk="<unk>", pad="<pad>")
    patch = patch_size if patch_size is not None else image_processor.patch_size
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        spatial_merge_size=merge,
    )


def mistral3_processor() -> Any:
    """Mistral-Small-3.1's published layout: patch 14, merge 2, longest_edge 1540."""
    image_processor = PixtralImageProcessorPil(patch_size=14, size={"longest_edge": 1540})
    return pixtral_processor(image_processor, PIXTRAL_PUBLISHED)


def pixtral12b_processor() -> Any:
    """Pixtral-12B's: the image processor's defaults (patch 16, longest_edge 1024), merge 1."""
    return pixtral_processor(PixtralImageProcessorPil(), PIXTRAL_PUBLISHED, patch_size=16, merge=1)


def mistral3_model(dtype: torch.dtype, attn: str = "eager") -> Any:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            patch_size=8,  # the processor's patch size
            image_size=64,  # its longest_edge: the 2-D RoPE's extent
        ),
        text_config=dict(
            model_type="mistral",
            vocab_size=16,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        ),
        spatial_merge_size=2,
        image_token_index=PIXTRAL_SMALL["[IMG]"],
    )
    return tiny_model(Mistral3ForConditionalGeneration, config, dtype, attn=attn)


PIXTRAL = FamilyCase(
    family="pixtral",
    backends={"pil": PixtralImageProcessorPil, "torchvision": PixtralImageProcessor},
    # A small Mistral 3 layout for store and model tests: 16 px per token, up to 64 px. The
    # image processor carries the merge, so that it also lays out alone (alone_needs).
    small_settings={"patch_size": 8, "size": {"longest_edge": 64}, "spatial_merge_size": 2},
    full=pixtral_processor,
    published_ids=PIXTRAL_PUBLISHED,
    small_ids=PIXTRAL_SMALL,
    image_token="[IMG]",
    feature_token="[IMG]",
    pad_token="<pad>",
    special_tokens=("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    image_text="[IMG]",
    words=("hello", "world", "world", "hello"),
    published_layouts={"mistral3": mistral3_processor, "pixtral12b": pixtral12b_processor},
    layout_parameters={"patch_size": 14, "spatial_merge_size": 2, "longest_edge": 1540},
    fingerprint="118a97afc1559dfe",
    sizes=(
        # tiny and odd
        (1, 1),
        (1, 2),
        (2, 1),
        (3, 7),
        (13, 13),
        (27, 29),
        (28, 28),
        (29, 28),
        (55, 57),
        (56, 56),
        (101, 37),
        (255, 257),
        (333, 777),
        (641, 479),
        (999, 1001),
        # at and past longest_edge, and extreme aspect ratios (down to a 1-pixel side)
        (1540, 1540),
        (1541, 1540),
        (1540, 1),
        (1, 1540),
        (3080, 2),
        (5, 1000),
        (1000, 5),
        (8000, 40),
        # screens: 1080p, 1440p, 4K, portrait phones
        (1920, 1080),
        (2560, 1440),
        (3840, 2160),
        (1080, 1920),
        (1170, 2532),
    ),
    store_sizes=((40, 20), (64, 64), (17, 50)),
    tiny_model=mistral3_model,
    model_input_names=("input_ids", "attention_mask", "pixel_values", "image_sizes"),
    layout_changes=(
        {"patch_size": 16},
        {"size": {"longest_edge": 128}},
        {"spatial_merge_size": 1},
    ),
    alone_needs={"spatial_merge_size": 2},
    # A side that floors to 0 pixels when the image is fitted into longest_edge.
    unrepresentable=((5000, 1), (1, 5000), (3082, 1)),
    unrepresentable_match="0 pixels",
    backend_sizes=((1, 1), (3, 7), (100, 60), (641, 479), (1920, 1080)),
)


CASES: dict[str, FamilyCase] = {
    case.family: case for case in (QWEN_VL, GLM4V, KIMI_K25, GEMMA3, PIXTRAL)
}
