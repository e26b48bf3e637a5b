"""Packed micro-batches: budget, segments, images, exactly-once across ranks, lock-step,
resume, too-long samples, the footer's token counts, and the pure planner."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import mmstore
from mmstore._planning.pack import plan_epoch
from mmstore.synth import grpo_rollouts
from tests.resume_harness import check_resume

MAX_TOKENS = 700
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def write_mixed(store, adapter, *, run="p", steps=2, text_only_step=True):
    """GRPO groups with 0, 1 or 2 images and completions of 8..300 tokens; row groups of 8."""
    for step in range(steps):
        with store.writer(run_id=run, step=step, row_group_size=8) as w:
            for images in (0, 1, 2):
                if images == 0 and not text_only_step:
                    continue
                for r in grpo_rollouts(
                    store,
                    adapter,
                    groups=2,
                    group_size=4,
                    images_per_sample=images,
                    image_size=(320, 200),
                    completion_len=300,
                    seed=step * 10 + images,
                ):
                    w.write(r)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, small_processor):
    """2 steps x 3 kinds x 2 groups x 4 samples = 48 rows, a third of them text only."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("packing") / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor))
    return store


def stored_rows(store):
    rows = {}
    for f in store.rollout_files():
        table = pq.read_table(store.backend.abspath(f.path), partitioning=None)
        for row in table.to_pylist():
            rows[row["sample_id"]] = row
    return rows


def packed(store, processor, *, rank=0, world=1, batch_size=4, workers=0, seed=1, **kw):
    ds = mmstore.RolloutDataset(
        store,
        processor,
        dtype=torch.float32,
        rank=rank,
        world_size=world,
        seed=seed,
        max_len=kw.pop("max_len", None),
    )
    return mmstore.RolloutLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        **kw,
    )


def test_micro_batches_hold_whole_samples_within_budget(mixed, small_processor):
    adapter = mmstore.adapter_for(small_processor)
    rows = stored_rows(mixed)
    loader = packed(mixed, small_processor, batch_size=6)
    assert loader.model_input_names == (
        "input_ids",
        "position_ids",
        "pixel_values",
        "image_grid_thw",
        "mm_token_type_ids",
        "use_cache",
    )
    seen = []
    for batch in loader:
        ids, cu = batch["input_ids"], batch["cu_seqlens"]
        assert ids.shape[0] == 1 and ids.shape[1] <= MAX_TOKENS
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == ids.shape[1]
        assert len(cu) == len(batch["sample_ids"]) + 1 == len(batch["advantage"]) + 1
        assert batch["position_ids"].shape == (4, 1, ids.shape[1])
        # No image in the micro-batch: None, as a padded batch passes (issue 30, item 20).
        has_images = batch["pixel_values"] is not None
        assert (batch["image_grid_thw"] is not None) == has_images
        grids = iter(batch["image_grid_thw"].tolist() if has_images else [])
        for i, sid in enumerate(batch["sample_ids"]):
            lo, hi = int(cu[i]), int(cu[i + 1])
            segment = ids[0, lo:hi]
            text_row = batch["position_ids"][0, 0, lo:hi]
            assert torch.equal(text_row, torch.arange(hi - lo))  # restarts at each sample
            image_tokens = int((segment == adapter.image_token_id).sum())
            if batch["is_filler"][i]:
                assert sid == "<filler>" and not batch["loss_mask"][0, lo:hi].any()
                assert float(batch["advantage"][i]) == 0.0
            else:
                row = rows[sid]
                assert segment.tolist() == row["tokens"]  # a segment is exactly its sample
                assert batch["loss_mask"][0, lo:hi].tolist() == row["loss_mask"]
                assert torch.allclose(batch["logprobs"][0, lo:hi], torch.tensor(row["logprobs"]))
                assert float(batch["advantage"][i]) == pytest.approx(row["advantage"])
                assert image_tokens == sum(r["length"] for r in row["images"])
                seen.append(sid)
            # pixel rows follow the grids, in sample order, and fill exactly the image tokens
            expected = 0
            for _ in range(
                len(
                    torch.nonzero(
                        torch.diff(
                            torch.cat(
                                [
                                    torch.tensor([0]),
                                    (segment == adapter.image_token_id).int(),
                                    torch.tensor([0]),
                                ]
                            )
                        )
                        == 1
                    )
                )
            ):
                t, h, w = next(grids)
                expected += t * h * w // 4
            assert expected == image_tokens
        assert next(grids, None) is None
        if has_images:
            pixels = batch["pixel_values"].shape[0]
            assert pixels == int(batch["image_grid_thw"].prod(-1).sum())
        assert torch.equal(batch["mm_token_type_ids"] == 1, ids == adapter.image_token_id)
    assert sorted(seen) == sorted(rows)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exactly_once_across_ranks_and_lock_step(mixed, small_processor, world):
    per_rank = [
        list(packed(mixed, small_processor, rank=r, world=world, batch_size=3))
        for r in range(world)
    ]
    ids = [
        sid
        for batches in per_rank
        for b in batches
        for sid, f in zip(b["sample_ids"], b["is_filler"].tolist(), strict=True)
        if not f
    ]
    assert len(ids) == len(set(ids)) == 48
    # every rank: the same (step, micro, num_micro) sequence
    shapes = [[(b["step"], b["micro"], b["num_micro"]) for b in batches] for batches in per_rank]
    assert all(s == shapes[0] for s in shapes)
    for _step, micros in itertools.groupby(shapes[0], key=lambda x: x[0]):
        micros = list(micros)
        assert [m for _, m, _ in micros] == list(range(micros[0][2]))
    # the vision tower runs on every rank for a micro index iff it runs on any
    for i in range(len(shapes[0])):
        with_images = [batches[i]["pixel_values"] is not None for batches in per_rank]
        assert all(with_images) or not any(with_images)


