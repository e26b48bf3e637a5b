"""mmstore.Materialize: one frozen object holds how rows become tensors, checked once when it
is built, taken by every reader that materializes (RolloutDataset and its loaders, LiveLoader,
the Ray reader, the wire-ref resolver); the flat keywords of the first releases build the same
object, with a DeprecationWarning."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore.integrations import ray as mmray
from mmstore.integrations.vllm import RefResolver
from mmstore.synth import grpo_rollouts
from tests.conftest import SMALL_MAX_PIXELS

OFF = mmstore.Materialize(node_cache_bytes=0)


@pytest.fixture(scope="module")
def processor():
    return Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, processor):
    """One step: 2 GRPO groups of 2 samples, one shared image each."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("settings") / "s", create=True)
    adapter = mmstore.adapter_for(processor)
    with store.writer(run_id="r", step=0) as w:
        for r in grpo_rollouts(store, adapter, groups=2, group_size=2, image_size=(96, 64)):
            w.write(r)
    return store


# -- the object ------------------------------------------------------------------------------


def test_it_is_frozen_and_replace_makes_a_checked_copy():
    settings = mmstore.Materialize(dtype="fp32", max_len=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_len = 1  # type: ignore[misc]
    assert settings.dtype is torch.float32  # a name becomes the dtype once, when built
    assert settings.replace(max_len=None).max_len is None and settings.max_len == 64
    with pytest.raises(mmstore.InvalidArgumentError, match="max_len"):
        settings.replace(max_len=0)
    assert pickle.loads(pickle.dumps(settings)) == settings  # travels to spawned workers


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "int8"),
        ("dtype", "bfloat17"),
        ("missing", "skip"),
        ("max_len", 0),
        ("pad_token_id", -1),
        ("dummy_image", "yes"),
        ("distinct_images", 1),
        ("cache_bytes", -1),
        ("node_cache_bytes", 1.5),
        ("node_cache_dir", 3),
        ("prefetch_requests", -1),
        ("prefetch_bytes", 0),
        ("preprocess_device", 0),
    ],
)
def test_every_field_is_checked_when_built(field, value):
    with pytest.raises(mmstore.InvalidArgumentError, match=field):
        mmstore.Materialize(**{field: value})


def test_a_combination_that_cannot_work_is_refused_naming_both():
    # Workers only decode for the device stage: nothing would fill the node cache.
    with pytest.raises(mmstore.InvalidArgumentError) as info:
        mmstore.Materialize(preprocess_device="cpu", node_cache_bytes=2**20)
    assert "node_cache_bytes" in str(info.value) and "preprocess_device" in str(info.value)
    # Off, or left to its default, the node cache is no conflict.
    assert mmstore.Materialize(preprocess_device="cpu", node_cache_bytes=0).preprocess_device
    assert mmstore.Materialize(preprocess_device="cpu").node_cache_bytes is None


def test_the_store_dependent_check_names_the_setting(stored, processor):
    # A local store reads without read-ahead: a bound on it would bound nothing.
    with pytest.raises(mmstore.InvalidArgumentError, match="prefetch_bytes"):
        mmstore.RolloutDataset(stored, processor, materialize=OFF.replace(prefetch_bytes=2**20))


# -- the readers take it ---------------------------------------------------------------------


def test_the_dataset_and_its_loader_apply_it(stored, processor):
    settings = OFF.replace(dtype=torch.float32, max_len=40, distinct_images=True)
    ds = mmstore.RolloutDataset(stored, processor, shuffle=False, materialize=settings)
    assert ds.materialize is settings
    assert (ds.dtype, ds.max_len, ds.node_cache_bytes) == (torch.float32, 40, 0)
    batch = next(iter(mmstore.RolloutLoader(ds, batch_size=2)))
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["input_ids"].shape[1] <= 40
    assert "image_index" in batch  # distinct_images, from the dataset's settings


