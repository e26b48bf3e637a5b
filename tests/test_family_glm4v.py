"""The GLM-4.1V / GLM-4.5V family against the real transformers processor and model.

The expansion is checked token for token against ``Glm4vProcessor`` (GLM's image processor
plus an offline WordLevel tokenizer holding GLM's special tokens at their published ids);
rows written through the store are read back by the loader and trained on by a tiny
random-weight ``Glm4vForConditionalGeneration``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore.integrations import vllm
from tests.families_common import (
    check_distinct_images,
    check_output_fits,
    check_placeholder,
    check_refused_by,
    media_ref,
    model_inputs,
    sized,
    tiny_model,
    train_loss,
    word_level_tokenizer,
)

# GLM-4.1V's tokenizer, as published (zai-org/GLM-4.1V-9B-Thinking).
PUBLISHED = {
    "<|endoftext|>": 151329,
    "<|begin_of_image|>": 151339,
    "<|end_of_image|>": 151340,
    "<|begin_of_video|>": 151341,
    "<|end_of_video|>": 151342,
    "<|image|>": 151343,
    "<|video|>": 151344,
}
# GLM-4.5V's tokenizer moves <|image|> and <|video|> (its config's image_token_id 151363).
GLM45V = {**PUBLISHED, "<|image|>": 151363, "<|video|>": 151364}
# Small ids for the tiny model, so its vocabulary stays small.
SMALL = {
    "<|endoftext|>": 1,
    "<|begin_of_image|>": 12,
    "<|end_of_image|>": 13,
    "<|begin_of_video|>": 14,
    "<|end_of_video|>": 15,
    "<|image|>": 10,
    "<|video|>": 11,
}
WORDS = {"[UNK]": 0, "hello": 2, "look": 3, "answer": 4, "yes": 5}
IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"  # what GLM's chat template emits

# A small pixel budget: 8..16 image tokens per image, so the loader and model tests are fast.
SMALL_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 2 * 28 * 28 * 16}

# (width, height); the processor runs on a real image of each size with GLM-4.1V's defaults
SIZES = [
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
]


def _processor(image_processor, special):
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    return Glm4vProcessor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer(
            {**WORDS, **special}, special, unk="[UNK]", pad="<|endoftext|>"
        ),
        video_processor=Glm4vVideoProcessor(),
    )


def _image(width, height, seed=0):
    """A smooth image with some structure (interpolation differences stay realistic)."""
    y, x = np.mgrid[0:height, 0:width]
    r = 127 + 120 * np.sin(x / 17.0 + seed) * np.cos(y / 23.0)
    g = 255 * x / max(width - 1, 1)
    b = 255 * y / max(height - 1, 1)
    return Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8))


@pytest.fixture(scope="module")
def published():
    """GLM-4.1V's full processor with its defaults and the published token ids."""
    return _processor(Glm4vImageProcessorPil(), PUBLISHED)


@pytest.fixture(scope="module")
def small():
    """A full processor with a small pixel budget and small token ids (the tiny model's)."""
    return _processor(Glm4vImageProcessorPil(size=SMALL_SIZE), SMALL)


# -- the expansion against the real processor ------------------------------------------------


