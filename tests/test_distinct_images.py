"""Batches that carry each distinct image once (``RolloutLoader(distinct_images=True)``).

The check is the plain batch: expanded, a distinct batch equals it tensor for tensor, on
every loader path (workers, node cache, packed, preprocessing on a device); and the real
model's vision tower gives each image of the plain batch the features of its distinct image.
Every family runs the same check in ``tests/test_family_contract.py`` (``check_distinct_images``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._loading.distinct import distinct
from mmstore.synth import write_grpo_steps
from tests.families_common import (
    check_distinct_images,
    model_inputs,
    tiny_model,
    tiny_qwen2_vl_config,
)


@pytest.fixture
def grpo(store, adapter):
    """Groups of 4 sharing 2 images of 112x84, written two groups per file."""
    write_grpo_steps(
        store,
        adapter,
        run_id="grpo",
        groups=2,
        group_size=4,
        image_size=(112, 84),
        completion_len=10,
    )
    return store


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_expanded_batches_equal_the_plain_ones(grpo, small_processor, workers):
    shared = check_distinct_images(
        grpo, small_processor, batch_size=4, num_workers=workers, shuffle=True, seed=3
    )
    assert shared > 0  # the groups' images did travel once


@pytest.mark.slow
def test_with_the_node_cache_and_workers(grpo, small_processor, tmp_path):
    shared = check_distinct_images(
        grpo,
        small_processor,
        batch_size=3,  # groups straddle batches and workers
        num_workers=2,
        node_cache_dir=str(tmp_path / "node"),
    )
    assert shared > 0


def test_packed_micro_batches(grpo, small_processor):
    shared = check_distinct_images(grpo, small_processor, batch_size=4, max_tokens=400)
    assert shared > 0


def test_preprocessing_on_a_device(grpo, small_processor):
    torchvision = Qwen2VLImageProcessor(**small_processor.to_dict())
    # Pending images are decoded per sample: nothing to share, the index still holds.
    check_distinct_images(grpo, torchvision, batch_size=4, preprocess_device="cpu")


def test_a_batch_without_images_expands_to_itself(store, adapter, small_processor):
    with store.writer(run_id="text", step=0, adapter=adapter) as writer:
        writer.write(
            mmstore.Rollout(
                sample_id="t", tokens=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1], reward=0.0
            )
        )
    ds = mmstore.RolloutDataset(store, small_processor)
    (batch,) = mmstore.RolloutLoader(ds, batch_size=2, distinct_images=True)
    assert batch["image_index"].shape == (0,) and batch["pixel_values"] is None
    plain = mmstore.expand_images(dict(batch))
    assert "image_index" not in plain and plain["pixel_values"] is None


@pytest.mark.slow
def test_the_vision_tower_once_per_distinct_image(grpo, small_processor):
    """What a trainer may do instead of expanding: features of the distinct images, gathered
    with ``image_index``, are the features of the plain batch's images."""
    from transformers import Qwen2VLForConditionalGeneration

    model = tiny_model(
        Qwen2VLForConditionalGeneration, tiny_qwen2_vl_config(num_hidden_layers=1), torch.float32
    )
    ds = mmstore.RolloutDataset(grpo, small_processor, dtype=torch.float32, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=4, distinct_images=True)
    batch = next(iter(loader))
    plain = mmstore.expand_images(dict(batch))
    assert batch["pixel_values"].shape[0] < plain["pixel_values"].shape[0]
    with torch.no_grad():
        once = model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        every = model.get_image_features(plain["pixel_values"], plain["image_grid_thw"])
        gathered = [once.pooler_output[i] for i in batch["image_index"].tolist()]
        assert len(gathered) == len(every.pooler_output)
        for mine, theirs in zip(gathered, every.pooler_output, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        # And the model takes the expanded batch as it takes the plain one.
        logits = model(**model_inputs(loader, plain)).logits
    assert torch.isfinite(logits).all()


# -- the pure parts ---------------------------------------------------------------------------


@given(st.lists(st.integers(0, 4), max_size=12), st.data())
def test_expand_repeats_each_images_rows_in_model_order(picks, data):
    rows = data.draw(st.lists(st.integers(1, 5), min_size=5, max_size=5))
    images = [{"x": torch.full((rows[i], 2), float(i)), "n": torch.tensor([[i]])} for i in range(5)]
    shown = [images[i] for i in picks]
    kept, index = distinct(shown)
    assert [kept[j] for j in index.tolist()] == shown
    assert len(kept) == len(set(picks))
    batch = {
        "x": torch.cat([k["x"] for k in kept]) if kept else torch.zeros(0, 2),
        "n": torch.cat([k["n"] for k in kept]) if kept else torch.zeros(0, 1, dtype=torch.int64),
        "image_index": index,
        "image_rows": {
            "x": torch.tensor([k["x"].shape[0] for k in kept], dtype=torch.int64),
            "n": torch.ones(len(kept), dtype=torch.int64),
        },
        "other": "kept as it is",
    }
    out = mmstore.expand_images(batch)
    assert set(out) == {"x", "n", "other"}
    expected_x = torch.cat([s["x"] for s in shown]) if shown else torch.zeros(0, 2)
    assert torch.equal(out["x"], expected_x)
    assert out["n"].flatten().tolist() == picks


def test_distinct_is_by_identity_not_by_value():
    a, b = {"x": torch.zeros(1)}, {"x": torch.zeros(1)}  # equal values, two objects
    kept, index = distinct([a, b, a])
    assert kept == [a, b] and index.tolist() == [0, 1, 0]


def test_a_plain_batch_is_returned_as_it_is():
    batch = {"pixel_values": torch.ones(2, 3)}
    assert mmstore.expand_images(batch) is batch
