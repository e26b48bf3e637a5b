"""What only Pixtral / Mistral 3 do; the contract every family keeps is
``tests/test_family_contract.py``.

Native-resolution images fitted into ``longest_edge``: rows of ``[IMG]`` tokens, each row
closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]``; ``PixtralProcessor``'s patch size and
merge decide the layout (not the image processor's), and pixels are zero-padded to the
batch's largest image.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.pixtral.processing_pixtral import PixtralProcessor

import mmstore
from mmstore.integrations import vllm
from tests.families_common import gradient, media_ref
from tests.family_cases import PIXTRAL, PIXTRAL_PUBLISHED, PIXTRAL_SMALL, pixtral_processor

IMG, BREAK, END = (PIXTRAL_SMALL[k] for k in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
PUBLISHED_IDS = {
    "image_token_id": PIXTRAL_PUBLISHED["[IMG]"],
    "pad_token_id": PIXTRAL_PUBLISHED["<pad>"],
    "image_break_token_id": PIXTRAL_PUBLISHED["[IMG_BREAK]"],
    "image_end_token_id": PIXTRAL_PUBLISHED["[IMG_END]"],
}


def test_rows_of_image_tokens_end_in_breaks_and_the_last_in_an_end():
    adapter = mmstore.adapter_for(PIXTRAL.small())  # 16 px per token
    assert adapter.expansion(20, 40) == [IMG, IMG, BREAK, IMG, IMG, BREAK, IMG, IMG, END]
    # Two tokens wide, the dummy image: Mistral3's get_image_features squeezes a lone
    # feature token away.
    assert adapter.expansion(*adapter.dummy_size) == [IMG, IMG, END]
    assert adapter.placeholder(*adapter.dummy_size)["image_sizes"].tolist() == [[16, 32]]


def test_the_image_processor_alone_takes_the_published_ids_and_its_own_merge():
    small = PIXTRAL.small()
    adapter = mmstore.adapter_for(small.image_processor)  # it carries spatial_merge_size=2
    assert {k: adapter.layout.token_id(k) for k in PUBLISHED_IDS} == PUBLISHED_IDS
    assert adapter.expansion(20, 40) == [10, 10, 12, 10, 10, 12, 10, 10, 13]
    assert adapter.layout.param("spatial_merge_size") == 2
    assert (
        adapter.layout
        == mmstore.adapter_for(PIXTRAL.full(small.image_processor, PIXTRAL_PUBLISHED)).layout
    )


@pytest.mark.parametrize("backend", sorted(PIXTRAL.backends))
def test_an_image_processor_alone_without_the_merge_is_refused_not_guessed(backend, tmp_path):
    """Pixtral-12B and Mistral 3 share the image processor; only the full processor (or the
    model's config) knows the merge. With the class defaults a guess of 2 lays a 28x28 image
    out as 2 tokens and a 1080p one as 594, where Pixtral-12B's processor makes 6 and 2340."""
    cls = PIXTRAL.backends[backend]
    with pytest.raises(mmstore.UnsupportedProcessorError, match="spatial_merge_size") as err:
        mmstore.adapter_for(cls())
    assert "PixtralProcessor" in str(err.value)
    # Everything that takes a processor refuses it the same way, before reading anything.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    with pytest.raises(mmstore.UnsupportedProcessorError, match="spatial_merge_size"):
        mmstore.RolloutDataset(store, cls())
    with pytest.raises(mmstore.UnsupportedProcessorError, match="spatial_merge_size"):
        vllm.RefResolver(store, cls())
    # Given the merge, it lays out as the full processor of that merge, fingerprint and all.
    for merge, full in ((1, PIXTRAL.published("pixtral12b")), (2, None)):
        alone = mmstore.adapter_for(cls(spatial_merge_size=merge))
        if full is not None:
            assert alone.fingerprint == mmstore.adapter_for(full).fingerprint
        assert (alone.num_tokens(28, 28), alone.num_tokens(1920, 1080)) == {
            1: (6, 2340),
            2: (2, 594),
        }[merge]


def test_a_merge_the_full_processor_contradicts_is_refused():
    image_processor = PixtralImageProcessorPil(patch_size=8, spatial_merge_size=1)
    with pytest.raises(mmstore.UnsupportedProcessorError, match="ambiguous"):
        mmstore.adapter_for(pixtral_processor(image_processor, merge=2))
    for value in (0, "2", True):
        with pytest.raises(mmstore.UnsupportedProcessorError, match="spatial_merge_size"):
            mmstore.adapter_for(PixtralImageProcessorPil(spatial_merge_size=value))


def test_pixtral_12b_merges_no_patches():
    assert (
        mmstore.adapter_for(PIXTRAL.published("pixtral12b")).layout.param("spatial_merge_size") == 1
    )


@pytest.mark.parametrize(("width", "height"), [(1, 1), (3, 7), (100, 60), (641, 479), (999, 5)])
def test_the_processors_patch_size_decides_not_the_image_processors(width, height):
    # Built with the image processor's default patch (16): PixtralProcessor passes its own
    # patch * merge (14 * 2) to it on every call, and so must the adapter.
    processor = pixtral_processor(
        PixtralImageProcessorPil(size={"longest_edge": 1540}), patch_size=14, merge=2
    )
    adapter = mmstore.adapter_for(processor)
    assert adapter.layout.param("patch_size") == 14
    image = gradient(width, height)
    out = processor(text="hello [IMG] world", images=[image], return_tensors="np")
    assert adapter.expansion(width, height) == [int(t) for t in out["input_ids"][0][1:-1]]
    ours = adapter.process([image])
    np.testing.assert_array_equal(ours["pixel_values"], out["pixel_values"])
    np.testing.assert_array_equal(ours["image_sizes"], out["image_sizes"])


def test_check_output_refuses_a_grid_of_the_right_count_but_wrong_shape():
    adapter = mmstore.adapter_for(PIXTRAL.published())
    # 84x56 is 3 columns x 2 rows: 2 * (3 + 1) = 8 tokens; 28x112 (1 x 4) is 8 tokens too.
    _, [ref] = adapter.expand([adapter.image_token_id], [media_ref(84, 56)])
    assert ref.length == 8
    wrong = {"pixel_values": np.zeros((1, 3, 112, 28)), "image_sizes": np.array([[112, 28]])}
    with pytest.raises(mmstore.LayoutMismatchError, match="resized") as info:
        adapter.check_output(wrong, ref, sample_id="s", image_index=2)
    assert info.value.image_index == 2


def test_custom_break_and_end_strings_of_the_processor_are_used():
    vocab_ids = {"<unk>": 0, "[IMG]": 1, "<b>": 2, "<e>": 3, "[IMG_BREAK]": 4, "[IMG_END]": 5}
    tok = Tokenizer(models.WordLevel(vocab_ids, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64}),
        tokenizer=tokenizer,
        patch_size=8,
        spatial_merge_size=2,
        image_break_token="<b>",
        image_end_token="<e>",
    )
    adapter = mmstore.adapter_for(processor)
    assert adapter.expansion(32, 16) == [1, 1, 3]
    assert adapter.expansion(16, 32) == [1, 2, 1, 3]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PixtralImageProcessorPil(do_center_crop=True), "center_crop"),
        (lambda: PixtralImageProcessorPil(size={"height": 64, "width": 64}), "longest_edge"),
        (lambda: PixtralImageProcessorPil(patch_size={"height": 8, "width": 16}), "non-square"),
        (
            lambda: types.SimpleNamespace(
                image_processor=PixtralImageProcessorPil(), patch_size=14, spatial_merge_size=2
            ),
            "only PixtralProcessor",
        ),
    ],
    ids=["center-crop", "height-width-box", "non-square-patch", "unknown-processor"],
)
def test_settings_without_an_exact_layout_are_refused(make, match):
    with pytest.raises(mmstore.UnsupportedProcessorError, match=match):
        mmstore.adapter_for(make())