@sized(SIZES)
def test_expansion_is_what_the_processor_substitutes(published, width, height):
    adapter = mmstore.adapter_for(published)
    text = f"hello {IMAGE} look"
    image = Image.new("RGB", (width, height), (20, 120, 220))  # cheap at 4K; layout only
    out = published(text=[text], images=[image], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    # The processor replaces only <|image|>: begin/end-of-image stay text around the span.
    assert ids[:2] == [WORDS["hello"], PUBLISHED["<|begin_of_image|>"]]
    assert ids[-2:] == [PUBLISHED["<|end_of_image|>"], WORDS["look"]]
    assert ids[2:-2] == adapter.expansion(width, height)
    assert adapter.num_tokens(width, height) == len(ids) - 4
    # expand() of the template's tokens is exactly the processor's token list
    prompt = published.tokenizer(text)["input_ids"]
    tokens, refs = adapter.expand(prompt, [media_ref(width, height)])
    assert tokens == ids
    assert (refs[0].offset, refs[0].length) == (2, len(ids) - 4)
    assert refs[0].family == "glm4v"
    # the processor's mm_token_type_ids are the family's token types
    types = adapter.token_types(torch.tensor([ids]))["mm_token_type_ids"]
    assert types.tolist() == out["mm_token_type_ids"].tolist()
    # the placeholder has the processor's shapes; check_output accepts the real output
    check_placeholder(adapter, out, width, height)
    check_output_fits(adapter, {k: out[k] for k in adapter.image_inputs}, refs[0])


@pytest.mark.parametrize(("width", "height"), [(1, 201), (201, 1), (3, 700), (300, 1)])
def test_sizes_the_processor_refuses_are_refused(width, height):
    adapter = mmstore.adapter_for(Glm4vImageProcessorPil())
    with pytest.raises(ValueError, match="aspect ratio"):
        Glm4vImageProcessorPil()(images=[_image(width, height)])
    with pytest.raises(mmstore.ImageSizeError, match="aspect ratio"):
        adapter.expansion(width, height)


def test_the_torchvision_backend_lays_out_and_processes_like_the_pil_backend():
    pil = Glm4vImageProcessorPil(size=SMALL_SIZE)
    fast = Glm4vImageProcessor(size=SMALL_SIZE)
    adapter = mmstore.adapter_for(fast)
    assert adapter.fingerprint == mmstore.adapter_for(pil).fingerprint
    levels = 1 / 255 / min(pil.image_std)  # one 8-bit gray level after normalization
    # sizes the layout keeps (no resampling) and sizes it resamples (down, up, both)
    for (width, height), resampled in [
        ((112, 112), False),
        ((112, 84), False),
        ((56, 140), False),
        ((1, 1), False),  # a constant image, however it is scaled
        ((37, 91), True),
        ((641, 479), True),
        ((1000, 5), True),
        ((1920, 1080), True),
    ]:
        image = _image(width, height)
        a = pil(images=[image], return_tensors="pt")
        b = fast(images=[image], return_tensors="pt")
        assert a["image_grid_thw"].tolist() == b["image_grid_thw"].tolist()
        assert adapter.grid(width, height) == tuple(b["image_grid_thw"][0].tolist())
        assert adapter.placeholder(width, height)["pixel_values"].shape == b["pixel_values"].shape
        if not resampled:
            torch.testing.assert_close(a["pixel_values"].bfloat16(), b["pixel_values"].bfloat16())
        else:
            # PIL's and torchvision's bicubic kernels round differently: at most two gray
            # levels apart on a smooth image, almost every value equal in bf16.
            diff = (a["pixel_values"] - b["pixel_values"]).abs()
            assert diff.max() <= 2 * levels + 1e-4, (width, height)
            torch.testing.assert_close(
                a["pixel_values"].bfloat16(),
                b["pixel_values"].bfloat16(),
                atol=2 * levels,
                rtol=0.016,
            )


# -- token ids ---------------------------------------------------------------------------------


def test_token_ids_come_from_the_tokenizer_or_the_published_tokenizer(published, small):
    by_tokenizer = mmstore.adapter_for(small)
    assert by_tokenizer.image_token_id == SMALL["<|image|>"]
    assert by_tokenizer.pad_token_id == SMALL["<|endoftext|>"]
    assert by_tokenizer.layout.token_id("image_start_token_id") == SMALL["<|begin_of_image|>"]
    assert by_tokenizer.expansion(28, 28) == [SMALL["<|image|>"]] * 9
    alone = mmstore.adapter_for(small.image_processor)
    assert alone.image_token_id == PUBLISHED["<|image|>"]
    assert alone.pad_token_id == PUBLISHED["<|endoftext|>"]
    assert alone.special_token_ids == {PUBLISHED["<|image|>"]}
    assert mmstore.adapter_for(published).layout.token_ids == alone.layout.token_ids
    # one layout, whatever the tokenizer: the fingerprint leaves token ids out
    assert by_tokenizer.fingerprint == alone.fingerprint


def test_glm45v_takes_its_image_token_from_its_tokenizer():
    processor = _processor(Glm4vImageProcessorPil(), GLM45V)
    adapter = mmstore.adapter_for(processor)
    assert adapter.image_token_id == 151363
    out = processor(text=[f"hello {IMAGE}"], images=[_image(300, 200)], return_tensors="np")
    assert out["input_ids"][0, 2:-1].tolist() == adapter.expansion(300, 200)
    assert mmstore.adapter_for(Glm4vImageProcessorPil(), image_token_id=151363).expansion(
        300, 200
    ) == adapter.expansion(300, 200)


def test_layout_parameters_and_refused_settings():
    adapter = mmstore.adapter_for(Glm4vImageProcessorPil(size=SMALL_SIZE))
    assert dict(adapter.layout.parameters) == {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 112 * 112,
        "max_pixels": 2 * 28 * 28 * 16,
    }
    # every layout parameter moves the fingerprint
    for change in (
        {"patch_size": 16},
        {"temporal_patch_size": 1},
        {"merge_size": 1},
        {"size": {**SMALL_SIZE, "shortest_edge": 56 * 56}},
        {"size": {**SMALL_SIZE, "longest_edge": 2 * 28 * 28 * 32}},
    ):
        other = mmstore.adapter_for(Glm4vImageProcessorPil(**{"size": SMALL_SIZE, **change}))
        assert other.fingerprint != adapter.fingerprint, change
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_resize"):
        mmstore.adapter_for(Glm4vImageProcessorPil(do_resize=False))
    # a fixed size: GLM's resize refuses it at call time, the adapter when it is built
    fixed = Glm4vImageProcessorPil(size={"height": 224, "width": 224})
    with pytest.raises(ValueError, match="shortest_edge"):
        fixed(images=[_image(56, 56)])
    with pytest.raises(mmstore.UnsupportedProcessorError, match="shortest_edge"):
        mmstore.adapter_for(fixed)


def test_fingerprint_differs_from_qwen_vl_with_the_same_numbers():
    same = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}
    glm = mmstore.adapter_for(Glm4vImageProcessorPil(size=same))
    qwen = mmstore.adapter_for(Qwen2VLImageProcessorPil(size=same))
    assert dict(glm.layout.parameters) == dict(qwen.layout.parameters)
    assert glm.fingerprint != qwen.fingerprint


