"""The node-wide pixel cache wired into the loader (issue 14, item 2), and worker threads."""

from __future__ import annotations

import functools
import os

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._loading.materialize import wanted_elsewhere
from mmstore._loading.node_cache import NodeCache, processor_digest
from mmstore._loading.workers import init_worker
from tests.store_workers import SMALL_MAX_PIXELS, image_bytes, make_row, small_adapter

GROUPS, GROUP_SIZE = 4, 8


@pytest.fixture
def grpo_store(tmp_path):
    """GRPO groups of 8 samples sharing their prompt image; 4 distinct images."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()
    with store.writer(run_id="r", step=0, adapter=adapter, row_group_size=4) as w:
        for g in range(GROUPS):
            media = store.put_media(image_bytes(100 + g))
            for i in range(GROUP_SIZE):
                w.write(make_row(adapter, [media], f"g{g}-{i}", group_id=f"g{g}"))
    return store


def processor():
    return Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS)


def batches(store, directory, *, rank=0, world_size=1, workers=0, node_cache_bytes=None):
    ds = mmstore.RolloutDataset(
        store,
        processor(),
        rank=rank,
        world_size=world_size,
        node_cache_dir=str(directory),
        node_cache_bytes=node_cache_bytes,
    )
    return list(mmstore.RolloutLoader(ds, batch_size=2, num_workers=workers))


def test_only_images_another_process_may_ask_for_are_published(tmp_path):
    # One image shared by a group at the unit's edge (it may go on in the next unit, another
    # rank's), four images shown once: publishing those would cost a write of their pixels
    # to /dev/shm that nobody reads back.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()
    shared = store.put_media(image_bytes(1))
    with store.writer(run_id="r", step=0, adapter=adapter, row_group_size=8) as w:
        for i in range(4):
            w.write(make_row(adapter, [shared], f"shared-{i}", group_id="g"))
            w.write(make_row(adapter, [store.put_media(image_bytes(10 + i))], f"own-{i}"))
    directory = tmp_path / "node"
    got = batches(store, directory)
    assert published(directory) == {node_key(directory, shared.hash, adapter)}
    assert sum(b["node_cache_misses"] for b in got) == 5  # each image processed once
    plain = batches(store, tmp_path / "off", node_cache_bytes=0)
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def published(directory):
    """Names of the entries at ``directory`` (not the cache's own dot files)."""
    if not directory.exists():
        return set()
    return {e.name for e in directory.iterdir() if not e.name.startswith(".")}


def node_key(directory, hash_, adapter):
    """The name of ``hash_``'s entry in the node cache at ``directory``."""
    return NodeCache(str(directory), 1).key(hash_, adapter.fingerprint, *key_parts())


def grouped_store(root, groups, group_size, row_group_size):
    """GRPO groups of ``group_size`` rows sharing their image, written in order."""
    store = mmstore.Store.open(root, create=True)
    adapter = small_adapter()
    refs = []
    with store.writer(run_id="r", step=0, adapter=adapter, row_group_size=row_group_size) as w:
        for g in range(groups):
            refs.append(store.put_media(image_bytes(200 + g)))
            for i in range(group_size):
                w.write(make_row(adapter, [refs[-1]], f"g{g}-{i}", group_id=f"g{g}"))
    return store, adapter, refs


def test_a_group_one_worker_builds_whole_is_not_published(tmp_path):
    # Three groups of 8 in one unit of 24 rows, batches of 8: each group is one batch of one
    # worker, whose own cache serves its 7 other rows. Only the groups at the unit's edges,
    # which might go on in a neighbouring unit, are published.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = tmp_path / "node"
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=str(directory))
    got = list(mmstore.RolloutLoader(ds, batch_size=8, num_workers=2))
    assert published(directory) == {
        node_key(directory, refs[0].hash, adapter),
        node_key(directory, refs[2].hash, adapter),
    }
    assert sum(b["node_cache_misses"] for b in got) == 3
    assert sum(b["cache_hits"] for b in got) == 21


def test_a_group_split_across_workers_is_processed_once_per_node(tmp_path):
    # Batches of 4: each group's two halves go to the two workers, neither at a unit edge.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = tmp_path / "node"
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=str(directory))
    got = list(mmstore.RolloutLoader(ds, batch_size=4, num_workers=2))
    assert published(directory) == {node_key(directory, r.hash, adapter) for r in refs}
    assert sum(b["node_cache_misses"] for b in got) == 3
    assert sum(b["node_cache_hits"] for b in got) == 3
    plain = list(mmstore.RolloutLoader(mmstore.RolloutDataset(store, processor()), batch_size=4))
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def _window(groups, hashes):
    images = pa.array(
        [[{"hash": h} for h in row] for row in hashes],
        pa.list_(pa.struct([("hash", pa.string())])),
    )
    return pa.table({"images": images, "group_id": pa.array(groups, pa.string())})