def _vllm_replacement(width: int, height: int, *, side: int, longest: int) -> list[int]:
    """vLLM's own re-expansion of one [IMG] (``Mistral3MultiModalProcessor``'s
    ``get_replacement`` over ``Mistral3HFEncoderInfo.get_patch_grid_size``), published ids."""
    ratio = max(width / longest, height / longest)
    if ratio > 1:
        width, height = int(np.floor(width / ratio)), int(np.floor(height / ratio))
    ncols, nrows = (width - 1) // side + 1, (height - 1) // side + 1
    tokens = ([10] * ncols + [12]) * nrows
    tokens[-1] = 13
    return tokens


def test_spans_are_what_vllm_expands_each_image_token_to(store):
    # The published ids: Mistral 3's image processor alone, given the model's merge.
    image_processor = copy.deepcopy(PIXTRAL.published().image_processor)
    image_processor.spatial_merge_size = 2
    adapter = mmstore.adapter_for(image_processor)
    sizes = [(641, 479), (3840, 2160)]
    media = [store.put_image(gradient(w, h)) for w, h in sizes]
    prompt = [1, 3, 10, 4, 10, 3]
    tokens, refs = adapter.expand(prompt, media)
    for (w, h), ref in zip(sizes, refs, strict=True):
        assert tokens[ref.offset : ref.offset + ref.length] == _vllm_replacement(
            w, h, side=28, longest=1540
        )
    row = mmstore.Rollout(
        sample_id="v",
        tokens=tokens,
        prompt_len=len(tokens),
        loss_mask=[0] * len(tokens),
        images=refs,
    )
    assert vllm.to_vllm_prompt(store, row)["prompt_token_ids"] == prompt
