"""Kimi-K2.5: the family's layout against the real transformers processor and model.

Everything is built from parameters: the real ``Kimi_K25ImageProcessor`` (torchvision), a
``Kimi_K25Processor`` over a WordLevel tokenizer holding the family's special tokens, and a
tiny random-weight ``Kimi_K25ForConditionalGeneration`` (MoonViT + a DeepSeek-V3 MoE/MLA
text model), so nothing downloads.
"""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

import mmstore
from mmstore.integrations import vllm
from mmstore.synth import photo
from tests.families_common import (
    check_distinct_images,
    check_output_fits,
    check_placeholder,
    check_refused_by,
    model_output,
    sized,
    word_level_tokenizer,
)

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_k25.image_processing_kimi_k25 import (  # noqa: E402
    Kimi_K25ImageProcessor,
)

PUBLISHED = {"<|media_pad|>": 163605, "[PAD]": 163839, "<|media_begin|>": 163602}
PUBLISHED.update({"<|media_content|>": 163603, "<|media_end|>": 163604})
# Small ids for the model tests (a 32-token vocabulary), read from the tokenizer.
SMALL = {
    "[PAD]": 1,
    "<|media_begin|>": 20,
    "<|media_content|>": 22,
    "<|media_end|>": 23,
    "<|media_pad|>": 24,
    "<|kimi_k25_video_placeholder|>": 25,
}
WORDS = {"[UNK]": 0, "a": 2, "b": 3, "c": 4, "image": 21}
# The chat template's per-image text: only the <|media_pad|> is expanded.
IMAGE = "<|media_begin|> image <|media_content|> <|media_pad|> <|media_end|>"

SIZES = [
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
]


def _processor(image_processor, special: dict[str, int]):
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    return Kimi_K25Processor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer({**WORDS, **special}, special, unk="[UNK]", pad="[PAD]"),
        video_processor=Kimi_K25VideoProcessor(),
    )


@pytest.fixture(scope="module")
def published_processor():
    """The published defaults (patch 14, merge 2, 16384 patches, 512 a side), published ids."""
    return _processor(Kimi_K25ImageProcessor(), PUBLISHED)


@pytest.fixture(scope="module")
def small_image_processor():
    # A small patch budget keeps materialization fast; the layout code is the same.
    return Kimi_K25ImageProcessor(max_patches=64, size={"max_height": 16, "max_width": 16})


@pytest.fixture(scope="module")
def small_processor(small_image_processor):
    return _processor(small_image_processor, SMALL)


@pytest.fixture(scope="module")
def tiny_model_config():
    from transformers import Kimi_K25Config

    return Kimi_K25Config(
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
            pad_token_id=SMALL["[PAD]"],
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
        image_token_id=SMALL["<|media_pad|>"],
        video_token_id=SMALL["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=SMALL["<|media_begin|>"],
        vision_end_token_id=SMALL["<|media_end|>"],
    )


def _model(config, dtype):
    from transformers import Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration._from_config(config, attn_implementation="eager")
    return model.to(dtype).eval()


def _loss(model, loader, batch):
    # Labels on every attended token: a zero-loss batch (missing media) still gives a loss.
    with torch.no_grad():
        return model_output(model, loader, batch, labels_on="attention_mask").loss


def _ref(adapter, width, height):
    return mmstore.ImageRef(
        uri="media/x.png",
        hash="0" * 32,
        width=width,
        height=height,
        offset=0,
        length=adapter.num_tokens(width, height),
        family=adapter.family,
        layout_fingerprint=adapter.fingerprint,
    )


def _prompt(processor, text: str) -> list[int]:
    return [int(t) for t in processor.tokenizer(text)["input_ids"]]


def _rollout(sample_id, tokens, refs, **kw):
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=tokens,
        prompt_len=min(len(tokens), 4),
        loss_mask=[True] * len(tokens),
        images=refs,
        reward=1.0,
        advantage=0.5,
        **kw,
    )


# -- 1. the layout equals the real processor's, token for token -------------------------