def test_wanted_elsewhere():
    # Two units of 4 rows: groups a (rows 0-2), b (3-4, cut by the unit boundary), c (5-6),
    # and a row of no group at the end.
    table = _window(
        ["a", "a", "a", "b", "b", "c", "c", None],
        [["A"], ["A"], ["A"], ["B"], ["B"], ["C1", "C2"], ["C2"], ["D"]],
    )
    units = [4, 4]
    # Every row this worker's: the edge groups only (a starts unit 0, b ends it and starts
    # unit 1); c is inside unit 1, and the last row has no group to go on.
    assert wanted_elsewhere(table, units, np.arange(8)) == {"A", "B"}
    # Row 6 another worker's: its images too.
    assert wanted_elsewhere(table, units, np.array([0, 1, 2, 3, 4, 5, 7])) == {"A", "B", "C2"}
    # One unit of all 8 rows: no group is cut; the unit's first group still is at its edge.
    assert wanted_elsewhere(table, [8], np.arange(8)) == {"A"}
    # Which worker builds which row unknown (packed micro-batches): what several rows show.
    assert wanted_elsewhere(table, [8], None) == {"A", "B", "C2"}
    # A malformed window publishes nothing (the reader's checks name what is wrong).
    assert wanted_elsewhere(pa.table({"x": [1]}), [1], None) == set()


def test_wanted_elsewhere_reads_the_neighbouring_row_groups_ids():
    table = _window(
        ["a", "a", "a", "b", "b", "c", "c", None],
        [["A"], ["A"], ["A"], ["B"], ["B"], ["C1", "C2"], ["C2"], ["D"]],
    )
    rows = np.arange(8)
    # The row group before unit 0 holds ids x..z: group a cannot go on there. Unknown after
    # unit 0 and before unit 1: b is published as before.
    assert wanted_elsewhere(table, [4, 4], rows, [(("x", "z"), None), (None, None)]) == {"B"}
    # Ranges that can hold the edge's id (bounds included) count as "may go on".
    assert wanted_elsewhere(table, [4, 4], rows, [(("a", "a"), ("b", "c")), (None, None)]) == {
        "A",
        "B",
    }
    # b's id outside both neighbours' ranges: b is this window's alone.
    around = [(("x", "z"), ("c", "d")), (("0", "a"), ("d", "e"))]
    assert wanted_elsewhere(table, [4, 4], rows, around) == set()
    # Another worker's rows still count, whatever the neighbours.
    assert wanted_elsewhere(table, [4, 4], rows[:-2], around) == {"C2", "D"}


def test_groups_that_cannot_go_on_in_the_next_row_group_are_not_published(tmp_path):
    # Four groups of 8 in row groups of 16: g0 g1 | g2 g3. The footer's statistics say that
    # g1 (end of the first) and g2 (start of the second) are not in the other row group, so
    # only the file's first and last groups, whose neighbours are unknown, are published.
    store, adapter, refs = grouped_store(tmp_path / "s", 4, 8, 16)
    units = mmstore.RolloutDataset(store, processor()).snapshot.units
    assert [u.neighbours for u in units] == [(None, ("g2", "g3")), (("g0", "g1"), None)]
    directory = tmp_path / "node"
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=str(directory))
    got = list(mmstore.RolloutLoader(ds, batch_size=8, num_workers=2))
    assert published(directory) == {node_key(directory, refs[i].hash, adapter) for i in (0, 3)}
    assert sum(b["node_cache_misses"] for b in got) == 4


def test_a_group_cut_by_row_groups_is_processed_once_across_ranks(tmp_path):
    # Three groups of 8 in row groups of 12: g1 runs over both (rows 8-15), which two ranks
    # read. The statistics show g1 in both row groups: its image is published once and the
    # other rank takes it from the node cache.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 12)
    units = mmstore.RolloutDataset(store, processor()).snapshot.units
    assert [u.neighbours for u in units] == [(None, ("g1", "g2")), (("g0", "g1"), None)]
    directory = tmp_path / "node"
    got = [
        b for rank in (0, 1) for b in batches(store, directory, rank=rank, world_size=2, workers=0)
    ]
    assert sum(b["node_cache_misses"] for b in got) == 3
    assert sum(b["node_cache_hits"] for b in got) == 1
    assert node_key(directory, refs[1].hash, adapter) in published(directory)


def key_parts():
    return (str(torch.bfloat16), processor_digest(processor()))


