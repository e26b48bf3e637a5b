"""The Pixtral / Mistral 3 family against the real transformers processor and model.

Every layout check runs ``PixtralProcessor`` (image processor + an offline WordLevel tokenizer
holding the family's special tokens) on a real image: the family, which never sees the image,
must produce the same tokens and tensor shapes. Rows then go through the store, the loader and
a tiny random-weight ``Mistral3ForConditionalGeneration``.
"""

from __future__ import annotations

import os
import types
import warnings

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
)
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
from transformers.models.pixtral.processing_pixtral import PixtralProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._loading.stack import batch_images
from mmstore.integrations import vllm
from tests.families_common import (
    check_distinct_images,
    check_output_fits,
    check_placeholder,
    check_refused_by,
    gradient,
    media_ref,
    noise,
    sized,
    tiny_model,
    train_loss,
    word_level_tokenizer,
)

# A test tokenizer whose image tokens sit away from the published ids (10, 12, 13; pad 11),
# so a test can tell which ids an adapter took.
VOCAB = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    "hello": 3,
    "world": 4,
    "[IMG]": 5,
    "[IMG_BREAK]": 6,
    "[IMG_END]": 7,
    "<pad>": 8,
}
IMG, BREAK, END, PAD = 5, 6, 7, 8
PUBLISHED = {
    "image_token_id": 10,
    "pad_token_id": 11,
    "image_break_token_id": 12,
    "image_end_token_id": 13,
}

# (width, height). Mistral-Small-3.1: patch 14, merge 2 (28 px per token), longest_edge 1540.
SIZES = [
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
]
# A side that floors to 0 pixels when the image is fitted into longest_edge.
UNREPRESENTABLE = [(5000, 1), (1, 5000), (3082, 1)]


def _tokenizer() -> PreTrainedTokenizerFast:
    # Special, so "[IMG][IMG][IMG_BREAK]" (what the processor writes) splits into tokens.
    specials = ("[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>")
    return word_level_tokenizer(VOCAB, specials, unk="<unk>", pad="<pad>")


def _processor(image_processor, *, patch_size: int, merge: int) -> PixtralProcessor:
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=_tokenizer(),
        patch_size=patch_size,
        spatial_merge_size=merge,
    )


@pytest.fixture(scope="module")
def mistral3():
    """Mistral-Small-3.1's published layout: patch 14, merge 2, longest_edge 1540."""
    return _processor(
        PixtralImageProcessorPil(patch_size=14, size={"longest_edge": 1540}), patch_size=14, merge=2
    )


@pytest.fixture(scope="module")
def pixtral12b():
    """Pixtral-12B's: the image processor's defaults (patch 16, longest_edge 1024), merge 1."""
    return _processor(PixtralImageProcessorPil(), patch_size=16, merge=1)


@pytest.fixture(scope="module")
def small():
    """A small Mistral 3 layout for store and model tests: 16 px per token, up to 64 px."""
    return _processor(
        PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64}), patch_size=8, merge=2
    )


def _strip_text(input_ids: np.ndarray) -> list[int]:
    """The image's tokens of "hello [IMG] world": drop the text tokens around them."""
    ids = [int(t) for t in np.asarray(input_ids).reshape(-1)]
    assert ids[0] == VOCAB["hello"] and ids[-1] == VOCAB["world"]
    return ids[1:-1]


# --- 1. layout against the real processor ---------------------------------------------------


def test_enough_sizes():
    assert len(set(SIZES)) >= 20


