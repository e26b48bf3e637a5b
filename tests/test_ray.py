"""Ray Data on a real two-node Ray cluster on loopback: materialization actors on one node,
the consumer (this driver) on the other; the batches equal the local loader's, ranks are
disjoint and complete, and a resume mid-epoch continues exactly. Ray reads with the loader's
checks (page checksums), errors arrive typed, and a pool the cluster cannot hold fails at
once instead of hanging (issue 30 items 4, 13, 22)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import mmstore
from mmstore._format.schema import ROW_COLUMNS
from mmstore._rows.check import RowWindow
from mmstore._rows.files import conform
from mmstore._rows.lookups import family_checker
from mmstore.synth import photo, write_grpo_steps
from tests.conftest import SMALL_MAX_PIXELS

ray = pytest.importorskip("ray")
mmray = pytest.importorskip("mmstore.integrations.ray")

# One worker under xdist for every Ray test (here and test_engines): a Cluster writes
# /tmp/ray/ray_current_cluster, which a plain ray.init() elsewhere would join.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("ray"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

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
    with pytest.raises(mmstore.InvalidRolloutError) as info:
        data.take_all()
    # The loader's error, typed, with the loader's context: file, run, step and sample.
    err = info.value
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "forged", 0, "bad")


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


# -- issue 30 item 4: Ray reads what it checks ----------------------------------------------


def _one_step_store(root: Path, processor, run_id: str) -> tuple[mmstore.Store, list, str]:
    """A store with one committed file of ``run_id`` at step 0 (two row groups of 4 rows);
    its rows and the file's store-relative path."""
    store = mmstore.Store.open(root, create=True)
    written = write_grpo_steps(
        store,
        mmstore.adapter_for(processor),
        run_id=run_id,
        steps=[0],
        row_group_size=4,
        groups=2,
        group_size=4,
        images_per_sample=1,
        image_size=(56, 56),
    )
    base = Path(store.backend.abspath(""))
    [file] = [
        p
        for p in (base / "rollouts").rglob("*.parquet")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(base).parts)
    ]
    return store, written, file.relative_to(base).as_posix()


def _rot_silently(path: str, rel: str, adapter: mmstore.QwenVL) -> None:
    """Flip one bit in a tokens page body of the file at ``path`` such that a read without
    page checksums still succeeds, with other tokens that pass every row check (bit rot
    that nothing but the page checksum catches)."""
    good = Path(path).read_bytes()
    clean = pq.read_table(path, partitioning=None).column("tokens")
    meta = pq.ParquetFile(path).metadata
    chunk = next(
        meta.row_group(0).column(c)
        for c in range(meta.num_columns)
        if meta.row_group(0).column(c).path_in_schema == "tokens.list.element"
    )
    end = chunk.data_page_offset + chunk.total_compressed_size
    for offset, bit in itertools.product(range(end - 1, chunk.data_page_offset, -1), range(8)):
        damaged = bytearray(good)
        damaged[offset] ^= 1 << bit
        Path(path).write_bytes(damaged)
        try:
            rows = pq.read_table(path, partitioning=None)
        except (OSError, ValueError):  # this flip is caught anyway (zstd, a torn page)
            continue
        if not rows.column("tokens").equals(clean) and _rows_pass_checks(rows, rel, adapter):
            return
    Path(path).write_bytes(good)
    raise AssertionError("no single bit flip in the tokens page is silent")


def _rows_pass_checks(rows, rel: str, adapter: mmstore.QwenVL) -> bool:
    """Whether the loader's row checks (spans, stray image tokens, sizes) pass every row."""
    window = RowWindow(
        conform(rows, ROW_COLUMNS, file=rel),
        family_checker(adapter),
        max_pixels=2**31,
        image_token_ids=adapter.special_token_ids,
    )
    try:
        for i in range(window.num_rows):
            window.check(i)
    except mmstore.MmstoreError:
        return False
    return True


def test_read_rollouts_refuses_a_rotten_page_naming_its_file(cluster, tmp_path, small_processor):
    store, _, rel = _one_step_store(tmp_path / "s", small_processor, "rot")
    _rot_silently(store.backend.abspath(rel), rel, mmstore.adapter_for(small_processor))
    data = mmray.read_rollouts(store, small_processor, concurrency=1, resources=ON_WORKER_NODE)
    with pytest.raises(mmstore.CorruptFileError) as info:
        data.take_all()
    err = info.value
    assert (err.file, err.run_id, err.step) == (rel, "rot", 0)


# -- issue 30 item 13: errors through Ray arrive as the mmstore error raised ----------------


def test_errors_on_actors_arrive_as_the_mmstore_error_they_are(cluster, tmp_path, small_processor):
    store, written, rel = _one_step_store(tmp_path / "s", small_processor, "gone")
    for media in Path(store.backend.abspath("media")).rglob("*.*"):
        media.unlink()
    sample_ids = {r.sample_id for r in written}

    data = mmray.read_rollouts(store, small_processor, concurrency=1, resources=ON_WORKER_NODE)
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        data.take_all()
    err = info.value  # Ray's RayTaskError made an instance of the error's class
    assert isinstance(err, FileNotFoundError) and isinstance(err, mmstore.MmstoreError)
    assert type(err.cause) is mmstore.MediaNotFoundError  # the original, whole
    assert (err.file, err.run_id, err.step, err.image_index) == (rel, "gone", 0, 0)
    assert err.sample_id in sample_ids and err.uri.startswith("media/")

    batches = mmray.iter_batches(
        _loader(store, small_processor), concurrency=1, resources=ON_WORKER_NODE
    )
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        next(batches)
    err = info.value
    assert type(err) is mmstore.MediaNotFoundError  # unwrapped: the error the actor raised
    assert (err.file, err.run_id, err.step, err.image_index) == (rel, "gone", 0, 0)
    assert err.sample_id in sample_ids