def test_pixels_from_the_node_cache_equal_the_processors(grpo_store, tmp_path):
    directory = tmp_path / "node"
    plain = batches(grpo_store, directory, node_cache_bytes=0)
    first = batches(grpo_store, directory)  # computes and publishes
    again = batches(grpo_store, directory)  # a fresh process-level cache: node hits only
    assert sum(b["node_cache_misses"] for b in first) == GROUPS
    assert sum(b["node_cache_misses"] for b in again) == 0
    # Every image the process's own cache lacked came from the node cache: once per window
    # showing it (groups of 8 in row groups of 4 span two units, shuffled into two windows;
    # the process lets an image go once its window is done with it).
    hits = sum(b["node_cache_hits"] for b in again)
    assert hits == sum(b["cache_misses"] for b in again) >= GROUPS
    for a, b, c in zip(plain, first, again, strict=True):
        assert a["sample_ids"] == b["sample_ids"] == c["sample_ids"]
        assert a["pixel_values"].dtype == c["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["pixel_values"], c["pixel_values"])
        assert torch.equal(a["image_grid_thw"], c["image_grid_thw"])


@pytest.mark.slow
def test_each_distinct_image_is_processed_once_per_node(grpo_store, tmp_path):
    """2 DataLoader workers x 2 simulated ranks of one node, sharing one directory."""
    directory = tmp_path / "node"
    out = [
        b
        for rank in (0, 1)
        for b in batches(grpo_store, directory, rank=rank, world_size=2, workers=2)
    ]
    assert sorted(s for b in out for s in b["sample_ids"]) == sorted(
        f"g{g}-{i}" for g in range(GROUPS) for i in range(GROUP_SIZE)
    )
    # Every worker-level miss went to the node cache; the node processed each image once.
    assert sum(b["node_cache_misses"] for b in out) == GROUPS
    assert sum(b["node_cache_hits"] + b["node_cache_misses"] for b in out) == sum(
        b["cache_misses"] for b in out
    )
    assert sum(b["cache_misses"] for b in out) > GROUPS  # what a per-worker cache costs


def test_node_cache_off(grpo_store, tmp_path):
    out = batches(grpo_store, tmp_path / "node", node_cache_bytes=0)
    assert sum(b["node_cache_hits"] for b in out) == 0
    assert not (tmp_path / "node").exists()
    with pytest.raises(ValueError):
        batches(grpo_store, tmp_path / "node", node_cache_bytes=-1)


def test_the_default_is_on_where_a_directory_is_usable(grpo_store, monkeypatch, tmp_path):
    monkeypatch.setenv("MMSTORE_NODE_CACHE", str(tmp_path / "env"))
    ds = mmstore.RolloutDataset(grpo_store, processor())
    assert ds.node_cache_dir == str(tmp_path / "env") and ds.node_cache_bytes == 2 * 2**30


class _Threads(IterableDataset):
    def __iter__(self):
        yield torch.get_num_threads()


@pytest.mark.slow
def test_a_spawned_worker_runs_the_threads_it_is_given():
    loader = DataLoader(
        _Threads(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="spawn",
        worker_init_fn=functools.partial(init_worker, 2),
    )
    assert list(loader) == [2]


def test_rolloutloader_worker_threads(grpo_store):
    ds = mmstore.RolloutDataset(grpo_store, processor())
    assert mmstore.RolloutLoader(ds, num_workers=2).worker_threads == 1
    spawned = mmstore.RolloutLoader(
        ds, num_workers=2, worker_threads=2, multiprocessing_context="spawn"
    )
    assert spawned.worker_threads == 2
    # Forked workers hang once they start OpenMP threads: refused, typed.
    with pytest.raises(mmstore.InvalidArgumentError, match="spawn"):
        mmstore.RolloutLoader(ds, num_workers=2, worker_threads=2, multiprocessing_context="fork")
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.RolloutLoader(ds, worker_threads=0)


def test_the_process_cache_lets_an_image_go_when_its_window_is_done_unless_it_recurs(tmp_path):
    # Four groups of 8 in one unit, batches of 8: each group's 7 other rows still hit the
    # process's own cache, but its image leaves that cache with the group's last row (its
    # memory then serves the next image), instead of staying until the byte budget is full.
    store, _, _ = grouped_store(tmp_path / "s", 4, 8, 32)
    ds = mmstore.RolloutDataset(store, processor(), node_cache_bytes=0)
    cache = ds.materializer().cache
    loader = mmstore.RolloutLoader(ds, batch_size=8)

    def epoch():
        counts = []
        for b in loader:
            counts.append((b["cache_hits"], b["cache_misses"], len(cache)))
        return counts

    assert epoch() == [(7, 1, 0)] * 4
    # Seen again in a later window: processed once more, then kept (a start screen many
    # tasks share stays cached), so a third epoch processes nothing.
    assert epoch() == [(7, 1, i + 1) for i in range(4)]
    assert epoch() == [(8, 0, 4)] * 4


# -- trust (issue 30): what a loader trains on never depends on what the node holds --------


def media_path(store, ref):
    backend, rel = store.resolve(ref.uri)
    return backend.abspath(rel)


def publish_all(store, directory):
    """Every image of a ``grouped_store`` published at ``directory``, as an earlier process
    of the node leaves them (each group split across the two workers)."""
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=str(directory))
    list(mmstore.RolloutLoader(ds, batch_size=4, num_workers=2))


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["error", "placeholder_zero_loss"])
def test_lost_media_is_lost_whatever_the_node_cache_holds(tmp_path, missing):
    # An earlier process published every image, then one media file was deleted: a loader
    # raises (or masks) as it does with an empty node cache, instead of training the image.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = tmp_path / "node"
    publish_all(store, directory)
    assert node_key(directory, refs[1].hash, adapter) in published(directory)
    os.unlink(media_path(store, refs[1]))

    def run(node_dir):
        ds = mmstore.RolloutDataset(
            store, processor(), missing=missing, node_cache_dir=str(node_dir)
        )
        return list(mmstore.RolloutLoader(ds, batch_size=4))

    if missing == "error":
        for node_dir in (tmp_path / "empty", directory):
            with pytest.raises(mmstore.MediaNotFoundError) as caught:
                run(node_dir)
            assert caught.value.uri == refs[1].uri
        return
    with pytest.warns(UserWarning, match="missing media"):
        empty = run(tmp_path / "empty")
    with pytest.warns(UserWarning, match="missing media"):
        left = run(directory)
    assert sum(b["node_cache_hits"] for b in left) == 2  # the two images still there
    assert sum(b["images_missing"] for b in left) == 8
    for a, b in zip(empty, left, strict=True):
        assert a["images_missing"] == b["images_missing"]
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["pixel_values"], b["pixel_values"])