# -- the store, the loader and a real model --------------------------------------------------


def _tiny_model(dtype):
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
        image_token_id=SMALL["<|image|>"],
        video_token_id=SMALL["<|video|>"],
        image_start_token_id=SMALL["<|begin_of_image|>"],
        image_end_token_id=SMALL["<|end_of_image|>"],
        video_start_token_id=SMALL["<|begin_of_video|>"],
        video_end_token_id=SMALL["<|end_of_video|>"],
    )
    return tiny_model(Glm4vForConditionalGeneration, config, dtype, attn="sdpa")


def _write(store, adapter, processor, rows, *, run_id="r", step=0):
    """Rows of (sample_id, images): a prompt with GLM's template per image, then an answer."""
    tok = processor.tokenizer
    out = []
    with store.writer(run_id=run_id, step=step, adapter=adapter) as w:
        for sid, images in rows:
            media = [store.put_image(image) for image in images]
            prompt = tok(" ".join(["hello", *[IMAGE] * len(media), "look"]))["input_ids"]
            tokens, refs = adapter.expand(prompt, media)
            answer = tok("answer yes")["input_ids"]
            rollout = mmstore.Rollout(
                sample_id=sid,
                tokens=tokens + answer,
                prompt_len=len(tokens),
                loss_mask=[False] * len(tokens) + [True] * len(answer),
                images=refs,
                reward=1.0,
                advantage=0.5,
            )
            w.write(rollout)
            out.append(rollout)
    return out