@pytest.mark.parametrize("processor_name", ["mistral3", "pixtral12b"])
@sized(SIZES)
def test_expansion_and_placeholder_match_the_real_processor(request, processor_name, width, height):
    processor = request.getfixturevalue(processor_name)
    adapter = mmstore.adapter_for(processor)
    image = gradient(width, height)
    try:
        expansion = adapter.expansion(width, height)
    except mmstore.ImageSizeError:  # fitted into Pixtral-12B's 1024 px, 1540x1 has 0 rows
        with pytest.raises(ValueError):
            processor(text="hello [IMG] world", images=[image])
        assert processor_name == "pixtral12b"
        return
    out = processor(text="hello [IMG] world", images=[image], return_tensors="np")

    assert expansion == _strip_text(out["input_ids"])
    assert adapter.num_tokens(width, height) == len(expansion)
    assert expansion[-1] == END and set(expansion) <= {IMG, BREAK, END}
    placeholder = check_placeholder(adapter, out, width, height)
    assert placeholder["pixel_values"].dtype == np.float32
    assert adapter.pixel_shape(width, height) == out["pixel_values"].shape

    _, [ref] = adapter.expand([IMG], [media_ref(width, height)])
    check_output_fits(adapter, out, ref)


@pytest.mark.parametrize(("width", "height"), UNREPRESENTABLE)
def test_sizes_the_processor_cannot_resize_raise_image_size_error(mistral3, width, height):
    adapter = mmstore.adapter_for(mistral3)
    with pytest.raises(mmstore.ImageSizeError, match="0 pixels"):
        adapter.expansion(width, height)
    with pytest.raises(ValueError):  # the processor fails on them too
        mistral3(text="hello [IMG] world", images=[gradient(width, height)])


@pytest.mark.parametrize(("width", "height"), [(1, 1), (3, 7), (100, 60), (641, 479), (999, 5)])
def test_the_processors_patch_size_decides_not_the_image_processors(width, height):
    # Built with the image processor's default patch (16): PixtralProcessor passes its own
    # patch * merge (14 * 2) to it on every call, and so must the adapter.
    processor = _processor(
        PixtralImageProcessorPil(size={"longest_edge": 1540}), patch_size=14, merge=2
    )
    adapter = mmstore.adapter_for(processor)
    assert adapter.layout.param("patch_size") == 14
    image = gradient(width, height)
    out = processor(text="hello [IMG] world", images=[image], return_tensors="np")
    assert adapter.expansion(width, height) == _strip_text(out["input_ids"])
    ours = adapter.process([image])
    np.testing.assert_array_equal(ours["pixel_values"], out["pixel_values"])
    np.testing.assert_array_equal(ours["image_sizes"], out["image_sizes"])


def test_check_output_refuses_a_grid_of_the_right_count_but_wrong_shape(mistral3):
    adapter = mmstore.adapter_for(mistral3)
    # 84x56 is 3 columns x 2 rows: 2 * (3 + 1) = 8 tokens; 28x112 (1 x 4) is 8 tokens too.
    _, [ref] = adapter.expand([IMG], [media_ref(84, 56)])
    assert ref.length == 8
    wrong = {"pixel_values": np.zeros((1, 3, 112, 28)), "image_sizes": np.array([[112, 28]])}
    with pytest.raises(mmstore.LayoutMismatchError, match="resized") as info:
        adapter.check_output(wrong, ref, sample_id="s", image_index=2)
    assert info.value.image_index == 2


def test_torchvision_backend_matches_the_pil_backend():
    pil = PixtralImageProcessorPil(patch_size=14, size={"longest_edge": 1540})
    fast = PixtralImageProcessor(patch_size=14, size={"longest_edge": 1540})
    a, b = mmstore.adapter_for(pil), mmstore.adapter_for(fast)
    assert a.fingerprint == b.fingerprint
    # The backends resample differently: at most 2 of 255 intensity levels apart at a pixel
    # (in normalized units, 2 / 255 / std), which is within 2 bf16 ulps of these values.
    levels = 2 / 255 / min(pil.image_std)
    for seed, (width, height) in enumerate([(1, 1), (3, 7), (100, 60), (641, 479), (1920, 1080)]):
        image = noise(width, height, seed)
        x, y = a.process([image]), b.process([image])
        np.testing.assert_array_equal(x["image_sizes"], y["image_sizes"])
        assert x["pixel_values"].shape == y["pixel_values"].shape == a.pixel_shape(width, height)
        for dtype in (torch.float32, torch.bfloat16):
            px = torch.from_numpy(x["pixel_values"]).to(dtype).float()
            py = torch.from_numpy(y["pixel_values"]).to(dtype).float()
            torch.testing.assert_close(px, py, rtol=0, atol=levels + 2 * 2**-6)
            assert (px - py).abs().mean() < 1e-3


