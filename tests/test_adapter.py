"""Qwen-VL's own layout, and choosing an adapter (``adapter_for``), the fingerprint and
``expand`` as Qwen-VL's adapter shows them. The contract every family keeps, Qwen-VL's
included, is ``tests/test_family_contract.py``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from transformers import CLIPImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._families import layout_for_fingerprint
from tests.families_common import gradient, media_ref
from tests.family_cases import QWEN_VL

QWEN_VL_IMAGE_TOKEN_ID = 151655  # `<|image_pad|>` in the published Qwen-VL tokenizers

PROCESSORS = ["qwen2_processor", "qwen3_processor"]


@pytest.mark.parametrize("processor_name", PROCESSORS)
def test_tokens_are_the_processors_patches_over_the_merge_window(request, processor_name):
    """Qwen2VLProcessor expands an image into ``grid.prod() // merge_size**2`` tokens; the
    image processor counts the same patches without resizing anything."""
    processor = request.getfixturevalue(processor_name)
    adapter = mmstore.adapter_for(processor)
    for width, height in QWEN_VL.sizes:
        tokens = adapter.num_tokens(width, height)
        assert tokens == int(np.prod(adapter.grid(width, height))) // processor.merge_size**2
        patches = processor.get_number_of_image_patches(height, width)
        assert tokens * processor.merge_size**2 == patches, (width, height)


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
    # token id (a real Qwen2VLProcessor's: tests/test_family_contract.py).
    full = types.SimpleNamespace(image_processor=small_processor, image_token_id=4242)
    adapter = mmstore.adapter_for(full)
    assert adapter.image_processor is small_processor
    assert adapter.image_token_id == 4242
    assert adapter.fingerprint == mmstore.adapter_for(small_processor).fingerprint
    tokens, _ = adapter.expand([1, 4242, 2], [media_ref(56, 56)])
    assert tokens == [1, 4242, 4242, 4242, 4242, 2]
    assert mmstore.adapter_for(small_processor, image_token_id=0).image_token_id == 0


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
    # Images 1 and 2 touch: their image tokens would read as one image to the model.
    with pytest.raises(mmstore.InvalidRolloutError, match="as one image") as err:
        mmstore.check_rollout(rollout)
    assert (err.value.sample_id, err.value.image_index) == ("s", 2)
    apart, refs = adapter.expand(np.array([10, 11, img, 12, img, 15, img, 13, 14]), media)
    mmstore.check_rollout(
        rollout.model_copy(update={"tokens": apart, "loss_mask": [0] * len(apart), "images": refs})
    )


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


def test_expansions_are_cached_per_layout_and_keep_no_processor_alive():
    import gc
    import weakref

    from mmstore._families import expansion_array
    from mmstore._families._base import _cached_expansion

    processor = Qwen2VLImageProcessorPil(max_pixels=123 * 28 * 28)
    first = mmstore.adapter_for(processor)
    second = mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=123 * 28 * 28))
    assert first is not second and first.layout == second.layout
    array = expansion_array(first, 97, 61)
    assert array.tolist() == first.expansion(97, 61) and not array.flags.writeable
    assert expansion_array(second, 97, 61) is array  # one entry serves both adapters
    gone = weakref.ref(processor)
    del first, processor
    gc.collect()
    assert gone() is None, "the expansion cache kept the adapter's processor alive"
    assert _cached_expansion.cache_info().maxsize is not None  # bounded


def _methods(cls: type) -> set[str]:
    """The public methods and properties ``cls`` itself defines."""
    kinds = (property, classmethod, staticmethod)
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, kinds))
    }


def test_the_family_docstring_names_every_method_a_family_implements_or_may_override():
    """The class docstring is the contract a third party reads: it names each method."""
    doc = mmstore.Family.__doc__ or ""
    undocumented = sorted(
        name
        for name in _methods(mmstore.Family)
        if f":meth:`{name}`" not in doc and f":attr:`{name}`" not in doc
    )
    assert not undocumented, f"Family methods its docstring does not name: {undocumented}"
    for attribute in ("name", "parameter_names", "token_table", "image_inputs"):
        assert f"``{attribute}``" in doc


def test_every_family_publishes_its_image_and_pad_tokens():
    from mmstore._families import family_class

    for name in mmstore.known_families():
        table = family_class(name).token_table
        assert {"image_token_id", "pad_token_id"} <= set(table), name
        assert all(isinstance(t, mmstore.Token) and t.text for t in table.values()), name
