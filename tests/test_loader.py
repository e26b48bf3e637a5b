"""RolloutDataset / RolloutLoader: order, workers, materialization, policies, collate."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore.synth import screenshot, write_grpo_steps
from tests.families_common import tiny_qwen2_vl_config

SMALL = 256 * 28 * 28


def write_steps(store, adapter, *, steps=2, groups=4, group_size=4, run="r1", row_group_size=8):
    """GRPO steps of this file's shape: 2 images of 320x200 per sample, 8 rows a row group."""
    write_grpo_steps(
        store,
        adapter,
        run_id=run,
        steps=range(steps),
        row_group_size=row_group_size,
        groups=groups,
        group_size=group_size,
        images_per_sample=2,
        image_size=(320, 200),
    )


@pytest.fixture(scope="module")
def filled(tmp_path_factory, small_processor):
    """A store with 2 steps x 4 GRPO groups x 4 samples, 2 shared images per sample."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("loader") / "s", create=True)
    write_steps(store, mmstore.adapter_for(small_processor))
    return store


def all_ids(loader):
    return [sid for batch in loader for sid in batch["sample_ids"]]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_every_sample_once_and_order_independent_of_workers(filled, small_processor):
    ds = mmstore.RolloutDataset(filled, small_processor, seed=3)
    assert len(ds) == 32
    orders = {}
    for workers in (0, 1, 3):
        orders[workers] = all_ids(mmstore.RolloutLoader(ds, batch_size=5, num_workers=workers))
    assert orders[0] == orders[1] == orders[3]
    expected = [f"g{s}-{g:05d}-{k:02d}" for s in (0, 1) for g in range(4) for k in range(4)]
    assert sorted(orders[0]) == sorted(expected)


@pytest.mark.slow
def test_order_is_a_function_of_seed_and_epoch(filled, small_processor):
    def order(seed, epoch, shuffle=True):
        loader = mmstore.RolloutLoader(
            mmstore.RolloutDataset(filled, small_processor, seed=seed, shuffle=shuffle),
            batch_size=4,
        )
        loader.set_epoch(epoch)
        return all_ids(loader)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(0, 0)) == sorted(order(1, 1))
    unshuffled = order(0, 0, shuffle=False)
    assert unshuffled == order(5, 3, shuffle=False)


def test_groups_stay_adjacent(filled, small_processor):
    ids = all_ids(
        mmstore.RolloutLoader(mmstore.RolloutDataset(filled, small_processor, seed=9), batch_size=4)
    )
    groups = [sid.rsplit("-", 1)[0] for sid in ids]
    runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
    assert len(runs) == len(set(groups)), "a GRPO group was split apart"


@pytest.mark.slow
def test_epoch_advances_after_a_full_pass(filled, small_processor):
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(filled, small_processor), batch_size=8)
    first = all_ids(loader)
    assert loader.state_dict()["epoch"] == 1
    second = all_ids(loader)
    assert sorted(first) == sorted(second) and first != second


@pytest.mark.parametrize("workers", [0, 1])
def test_parity_with_the_real_processor(filled, small_processor, workers):
    ds = mmstore.RolloutDataset(filled, small_processor, dtype=torch.bfloat16, shuffle=False)
    batch = next(iter(mmstore.RolloutLoader(ds, batch_size=2, num_workers=workers)))
    # Rebuild what the trainer would compute by hand: processor over the stored images.
    adapter = mmstore.adapter_for(small_processor)
    refs = _refs_of(filled, batch["sample_ids"])
    images = [filled.open_image(r["uri"], r["hash"]) for r in refs]
    expected = small_processor(images=images, return_tensors="pt")
    assert batch["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(batch["pixel_values"], expected["pixel_values"].to(torch.bfloat16))
    assert batch["image_grid_thw"].dtype == torch.int64
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    n_image_tokens = int((batch["mm_token_type_ids"] == 1).sum())
    assert n_image_tokens == sum(adapter.num_tokens(r["width"], r["height"]) for r in refs)
    assert torch.equal(
        batch["input_ids"] == adapter.image_token_id, batch["mm_token_type_ids"] == 1
    )


def _refs_of(store, sample_ids):
    import pyarrow.parquet as pq

    by_id = {}
    for f in store.rollout_files():
        for row in pq.read_table(store.backend.abspath(f.path), partitioning=None).to_pylist():
            by_id[row["sample_id"]] = row["images"]
    return [ref for sid in sample_ids for ref in by_id[sid]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floats_cast_integers_kept(filled, small_processor, dtype):
    ds = mmstore.RolloutDataset(filled, small_processor, dtype=dtype)
    batch = next(iter(mmstore.RolloutLoader(ds, batch_size=3)))
    assert batch["pixel_values"].dtype == dtype
    assert batch["image_grid_thw"].dtype == torch.int64
    assert batch["input_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["advantage"].dtype == torch.float32


def test_collated_batch_shapes(filled, small_processor):
    ds = mmstore.RolloutDataset(filled, small_processor, shuffle=False)
    batch = next(iter(mmstore.RolloutLoader(ds, batch_size=4)))
    b, width = batch["input_ids"].shape
    assert b == 4 and len(batch["sample_ids"]) == 4
    for key in ("attention_mask", "loss_mask", "mm_token_type_ids", "logprobs"):
        assert batch[key].shape == (b, width)
    lengths = batch["attention_mask"].sum(1)
    assert int(lengths.max()) == width
    assert not batch["loss_mask"][batch["attention_mask"] == 0].any()
    patches = int(batch["image_grid_thw"].prod(-1).sum())
    assert batch["pixel_values"].shape[0] == patches
    assert batch["images_missing"] == 0 and not batch["dummy_image"]


@pytest.mark.slow
def test_cache_processes_a_shared_image_once(filled, small_processor):
    ds = mmstore.RolloutDataset(filled, small_processor, shuffle=False)
    batches = list(mmstore.RolloutLoader(ds, batch_size=8))
    hits = sum(b["cache_hits"] for b in batches)
    misses = sum(b["cache_misses"] for b in batches)
    distinct = len(
        {r["hash"] for r in _refs_of(filled, [s for b in batches for s in b["sample_ids"]])}
    )
    assert misses == distinct  # 2 steps x 4 groups x 2 images
    assert hits == 32 * 2 - distinct


def test_fingerprint_mismatch_fails_when_built(filled):
    other = Qwen2VLImageProcessorPil(max_pixels=SMALL * 2)
    with pytest.raises(mmstore.LayoutMismatchError) as err:
        mmstore.RolloutDataset(filled, other)
    assert "r1" in str(err.value)


def test_layout_mismatch_names_the_parameters_that_differ(filled):
    other = Qwen2VLImageProcessorPil(patch_size=16, max_pixels=SMALL)
    with pytest.raises(mmstore.LayoutMismatchError) as err:
        mmstore.RolloutDataset(filled, other)
    message = str(err.value)
    assert "patch_size 14 vs 16" in message and "stored vs processor" in message
    assert "max_pixels" not in message  # equal on both sides
    assert "runs=" in message  # what to do about it


def test_layout_mismatch_across_families_says_the_family_first_and_stays_short(filled):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    with pytest.raises(mmstore.LayoutMismatchError) as err:
        mmstore.RolloutDataset(filled, Glm4vImageProcessorPil())
    message = str(err.value)
    assert "family differs (qwen-vl vs glm4v)" in message
    assert "None vs" not in message  # not every parameter only one family has
    assert len(err.value.files) <= 3 and err.value.num_files >= len(err.value.files)
    assert len(message) < 700


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_dtype_by_name(filled, small_processor, name):
    ds = mmstore.RolloutDataset(filled, small_processor, dtype=name, steps=[0])
    assert ds.dtype is torch.bfloat16


@pytest.mark.parametrize("bad", ["bf17", "int64", torch.int64, 3])
def test_a_dtype_that_is_no_floating_torch_dtype_is_refused(filled, small_processor, bad):
    with pytest.raises(mmstore.InvalidArgumentError, match="dtype"):
        mmstore.RolloutDataset(filled, small_processor, dtype=bad)


def test_argument_errors_are_typed(filled, small_processor):
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.RolloutDataset(filled, small_processor, missing="skip")
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.RolloutDataset(filled, small_processor, rank=2, world_size=2)
    ds = mmstore.RolloutDataset(filled, small_processor, steps=[0])
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.RolloutLoader(ds, batch_size=0)
    with pytest.raises(mmstore.InvalidArgumentError):
        filled.writer(run_id="r", step=0, row_group_size="8")
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.debug.summary(filled, by=("nope",))


def test_missing_media_error_policy(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(small_processor), steps=1, groups=1, group_size=2)
    victim = _refs_of(store, ["g0-00000-00"])[0]
    os.unlink(store.backend.abspath(victim["uri"]))
    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False)
    with pytest.raises(mmstore.MediaNotFoundError) as err:
        list(mmstore.RolloutLoader(ds, batch_size=2))
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 0
    # Through worker processes too: the same error, its context attributes intact (torch's
    # DataLoader alone would re-raise type(err)(its traceback text), without them).
    with pytest.raises(mmstore.MediaNotFoundError) as err:
        list(mmstore.RolloutLoader(ds, batch_size=1, num_workers=2))
    assert isinstance(err.value, FileNotFoundError)
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 0
    assert err.value.context["uri"] == victim["uri"]
    packed = mmstore.RolloutLoader(ds, batch_size=2, num_workers=1, max_tokens=4096)
    with pytest.raises(mmstore.MediaNotFoundError) as err:
        list(packed)
    assert err.value.sample_id == "g0-00000-00"


def test_missing_media_placeholder_policy(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    write_steps(store, adapter, steps=1, groups=2, group_size=2)
    victim = _refs_of(store, ["g0-00000-00"])[1]
    os.unlink(store.backend.abspath(victim["uri"]))
    ds = mmstore.RolloutDataset(
        store, small_processor, shuffle=False, missing="placeholder_zero_loss"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(mmstore.RolloutLoader(ds, batch_size=4))
    assert any(victim["uri"] in str(w.message) for w in caught)
    batch = next(b for b in batches if "g0-00000-00" in b["sample_ids"])
    assert batch["images_missing"] == 2  # both samples of the group share the image
    for i, sid in enumerate(batch["sample_ids"]):
        if sid.startswith("g0-00000"):
            assert not batch["loss_mask"][i].any()
        else:
            assert batch["loss_mask"][i].any()
    # Shapes are exactly those of the real image, and the missing one is all zeros.
    refs = _refs_of(store, batch["sample_ids"])
    sizes = [int(np.prod(adapter.grid(r["width"], r["height"]))) for r in refs]
    assert batch["pixel_values"].shape[0] == sum(sizes)
    start = sizes[0]
    assert not batch["pixel_values"][start : start + sizes[1]].any()


def test_corrupt_media_is_a_hash_mismatch(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(small_processor), steps=1, groups=1, group_size=1)
    ref = _refs_of(store, ["g0-00000-00"])[0]
    path = store.backend.abspath(ref["uri"])
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[-20] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))
    ds = mmstore.RolloutDataset(store, small_processor, missing="placeholder_zero_loss")
    with pytest.raises(mmstore.HashMismatchError) as err:
        list(mmstore.RolloutLoader(ds, batch_size=1))
    assert err.value.sample_id == "g0-00000-00"


def test_grid_span_mismatch_is_a_layout_error(tmp_path, small_processor):
    """A processor whose live settings drift from its layout after the check is caught."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(small_processor), steps=1, groups=1, group_size=1)
    drifting = Qwen2VLImageProcessorPil(max_pixels=SMALL)
    ds = mmstore.RolloutDataset(store, drifting)
    drifting.size = {"shortest_edge": SMALL * 2, "longest_edge": SMALL * 4}
    with pytest.raises(mmstore.LayoutMismatchError) as err:
        list(mmstore.RolloutLoader(ds, batch_size=1))
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 0