def test_the_flat_keywords_build_the_same_settings_with_a_warning(stored, processor):
    with pytest.warns(DeprecationWarning, match=r"materialize=mmstore\.Materialize\(dtype="):
        flat = mmstore.RolloutDataset(
            stored, processor, shuffle=False, dtype="fp32", node_cache_bytes=0
        )
    assert flat.materialize == OFF.replace(dtype=torch.float32)
    with pytest.warns(DeprecationWarning, match="distinct_images"):
        loader = mmstore.RolloutLoader(flat, batch_size=2, distinct_images=True)
    # The loader's keywords apply over the dataset's settings, for this loader only.
    assert loader.materialize.distinct_images and not flat.materialize.distinct_images
    assert "image_index" in next(iter(loader))


def test_settings_and_flat_keywords_together_are_refused(stored, processor):
    with pytest.raises(mmstore.InvalidArgumentError, match="materialize= and the flat"):
        mmstore.RolloutDataset(stored, processor, materialize=OFF, dtype="fp32")
    with pytest.raises(TypeError, match="unexpected keyword"):
        mmstore.RolloutDataset(stored, processor, dtpye="fp32")
    with pytest.raises(mmstore.InvalidArgumentError, match=r"mmstore\.Materialize"):
        mmstore.RolloutDataset(stored, processor, materialize={"dtype": "fp32"})
    ds = mmstore.RolloutDataset(stored, processor, materialize=OFF)
    with pytest.raises(TypeError, match="unexpected keyword"):
        mmstore.RolloutLoader(ds, batch_size=2, cache_bytes=0)  # a dataset's setting


def test_the_loader_refuses_a_device_stage_beside_an_asked_node_cache(stored, processor):
    ds = mmstore.RolloutDataset(
        stored, processor, materialize=mmstore.Materialize(node_cache_bytes=2**20)
    )
    with pytest.raises(mmstore.InvalidArgumentError) as info:
        mmstore.RolloutLoader(ds, batch_size=2, preprocess_device="cpu")
    assert "node_cache_bytes" in str(info.value) and "preprocess_device" in str(info.value)


def test_the_live_loader_takes_it_and_refuses_what_it_cannot_apply(stored, processor):
    settings = OFF.replace(dtype=torch.float32)
    with mmstore.LiveLoader(
        stored, processor, runs=["r"], batch_size=4, materialize=settings
    ) as live:
        assert live.materialize is settings
        (batch,) = list(live.next_step(timeout=30))
        assert batch["pixel_values"].dtype == torch.float32
    with pytest.raises(mmstore.InvalidArgumentError, match="preprocess_device"):
        mmstore.LiveLoader(
            stored,
            processor,
            runs=["r"],
            batch_size=4,
            materialize=OFF.replace(preprocess_device="cpu"),
        )


def test_the_resolver_applies_its_cache_bound_and_refuses_the_rest(stored, processor):
    ref = stored.rollouts(run_id="r", step=0)[0].images[0]
    wire = [mmstore.wire.encode(ref)]
    cached = RefResolver(stored, processor, materialize=mmstore.Materialize())
    uncached = RefResolver(stored, processor, materialize=mmstore.Materialize(cache_bytes=0))
    for resolver in (cached, uncached):
        for _ in range(2):
            assert "error" not in resolver.resolve(wire)
    assert cached.stats()["hits"] == 1 and uncached.stats()["hits"] == 0
    with pytest.raises(mmstore.InvalidArgumentError, match="missing"):
        RefResolver(
            stored, processor, materialize=mmstore.Materialize(missing="placeholder_zero_loss")
        )
    with pytest.raises(mmstore.InvalidArgumentError, match="cache_bytes"):
        RefResolver(stored, processor, cache_bytes=0, materialize=mmstore.Materialize())


def test_the_ray_reader_keeps_float32_by_default_and_refuses_batch_settings():
    # What its actors apply; checked in the driver, before any actor starts.
    assert mmray._settings(None, {}).dtype is torch.float32
    assert mmray._settings(mmstore.Materialize(), {}).dtype is torch.bfloat16
    with pytest.warns(DeprecationWarning):
        assert mmray._settings(None, {"missing": "placeholder_zero_loss"}).missing
    with pytest.raises(mmstore.InvalidArgumentError, match="distinct_images"):
        mmray._settings(mmstore.Materialize(distinct_images=True), {})