@pytest.fixture(scope="module")
def filled(tmp_path_factory, small):
    """A store of GLM rows: two images, one image, text only, one image."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("glm") / "store", create=True)
    adapter = mmstore.adapter_for(small)
    _write(
        store,
        adapter,
        small,
        [
            ("two", [_image(300, 200), _image(57, 91, seed=1)]),
            ("one", [_image(640, 480, seed=2)]),
            ("text", []),
            ("again", [_image(300, 200)]),
        ],
    )
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_real_glm4v_model_trains_on_every_batch(filled, small, dtype):
    model = _tiny_model(dtype)
    ds = mmstore.RolloutDataset(filled, small, dtype=dtype, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    assert set(loader.model_input_names) == {
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
    }
    batches = list(loader)
    assert [b["sample_ids"] for b in batches] == [["two", "one"], ["text", "again"]]
    for batch in batches:
        assert batch["pixel_values"].dtype == dtype
        assert batch["image_grid_thw"].dtype == torch.int64
        assert torch.isfinite(train_loss(model, loader, batch)), batch["sample_ids"]
    # The model itself refuses image tokens that do not line up with the pixels: a finite
    # loss above means the spans, grids and pixels agree.
    batch = batches[0]
    broken = batch["input_ids"].clone()
    first = int((broken == SMALL["<|image|>"]).nonzero()[0, 1])
    broken[0, first] = WORDS["hello"]
    with pytest.raises(ValueError, match="do not match"):
        model(**{**model_inputs(loader, batch), "input_ids": broken})


def test_position_ids_are_the_models_own_for_each_sample(filled, small):
    model = _tiny_model(torch.float32)
    ds = mmstore.RolloutDataset(filled, small, dtype=torch.float32, shuffle=False)
    adapter = ds.adapter
    for sample in ds:
        positions = adapter.position_ids(sample.input_ids, sample.images)
        assert positions.shape == (adapter.position_rows, len(sample.input_ids))
        ids = sample.input_ids[None]
        grids = [image["image_grid_thw"] for image in sample.images]
        expected, _ = model.model.get_rope_index(
            ids,
            (ids == adapter.image_token_id).int(),
            image_grid_thw=torch.cat(grids) if grids else None,
        )
        assert torch.equal(positions, expected[:, 0]), sample.sample_id
        if sample.images:
            # and the model's output is the same when given them
            inputs = {
                "input_ids": ids,
                "mm_token_type_ids": (ids == adapter.image_token_id).int(),
                "pixel_values": torch.cat([image["pixel_values"] for image in sample.images]),
                "image_grid_thw": torch.cat(grids),
            }
            with torch.no_grad():
                alone = model(**inputs).logits
                given = model(**inputs, position_ids=positions[:, None]).logits
            torch.testing.assert_close(given, alone)


def test_position_ids_refuse_adjacent_images(small):
    adapter = mmstore.adapter_for(small)
    expansion = adapter.expansion(28, 28)
    grid = {"image_grid_thw": torch.tensor([adapter.grid(28, 28)])}
    with pytest.raises(mmstore.InvalidRolloutError, match="between adjacent images"):
        adapter.position_ids(torch.tensor(expansion + expansion), [grid, grid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_text_only_batch_gets_a_dummy_image_the_model_runs(tmp_path, small, dtype):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small)
    _write(store, adapter, small, [("a", []), ("b", [])])
    ds = mmstore.RolloutDataset(store, small, dtype=dtype, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True)
    (batch,) = list(loader)
    assert batch["dummy_image"]
    assert batch["image_grid_thw"].tolist() == [list(adapter.grid(*adapter.dummy_size))]
    assert int(batch["mm_token_type_ids"].sum()) == adapter.num_tokens(*adapter.dummy_size)
    assert torch.isfinite(train_loss(_tiny_model(dtype), loader, batch))


def test_missing_media_gives_placeholders_the_model_accepts(tmp_path, small):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small)
    (lost, _) = _write(
        store, adapter, small, [("lost", [_image(300, 200)]), ("kept", [_image(57, 91)])]
    )
    os.unlink(store.backend.abspath(lost.images[0].uri))
    ds = mmstore.RolloutDataset(
        store, small, dtype=torch.bfloat16, shuffle=False, missing="placeholder_zero_loss"
    )
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    with pytest.warns(UserWarning):
        (batch,) = list(loader)
    assert batch["sample_ids"] == ["lost", "kept"]
    assert batch["images_missing"] == 1
    assert not batch["loss_mask"][0].any() and batch["loss_mask"][1].any()
    rows = adapter.num_tokens(300, 200) * adapter.layout.param("merge_size") ** 2
    assert not batch["pixel_values"][:rows].any()
    assert batch["pixel_values"][rows:].any()
    assert torch.isfinite(train_loss(_tiny_model(torch.bfloat16), loader, batch))


# -- refusals ------------------------------------------------------------------------------------


def test_a_shifted_span_is_refused_by_the_writer(tmp_path, small):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small)
    media = store.put_image(_image(300, 200))
    prompt = small.tokenizer(f"hello {IMAGE} look")["input_ids"]
    tokens, refs = adapter.expand(prompt, [media])
    shifted = refs[0].model_copy(update={"offset": refs[0].offset + 1})
    rollout = mmstore.Rollout(
        sample_id="shifted",
        tokens=tokens,
        prompt_len=len(tokens),
        loss_mask=[True] * len(tokens),
        images=[shifted],
    )
    writer = store.writer(run_id="r", step=0, adapter=adapter)
    with pytest.raises(mmstore.InvalidRolloutError) as err, writer as w:
        w.write(rollout)
    assert err.value.sample_id == "shifted"
    assert store.rollout_files() == []
    # and a stray <|image|> outside every span is refused too
    stray = mmstore.Rollout(
        sample_id="stray",
        tokens=[*tokens, SMALL["<|image|>"]],
        prompt_len=len(tokens),
        loss_mask=[True] * (len(tokens) + 1),
        images=refs,
    )
    writer = store.writer(run_id="r", step=0, adapter=adapter)
    with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"), writer as w:
        w.write(stray)


def test_a_glm_store_read_with_a_qwen_processor_fails_at_construction(filled):
    check_refused_by(filled, Qwen2VLImageProcessorPil(size=SMALL_SIZE))


# -- vLLM ----------------------------------------------------------------------------------------


def test_vllm_prompt_collapses_each_span_to_one_image_token(tmp_path, published):
    # vLLM's glm4_1v: the placeholder is "<|begin_of_image|><|image|><|end_of_image|>" and
    # _get_prompt_updates replaces the one <|image|> by [image_token_id] * (grid.prod() //
    # merge**2), as transformers' processor does: the prompt keeps begin/end around one token.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(published.image_processor)  # published ids, like vLLM's
    (rollout,) = _write(store, adapter, published, [("v", [_image(300, 200), _image(57, 91)])])
    prompt = vllm.to_vllm_prompt(store, rollout)
    template = published.tokenizer(f"hello {IMAGE} {IMAGE} look answer yes")["input_ids"]
    assert prompt["prompt_token_ids"] == template
    assert prompt["prompt_token_ids"].count(PUBLISHED["<|image|>"]) == 2
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(300, 200), (57, 91)]
    assert prompt["multi_modal_uuids"]["image"] == [ref.hash for ref in rollout.images]


def test_distinct_images_expand_to_the_plain_batches(filled, small):
    # "again" shows the first image of "two": one batch of 4 carries it once.
    assert check_distinct_images(filled, small, batch_size=4, shuffle=False) > 0