# --- 2. token ids and parameters -----------------------------------------------------------


def test_full_processor_ids_come_from_its_tokenizer(small):
    adapter = mmstore.adapter_for(small)
    assert adapter.family == "pixtral"
    assert adapter.image_token_id == adapter.feature_token_id == IMG
    assert adapter.special_token_ids == {IMG, BREAK, END}
    assert adapter.pad_token_id == PAD
    assert adapter.expansion(20, 40) == [IMG, IMG, BREAK, IMG, IMG, BREAK, IMG, IMG, END]


def test_image_processor_alone_uses_the_published_ids_and_merge(small):
    adapter = mmstore.adapter_for(small.image_processor)
    assert {k: adapter.layout.token_id(k) for k in PUBLISHED} == PUBLISHED
    assert adapter.special_token_ids == {10, 12, 13}
    assert adapter.expansion(20, 40) == [10, 10, 12, 10, 10, 12, 10, 10, 13]
    # Same layout as the full processor (merge 2 is Mistral 3's published value).
    assert adapter.layout.params()["spatial_merge_size"] == 2
    assert adapter.fingerprint == mmstore.adapter_for(small).fingerprint


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


def test_pixtral_12b_merge_one_and_mistral3_merge_two_differ(mistral3, pixtral12b):
    assert mmstore.adapter_for(pixtral12b).layout.param("spatial_merge_size") == 1
    assert mmstore.adapter_for(mistral3).fingerprint != mmstore.adapter_for(pixtral12b).fingerprint


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PixtralImageProcessorPil(do_resize=False), "do_resize"),
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
    ids=["no-resize", "center-crop", "height-width-box", "non-square-patch", "unknown-processor"],
)
def test_settings_without_an_exact_layout_are_refused(make, match):
    with pytest.raises(mmstore.UnsupportedProcessorError, match=match):
        mmstore.adapter_for(make())


# --- 3. store -> loader -> a real Mistral 3 model -------------------------------------------


def _row(adapter, sid, prompt, media, completion=(4, 3, 2)):
    tokens, refs = adapter.expand(prompt, media)
    return mmstore.Rollout(
        sample_id=sid,
        tokens=tokens + list(completion),
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * len(completion),
        images=refs,
        reward=1.0,
        advantage=0.5,
    )


# Images of the training store, in order: (width, height, seed).
TRAIN_IMAGES = [(40, 20, 1), (64, 64, 2), (17, 50, 3), (64, 10, 4)]