@sized(SIZES)
def test_expansion_equals_the_real_processor(published_processor, width, height):
    adapter = mmstore.adapter_for(published_processor)
    text = f"a {IMAGE} b"
    prompt = _prompt(published_processor, text)
    image = Image.new("RGB", (width, height), (120, 30, 200))
    out = published_processor(text=[text], images=[image], return_tensors="np")
    ids = [int(t) for t in out["input_ids"][0]]
    # Strip the text around the image token: what is left is what the processor put there.
    pad = prompt.index(adapter.image_token_id)
    tail = len(prompt) - pad - 1
    assert ids[:pad] == prompt[:pad] and ids[len(ids) - tail :] == prompt[pad + 1 :]
    expansion = ids[pad : len(ids) - tail]

    assert adapter.expansion(width, height) == expansion
    assert adapter.num_tokens(width, height) == len(expansion)
    assert set(adapter.image_inputs) == {"pixel_values", "image_grid_thw"}
    check_placeholder(adapter, out, width, height)
    outputs = {k: out[k] for k in adapter.image_inputs}
    check_output_fits(adapter, outputs, _ref(adapter, width, height))


def test_the_adapter_runs_the_same_processor_call(small_image_processor):
    adapter = mmstore.adapter_for(small_image_processor)
    out = adapter.process([photo(1, 90, 61)])
    direct = small_image_processor(images=[photo(1, 90, 61)], return_tensors="np")
    assert set(out) == {"pixel_values", "image_grid_thw"}
    assert torch.equal(
        torch.from_numpy(out["pixel_values"]), torch.from_numpy(direct["pixel_values"])
    )
    assert out["image_grid_thw"].tolist() == [list(adapter.grid(90, 61))]
    check_output_fits(adapter, out, _ref(adapter, 90, 61))


def test_layout_parameters_and_refusals():
    adapter = mmstore.adapter_for(Kimi_K25ImageProcessor())
    assert adapter.family == "kimi-k25"
    assert adapter.layout.params() == {
        "family": "kimi-k25",
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": 16384,
        "max_size_per_side": 512,
        "image_token_id": 163605,
        "pad_token_id": 163839,
    }
    assert adapter.position_rows == 1 and adapter.token_type_input is None
    assert adapter.model_input_names == (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
    )
    # Each layout parameter moves the fingerprint; settings without a token effect do not.
    for changed in (
        {"max_patches": 1024},
        {"patch_size": 16},
        {"merge_size": 4},
        {"size": {"max_height": 256, "max_width": 256}},
    ):
        other = mmstore.adapter_for(Kimi_K25ImageProcessor(**changed))
        assert other.fingerprint != adapter.fingerprint, changed
    same = mmstore.adapter_for(Kimi_K25ImageProcessor(image_mean=[0.5] * 3, resample=2))
    assert same.fingerprint == adapter.fingerprint
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_resize"):
        mmstore.adapter_for(Kimi_K25ImageProcessor(do_resize=False))
    lopsided = Kimi_K25ImageProcessor()
    lopsided.size = {"max_height": 512, "max_width": 256}
    with pytest.raises(mmstore.UnsupportedProcessorError, match="max_height and max_width"):
        mmstore.adapter_for(lopsided)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.expansion(0, 10)


def test_position_ids_are_one_dimensional(small_processor):
    adapter = mmstore.adapter_for(small_processor)
    ids = torch.tensor([*adapter.expansion(56, 42), 2, 3])
    assert adapter.position_ids(ids, []).tolist() == [list(range(len(ids)))]


# -- 2. token ids: from the tokenizer, or the published ones ----------------------------


def test_token_ids_come_from_the_tokenizer_or_are_published(
    small_processor, small_image_processor, published_processor
):
    full = mmstore.adapter_for(small_processor)
    assert full.image_token_id == SMALL["<|media_pad|>"]
    assert full.pad_token_id == SMALL["[PAD]"]
    assert full.expansion(56, 42) == [SMALL["<|media_pad|>"]] * 4
    assert full.special_token_ids == {SMALL["<|media_pad|>"]}

    alone = mmstore.adapter_for(small_image_processor)
    assert alone.image_token_id == 163605 and alone.pad_token_id == 163839
    # Token ids are tokenizer facts, not layout: one fingerprint for both.
    assert alone.fingerprint == full.fingerprint
    assert mmstore.adapter_for(published_processor).image_token_id == 163605


# -- 3. write, load, train ---------------------------------------------------------------