# -- issue 30 item 22: a pool the cluster cannot hold -----------------------------------------


def test_a_pool_the_cluster_cannot_hold_fails_at_the_call(cluster, filled, small_processor):
    # The cluster: 3 CPUs, of which 2 on the node with the 2 "materialize" resources.
    with pytest.raises(mmstore.InvalidArgumentError, match="cannot hold") as info:
        mmray.read_rollouts(filled, small_processor, concurrency=3, resources=ON_WORKER_NODE)
    assert info.value.fits == 2
    with pytest.raises(mmstore.InvalidArgumentError, match="room for 3"):
        mmray.read_rollouts(filled, small_processor, concurrency=4)
    with pytest.raises(mmstore.InvalidArgumentError, match="cannot hold"):
        mmray.iter_batches(
            _loader(filled, small_processor), concurrency=3, resources=ON_WORKER_NODE
        )
    with pytest.raises(mmstore.InvalidArgumentError, match="cannot hold one actor"):
        mmray.read_rollouts(filled, small_processor, resources={"gpu_node": 1})


# A laptop's Ray: one node of 2 CPUs, read_rollouts with every default. Run in a process of
# its own (a driver joins one cluster), bounded: a hang fails the test instead of the suite.
TWO_CPU_DRIVER = """
import sys
import ray
import mmstore
from mmstore.integrations import ray as mmray
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         _node_ip_address="127.0.0.1")
store = mmstore.Store.open(sys.argv[1])
processor = Qwen2VLImageProcessorPil(max_pixels=int(sys.argv[2]))
print("ROWS", len(mmray.read_rollouts(store, processor).take_all()), flush=True)
ray.shutdown()
"""
TWO_CPU_BOUND_S = 240


def test_read_rollouts_with_its_defaults_finishes_on_a_two_cpu_ray(filled):
    proc = subprocess.Popen(
        [sys.executable, "-c", TWO_CPU_DRIVER, filled.root, str(SMALL_MAX_PIXELS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its Ray processes in its group: all of them end with it
    )
    try:
        out, _ = proc.communicate(timeout=TWO_CPU_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"read_rollouts with its defaults hung on a 2-CPU Ray ({TWO_CPU_BOUND_S} s)")
    assert proc.returncode == 0, out[-4000:]
    assert "ROWS 24" in out, out[-4000:]


def test_read_rollouts_materializes_videos_as_the_local_loader(cluster, tmp_path):
    """Rows with a video, and rows without one, in one store: each row's video tensors (None
    where it has none) equal the local loader's for that sample."""
    from mmstore.synth import screen_recording
    from tests.family_cases import QWEN_VL
    from tests.test_video_loading import VIDEO_TEXT, small_video, write_rows

    processor = small_video(QWEN_VL.small())
    store = mmstore.Store.open(tmp_path / "s", create=True)
    clip = store.put_video(screen_recording(3, num_frames=16, width=96, height=64))
    write_rows(store, processor, [(VIDEO_TEXT, {"videos": [clip], "fps": 2.0}), ("", {})] * 2)
    data = mmray.read_rollouts(store, processor, concurrency=1, resources=ON_WORKER_NODE)
    rows = {r["sample_id"]: r for r in data.take_all()}
    assert sorted(rows) == ["s0", "s1", "s2", "s3"]
    local = mmstore.RolloutLoader(
        mmstore.RolloutDataset(store, processor, dtype=torch.float32), batch_size=1
    )
    for batch in local:
        row = rows[batch["sample_ids"][0]]
        if batch["pixel_values_videos"] is None:
            assert row["pixel_values_videos"] is None
            continue
        assert np.array_equal(row["pixel_values_videos"], batch["pixel_values_videos"].numpy())
        assert row["video_grid_thw"].tolist() == batch["video_grid_thw"].tolist()


def test_read_rollouts_carries_the_declared_columns_asked_for(cluster, tmp_path):
    """Issue 40: extra columns through Ray, bit for bit, and each sample's policy version."""
    from tests.live_workers import image_bytes, make_row, processor
    from tests.test_columns import ASKED, COLUMNS, values_for

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(processor())
    media = [store.put_media(image_bytes(2, 96, 64), ext="png")]
    rows = {}
    with store.writer("run", 0, columns=COLUMNS) as w:
        for k in range(4):
            base = make_row(adapter, media if k % 2 else [], f"s{k}")
            row = mmstore.Rollout(
                **{
                    **base.model_dump(),
                    "policy_version": k,
                    "columns": values_for(f"s{k}", len(base.tokens)),
                }
            )
            rows[row.sample_id] = row
            w.write(row)
    data = mmray.read_rollouts(
        store, processor(), columns=list(ASKED), concurrency=1, resources=ON_WORKER_NODE
    )
    got = {r["sample_id"]: r for r in data.take_all()}
    assert set(got) == set(rows)
    for sid, row in rows.items():
        assert int(got[sid]["policy_version"]) == row.policy_version
        for name in ("ref_logprobs", "topk_ids", "experts"):
            assert np.asarray(got[sid][name]).tobytes() == row.columns[name].tobytes(), name
        assert got[sid]["env"] == row.columns["env"]