@pytest.fixture
def filled(tmp_path, small):
    """Run "r": [2 images], [text only], [1 image], [1 image]; run "t": text only."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small)
    media = [store.put_image(noise(w, h, seed)) for w, h, seed in TRAIN_IMAGES]
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(_row(adapter, "a", [1, 3, IMG, 4, IMG, 3], media[:2]))
        w.write(_row(adapter, "b", [1, 3, 4], []))
        w.write(_row(adapter, "c", [1, IMG, 3], media[2:3]))
        w.write(_row(adapter, "d", [1, 4, IMG], media[3:]))
    with store.writer(run_id="t", step=0, adapter=adapter) as w:
        w.write(_row(adapter, "t0", [1, 3, 4, 3], []))
        w.write(_row(adapter, "t1", [1, 4], []))
    return store


def _tiny_mistral3(dtype: torch.dtype) -> Mistral3ForConditionalGeneration:
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
        image_token_index=IMG,
    )
    return tiny_model(Mistral3ForConditionalGeneration, config, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_real_mistral3_model_trains_on_every_batch(filled, small, dtype):
    model = _tiny_mistral3(dtype)
    ds = mmstore.RolloutDataset(filled, small, dtype=dtype, runs=["r"], shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    names = ("input_ids", "attention_mask", "pixel_values", "image_sizes")
    assert loader.model_input_names == names
    batches = list(loader)
    assert [b["sample_ids"] for b in batches] == [["a", "b"], ["c", "d"]]
    for batch in batches:
        assert batch["pixel_values"].dtype == dtype and batch["image_sizes"].dtype == torch.int64
        assert torch.isfinite(train_loss(model, loader, batch))
    # Padding: the image processor's own batch of the same images, pixel for pixel.
    images = [noise(w, h, seed) for w, h, seed in TRAIN_IMAGES[2:]]
    theirs = small.image_processor(images=images, patch_size=16, return_tensors="pt")
    torch.testing.assert_close(batches[1]["pixel_values"], theirs["pixel_values"].to(dtype))
    torch.testing.assert_close(batches[1]["image_sizes"], theirs["image_sizes"])
    # The model itself refuses image tokens that do not line up with the features.
    broken = dict(batches[1])
    broken["input_ids"] = batches[1]["input_ids"].clone()
    broken["input_ids"][broken["input_ids"] == IMG] = torch.where(
        torch.arange(int((broken["input_ids"] == IMG).sum())) == 0, 3, IMG
    )
    with pytest.raises((ValueError, RuntimeError)):
        train_loss(model, loader, broken)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_text_only_batch_gets_a_dummy_image_the_model_takes(filled, small, dtype):
    model = _tiny_mistral3(dtype)
    ds = mmstore.RolloutDataset(filled, small, dtype=dtype, runs=["t"], shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True)
    [batch] = list(loader)
    assert batch["dummy_image"]
    # Two tokens wide: Mistral3's get_image_features squeezes a lone feature token away.
    assert batch["image_sizes"].tolist() == [[16, 32]]
    assert batch["input_ids"][0, -3:].tolist() == [IMG, IMG, END]
    assert torch.isfinite(train_loss(model, loader, batch))


def test_position_ids_are_1d_rope_positions_the_model_uses(filled, small):
    model = _tiny_mistral3(torch.float32)
    adapter = mmstore.adapter_for(small)
    ds = mmstore.RolloutDataset(filled, small, dtype=torch.float32, runs=["r"], shuffle=False)
    sample = next(s for s in ds if s.sample_id == "c")
    positions = adapter.position_ids(sample.input_ids, sample.images)
    n = len(sample.input_ids)
    assert adapter.position_rows == 1 and positions.tolist() == [list(range(n))]
    inputs = {"input_ids": sample.input_ids[None], **batch_images(adapter, sample.images)}
    with torch.no_grad():
        ours = model(**inputs, position_ids=positions).logits
        default = model(**inputs).logits
    torch.testing.assert_close(ours, default)


# --- 4. refused before the model --------------------------------------------------------


def test_a_shifted_or_reshaped_span_is_refused_by_the_writer(filled, small):
    adapter = mmstore.adapter_for(small)
    media = filled.put_image(noise(*TRAIN_IMAGES[0]))
    good = _row(adapter, "x", [1, IMG, 3], [media])
    ref = good.images[0]
    shifted = good.model_copy(update={"images": [ref.model_copy(update={"offset": 2})]})
    # Same tokens and the same count of [IMG], but the row break moved: still refused.
    tokens = list(good.tokens)
    first_break = tokens.index(BREAK)
    tokens[first_break], tokens[first_break - 1] = tokens[first_break - 1], tokens[first_break]
    reshaped = good.model_copy(update={"tokens": tokens})
    stray = _row(adapter, "y", [1, 3, END, 4], [])
    with filled.writer(run_id="bad", step=0, adapter=adapter) as w:
        for row in (shifted, reshaped, stray):
            with pytest.raises(mmstore.InvalidRolloutError) as info:
                w.write(row)
            assert info.value.sample_id == row.sample_id
        w.write(good)


def test_a_qwen_processor_cannot_read_a_pixtral_store(filled, small):
    qwen = Qwen2VLImageProcessorPil(max_pixels=256 * 28 * 28)
    assert mmstore.adapter_for(qwen).fingerprint != mmstore.adapter_for(small).fingerprint
    check_refused_by(filled, qwen)
    check_refused_by(filled, PixtralImageProcessorPil(patch_size=8))  # nor another Pixtral layout


# --- 5. missing media ---------------------------------------------------------------------


def test_missing_media_placeholders_are_accepted_by_the_model(tmp_path, small):
    store = mmstore.Store.open(tmp_path / "m", create=True)
    adapter = mmstore.adapter_for(small)
    lost, kept = store.put_image(noise(50, 30, 7)), store.put_image(noise(20, 60, 8))
    with store.writer(run_id="m", step=0, adapter=adapter) as w:
        w.write(_row(adapter, "lost", [1, IMG, 3], [lost]))
        w.write(_row(adapter, "kept", [1, IMG, 4], [kept]))
    os.unlink(store.backend.abspath(lost.uri))
    model = _tiny_mistral3(torch.bfloat16)
    ds = mmstore.RolloutDataset(store, small, shuffle=False, missing="placeholder_zero_loss")
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [batch] = list(loader)
    assert batch["images_missing"] == 1
    assert not batch["loss_mask"][0].any() and batch["loss_mask"][1].any()
    sizes = [list(adapter.resized(50, 30)), list(adapter.resized(20, 60))]
    assert batch["image_sizes"].tolist() == sizes
    assert not batch["pixel_values"][0].any() and batch["pixel_values"][1].any()
    assert torch.isfinite(train_loss(model, loader, batch))


# --- 6. vLLM ------------------------------------------------------------------------------


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


def test_vllm_prompt_holds_one_image_token_per_image(store, mistral3):
    adapter = mmstore.adapter_for(mistral3.image_processor)  # the published tokenizer's ids
    sizes = [(641, 479), (3840, 2160)]
    media = [store.put_image(gradient(w, h)) for w, h in sizes]
    prompt = [1, 3, 10, 4, 10, 3]
    rollout = _row(adapter, "v", prompt, media)
    for (w, h), ref in zip(sizes, rollout.images, strict=True):
        assert rollout.tokens[ref.offset : ref.offset + ref.length] == _vllm_replacement(
            w, h, side=28, longest=1540
        )
    out = vllm.to_vllm_prompt(store, rollout)
    assert out["prompt_token_ids"] == [*prompt, 4, 3, 2]
    assert [im.size for im in out["multi_modal_data"]["image"]] == sizes
    assert out["multi_modal_uuids"]["image"] == [m.hash for m in media]


def test_distinct_images_expand_to_the_plain_batches(filled, small):
    adapter = mmstore.adapter_for(small)
    media = [filled.put_image(noise(w, h, seed)) for w, h, seed in TRAIN_IMAGES]  # stored: refs
    with filled.writer(run_id="s", step=0, adapter=adapter) as w:
        w.write(_row(adapter, "x", [1, IMG, 3, IMG], media[:2]))
        w.write(_row(adapter, "y", [1, IMG, 4], media[1:2]))
        w.write(_row(adapter, "z", [1, IMG, 4], media[2:3]))
    # Padded pixel values: the distinct images pad to the same largest size.
    shared = check_distinct_images(filled, small, batch_size=3, runs=["s"], shuffle=False)
    assert shared > 0