def _fill(store, adapter, processor):
    """Rows of one image, two images, and none; media in the store."""
    small, wide, tall = (
        store.put_image(photo(s, w, h)) for s, w, h in [(1, 56, 42), (2, 90, 31), (3, 20, 70)]
    )
    one = _prompt(processor, f"a {IMAGE} b c")
    two = _prompt(processor, f"a {IMAGE} b {IMAGE} c")
    rows = []
    for sid, prompt, media in [
        ("one", one, [small]),
        ("two", two, [wide, tall]),
        ("text", _prompt(processor, "a b c b a"), []),
    ]:
        tokens, refs = adapter.expand([*prompt, 2, 3], media)
        rows.append(_rollout(sid, tokens, refs))
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write_many(rows)
    return rows


def test_rows_train_a_real_kimi_k25_model(tmp_path, small_processor, tiny_model_config):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    _fill(store, adapter, small_processor)
    with store.writer(run_id="t", step=0, adapter=adapter) as w:
        for i in range(2):
            w.write(_rollout(f"t{i}", _prompt(small_processor, "b c a"), []))

    for dtype in (torch.float32, torch.bfloat16):
        model = _model(tiny_model_config, dtype)
        ds = mmstore.RolloutDataset(store, small_processor, dtype=dtype, runs=["r"], shuffle=False)
        loader = mmstore.RolloutLoader(ds, batch_size=2)
        batches = list(loader)
        assert [b["sample_ids"] for b in batches] == [["one", "two"], ["text"]]
        images, text = batches
        assert images["pixel_values"].dtype == dtype
        assert images["image_grid_thw"].dtype == torch.int64
        assert images["image_grid_thw"].tolist() == [
            list(adapter.grid(56, 42)),
            list(adapter.grid(90, 31)),
            list(adapter.grid(20, 70)),
        ]
        assert images["pixel_values"].shape[0] == int(images["image_grid_thw"].prod(-1).sum())
        for batch in batches:
            assert torch.isfinite(_loss(model, loader, batch)), (dtype, batch["sample_ids"])
        # A text-only batch passes no pixels (MoonViT cannot run on zero patches)...
        assert text["pixel_values"] is None and text["image_grid_thw"] is None

        # ...unless dummy_image asks for a tiny zero image so every rank runs the tower.
        ds = mmstore.RolloutDataset(store, small_processor, dtype=dtype, runs=["t"], shuffle=False)
        loader = mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True)
        (batch,) = list(loader)
        assert batch["dummy_image"]
        assert batch["image_grid_thw"].tolist() == [[1, 2, 2]]
        assert int((batch["input_ids"] == adapter.image_token_id).sum()) == 1
        assert not batch["loss_mask"][0, -1] and batch["pixel_values"].dtype == dtype
        assert torch.isfinite(_loss(model, loader, batch)), dtype


# -- 4. refusals --------------------------------------------------------------------------