def test_text_only_rows_and_dummy_image(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    media = store.put_image(screenshot(0, 300, 200))
    with store.writer(run_id="t", step=0) as w:
        for i in range(3):
            w.write(
                mmstore.Rollout(
                    sample_id=f"t{i}",
                    tokens=[1, 2, 3 + i],
                    prompt_len=1,
                    loss_mask=[False, True, True],
                    reward=1.0,
                )
            )
        tokens, refs = adapter.expand([7, adapter.image_token_id, 8], [media])
        w.write(
            mmstore.Rollout(
                sample_id="img",
                tokens=tokens,
                prompt_len=2,
                loss_mask=[True] * len(tokens),
                images=refs,
            )
        )
    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False)
    plain = list(mmstore.RolloutLoader(ds, batch_size=2))
    # A batch without images passes None, the model's own "no images" (Qwen2-VL cannot
    # run its vision tower on zero patches).
    assert plain[0]["pixel_values"] is None and plain[0]["image_grid_thw"] is None
    assert plain[1]["pixel_values"].shape[0] == (
        adapter.grid(300, 200)[1] * adapter.grid(300, 200)[2]
    )
    padded = list(mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True))
    first = padded[0]
    assert first["dummy_image"] and first["image_grid_thw"].shape == (1, 3)
    n_tokens = int((first["input_ids"] == adapter.image_token_id).sum())
    assert n_tokens == int(first["image_grid_thw"].prod()) // 4
    assert not first["loss_mask"][first["input_ids"] == adapter.image_token_id].any()
    assert not padded[1]["dummy_image"]