@pytest.mark.slow
def test_a_node_cache_directory_others_may_write_to_is_not_trusted(tmp_path):
    # Another user pre-created the directory world-writable and planted whole, well-formed
    # entries (zero pixels, the right shapes) under the keys anyone can compute.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = tmp_path / "shared"
    planter = NodeCache(str(directory), 1 << 30)
    for ref in refs:
        zeros = adapter.placeholder(ref.width, ref.height)
        planted = {k: torch.from_numpy(v) for k, v in zeros.items()}
        planted["pixel_values"] = planted["pixel_values"].to(torch.bfloat16)
        planter.get_or_compute(node_key(directory, ref.hash, adapter), lambda p=planted: p)
    os.chmod(directory, 0o777)
    with pytest.warns(RuntimeWarning, match="node cache off"):
        got = batches(store, directory)
    plain = batches(store, tmp_path / "off", node_cache_bytes=0)
    assert sum(b["node_cache_hits"] for b in got) == 0
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def flip_a_pixel_bit(path, entry):
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte ^ 0x40]))


def as_float16(path, entry):
    return {**entry, "pixel_values": entry["pixel_values"].to(torch.float16)}


def another_shape(path, entry):
    rows, cols = entry["pixel_values"].shape
    return {**entry, "pixel_values": entry["pixel_values"].reshape(rows * 2, cols // 2)}


def without_the_grid(path, entry):
    return {"pixel_values": entry["pixel_values"]}


@pytest.mark.slow
@pytest.mark.parametrize("damage", [flip_a_pixel_bit, as_float16, another_shape, without_the_grid])
def test_an_entry_that_is_not_the_processors_is_recomputed(tmp_path, damage):
    # A flipped bit, or a whole (checksummed) entry of another dtype, shape or keys: each is
    # processed again, and replaced; the batches equal the processor's.
    store, adapter, refs = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = tmp_path / "node"
    publish_all(store, directory)
    cache = NodeCache(str(directory), 1 << 30)
    for ref in refs:
        key = node_key(directory, ref.hash, adapter)
        entry = {k: v.clone() for k, v in cache.get_or_compute(key, pytest.fail).items()}
        replacement = damage(str(directory / key), entry)
        if replacement is not None:  # a whole entry, republished under the key
            os.unlink(directory / key)
            cache.get_or_compute(key, lambda r=replacement: r)
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=str(directory))
    got = list(mmstore.RolloutLoader(ds, batch_size=4, num_workers=2))
    plain = list(mmstore.RolloutLoader(mmstore.RolloutDataset(store, processor()), batch_size=4))
    assert sum(b["node_cache_misses"] for b in got) == len(refs)  # each processed again, once
    for a, b in zip(plain, got, strict=True):
        assert b["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    again = list(mmstore.RolloutLoader(ds, batch_size=4, num_workers=2))  # replaced: hits now
    assert sum(b["node_cache_misses"] for b in again) == 0
