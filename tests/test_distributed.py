"""Two real torch.distributed ranks (gloo on CPU): disjoint shares, complete union."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore.synth import write_grpo_steps

SMALL = 256 * 28 * 28


def _rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        store = mmstore.Store.open(root)
        # rank/world_size come from the initialized process group.
        ds = mmstore.RolloutDataset(store, Qwen2VLImageProcessorPil(max_pixels=SMALL), seed=5)
        loader = mmstore.RolloutLoader(ds, batch_size=3, num_workers=1)
        ids = [sid for batch in loader for sid in batch["sample_ids"]]
        gathered: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, ids)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"rank": ds.rank, "world": ds.world_size, "ids": gathered}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo ranks in processes
def test_two_gloo_ranks_are_disjoint_and_complete(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    written = write_grpo_steps(
        store,
        adapter,
        run_id="d",
        row_group_size=4,
        groups=3,
        group_size=4,
        images_per_sample=1,
        image_size=(128, 96),
    )
    expected = [r.sample_id for r in written]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ids.json"
    mp.start_processes(
        _rank_main, args=(2, port, str(tmp_path / "s"), str(out)), nprocs=2, start_method="spawn"
    )
    result = json.loads(out.read_text())
    rank0, rank1 = result["ids"]
    assert rank0 and rank1
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(expected)
    assert torch.distributed.is_available()