def test_max_len_keeps_whole_images(filled, small_processor):
    adapter = mmstore.adapter_for(small_processor)
    refs = _refs_of(filled, ["g0-00000-00"])
    cut = refs[1]["offset"] + 3  # inside the second image
    ds = mmstore.RolloutDataset(filled, small_processor, shuffle=False, max_len=cut)
    for batch in mmstore.RolloutLoader(ds, batch_size=4):
        assert batch["input_ids"].shape[1] <= cut
        image_tokens = int((batch["input_ids"] == adapter.image_token_id).sum())
        assert image_tokens * 4 == int(batch["image_grid_thw"].prod(-1).sum())
    text_only = mmstore.RolloutDataset(filled, small_processor, max_len=refs[0]["offset"])
    for batch in mmstore.RolloutLoader(text_only, batch_size=8):
        assert batch["pixel_values"] is None
        assert not (batch["input_ids"] == adapter.image_token_id).any()


def test_max_len_inside_a_leading_image_is_an_error(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    media = store.put_image(screenshot(0, 300, 200))
    tokens, refs = adapter.expand([adapter.image_token_id, 8, 9], [media])
    with store.writer(run_id="t", step=0) as w:
        w.write(
            mmstore.Rollout(
                sample_id="lead",
                tokens=tokens,
                prompt_len=1,
                loss_mask=[True] * len(tokens),
                images=refs,
            )
        )
    ds = mmstore.RolloutDataset(store, small_processor, max_len=refs[0].length - 1)
    with pytest.raises(mmstore.InvalidRolloutError) as err:
        list(mmstore.RolloutLoader(ds, batch_size=1))
    assert err.value.sample_id == "lead"


def test_runs_and_steps_select(filled, small_processor):
    ds = mmstore.RolloutDataset(filled, small_processor, steps=[1])
    ids = all_ids(mmstore.RolloutLoader(ds, batch_size=8))
    assert len(ids) == 16 and all(sid.startswith("g1-") for sid in ids)
    with pytest.raises(mmstore.NoMatchError):  # never a silent epoch of nothing
        mmstore.RolloutDataset(filled, small_processor, runs=["nope"])
    # One run id may be given as a plain string (the same selection gc and export use).
    assert len(mmstore.RolloutDataset(filled, small_processor, runs="r1")) == 32


def test_a_sample_says_where_its_row_came_from(filled, small_processor):
    """The record the checks built carries the row's origin (what its errors would name)."""
    ds = mmstore.RolloutDataset(filled, small_processor, shuffle=False)
    seen = 0
    for sample in ds:
        step = int(sample.sample_id[1])  # grpo_rollouts ids: g<step>-<group>-<k>
        assert sample.where["sample_id"] == sample.sample_id
        assert (sample.where["run_id"], sample.where["step"]) == ("r1", step)
        assert f"run_id=r1/step={step}/" in sample.where["file"]
        assert sample.input_ids.dtype == torch.int64 and len(sample.images) == 2
        seen += 1
    assert seen == 32


def test_ranks_are_disjoint_and_complete(filled, small_processor):
    for world in (2, 3):
        seen = []
        for rank in range(world):
            ds = mmstore.RolloutDataset(
                filled, small_processor, rank=rank, world_size=world, seed=4
            )
            seen.append(all_ids(mmstore.RolloutLoader(ds, batch_size=3)))
        flat = [s for ids in seen for s in ids]
        assert len(flat) == len(set(flat)) == 32


@pytest.mark.slow
def test_a_real_qwen2_vl_model_trains_on_every_batch(filled, small_processor):
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = tiny_qwen2_vl_config(num_hidden_layers=1)
    for dtype in (torch.float32, torch.bfloat16):
        model = Qwen2VLForConditionalGeneration(config).to(dtype)
        ds = mmstore.RolloutDataset(filled, small_processor, dtype=dtype, steps=[0])
        for batch in mmstore.RolloutLoader(ds, batch_size=4, dummy_image=True):
            labels = batch["input_ids"].masked_fill(~batch["loss_mask"], -100)
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                mm_token_type_ids=batch["mm_token_type_ids"],
                pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"],
                labels=labels,
            )
            assert torch.isfinite(out.loss), dtype
        # The model itself refuses image tokens that do not line up with the pixel features:
        # the check above is meaningful.
        broken = batch["input_ids"].clone()
        broken[broken == 151655] = torch.where(
            torch.arange(int((broken == 151655).sum())) == 0, 7, 151655
        )
        with pytest.raises(ValueError, match="do not match"):
            model(
                input_ids=broken,
                attention_mask=batch["attention_mask"],
                mm_token_type_ids=batch["mm_token_type_ids"],
                pixel_values=batch["pixel_values"],
                image_grid_thw=batch["image_grid_thw"],
            )


