"""Ray Data on a real two-node Ray cluster on loopback: materialization actors on one node,
the consumer (this driver) on the other; the batches equal the local loader's, ranks are
disjoint and complete, and a resume mid-epoch continues exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmstore
from mmstore.synth import photo, write_grpo_steps

ray = pytest.importorskip("ray")
mmray = pytest.importorskip("mmstore.integrations.ray")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ON_WORKER_NODE = {"materialize": 1}
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # Loopback only: this test talks to nothing but this machine.
        head_node_args={"num_cpus": 1, "include_dashboard": False, "node_ip_address": LOOPBACK},
    )
    cluster.add_node(num_cpus=2, resources={"materialize": 2}, node_ip_address=LOOPBACK)
    ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def filled(tmp_path_factory, small_processor):
    store = mmstore.Store.open(tmp_path_factory.mktemp("ray") / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    write_grpo_steps(
        store,
        adapter,
        run_id="0042",
        row_group_size=4,
        groups=3,
        group_size=4,
        images_per_sample=1,
        image_size=(120, 90),
    )
    return store


def _loader(store, processor, rank=0, world=1):
    ds = mmstore.RolloutDataset(
        store, processor, dtype=torch.float32, seed=5, rank=rank, world_size=world
    )
    return mmstore.RolloutLoader(ds, batch_size=3)


def _same(a: dict, b: dict) -> None:
    assert a["sample_ids"] == b["sample_ids"]
    for key in ("input_ids", "loss_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(a[key], b[key]), key


def test_the_cluster_has_two_nodes_and_only_one_can_materialize(cluster):
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2
    able = [n for n in alive if n["Resources"].get("materialize")]
    assert len(able) == 1 and able[0]["NodeID"] != ray.get_runtime_context().get_node_id()


def test_ray_batches_equal_the_local_loader_and_ranks_cover_every_sample(
    cluster, filled, small_processor
):
    world = 2
    seen = []
    for rank in range(world):
        local = list(_loader(filled, small_processor, rank, world))
        remote = list(
            mmray.iter_batches(
                _loader(filled, small_processor, rank, world),
                concurrency=2,
                resources=ON_WORKER_NODE,
            )
        )
        assert len(remote) == len(local)
        for a, b in zip(remote, local, strict=True):
            _same(a, b)
        seen += [sid for b in remote for sid in b["sample_ids"]]
    assert len(seen) == len(set(seen)) == 24


def test_a_resume_mid_epoch_continues_exactly(cluster, filled, small_processor):
    reference = [b["sample_ids"] for b in _loader(filled, small_processor)]
    first = _loader(filled, small_processor)
    head = []
    for batch in mmray.iter_batches(first, concurrency=1, resources=ON_WORKER_NODE):
        head.append(batch["sample_ids"])
        if len(head) == 3:
            break
    state = first.state_dict()
    resumed = _loader(filled, small_processor)
    resumed.load_state_dict(state)
    tail = [
        b["sample_ids"]
        for b in mmray.iter_batches(resumed, concurrency=1, resources=ON_WORKER_NODE)
    ]
    assert head + tail == reference
    assert resumed.epoch == 1  # the epoch was read to its end


def test_read_rollouts_materializes_every_sample(cluster, filled, small_processor):
    data = mmray.read_rollouts(filled, small_processor, concurrency=1, resources=ON_WORKER_NODE)
    rows = {r["sample_id"]: r for r in data.take_all()}
    assert len(rows) == 24
    assert {type(r["run_id"]) for r in rows.values()} == {str}
    assert {r["run_id"] for r in rows.values()} == {"0042"}
    assert {int(r["step"]) for r in rows.values()} == {0, 1}
    local = {s: b for b in _loader(filled, small_processor) for s in b["sample_ids"]}
    adapter = mmstore.adapter_for(small_processor)
    for sid, row in rows.items():
        batch = local[sid]
        i = batch["sample_ids"].index(sid)
        n = int(batch["attention_mask"][i].sum())
        assert np.array_equal(row["input_ids"], batch["input_ids"][i, :n].numpy())
        assert row["pixel_values"].dtype == np.float32
        assert row["pixel_values"].shape[0] == int(np.prod(row["image_grid_thw"], -1).sum())
        tokens = int((row["input_ids"] == adapter.image_token_id).sum())
        assert tokens * 4 == row["pixel_values"].shape[0]


def test_read_rollouts_refuses_a_forged_row_naming_its_file(cluster, tmp_path, small_processor):
    from tests.test_reader_trust import forge, make_row

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    media = [store.put_image(photo(seed, 56, 56)) for seed in range(2)]
    bad = make_row(adapter, media, "bad")
    bad["images"][0]["offset"] += 1  # the span no longer covers the image's tokens
    path = forge(store, adapter, [make_row(adapter, media, "ok"), bad])
    data = mmray.read_rollouts(store, small_processor, concurrency=1, resources=ON_WORKER_NODE)
    with pytest.raises(Exception) as info:
        data.take_all()
    # Ray re-raises the actor's error as its own type; the message is the loader's, with
    # the loader's context: file, run, step and sample.
    message = str(info.value)
    assert "InvalidRolloutError" in message
    assert f"file={path!r}" in message and "run_id='forged'" in message
    assert "step=0" in message and "sample_id='bad'" in message


def test_device_preprocessing_runs_where_the_batches_are_consumed(cluster, filled):
    """preprocess_device: actors decode (build_batch), the driver runs the processor."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from tests.conftest import SMALL_MAX_PIXELS

    processor = Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)

    def loader(device):
        ds = mmstore.RolloutDataset(filled, processor, dtype=torch.float32, seed=5)
        return mmstore.RolloutLoader(ds, batch_size=3, preprocess_device=device)

    local = list(loader(None))
    remote = list(mmray.iter_batches(loader("cpu"), concurrency=1, resources=ON_WORKER_NODE))
    assert len(remote) == len(local)
    for a, b in zip(remote, local, strict=True):
        _same(a, b)
