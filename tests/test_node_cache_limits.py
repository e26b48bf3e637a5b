"""The node cache under pressure (issue 30, items 6, 7 and 8): a request waits a bounded time
for a stopped holder; a full file system (Docker's 64 MB /dev/shm) bounds the cache and a
publish that fails is a miss; a publish's bookkeeping does not list the directory."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch

import mmstore
from mmstore._loading import node_cache
from mmstore._loading.node_cache import NodeCache
from tests.test_loader_node_cache import grouped_store, processor


def _tensors(seed: int, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(rows, 12, generator=g).to(torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 8, 8]], dtype=torch.int64),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def _entries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


# -- item 6: a stopped holder ------------------------------------------------------------


def _hold_while_computing(directory: str, started: str) -> None:
    def compute():
        with open(started, "w"):
            pass
        time.sleep(600)  # stopped here by the test, then killed
        return _tensors(0)

    NodeCache(directory, 1 << 20).get_or_compute("k", compute)


def test_a_stopped_holder_is_waited_for_a_bounded_time(tmp_path):
    directory, started = str(tmp_path / "c"), str(tmp_path / "started")
    holder = mp.get_context("fork").Process(target=_hold_while_computing, args=(directory, started))
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(started), "the holder never started computing"
        os.kill(holder.pid, signal.SIGSTOP)  # holds the entry's lock, stopped, not dead

        cache = NodeCache(directory, 1 << 20, lock_wait=0.5)
        got: dict[str, dict[str, torch.Tensor]] = {}
        waiter = threading.Thread(
            target=lambda: got.update(k=cache.get_or_compute("k", lambda: _tensors(3))),
            daemon=True,
        )
        waiter.start()
        waiter.join(timeout=120)  # a hang guard, far past the bound
        assert not waiter.is_alive(), "still waiting for a stopped holder"
        assert _equal(got["k"], _tensors(3)) and cache.misses == 1
        # Published, though the holder still holds the lock: the next request is a hit.
        again = NodeCache(directory, 1 << 20, lock_wait=0.5)
        assert _equal(again.get_or_compute("k", lambda: pytest.fail("recomputed")), _tensors(3))
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()


# -- item 7: a full file system ------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path, request):
    """A tmpfs of ``request.param`` bytes (1 MiB unless given), as Docker's /dev/shm."""
    size = getattr(request, "param", 1 << 20)
    where = tmp_path / "shm"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazily: a hit's mapping may still hold the file system until it is collected.
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill(where) -> str:
    """Fill the file system at ``where`` (another process's data); the ballast's path."""
    ballast = os.path.join(where, "ballast")
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def test_the_bound_is_sized_to_the_file_systems_room(small_tmpfs):
    cache = NodeCache(str(small_tmpfs / "c"), capacity=2 * 2**30)  # the default bound
    for k in range(30):  # about 3 MB of entries on a 1 MiB file system
        got = cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k, 4000))
        assert _equal(got, _tensors(k, 4000))
        del got
    assert cache.misses == 30
    assert cache.bound <= (1 << 20) // 2  # half of the room: DataLoader workers need some
    assert 0 < cache.nbytes() <= cache.bound
    assert _equal(cache.get_or_compute("k29", lambda: pytest.fail("evicted")), _tensors(29, 4000))


def test_a_publish_that_fails_is_a_miss(small_tmpfs):
    cache = NodeCache(str(small_tmpfs / "c"), capacity=2 * 2**30)
    ballast = _fill(small_tmpfs)  # another process took the rest
    with pytest.warns(RuntimeWarning, match="could not be written"):
        got = cache.get_or_compute("k", lambda: _tensors(1, 400))
    assert _equal(got, _tensors(1, 400)) and cache.misses == 1
    assert os.listdir(small_tmpfs / "c") in ([], [".usage"])  # no torn or temporary file
    os.unlink(ballast)  # room again: entries are published again
    cache.get_or_compute("k2", lambda: _tensors(2, 400))
    assert _equal(cache.get_or_compute("k2", lambda: pytest.fail("recomputed")), _tensors(2, 400))


# -- item 8: O(1) bookkeeping per publish ----------------------------------------------------


def test_a_publish_does_not_list_the_directory(tmp_path, monkeypatch):
    cache = NodeCache(str(tmp_path / "c"), capacity=1 << 30)
    for k in range(300):
        cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k, 4))
    listings = []
    real = os.scandir

    def scandir(path):
        listings.append(path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    for k in range(300, 400):
        cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k, 4))
    assert listings == []  # 100 publishes under the bound: no sweep
    monkeypatch.undo()
    assert len(_entries(tmp_path / "c")) == 400


def _publisher(directory: str, capacity: int, first: int) -> None:
    cache = NodeCache(directory, capacity)
    for k in range(first, first + 40):
        got = cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k))
        assert _equal(got, _tensors(k))


def test_the_bound_holds_across_processes(tmp_path):
    probe = NodeCache(str(tmp_path / "probe"), 1 << 30)
    probe.get_or_compute("k", lambda: _tensors(0))
    capacity = 10 * probe.nbytes()
    directory = str(tmp_path / "c")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_publisher, args=(directory, capacity, 40 * i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    assert NodeCache(directory, capacity).nbytes() <= capacity


def test_entries_the_running_total_missed_are_found_by_the_periodic_sweep(tmp_path, monkeypatch):
    # A process killed between its rename and its bookkeeping leaves an entry the running
    # total does not count; every SWEEP_EVERY publishes a sweep recounts the directory.
    monkeypatch.setattr(node_cache, "SWEEP_EVERY", 8)
    probe = NodeCache(str(tmp_path / "probe"), 1 << 30)
    probe.get_or_compute("k", lambda: _tensors(0))
    entry = probe.nbytes()
    cache = NodeCache(str(tmp_path / "c"), capacity=20 * entry)
    cache.get_or_compute("first", lambda: _tensors(0))
    for k in range(30):  # uncounted entries, past the bound
        with contextlib.suppress(FileExistsError):
            os.link(tmp_path / "probe" / "k", tmp_path / "c" / f"left{k}")
    assert cache.nbytes() > cache.capacity
    for k in range(8):
        cache.get_or_compute(f"k{k}", lambda k=k: _tensors(k))
    assert cache.nbytes() <= cache.capacity


@pytest.mark.parametrize("small_tmpfs", [256 << 10], indirect=True)
def test_a_loader_trains_with_a_small_shm(small_tmpfs, tmp_path):
    # Docker's 64 MB /dev/shm under the default 2 GiB bound, scaled to these ~110 KB images:
    # 256 KiB hold two entries. The loader trains, on the processor's pixels.
    store, _, _ = grouped_store(tmp_path / "s", 3, 8, 24)
    directory = str(small_tmpfs / "c")
    ds = mmstore.RolloutDataset(store, processor(), node_cache_dir=directory)
    assert ds.node_cache_bytes == 2 * 2**30
    got = list(mmstore.RolloutLoader(ds, batch_size=4, num_workers=2))
    plain = list(mmstore.RolloutLoader(mmstore.RolloutDataset(store, processor()), batch_size=4))
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert NodeCache(directory, 2 * 2**30).nbytes() <= 128 << 10