def test_even_ranks_give_every_rank_the_same_number_of_batches(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    # files of 12, 4, 8 and 1 rows: 25 samples, shares of 7, 6, 6 and 6 (balanced by
    # samples), so 3 batches of 3 on rank 0 and 2 on the others
    for step, (groups, size) in enumerate(((3, 4), (1, 4), (2, 4), (1, 1))):
        write_grpo_steps(
            store,
            adapter,
            run_id="u",
            steps=[step],
            row_group_size=4,
            groups=groups,
            group_size=size,
            images_per_sample=1,
            image_size=(64, 48),
        )

    def loaders(even):
        return [
            mmstore.RolloutLoader(
                mmstore.RolloutDataset(store, small_processor, rank=r, world_size=4, seed=2),
                batch_size=3,
                even_ranks=even,
            )
            for r in range(4)
        ]

    uneven = [len(lo) for lo in loaders(False)]
    assert uneven == [3, 2, 2, 2], "the fixture must give ranks unequal shares"
    even = loaders(True)
    counts = [len(list(lo)) for lo in even]
    assert counts == [min(uneven)] * 4
    seen = [sid for lo in loaders(True) for b in lo for sid in b["sample_ids"]]
    assert len(seen) == len(set(seen))
    state = even[0].state_dict()
    assert state["even_ranks"] is True


def test_workers_never_receive_the_parents_cache(filled, small_processor):
    import pickle

    ds = mmstore.RolloutDataset(filled, small_processor, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=8)
    list(loader)
    list(loader)  # images seen again in a later window stay in the main process's cache
    assert len(ds.materializer().cache) > 0
    shipped = pickle.loads(pickle.dumps(ds))
    assert shipped.source.built is None and shipped.source.prefetcher is None
    assert len(pickle.dumps(ds)) < 1_000_000


@pytest.mark.parametrize(
    ("selection", "needle"),
    [
        ({"runs": ["typo"]}, "no run 'typo'"),
        ({"runs": ["r1", "typo"]}, "no run 'typo'"),
        ({"steps": [99]}, "step 99"),
        ({"runs": "r1", "steps": range(5, 9)}, "steps 5-8"),
    ],
)
def test_a_selection_matching_nothing_raises_naming_what_exists(
    filled, small_processor, selection, needle
):
    with pytest.raises(mmstore.NoMatchError, match=needle) as err:
        mmstore.RolloutDataset(filled, small_processor, **selection)
    assert "runs r1 (steps 0-1)" in str(err.value)
