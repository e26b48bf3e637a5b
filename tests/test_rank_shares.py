"""How the padded loader shares an epoch by rank (issue 39, item 10).

Ranks take contiguous runs of one epoch order, balanced by samples (sizes differ by at most
one), so a file holding a whole step is shared, ``len(loader)`` is what the rank yields in
every epoch, GRPO groups are split only at the ``world_size - 1`` cuts, and fewer samples than
ranks is refused instead of training nothing.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._loading import spec as _spec
from mmstore.synth import grpo_rollouts
from tests.resume_harness import check_resume

SMALL = 256 * 28 * 28


def store_of(path, adapter, files, *, row_group_size=None):
    """A store with one file per step; ``files[s]`` lists the group sizes of step ``s``."""
    store = mmstore.Store.open(path, create=True)
    for step, groups in enumerate(files):
        with store.writer(
            run_id="r", step=step, adapter=adapter, row_group_size=row_group_size
        ) as writer:
            for g, size in enumerate(groups):
                for rollout in grpo_rollouts(
                    store,
                    adapter,
                    groups=1,
                    group_size=size,
                    images_per_sample=1,
                    image_size=(64, 48),
                    completion_len=8,
                    seed=step * 100 + g,
                ):
                    writer.write(rollout)
    return store


def loader(store, processor, rank, world, *, batch_size=2, seed=0, **kw):
    ds = mmstore.RolloutDataset(
        store,
        processor,
        rank=rank,
        world_size=world,
        seed=seed,
        dtype=torch.float32,
        node_cache_bytes=0,
        window_units=kw.pop("window_units", 4),
    )
    return mmstore.RolloutLoader(ds, batch_size=batch_size, **kw)


def ids(batches):
    return [s for b in batches for s in b["sample_ids"]]


@pytest.fixture(scope="module")
def one_file(tmp_path_factory, small_processor):
    """One step's 6 samples (3 GRPO groups of 2) in one file, one row group."""
    adapter = mmstore.adapter_for(small_processor)
    return store_of(tmp_path_factory.mktemp("one") / "s", adapter, [[2, 2, 2]])


@pytest.fixture(scope="module")
def two_files(tmp_path_factory, small_processor):
    """Two files of 4 and 6 samples."""
    adapter = mmstore.adapter_for(small_processor)
    return store_of(tmp_path_factory.mktemp("two") / "s", adapter, [[4], [6]])


@pytest.mark.parametrize("even", [False, True])
def test_one_file_is_shared_by_both_ranks(one_file, small_processor, even):
    """Before: rank 0 read all 6 samples and rank 1 none; with even_ranks both got 0."""
    got = []
    for rank in (0, 1):
        lo = loader(one_file, small_processor, rank, 2, even_ranks=even)
        batches = list(lo)
        assert len(batches) == 2, (rank, [b["sample_ids"] for b in batches])
        got.append(ids(batches))
    assert [len(g) for g in got] == [3, 3]
    assert not set(got[0]) & set(got[1])
    everything = {r.sample_id for r in one_file.rollouts()}
    assert set(got[0]) | set(got[1]) == everything


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_len_is_what_each_rank_yields_in_every_epoch(two_files, small_processor, seed):
    """Before: a rank's share changed with the epoch (4 or 6 samples), and ``len`` taken
    between epochs named the next epoch's count (3 batches where 2 came, or 2 where 3)."""
    for even in (False, True):
        for rank in (0, 1):
            lo = loader(two_files, small_processor, rank, 2, seed=seed, even_ranks=even)
            for epoch in range(3):
                lo.set_epoch(epoch)
                before = len(lo)
                batches = list(lo)
                assert before == len(batches) == len(lo) == 3, (even, rank, epoch)
                assert len(ids(batches)) == 5


def test_every_sample_once_and_shares_balanced(tmp_path, small_processor):
    adapter = mmstore.adapter_for(small_processor)
    # 3 files (5, 7 and 4 samples) in row groups of 3: ragged units and windows
    store = store_of(tmp_path / "s", adapter, [[3, 2], [4, 3], [4]], row_group_size=3)
    everything = sorted(r.sample_id for r in store.rollouts())
    for world in (2, 3, 5):
        for epoch in (0, 1):
            shares = []
            for rank in range(world):
                lo = loader(store, small_processor, rank, world, batch_size=2, window_units=2)
                lo.set_epoch(epoch)
                shares.append(ids(lo))
                assert len(lo.dataset) == len(shares[-1])
            sizes = [len(s) for s in shares]
            assert max(sizes) - min(sizes) <= 1, (world, sizes)
            assert sorted(s for share in shares for s in share) == everything


def test_groups_are_split_only_at_the_cuts(tmp_path, small_processor):
    adapter = mmstore.adapter_for(small_processor)
    store = store_of(tmp_path / "s", adapter, [[4, 4, 4], [4, 4], [4, 4, 4]], row_group_size=4)
    group_of = {r.sample_id: r.group_id for r in store.rollouts()}
    for world in (2, 3):
        for seed in (0, 5):
            placed: dict[str, set[int]] = {}
            for rank in range(world):
                share = ids(loader(store, small_processor, rank, world, seed=seed))
                groups = [group_of[s] for s in share]
                # a group's samples are adjacent in the rank's order
                runs = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
                assert len(runs) == len(set(runs)), (world, seed, rank, groups)
                for g in groups:
                    placed.setdefault(g, set()).add(rank)
            split = [g for g, ranks in placed.items() if len(ranks) > 1]
            assert len(split) <= world - 1, (world, seed, placed)


