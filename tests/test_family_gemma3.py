"""The Gemma 3 family against the real transformers processor and a tiny real Gemma 3 model.

The processors are transformers' own (``Gemma3Processor`` over ``Gemma3ImageProcessorPil`` or
the torchvision ``Gemma3ImageProcessor``) with a tokenizer built offline: a WordLevel vocabulary
holding Gemma's special tokens, at their published ids or at small ids for a tiny model.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._families import family_for_layout, layout_from_record
from mmstore.integrations import vllm
from tests.families_common import (
    check_distinct_images,
    check_output_fits,
    check_placeholder,
    check_refused_by,
    gradient,
    media_ref,
    model_output,
    noise,
    sized,
    tiny_model,
    word_level_tokenizer,
)

# `<start_of_image>`, `<end_of_image>`, `<image_soft_token>`, "\n\n" and `<pad>` in the
# published Gemma 3 tokenizer; SMALL: the same tokens at ids a tiny model's vocabulary holds.
PUBLISHED = {"boi": 255999, "eoi": 256000, "soft": 262144, "nl2": 108, "pad": 0}
SMALL = {"boi": 7, "eoi": 8, "soft": 9, "nl2": 6, "pad": 0}
WORDS = {"<unk>": 1, "<bos>": 2, "hi": 3, "there": 4, "ok": 5}
SIDE = 28  # the tiny vision tower's image size: 4x4 patches of 7, pooled to 2x2 soft tokens
SEQ = 4

# (width, height)
SIZES = [
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
]


def _tokenizer(ids: dict[str, int], *, with_nl2: bool = True) -> PreTrainedTokenizerFast:
    vocab = {
        **WORDS,
        "<pad>": ids["pad"],
        "<start_of_image>": ids["boi"],
        "<end_of_image>": ids["eoi"],
        "<image_soft_token>": ids["soft"],
    }
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


def _full(image_processor, ids=PUBLISHED, seq: int = 256, **kw) -> Gemma3Processor:
    return Gemma3Processor(
        image_processor=image_processor, tokenizer=_tokenizer(ids, **kw), image_seq_length=seq
    )


@pytest.fixture(scope="module")
def published() -> Gemma3Processor:
    return _full(Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}))


@pytest.fixture(scope="module")
def small() -> Gemma3Processor:
    """Small token ids and 4 soft tokens per image: what the tiny model below takes."""
    return _full(Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}), SMALL, SEQ)


def _expected(ids: dict[str, int], seq: int) -> list[int]:
    return [ids["nl2"], ids["boi"], *[ids["soft"]] * seq, ids["eoi"], ids["nl2"]]


# --- expansion against the real processor ------------------------------------------------


def test_enough_sizes():
    assert len(set(SIZES)) >= 20


@sized(SIZES)
def test_expansion_is_what_the_real_processor_substitutes(published, width, height):
    adapter = mmstore.adapter_for(published)
    image = gradient(width, height)
    out = published(text=["hi <start_of_image> there"], images=[image], return_tensors="np")
    ids = [int(t) for t in out["input_ids"][0]]
    before = published.tokenizer.encode("hi", add_special_tokens=False)
    after = published.tokenizer.encode("there", add_special_tokens=False)
    assert ids[: len(before)] == before and ids[-len(after) :] == after
    span = ids[len(before) : -len(after)]

    assert adapter.expansion(width, height) == span == _expected(PUBLISHED, 256)
    assert adapter.num_tokens(width, height) == len(span) == 260
    # token_type_ids: 1 on the soft tokens only, as the processor marks them.
    types = adapter.token_types(torch.tensor([ids]))["token_type_ids"]
    np.testing.assert_array_equal(types.numpy(), out["token_type_ids"])
    placeholder = check_placeholder(adapter, out, width, height)
    assert placeholder["pixel_values"].shape == (1, 3, SIDE, SIDE)
    _, refs = adapter.expand([3, PUBLISHED["boi"], 4], [media_ref(width, height)])
    check_output_fits(adapter, {"pixel_values": out["pixel_values"]}, refs[0])
    np.testing.assert_array_equal(adapter.process([image])["pixel_values"], out["pixel_values"])


def test_two_images_and_the_model_input_names(published):
    adapter = mmstore.adapter_for(published)
    out = published(
        text=["hi <start_of_image> ok <start_of_image> there"],
        images=[[gradient(30, 20), gradient(5, 900)]],
        return_tensors="np",
    )
    span = _expected(PUBLISHED, 256)
    assert [int(t) for t in out["input_ids"][0]] == [3, *span, 5, *span, 4]
    tokens, refs = adapter.expand(
        [3, PUBLISHED["boi"], 5, PUBLISHED["boi"], 4],
        [media_ref(30, 20), media_ref(5, 900, n=1)],
    )
    assert tokens == [int(t) for t in out["input_ids"][0]]
    assert [(r.offset, r.length) for r in refs] == [(1, 260), (262, 260)]
    # The keys the processor hands the model, less what the padded batch already names.
    assert set(adapter.model_input_names) == set(published.model_input_names) - {"num_crops"}


def test_adapter_for_an_image_processor_uses_the_published_ids():
    # The published preprocessor_config.json sets 896x896 (the class default is 224).
    adapter = mmstore.adapter_for(Gemma3ImageProcessorPil(size={"height": 896, "width": 896}))
    assert adapter.family == "gemma3"
    assert adapter.image_token_id == PUBLISHED["boi"]
    assert adapter.feature_token_id == PUBLISHED["soft"]
    assert adapter.pad_token_id == PUBLISHED["pad"]
    assert adapter.special_token_ids == {PUBLISHED[k] for k in ("boi", "eoi", "soft")}
    assert adapter.expansion(640, 480) == _expected(PUBLISHED, 256)
    assert adapter.layout.param("image_seq_length") == 256
    assert adapter.placeholder(640, 480)["pixel_values"].shape == (1, 3, 896, 896)
    assert adapter.model_input_names == (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "token_type_ids",
    )
    positions = adapter.position_ids(torch.zeros(7, dtype=torch.int64), [])
    assert positions.tolist() == [list(range(7))]  # 1-D RoPE, one row


def test_adapter_for_a_full_processor_takes_its_tokenizer_ids(small):
    adapter = mmstore.adapter_for(small)
    assert adapter.image_token_id == SMALL["boi"]
    assert adapter.feature_token_id == SMALL["soft"]
    assert adapter.pad_token_id == SMALL["pad"]
    assert adapter.expansion(10, 10) == _expected(SMALL, SEQ)
    # image_seq_length is the processor's, a layout parameter: it changes the fingerprint.
    assert adapter.layout.param("image_seq_length") == SEQ
    image_only = mmstore.adapter_for(small.image_processor)
    assert image_only.layout.param("image_seq_length") == 256
    assert adapter.fingerprint != image_only.fingerprint
    assert mmstore.adapter_for(_full(small.image_processor, SMALL, 256)).fingerprint == (
        image_only.fingerprint
    )
    out = small(text=["hi <start_of_image>"], images=[gradient(9, 9)], return_tensors="np")
    assert [int(t) for t in out["input_ids"][0]] == [3, *adapter.expansion(9, 9)]


def test_fingerprints_differ_across_layouts_and_families(small):
    fingerprints = {
        mmstore.adapter_for(Gemma3ImageProcessorPil()).fingerprint,
        mmstore.adapter_for(
            Gemma3ImageProcessorPil(size={"height": 448, "width": 448})
        ).fingerprint,
        mmstore.adapter_for(small).fingerprint,
        mmstore.adapter_for(Qwen2VLImageProcessorPil()).fingerprint,
    }
    assert len(fingerprints) == 4
    # The footer record rebuilds the layout (and so pixel shapes) without the processor.
    adapter = mmstore.adapter_for(small)
    layout = layout_from_record(adapter.layout.params())
    assert layout.fingerprint == adapter.fingerprint
    assert family_for_layout(layout).pixel_shape(5, 5) == (1, 3, SIDE, SIDE)


# --- settings the family refuses ---------------------------------------------------------


@pytest.mark.parametrize("backend", [Gemma3ImageProcessorPil, Gemma3ImageProcessor])
def test_pan_and_scan_is_refused(backend):
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_pan_and_scan"):
        mmstore.adapter_for(backend(do_pan_and_scan=True))
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_pan_and_scan"):
        mmstore.adapter_for(_full(backend(do_pan_and_scan=True)))


def test_a_processor_switched_to_pan_and_scan_later_is_refused_at_processing():
    processor = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})
    adapter = mmstore.adapter_for(processor)
    processor.do_pan_and_scan = True
    processor.pan_and_scan_min_crop_size = 8
    processor.pan_and_scan_max_num_crops = 4
    processor.pan_and_scan_min_ratio_to_activate = 1.2
    with pytest.raises(mmstore.LayoutMismatchError, match="pan-and-scan"):
        adapter.process([gradient(90, 30)])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"do_resize": False}, "do_resize"),
        ({"size": {"shortest_edge": 224}}, "shortest_edge"),
    ],
)
def test_variable_sizes_are_refused(kwargs, match):
    with pytest.raises(mmstore.UnsupportedProcessorError, match=match):
        mmstore.adapter_for(Gemma3ImageProcessorPil(**kwargs))


def test_a_tokenizer_without_one_double_newline_token_is_refused():
    with pytest.raises(mmstore.UnsupportedProcessorError, match="not one token"):
        mmstore.adapter_for(_full(Gemma3ImageProcessorPil(), with_nl2=False))


def test_a_processor_with_another_image_wrapper_is_refused(small):
    changed = _full(small.image_processor, SMALL, SEQ)
    changed.full_image_sequence = changed.full_image_sequence.strip("\n")
    with pytest.raises(mmstore.UnsupportedProcessorError, match="full_image_sequence"):
        mmstore.adapter_for(changed)


@pytest.mark.parametrize(("width", "height"), [(0, 5), (5, 0), (-1, 3)])
def test_empty_sizes_raise_image_size_error(width, height):
    adapter = mmstore.adapter_for(Gemma3ImageProcessorPil())
    with pytest.raises(mmstore.ImageSizeError):
        adapter.expansion(width, height)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.placeholder(width, height)


# --- the torchvision backend --------------------------------------------------------------


def test_torchvision_backend_matches_the_pil_backend():
    size = {"height": 56, "width": 56}
    pil, fast = Gemma3ImageProcessorPil(size=size), Gemma3ImageProcessor(size=size)
    adapter = mmstore.adapter_for(fast)
    assert adapter.fingerprint == mmstore.adapter_for(pil).fingerprint
    for width, height in [(1, 1), (3, 7), (56, 56), (641, 479), (1920, 1080), (5, 1000)]:
        for image in (gradient(width, height), noise(width, height)):
            ours = adapter.process([image])["pixel_values"]
            theirs = mmstore.adapter_for(pil).process([image])["pixel_values"]
            assert (
                ours.shape
                == theirs.shape
                == adapter.placeholder(width, height)["pixel_values"].shape
            )
            # The two resizes round to the nearest 8-bit level differently: at most one
            # level (2/255 after normalizing to [-1, 1]), about one bf16 step near 1.
            torch.testing.assert_close(
                torch.from_numpy(ours).bfloat16(),
                torch.from_numpy(theirs).bfloat16(),
                atol=2 / 255,
                rtol=2**-8,
            )


# --- the store, the loader and a tiny Gemma 3 model ----------------------------------------


def _model(dtype: torch.dtype):
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
            image_size=SIDE,
            patch_size=7,
        ),
        mm_tokens_per_image=SEQ,  # the processor's image_seq_length
        boi_token_index=SMALL["boi"],
        eoi_token_index=SMALL["eoi"],
        image_token_index=SMALL["soft"],
    )
    return tiny_model(Gemma3ForConditionalGeneration, config, dtype)


def _rollout(adapter, sid, prompt, media, completion=(5, 4)):
    tokens, refs = adapter.expand([*prompt, *completion], media)
    n_prompt = len(tokens) - len(completion)
    return mmstore.Rollout(
        sample_id=sid,
        tokens=tokens,
        prompt_len=n_prompt,
        loss_mask=[i >= n_prompt for i in range(len(tokens))],
        images=refs,
        reward=1.0,
        advantage=0.5,
    )


@pytest.fixture
def filled(store, small):
    adapter = mmstore.adapter_for(small)
    boi = adapter.image_token_id
    a = store.put_image(gradient(40, 30))
    b = store.put_image(noise(17, 90))
    with store.writer(run_id="g", step=0, adapter=adapter) as w:
        w.write(_rollout(adapter, "one", [2, 3, boi], [a]))
        w.write(_rollout(adapter, "two", [2, boi, 3, boi], [a, b]))
        w.write(_rollout(adapter, "text", [2, 3, 4], []))
        w.write(_rollout(adapter, "same", [2, boi, 4], [a]))
    with store.writer(run_id="g", step=1, adapter=adapter) as w:
        w.write(_rollout(adapter, "t1", [2, 3], []))
        w.write(_rollout(adapter, "t2", [2, 4, 3], []))
    return store


def _loss(model, loader, batch) -> torch.Tensor:
    out = model_output(model, loader, batch, labels_on="loss_mask")
    assert torch.isfinite(out.logits).all()
    return out.loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tiny_gemma3_model_trains_on_every_batch(filled, small, dtype):
    model = _model(dtype)
    ds = mmstore.RolloutDataset(filled, small, dtype=dtype, steps=[0], shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    assert loader.model_input_names == (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "token_type_ids",
    )
    batches = list(loader)
    assert sorted(s for b in batches for s in b["sample_ids"]) == ["one", "same", "text", "two"]
    for batch in batches:
        n_images = int((batch["input_ids"] == SMALL["boi"]).sum())
        assert batch["pixel_values"].shape == (n_images, 3, SIDE, SIDE)
        assert batch["pixel_values"].dtype == dtype
        assert int(batch["token_type_ids"].sum()) == SEQ * n_images
        assert torch.isfinite(_loss(model, loader, batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_text_only_batches_with_and_without_a_dummy_image(filled, small, dtype):
    model = _model(dtype)
    ds = mmstore.RolloutDataset(filled, small, dtype=dtype, steps=[1], shuffle=False)
    plain = mmstore.RolloutLoader(ds, batch_size=2)
    (batch,) = list(plain)
    assert batch["pixel_values"] is None  # the vision tower cannot run on zero images
    assert torch.isfinite(_loss(model, plain, batch))

    padded = mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True)
    (batch,) = list(padded)
    assert batch["dummy_image"]
    assert batch["pixel_values"].shape == (1, 3, SIDE, SIDE)
    assert batch["pixel_values"].dtype == dtype
    assert int(batch["token_type_ids"].sum()) == SEQ
    dummy = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()[-(SEQ + 4) :]
    assert dummy == _expected(SMALL, SEQ)
    assert not batch["loss_mask"][0][-(SEQ + 4) :].any()
    assert torch.isfinite(_loss(model, padded, batch))


def test_missing_media_gives_placeholders_the_model_accepts(store, small):
    adapter = mmstore.adapter_for(small)
    media = store.put_image(gradient(64, 48))
    with store.writer(run_id="m", step=0, adapter=adapter) as w:
        w.write(_rollout(adapter, "gone", [2, adapter.image_token_id], [media]))
        w.write(_rollout(adapter, "text", [2, 3], []))
    os.unlink(store.backend.abspath(media.uri))
    ds = mmstore.RolloutDataset(
        store, small, dtype=torch.float32, shuffle=False, missing="placeholder_zero_loss"
    )
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    with pytest.warns(UserWarning):
        (batch,) = list(loader)
    assert batch["images_missing"] == 1
    gone = batch["sample_ids"].index("gone")
    assert not batch["loss_mask"][gone].any()
    assert batch["pixel_values"].shape == (1, 3, SIDE, SIDE)
    assert not batch["pixel_values"].any()
    _loss(_model(torch.float32), loader, batch)


# --- refusals before the model ------------------------------------------------------------


def test_a_shifted_span_is_refused_by_the_writer(store, small):
    adapter = mmstore.adapter_for(small)
    media = store.put_image(gradient(20, 20))
    good = _rollout(adapter, "s", [2, 3, adapter.image_token_id], [media])
    shifted = good.model_copy(
        update={"images": [good.images[0].model_copy(update={"offset": good.images[0].offset + 1})]}
    )
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        with pytest.raises(mmstore.InvalidRolloutError, match="span"):
            w.write(shifted)
        # The soft tokens alone, without their wrapper, are not the expansion either.
        bare = good.model_copy(update={"tokens": [2, 3, 3, *[SMALL["soft"]] * SEQ, 3, 3, 5, 4]})
        with pytest.raises(mmstore.InvalidRolloutError):
            w.write(bare)
        # An end-of-image token outside every span is a stray image token.
        stray = _rollout(adapter, "stray", [2, 3], [], completion=(SMALL["eoi"], 4))
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
            w.write(stray)
        w.write(good)


def test_double_newlines_next_to_a_span_are_ordinary_text(store, small):
    # Token-level expansion never merges the wrapper's "\n\n" with the prompt's (a text-level
    # BPE tokenization would): the neighbours stay as given and the span stays exact.
    adapter = mmstore.adapter_for(small)
    nl2, boi = SMALL["nl2"], adapter.image_token_id
    media = store.put_image(gradient(20, 20))
    rollout = _rollout(adapter, "nl", [2, nl2, boi, nl2], [media], completion=(nl2, 4))
    assert rollout.tokens == [2, nl2, *_expected(SMALL, SEQ), nl2, nl2, 4]
    assert nl2 not in adapter.special_token_ids
    with store.writer(run_id="n", step=0, adapter=adapter) as w:
        w.write(rollout)


def test_a_gemma3_store_read_with_a_qwen_processor_fails_at_construction(filled):
    check_refused_by(filled, Qwen2VLImageProcessorPil())


# --- vLLM ---------------------------------------------------------------------------------


def test_vllm_prompt_collapses_each_span_to_one_start_of_image(store, published):
    # vLLM's gemma3_mm.py: the prompt holds one `<start_of_image>` per image, which its
    # PromptReplacement expands to processor.full_image_sequence ("\n\n", boi, soft tokens,
    # eoi, "\n\n"). The registry knows the published ids, so this adapter is built from the
    # image processor alone.
    adapter = mmstore.adapter_for(published.image_processor)
    boi = PUBLISHED["boi"]
    a, b = store.put_image(gradient(40, 30)), store.put_image(gradient(7, 70))
    rollout = _rollout(adapter, "v", [2, boi, 3, boi], [a, b])
    with store.writer(run_id="v", step=0) as w:
        w.write(rollout)
    prompt = vllm.to_vllm_prompt(store, rollout)
    assert prompt["prompt_token_ids"] == [2, boi, 3, boi, 5, 4]
    assert prompt["multi_modal_uuids"] == {"image": [a.hash, b.hash]}
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(40, 30), (7, 70)]


def test_distinct_images_expand_to_the_plain_batches(filled, small):
    # "one", "two" and "same" show image a: one batch of 4 carries it once.
    assert check_distinct_images(filled, small, batch_size=4, steps=[0], shuffle=False) > 0