def test_a_shifted_span_or_stray_pad_is_refused_before_the_model(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    media = store.put_image(photo(1, 56, 42))
    tokens, (ref,) = adapter.expand(_prompt(small_processor, f"a {IMAGE} b"), [media])
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        shifted = ref.model_copy(update={"offset": ref.offset + 1})
        with pytest.raises(mmstore.InvalidRolloutError, match="span"):
            w.write(_rollout("shifted", tokens, [shifted]))
        stray = [*tokens, adapter.image_token_id]
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
            w.write(_rollout("stray", stray, [ref]))
        w.write(_rollout("ok", tokens, [ref]))


def test_a_kimi_store_read_with_a_qwen_processor_fails_at_construction(tmp_path, small_processor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    store = mmstore.Store.open(tmp_path / "s", create=True)
    kimi = mmstore.adapter_for(small_processor)
    _fill(store, kimi, small_processor)
    qwen = Qwen2VLImageProcessorPil()
    assert mmstore.adapter_for(qwen).fingerprint != kimi.fingerprint
    check_refused_by(store, qwen)
    # The same store is fine for the Kimi processor, with or without its tokenizer.
    assert len(mmstore.RolloutDataset(store, small_processor.image_processor)) == 3


# -- 5. missing media ---------------------------------------------------------------------


def test_missing_media_gives_placeholders_the_model_accepts(
    tmp_path, small_processor, tiny_model_config
):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    rows = _fill(store, adapter, small_processor)
    gone = rows[1].images[1]  # the second image of "two"
    os.remove(os.path.join(store.root, gone.uri))

    dtype = torch.bfloat16
    model = _model(tiny_model_config, dtype)
    ds = mmstore.RolloutDataset(
        store, small_processor, dtype=dtype, missing="placeholder_zero_loss", shuffle=False
    )
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    with pytest.warns(UserWarning, match="missing media"):
        batch = next(iter(loader))
    assert batch["sample_ids"] == ["one", "two"] and batch["images_missing"] == 1
    assert batch["missing_uris"] == [gone.uri]
    assert not batch["loss_mask"][1].any() and batch["loss_mask"][0].any()
    width = adapter.pixel_shape(90, 31)[0] + adapter.pixel_shape(56, 42)[0]
    assert not batch["pixel_values"][width:].any()  # the placeholder is zeros
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert torch.isfinite(_loss(model, loader, batch))

    with pytest.raises(mmstore.MediaNotFoundError):
        list(mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2))


def test_debug_summary_and_the_wire_resolver_know_the_family(tmp_path, small_processor):
    from mmstore import debug, wire

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    rows = _fill(store, adapter, small_processor)
    refs = [ref for row in rows for ref in row.images]
    # dense bytes from the footer's layout record: fp32 pixel_values of every ref
    pixels = sum(adapter.placeholder(r.width, r.height)["pixel_values"].size for r in refs)
    total = debug.summary(store, by=()).row(0, named=True)
    assert total["images"] == 3 and total["dense_fp32_bytes"] == 4 * pixels

    out = vllm.resolve_wire_refs(store, [wire.encode(r) for r in refs], small_processor)
    assert out["image_grid_thw"].tolist() == [list(adapter.grid(r.width, r.height)) for r in refs]
    assert out["pixel_values"].shape == (int(out["image_grid_thw"].prod(-1).sum()), 3, 14, 14)


# -- 6. vLLM -------------------------------------------------------------------------------


def test_vllm_prompt_collapses_each_span_to_one_media_pad(tmp_path, published_processor):
    # vLLM's Kimi-K2.5 (vllm/model_executor/models/kimi_k25.py) writes an image as
    # "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" (get_placeholder_str)
    # and its _get_prompt_updates replaces [media_placeholder_token_id] by that id repeated.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(published_processor)
    media = [store.put_image(photo(1, 56, 42)), store.put_image(photo(2, 300, 200))]
    prompt = _prompt(published_processor, f"a {IMAGE} b {IMAGE} c")
    tokens, refs = adapter.expand(prompt, media)
    assert len(tokens) == len(prompt) - 2 + sum(r.length for r in refs)
    rollout = _rollout("v", [*tokens, 2], refs)

    request = vllm.to_vllm_prompt(store, rollout)
    assert request["prompt_token_ids"] == [*prompt, 2]
    pads = [i for i, t in enumerate(request["prompt_token_ids"]) if t == 163605]
    assert all(request["prompt_token_ids"][p - 1] == 163603 for p in pads)
    assert all(request["prompt_token_ids"][p + 1] == 163604 for p in pads)
    # vLLM's Kimi-K2.5 takes images as "vision_chunk" items (VisionChunkImage dicts).
    chunks = request["multi_modal_data"]["vision_chunk"]
    assert set(request["multi_modal_data"]) == set(request["multi_modal_uuids"]) == {"vision_chunk"}
    assert len(pads) == len(chunks) == 2
    assert [c["type"] for c in chunks] == ["image", "image"]
    assert [c["image"].size for c in chunks] == [(56, 42), (300, 200)]
    assert [c["uuid"] for c in chunks] == [m.hash for m in media]
    assert request["multi_modal_uuids"]["vision_chunk"] == [m.hash for m in media]


def test_distinct_images_expand_to_the_plain_batches(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    rows = _fill(store, adapter, small_processor)
    with store.writer(run_id="r", step=1, adapter=adapter) as w:
        w.write(_rollout("again", rows[1].tokens, rows[1].images))  # "two"'s images again
    shared = check_distinct_images(store, small_processor, batch_size=4, shuffle=False)
    assert shared > 0
