"""The model agrees: each sample's logits inside a packed micro-batch equal its logits when it
runs alone (fp32, atol 1e-4), with sdpa and eager attention.

Alone, the model computes its own position ids (its rope-index function); packed, it takes the
micro-batch's, and finds the sample boundaries from their text row. One table entry per family:
(image-processor fixture, model builder) for the M-RoPE families; Mistral 3 (Pixtral layout)
stands for the 1-D RoPE ones.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mmstore
from tests.families_common import tiny_qwen2_vl_config
from tests.test_packing import write_mixed


def qwen2_vl(attn: str) -> torch.nn.Module:
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = tiny_qwen2_vl_config(num_hidden_layers=2)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.set_attn_implementation(attn)
    return model


FAMILIES = {"qwen2-vl": ("small_processor", qwen2_vl)}


@pytest.fixture(scope="module")
def model_store(tmp_path_factory, small_processor):
    store = mmstore.Store.open(tmp_path_factory.mktemp("packmodel") / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor), steps=1)
    return store


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(hidden)  # the model's logits, for a slice of positions only


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_sample_in_a_micro_batch_matches_it_alone(request, model_store, family, attn):
    fixture, build = FAMILIES[family]
    processor = request.getfixturevalue(fixture)
    model = build(attn)
    ds = mmstore.RolloutDataset(model_store, processor, dtype=torch.float32, world_size=2, rank=0)
    loader = mmstore.RolloutLoader(ds, batch_size=6, max_tokens=700)
    adapter = ds.adapter
    checked = packed_many = 0
    with torch.no_grad():
        for batch in itertools.islice(loader, 4):  # logits over a 151k vocabulary: a few
            inputs = {k: batch[k] for k in loader.model_input_names}
            hidden = model.model(**inputs).last_hidden_state[0]
            cu = batch["cu_seqlens"].tolist()
            grids = batch["image_grid_thw"]
            pixels = batch["pixel_values"]
            image_at, patch_at = 0, 0
            packed_many += len(cu) > 2
            for i in range(len(cu) - 1):
                ids = batch["input_ids"][:, cu[i] : cu[i + 1]]
                n_images = _count_spans(ids[0], adapter.image_token_id)
                grid = grids[image_at : image_at + n_images]
                patches = int(grid.prod(-1).sum())
                alone = {
                    "input_ids": ids,
                    **adapter.token_types(ids),
                    "pixel_values": pixels[patch_at : patch_at + patches],
                    "image_grid_thw": grid,
                }
                image_at, patch_at = image_at + n_images, patch_at + patches
                if batch["is_filler"][i]:
                    continue
                if not n_images:
                    alone = {k: alone[k] for k in ("input_ids", "mm_token_type_ids")}
                expected = logits(model, model.model(**alone).last_hidden_state[0])
                got = logits(model, hidden[cu[i] : cu[i + 1]])
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
                checked += 1
    assert checked >= 4
    assert packed_many > 0, "the fixture must pack several samples into one micro-batch"


def _count_spans(ids: torch.Tensor, token: int) -> int:
    flags = (ids == token).int()
    return int((torch.diff(flags, prepend=torch.zeros(1, dtype=flags.dtype)) == 1).sum())


def test_qwen_position_ids_are_the_models_own(model_store, small_processor):
    """Per sample, the family's M-RoPE rows equal the real model's get_rope_index."""
    model = qwen2_vl("sdpa")
    ds = mmstore.RolloutDataset(model_store, small_processor, dtype=torch.float32)
    loader = mmstore.RolloutLoader(ds, batch_size=4, max_tokens=700)
    batch = next(b for b in loader if b["pixel_values"].shape[0])
    cu = batch["cu_seqlens"].tolist()
    ids = batch["input_ids"][:, cu[0] : cu[1]]
    n = _count_spans(ids[0], ds.adapter.image_token_id)
    expected, _ = model.model.get_rope_index(
        ids, ds.adapter.token_types(ids)["mm_token_type_ids"], batch["image_grid_thw"][:n]
    )
    assert torch.equal(batch["position_ids"][1:, :, cu[0] : cu[1]], expected)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_1d_rope_family_packed_matches_it_alone(tmp_path, attn):
    """Mistral 3 (Pixtral layout, 1-D RoPE): position ids restart at 0 per sample."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.families_common import noise
    from tests.test_family_pixtral import END, IMG, _processor, _row, _tiny_mistral3

    processor = _processor(
        PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64}), patch_size=8, merge=2
    )
    adapter = mmstore.adapter_for(processor)
    store = mmstore.Store.open(tmp_path / "s", create=True)
    media = [store.put_image(noise(w, h, seed)) for w, h, seed in [(40, 20, 1), (64, 64, 2)]]
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        for k in range(8):
            images = media[: k % 3]  # 0, 1 or 2 images
            prompt = [1, 3, *[IMG] * len(images), 4]
            w.write(_row(adapter, f"s{k}", prompt, images, completion=(4, 3) * (1 + k % 3)))
    model = _tiny_mistral3(torch.float32)
    model.set_attn_implementation(attn)
    ds = mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=8, max_tokens=80)
    checked = packed_many = 0
    with torch.no_grad():
        for batch in loader:
            packed = model(**{k: batch[k] for k in loader.model_input_names}).logits[0]
            cu = batch["cu_seqlens"].tolist()
            packed_many += len(cu) > 2
            image_at = 0
            for i in range(len(cu) - 1):
                ids = batch["input_ids"][:, cu[i] : cu[i + 1]]
                n = int((ids == END).sum())  # one [IMG_END] closes each image
                alone: dict = {"input_ids": ids}
                if n:
                    alone["pixel_values"] = batch["pixel_values"][image_at : image_at + n]
                    alone["image_sizes"] = batch["image_sizes"][image_at : image_at + n]
                image_at += n
                if batch["is_filler"][i]:
                    continue
                expected = model(**alone).logits[0]
                torch.testing.assert_close(packed[cu[i] : cu[i + 1]], expected, atol=1e-4, rtol=0)
                checked += 1
    assert checked == 8
    assert packed_many > 0, "the fixture must pack several samples into one micro-batch"