def test_dummy_image_keeps_ranks_in_lock_step(tmp_path, small_processor):
    """One rank's share is text only: it still runs the vision tower where the other does."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    with store.writer(run_id="d", step=0, row_group_size=4) as w:
        for r in grpo_rollouts(
            store,
            adapter,
            groups=1,
            group_size=1,
            images_per_sample=1,
            image_size=(320, 200),
            completion_len=10,
        ):
            w.write(r)
        for i in range(3):
            w.write(
                mmstore.Rollout(
                    sample_id=f"t{i}", tokens=[1] * 500, prompt_len=1, loss_mask=[True] * 500
                )
            )
    ranks = [list(packed(store, small_processor, rank=r, world=2, batch_size=2)) for r in (0, 1)]
    assert [len(b) for b in ranks] == [len(ranks[0])] * 2
    for i in range(len(ranks[0])):
        flags = [b[i]["pixel_values"] is not None for b in ranks]
        assert all(flags) or not any(flags)
    dummies = [b for batches in ranks for b in batches if b["dummy_image"]]
    assert dummies
    for b in dummies:
        assert b["is_filler"][-1] and b["sample_ids"][-1] == "<filler>"
        lo = int(b["cu_seqlens"][-2])
        assert not b["loss_mask"][0, lo:].any()
        assert (b["input_ids"][0, lo:] == adapter.image_token_id).all()
        assert b["input_ids"].shape[1] <= MAX_TOKENS


@pytest.mark.slow
def test_order_and_resume_are_exact_at_every_micro_batch(mixed, small_processor):
    def make(workers):
        return lambda: packed(
            mixed, small_processor, world=2, rank=1, batch_size=5, workers=workers
        )

    def key(batch):
        return (batch["epoch"], batch["step"], batch["micro"], tuple(batch["sample_ids"]))

    total = len(make(0)())
    assert [key(b) for b in make(2)()] == [key(b) for b in make(0)()]
    check_resume(make(0), key, range(0, total + 1, 2), make_resumed=make(2))
    check_resume(make(1), key, [1, total - 1], make_resumed=make(0))


@pytest.mark.slow
def test_resume_across_an_epoch_boundary(mixed, small_processor):
    class TwoEpochs:
        def __init__(self, workers):
            self.loader = packed(mixed, small_processor, batch_size=5, workers=workers)

        def __iter__(self):
            while self.loader.epoch < 2:
                yield from self.loader

        def state_dict(self):
            return self.loader.state_dict()

        def load_state_dict(self, state):
            self.loader.load_state_dict(state)

    def key(batch):
        return (batch["epoch"], batch["step"], batch["micro"], tuple(batch["sample_ids"]))

    first = len(TwoEpochs(0).loader)
    stream = check_resume(
        lambda: TwoEpochs(0), key, [first - 1, first, first + 1], make_resumed=lambda: TwoEpochs(1)
    )
    assert {k[0] for k in stream} == {0, 1}


def test_too_long_is_refused_by_name_or_truncated(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    write_mixed(store, adapter, steps=1)
    with store.writer(run_id="p", step=1) as w:
        w.write(
            mmstore.Rollout(
                sample_id="long",
                tokens=[3] * (MAX_TOKENS + 5),
                prompt_len=1,
                loss_mask=[True] * (MAX_TOKENS + 5),
            )
        )
    with pytest.raises(mmstore.SampleTooLongError) as err:
        list(packed(store, small_processor))
    assert err.value.sample_id == "long" and err.value.step == 1 and err.value.run_id == "p"
    assert isinstance(err.value, ValueError)
    # max_len <= the budget truncates instead (room for the dummy image stays free)
    budget = MAX_TOKENS - adapter.num_tokens(*adapter.dummy_size)
    assert f"max_len <= {budget}" in str(err.value)
    batches = list(packed(store, small_processor, max_len=budget))
    long = [b for b in batches if "long" in b["sample_ids"]]
    assert len(long) == 1
    i = long[0]["sample_ids"].index("long")
    cu = long[0]["cu_seqlens"]
    assert int(cu[i + 1] - cu[i]) == budget
    assert sum(len(b["sample_ids"]) - int(b["is_filler"].sum()) for b in batches) == 25


def test_footer_counts_are_written_and_older_files_still_plan(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor), steps=1)
    path = store.backend.abspath(store.rollout_files()[0].path)
    meta = pq.ParquetFile(path).metadata
    from mmstore._format.schema import decode_num_tokens

    counts = decode_num_tokens(meta.metadata, meta.num_rows)
    table = pq.read_table(path, partitioning=None)
    assert counts.tolist() == [len(t) for t in table.column("tokens").to_pylist()]

    def key(batch):
        return (batch["step"], batch["micro"], tuple(batch["sample_ids"]))

    before = [key(b) for b in packed(store, small_processor)]
    # rewrite the file as an older mmstore (or another engine) would: no counts in the footer
    kv = {
        k: v for k, v in meta.metadata.items() if k not in (b"mmstore.num_tokens", b"ARROW:schema")
    }
    pq.write_table(table.replace_schema_metadata(kv), path, row_group_size=8)
    assert decode_num_tokens(pq.ParquetFile(path).metadata.metadata, meta.num_rows) is None
    assert [key(b) for b in packed(store, small_processor)] == before


def test_a_footer_that_lies_is_caught_on_read(tmp_path, small_processor):
    from mmstore._format.schema import encode_num_tokens

    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor), steps=1)
    path = store.backend.abspath(store.rollout_files()[0].path)
    table = pq.read_table(path, partitioning=None)
    kv = dict(pq.ParquetFile(path).metadata.metadata)
    kv.pop(b"ARROW:schema")
    lengths = [len(t) for t in table.column("tokens").to_pylist()]
    lengths[0] -= 1
    kv[b"mmstore.num_tokens"] = encode_num_tokens(lengths)
    pq.write_table(table.replace_schema_metadata(kv), path, row_group_size=8)
    with pytest.raises(mmstore.CorruptFileError) as err:
        list(packed(store, small_processor, batch_size=24))
    assert err.value.sample_id == table.column("sample_id")[0].as_py()


def test_state_records_packing_settings(mixed, small_processor):
    state = packed(mixed, small_processor).state_dict()
    assert state["max_tokens"] == MAX_TOKENS
    other = packed(mixed, small_processor, max_tokens=MAX_TOKENS * 2)
    with pytest.raises(mmstore.InvalidArgumentError):
        other.load_state_dict(state)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_invariants(world, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    budget = 1000
    lengths = rng.integers(1, budget + 1, n)
    images = rng.random(n) < 0.5
    plan = plan_epoch(lengths, images, batch_size=7, world_size=world, budget=budget)
    seen = []
    per_rank = [plan.for_rank(r) for r in range(world)]
    for rp in per_rank:
        assert np.array_equal(rp.step, per_rank[0].step)
        assert np.array_equal(rp.num_micro, per_rank[0].num_micro)
        for i in range(len(rp)):
            positions = rp.samples(i)
            assert lengths[positions].sum() <= budget
            assert (positions // (7 * world) == rp.step[i]).all()  # a step's own samples
            seen.extend(positions.tolist())
    assert sorted(seen) == list(range(n))
    for i in range(len(per_rank[0])):
        imaged = [bool(images[rp.samples(i)].any()) or bool(rp.dummy[i]) for rp in per_rank]
        assert all(imaged) or not any(imaged)
        assert not any(rp.dummy[i] and images[rp.samples(i)].any() for rp in per_rank)


def test_one_dimensional_families_restart_positions_per_sample(small_processor):
    """A 1-D RoPE family (its position_ids the base 0..L-1) packs to ``[1, T]`` positions."""
    from mmstore._families import Family
    from mmstore._families.qwen_vl import QwenVL
    from mmstore._loading.microbatch import pack
    from mmstore._rows.check import Sample

    class OneD(QwenVL):
        position_rows = 1
        position_ids = Family.position_ids

    family = OneD(mmstore.adapter_for(small_processor).layout)

    def sample(sid, n):
        return Sample(
            sample_id=sid,
            group_id=None,
            input_ids=torch.arange(n) + 5,
            loss_mask=torch.ones(n, dtype=torch.bool),
            logprobs=None,
            prompt_len=1,
            reward=0.0,
            advantage=0.0,
            images=[],
        )

    batch = pack([sample("a", 3), sample("b", 4)], family, add_dummy=True, dtype=torch.float32)
    dummy = family.num_tokens(*family.dummy_size)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, *range(dummy)]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 7 + dummy]
    assert batch["sample_ids"] == ["a", "b", "<filler>"]
    assert batch["image_grid_thw"].shape == (1, 3) and "logprobs" not in batch
