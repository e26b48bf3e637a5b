"""The Qwen-VL family adapter against the real transformers image processor.

Every size below runs through ``Qwen2VLImageProcessorPil`` on a real image of that size; the
adapter, which never sees the image, must agree on the grid, the token count and the shape of
``pixel_values``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from transformers import CLIPImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._families import layout_for_fingerprint
from tests.families_common import check_placeholder, gradient, media_ref, sized

QWEN_VL_IMAGE_TOKEN_ID = 151655  # `<|image_pad|>` in the published Qwen-VL tokenizers

# (width, height)
SIZES = [
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
]

PROCESSORS = ["qwen2_processor", "qwen3_processor"]


def test_enough_sizes():
    assert len(set(SIZES)) >= 30


@pytest.mark.parametrize("processor_name", PROCESSORS)
@sized(SIZES)
def test_grid_tokens_and_placeholder_match_the_real_processor(
    request, processor_name, width, height
):
    processor = request.getfixturevalue(processor_name)
    adapter = mmstore.adapter_for(processor)
    out = processor(images=[gradient(width, height)], return_tensors="np")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    pixel_shape = out["pixel_values"].shape

    assert adapter.grid(width, height) == grid
    # Qwen2VLProcessor expands an image into grid.prod() // merge_size**2 placeholder tokens.
    assert adapter.num_tokens(width, height) == np.prod(grid) // processor.merge_size**2
    assert adapter.num_tokens(width, height) * processor.merge_size**2 == (
        processor.get_number_of_image_patches(height, width)
    )
    placeholder = check_placeholder(adapter, out, width, height)
    assert placeholder["pixel_values"].shape == pixel_shape
    assert placeholder["pixel_values"].dtype == np.float32


@pytest.mark.parametrize(("width", "height"), [(1, 1), (3, 7), (641, 479), (1920, 1080), (5, 1000)])
def test_unusual_layout_matches_the_real_processor(width, height):
    # merge 1, temporal patch 1: every layout parameter, not just the published values, counts.
    processor = Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=1, temporal_patch_size=1, min_pixels=32 * 32, max_pixels=96 * 96
    )
    adapter = mmstore.adapter_for(processor)
    out = processor(images=[gradient(width, height)], return_tensors="np")
    assert adapter.grid(width, height) == tuple(int(v) for v in out["image_grid_thw"][0])
    assert adapter.num_tokens(width, height) == np.prod(out["image_grid_thw"][0])
    assert adapter.placeholder(width, height)["pixel_values"].shape == out["pixel_values"].shape


def test_process_returns_what_the_processor_returns(adapter, small_processor):
    images = [gradient(300, 200), gradient(64, 900)]
    ours = adapter.process(images)
    theirs = small_processor(images=images, return_tensors="np")
    np.testing.assert_array_equal(ours["pixel_values"], theirs["pixel_values"])
    np.testing.assert_array_equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert ours["image_grid_thw"].dtype == np.int64
    for image, grid in zip(images, ours["image_grid_thw"], strict=True):
        assert adapter.grid(*image.size) == tuple(grid)


@pytest.mark.parametrize(("width", "height"), [(1, 201), (201, 1), (2, 403), (5, 1001), (0, 5)])
def test_unrepresentable_sizes_raise_image_size_error(adapter, small_processor, width, height):
    with pytest.raises(mmstore.ImageSizeError):
        adapter.num_tokens(width, height)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.placeholder(width, height)
    if width > 0:
        # The real processor refuses them too: the adapter is not stricter than the model.
        with pytest.raises(ValueError, match="aspect ratio"):
            small_processor(images=[gradient(width, height)], return_tensors="np")


# --- choosing an adapter ------------------------------------------------------------------


def test_adapter_for_reads_the_live_processor(qwen3_processor):
    adapter = mmstore.adapter_for(qwen3_processor)
    assert isinstance(adapter, mmstore.QwenVLAdapter)
    assert adapter.family == "qwen-vl"
    assert adapter.image_token_id == QWEN_VL_IMAGE_TOKEN_ID
    layout = adapter.layout
    p = layout.param
    assert (p("patch_size"), p("temporal_patch_size"), p("merge_size")) == (16, 2, 2)
    assert (p("min_pixels"), p("max_pixels")) == (65536, 16777216)
    assert layout_for_fingerprint(adapter.fingerprint) == layout


def test_adapter_for_accepts_a_full_processor(small_processor):
    # A transformers ProcessorMixin exposes the image processor and the tokenizer's image
    # token id; a real Qwen2VLProcessor needs torchvision for its video half (tested below).
    full = types.SimpleNamespace(image_processor=small_processor, image_token_id=4242)
    adapter = mmstore.adapter_for(full)
    assert adapter.image_processor is small_processor
    assert adapter.image_token_id == 4242
    assert adapter.fingerprint == mmstore.adapter_for(small_processor).fingerprint
    tokens, _ = adapter.expand([1, 4242, 2], [media_ref(56, 56)])
    assert tokens == [1, 4242, 4242, 4242, 4242, 2]
    assert mmstore.adapter_for(small_processor, image_token_id=0).image_token_id == 0


def test_adapter_for_accepts_a_real_qwen2vl_processor(small_processor):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    vocab = {"[UNK]": 0, "<|image_pad|>": 7, "<|video_pad|>": 8}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), unk_token="[UNK]"
    )
    processor = Qwen2VLProcessor(
        image_processor=small_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )
    assert mmstore.adapter_for(processor).image_token_id == 7


@pytest.mark.parametrize(
    "processor",
    [
        CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),
        object(),
        types.SimpleNamespace(image_processor=object(), image_token_id=1),
        "Qwen2VLImageProcessorPil",
    ],
    ids=["clip", "object", "processor-of-object", "str"],
)
def test_adapter_for_refuses_unknown_processors(processor):
    with pytest.raises(mmstore.UnsupportedProcessorError, match="no mmstore family adapter"):
        mmstore.adapter_for(processor)


def test_adapter_for_refuses_a_subclass():
    # Another model's processor may derive from Qwen's and resize differently.
    class Derived(Qwen2VLImageProcessorPil):
        pass

    with pytest.raises(mmstore.UnsupportedProcessorError, match="Derived"):
        mmstore.adapter_for(Derived())


def test_adapter_refuses_a_processor_that_does_not_resize():
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_resize"):
        mmstore.adapter_for(Qwen2VLImageProcessorPil(do_resize=False))


def test_torchvision_backend_matches_the_pil_backend():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(max_pixels=256 * 28 * 28)
    adapter = mmstore.adapter_for(processor)
    assert (
        adapter.fingerprint
        == mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=256 * 28 * 28)).fingerprint
    )
    for width, height in [(1, 1), (3, 7), (641, 479), (1920, 1080), (5, 1000)]:
        out = processor(images=[gradient(width, height)], return_tensors="pt")
        assert adapter.grid(width, height) == tuple(int(v) for v in out["image_grid_thw"][0])
        assert adapter.placeholder(width, height)["pixel_values"].shape == tuple(
            out["pixel_values"].shape
        )


# --- fingerprint --------------------------------------------------------------------------


def _fingerprint(**overrides) -> str:
    params = {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        # Fresh each time: the processor writes min_pixels/max_pixels into this dict.
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
        **overrides,
    }
    return mmstore.adapter_for(Qwen2VLImageProcessorPil(**params)).fingerprint


def test_fingerprint_is_stable(qwen2_processor):
    # Stores record this value; changing how it is computed orphans every stored layout.
    assert _fingerprint() == _fingerprint() == mmstore.adapter_for(qwen2_processor).fingerprint
    assert _fingerprint() == "e67b02d6e1613ce8"


@pytest.mark.parametrize(
    "overrides",
    [
        {"patch_size": 16},
        {"temporal_patch_size": 1},
        {"merge_size": 1},
        {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 1280}},
        {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256}},
        {"min_pixels": 65536},
        {"max_pixels": 16777216},
    ],
    ids=lambda o: ",".join(o),
)
def test_fingerprint_changes_with_every_layout_parameter(overrides):
    assert _fingerprint(**overrides) != _fingerprint()


@pytest.mark.parametrize(
    "overrides",
    [
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"do_normalize": False},
        {"rescale_factor": 1 / 127.5},
    ],
    ids=lambda o: ",".join(o),
)
def test_fingerprint_ignores_non_layout_parameters(overrides):
    assert _fingerprint(**overrides) == _fingerprint()


def test_fingerprint_ignores_the_image_token_id(small_processor):
    a = mmstore.adapter_for(small_processor)
    b = mmstore.adapter_for(small_processor, image_token_id=99)
    assert a.fingerprint == b.fingerprint


def test_registry_keeps_the_family_token_id_whatever_adapter_came_last(small_processor):
    custom = mmstore.adapter_for(small_processor, image_token_id=99)
    assert custom.image_token_id == 99
    assert layout_for_fingerprint(custom.fingerprint).image_token_id == QWEN_VL_IMAGE_TOKEN_ID
    # Rows of the custom tokenizer check against their own adapter's layout.
    tokens, refs = custom.expand([1, 99], [media_ref(56, 56)])
    row = mmstore.Rollout(
        sample_id="c", tokens=tokens, prompt_len=1, loss_mask=[1] * len(tokens), images=refs
    )
    mmstore.check_rollout(row, lambda fp: custom.layout)
    with pytest.raises(mmstore.InvalidRolloutError, match="not the qwen-vl expansion"):
        mmstore.check_rollout(row)


# --- expand -------------------------------------------------------------------------------


def test_expand_lays_out_spans_at_the_right_offsets(adapter):
    img = adapter.image_token_id
    media = [media_ref(56, 56, 1), media_ref(640, 480, 2), media_ref(28, 5600, 3)]
    ids = [10, 11, img, 12, img, img, 13, 14]
    tokens, refs = adapter.expand(np.array(ids), media)

    lengths = [adapter.num_tokens(m.width, m.height) for m in media]
    assert lengths[0] == 4
    assert [r.length for r in refs] == lengths
    assert [r.offset for r in refs] == [2, 3 + lengths[0], 3 + lengths[0] + lengths[1]]
    expected = [10, 11, *[img] * lengths[0], 12, *[img] * (lengths[1] + lengths[2]), 13, 14]
    assert tokens == expected
    for ref, item in zip(refs, media, strict=True):
        assert (ref.uri, ref.hash, ref.width, ref.height) == (
            item.uri,
            item.hash,
            item.width,
            item.height,
        )
        assert ref.family == adapter.family
        assert ref.layout_fingerprint == adapter.fingerprint
        assert set(tokens[ref.offset : ref.offset + ref.length]) == {img}
    rollout = mmstore.Rollout(
        sample_id="s",
        tokens=tokens,
        prompt_len=len(tokens),
        loss_mask=[0] * len(tokens),
        images=refs,
    )
    mmstore.check_rollout(rollout)


def test_expand_without_images_is_identity(adapter):
    assert adapter.expand([5, 6, 7], []) == ([5, 6, 7], [])


@pytest.mark.parametrize(("n_tokens", "n_media"), [(1, 0), (0, 1), (2, 1), (1, 2)])
def test_expand_refuses_a_count_mismatch(adapter, n_tokens, n_media):
    ids = [1, *[adapter.image_token_id] * n_tokens, 2]
    with pytest.raises(mmstore.InvalidRolloutError, match="image placeholder tokens"):
        adapter.expand(ids, [media_ref(56, 56, i) for i in range(n_media)])


def test_expand_refuses_an_unrepresentable_image(adapter):
    with pytest.raises(mmstore.ImageSizeError):
        adapter.expand([adapter.image_token_id], [media_ref(1, 500)])


def test_check_output_refuses_a_grid_that_does_not_fill_the_span(adapter):
    _, [ref] = adapter.expand([adapter.image_token_id], [media_ref(640, 480)])
    good = {"image_grid_thw": np.array([adapter.grid(640, 480)])}
    adapter.check_output(good, ref, sample_id="s", image_index=0)
    with pytest.raises(mmstore.LayoutMismatchError) as info:
        bad = {"image_grid_thw": np.array([[1, 2, 2]])}
        adapter.check_output(bad, ref, sample_id="s", image_index=3)
    assert (info.value.sample_id, info.value.image_index, info.value.uri) == ("s", 3, ref.uri)
