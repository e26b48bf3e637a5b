"""The node-wide processed-image cache: shared across processes, computed once per node,
never serving a torn entry, bounded in bytes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from mmstore._loading.node_cache import NodeCache


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(64, 12, generator=g).to(torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 8, 8]], dtype=torch.int64),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def test_entries_round_trip_exactly(tmp_path):
    cache = NodeCache(str(tmp_path), capacity=1 << 20)
    first = cache.get_or_compute("k", lambda: _tensors(1))
    second = cache.get_or_compute("k", lambda: pytest.fail("computed twice"))
    assert _equal(first, _tensors(1)) and _equal(second, _tensors(1))
    assert (cache.misses, cache.hits) == (1, 1)


def test_a_hit_maps_the_entry_and_writes_stay_private(tmp_path):
    cache = NodeCache(str(tmp_path), capacity=1 << 20)
    cache.get_or_compute("k", lambda: _tensors(1))
    hit = cache.get_or_compute("k", lambda: pytest.fail("computed twice"))
    hit["pixel_values"].zero_()  # copy-on-write: the entry on /dev/shm is untouched
    assert _equal(cache.get_or_compute("k", lambda: pytest.fail("recomputed")), _tensors(1))
    os.unlink(os.path.join(str(tmp_path), "k"))  # evicted while mapped: still readable
    assert not hit["pixel_values"].any()
    assert (cache.misses, cache.hits) == (1, 2)


def test_an_empty_or_foreign_file_is_recomputed(tmp_path):
    cache = NodeCache(str(tmp_path), capacity=1 << 20)
    for name, data in [
        ("empty", b""),
        ("foreign", b"\x10\x00\x00\x00" + b'{"x": ["nope", [1], 0]}'),
    ]:
        with open(os.path.join(str(tmp_path), name), "wb") as f:
            f.write(data)
        assert _equal(cache.get_or_compute(name, lambda: _tensors(2)), _tensors(2))
    assert cache.misses == 2


def _worker(directory: str, log: str, order: list[int], out: mp.Queue) -> None:
    cache = NodeCache(directory, capacity=1 << 24)

    def compute(key: int):
        def run():
            with open(log, "a") as f:  # O_APPEND: one line per computation, never interleaved
                f.write(f"{key}\n")
            time.sleep(0.05)  # widen the race a second process would lose
            return _tensors(key)

        return run

    got = {k: cache.get_or_compute(f"key{k}", compute(k)) for k in order}
    out.put({k: _equal(v, _tensors(k)) for k, v in got.items()})


def test_each_entry_is_computed_once_per_node_across_processes(tmp_path):
    ctx = mp.get_context("fork")
    log = str(tmp_path / "computed.log")
    out = ctx.Queue()
    keys = list(range(6))
    procs = [
        ctx.Process(target=_worker, args=(str(tmp_path / "c"), log, keys[i:] + keys[:i], out))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(all(r.values()) and len(r) == len(keys) for r in results)
    with open(log) as f:
        computed = sorted(int(line) for line in f.read().split())
    assert computed == keys  # every image processed exactly once on this node


def _hang_while_computing(directory: str) -> None:
    cache = NodeCache(directory, capacity=1 << 20)

    def compute():
        # Half an entry in a temporary file, as a writer killed mid-write leaves it.
        with open(os.path.join(directory, ".tmp-torn"), "wb") as f:
            f.write(b'\x10\x00\x00\x00{"pixel_values"')
        time.sleep(60)
        return _tensors(0)

    cache.get_or_compute("k", compute)


def test_a_writer_killed_mid_write_leaves_nothing_served(tmp_path):
    directory = str(tmp_path / "c")
    child = mp.get_context("fork").Process(target=_hang_while_computing, args=(directory,))
    child.start()
    deadline = time.time() + 30
    while not os.path.exists(os.path.join(directory, ".tmp-torn")) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    cache = NodeCache(directory, capacity=1 << 20)
    # The dead writer's lock is gone with it; the torn file is not an entry: we compute.
    got = cache.get_or_compute("k", lambda: _tensors(7))
    assert _equal(got, _tensors(7)) and cache.misses == 1


def test_a_damaged_entry_is_recomputed_not_served(tmp_path):
    cache = NodeCache(str(tmp_path), capacity=1 << 20)
    cache.get_or_compute("k", lambda: _tensors(1))
    with open(tmp_path / "k", "r+b") as f:
        f.truncate(40)
    got = cache.get_or_compute("k", lambda: _tensors(1))
    assert _equal(got, _tensors(1)) and cache.misses == 2


def test_the_byte_bound_holds_and_keeps_the_recently_used(tmp_path):
    one = NodeCache(str(tmp_path), capacity=1 << 30)
    one.get_or_compute("probe", lambda: _tensors(0))
    entry = one.nbytes()
    cache = NodeCache(str(tmp_path / "b"), capacity=3 * entry + entry // 2)
    for k in range(10):
        cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k))
        time.sleep(0.01)  # distinct mtimes: recency is what eviction orders by
        cache.get_or_compute("k0", lambda: _tensors(0))  # keep k0 hot
        assert cache.nbytes() <= cache.capacity
    entries = sorted(n for n in os.listdir(tmp_path / "b") if not n.startswith("."))
    assert entries == ["k0", "k8", "k9"]