@pytest.mark.parametrize(("samples", "world"), [(1, 2), (2, 3), (4, 7)])
def test_fewer_samples_than_ranks_is_refused_on_every_rank(
    tmp_path, small_processor, samples, world
):
    adapter = mmstore.adapter_for(small_processor)
    store = store_of(tmp_path / "s", adapter, [[samples]])
    for rank in range(world):
        with pytest.raises(mmstore.InvalidArgumentError) as err:
            mmstore.RolloutDataset(store, small_processor, rank=rank, world_size=world)
        message = str(err.value)
        assert f"{world} rank(s) would share {samples} sample(s)" in message
        assert f"rank {world - 1}" in message or f"ranks {samples}..{world - 1}" in message
        assert f"this is rank {rank}" in message
        assert err.value.context["samples"] == samples
        assert err.value.context["world_size"] == world
    # As many samples as ranks: one each.
    got = [ids(loader(store, small_processor, r, samples)) for r in range(samples)]
    assert all(len(share) == 1 for share in got)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "even"), [(2, False), (3, True)])
def test_every_rank_resumes_exactly(tmp_path, small_processor, world, even):
    adapter = mmstore.adapter_for(small_processor)
    store = store_of(tmp_path / "s", adapter, [[3, 3], [2, 2, 3], [5]], row_group_size=3)

    def make(rank, workers=0):
        def build():
            lo = loader(
                store,
                small_processor,
                rank,
                world,
                batch_size=2,
                seed=7,
                even_ranks=even,
                window_units=2,
                num_workers=workers,
            )
            lo.set_epoch(1)
            return lo

        return build

    for rank in range(world):
        batches = len(make(rank)())
        check_resume(
            make(rank),
            key=lambda b: tuple(b["sample_ids"]),
            cuts=range(batches + 1),
            make_resumed=make(rank, workers=2 if rank == 0 else 0),
        )


def test_a_rank_reads_only_the_windows_of_its_share(tmp_path, small_processor, monkeypatch):
    adapter = mmstore.adapter_for(small_processor)
    store = store_of(tmp_path / "s", adapter, [[2, 2]] * 6, row_group_size=2)  # 12 units
    read = []
    real = _spec.read_units
    monkeypatch.setattr(
        _spec, "read_units", lambda store, units, *a: read.append(units) or real(store, units, *a)
    )
    lo = loader(store, small_processor, 1, 3, batch_size=2, window_units=2)
    plan = lo.dataset.plan(0)
    assert (plan.total, plan.first, plan.num_samples) == (24, 8, 8)
    list(lo)
    assert read == [plan.windows[w] for w in plan.rank_windows()]
    assert len(read) == 2  # 2 of the epoch's 6 windows


def test_a_row_group_state_of_several_ranks_is_refused(two_files, small_processor):
    """A state saved when ranks were dealt row groups (state version 2) names other samples
    under the new sharding: refused with more than one rank, resumed with one."""
    lo = loader(two_files, small_processor, 1, 2)
    next(iter(lo))
    state = lo.state_dict()
    assert state["version"] == 3 and state["sharding"] == "contiguous-samples"
    old = {k: v for k, v in state.items() if k != "sharding"} | {"version": 2}
    with pytest.raises(mmstore.InvalidArgumentError, match="row groups"):
        loader(two_files, small_processor, 1, 2).load_state_dict(old)
    # One rank: the order is unchanged, the old state resumes exactly.
    reference = ids(loader(two_files, small_processor, 0, 1))
    single = loader(two_files, small_processor, 0, 1)
    head = ids([next(iter(single))])
    old = {k: v for k, v in single.state_dict().items() if k != "sharding"} | {"version": 2}
    resumed = loader(two_files, small_processor, 0, 1)
    resumed.load_state_dict(old)
    assert head + ids(resumed) == reference
    # The dataset's own state: the same rule.
    ds = mmstore.RolloutDataset(two_files, small_processor, rank=0, world_size=2)
    bare = {k: v for k, v in ds.state_dict().items() if k != "sharding"}
    with pytest.raises(mmstore.InvalidArgumentError, match="row groups"):
        ds.load_state_dict(bare)


def test_a_packed_state_of_several_ranks_still_resumes(two_files, small_processor):
    """The packed loader's order did not change: its version-2 states are accepted."""

    def packed():
        return loader(two_files, small_processor, 1, 2, batch_size=3, max_tokens=4096)

    reference = ids(packed())
    lo = packed()
    head = ids([next(iter(lo))])
    old = lo.state_dict() | {"version": 2}
    assert "sharding" not in old
    resumed = packed()
    resumed.load_state_dict(old)
    assert head + ids(resumed) == reference


def _rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        store = mmstore.Store.open(root)
        processor = Qwen2VLImageProcessorPil(max_pixels=SMALL)
        ds = mmstore.RolloutDataset(store, processor, seed=3, node_cache_bytes=0)
        lo = mmstore.RolloutLoader(ds, batch_size=2, even_ranks=True)
        length = len(lo)
        mine = ids(lo)
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, {"len": length, "ids": mine})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_share_one_file(one_file, tmp_path):
    """Two real ranks on a store whose one file holds the step: both train, ``len`` is
    what each yields (before: rank 0 all 6 samples, rank 1 none; with even_ranks, none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "shares.json"
    root = one_file.root
    mp.start_processes(
        _rank_main, args=(2, port, str(root), str(out)), nprocs=2, start_method="spawn"
    )
    ranks = json.loads(out.read_text())
    assert [r["len"] for r in ranks] == [2, 2]
    assert [len(r["ids"]) for r in ranks] == [3, 3]
    assert sorted(ranks[0]["ids"] + ranks[1]["ids"]) == sorted(
        r.sample_id for r in one_file.rollouts()
    )
