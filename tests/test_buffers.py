"""Workers reuse the shared memory of batches the trainer has dropped, never one it holds."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._loading import buffers as _buffers

from .test_loader import write_steps

# Large enough that a batch's pixel_values take a buffer (at least _buffers.MIN_BYTES).
PROCESSOR = Qwen2VLImageProcessor(max_pixels=1024 * 28 * 28)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    store = mmstore.Store.open(tmp_path_factory.mktemp("buffers") / "s", create=True)
    write_steps(store, mmstore.adapter_for(PROCESSOR), steps=3, groups=4, group_size=4)
    return store


@pytest.fixture(scope="module")
def expected(stored):
    """Every batch's pixels built in this process (no workers, no buffers)."""
    loader = mmstore.RolloutLoader(_dataset(stored), batch_size=4)
    return [batch["pixel_values"].clone() for batch in loader]


def _dataset(store):
    return mmstore.RolloutDataset(store, PROCESSOR, seed=1, node_cache_bytes=0, cache_bytes=0)


def _shm_file(tensor: torch.Tensor) -> int:
    fd, _ = tensor.untyped_storage()._share_fd_cpu_()
    return os.fstat(fd).st_ino


@pytest.mark.slow  # the store of this module takes 7 s
def test_batches_are_large_enough_to_use_buffers(expected):
    assert len(expected) == 12
    assert all(p.numel() * p.element_size() >= _buffers.MIN_BYTES for p in expected)


@pytest.mark.slow  # the store of this module takes 7 s
def test_batches_the_trainer_keeps_are_never_overwritten(stored, expected):
    kept = list(mmstore.RolloutLoader(_dataset(stored), batch_size=4, num_workers=2))
    assert _buffers.KEY not in kept[0]
    for got, want in zip(kept, expected, strict=True):
        assert torch.equal(got["pixel_values"], want)
    assert len({_shm_file(b["pixel_values"]) for b in kept}) == len(kept)


@pytest.mark.slow  # the store of this module takes 7 s
def test_dropped_batches_lend_their_memory_to_later_ones(stored, expected):
    files = []
    loader = mmstore.RolloutLoader(_dataset(stored), batch_size=4, num_workers=2)
    for i, batch in enumerate(loader):
        assert torch.equal(batch["pixel_values"], expected[i])
        files.append(_shm_file(batch["pixel_values"]))
        del batch  # the trainer is done with it
    # Later batches land in the shared memory of earlier ones (how many distinct files
    # depends on how far the workers run ahead of this loop: at most prefetch_factor + 2
    # buffers each, plus fresh memory when all of a worker's are still held).
    assert len(set(files)) < len(files)


@pytest.mark.slow  # the store of this module takes 7 s
def test_a_view_the_trainer_keeps_holds_its_buffer(stored, expected):
    views = []
    loader = mmstore.RolloutLoader(_dataset(stored), batch_size=4, num_workers=2)
    for batch in loader:
        views.append(batch["pixel_values"][:3])  # a slice alone keeps the storage
        del batch
    for view, want in zip(views, expected, strict=True):
        assert torch.equal(view, want[:3])


@pytest.mark.slow  # the store of this module takes 7 s
def test_only_forked_workers_take_buffers(stored):
    ds = _dataset(stored)
    assert mmstore.RolloutLoader(ds, num_workers=2)._batch_buffers() is not None
    assert mmstore.RolloutLoader(ds, num_workers=0)._batch_buffers() is None
    spawned = mmstore.RolloutLoader(ds, num_workers=2, multiprocessing_context="spawn")
    assert spawned._batch_buffers() is None


def _live(store, workers):
    return mmstore.LiveLoader(
        store, PROCESSOR, runs=["r1"], batch_size=4, num_workers=workers, node_cache_bytes=0
    )


def _live_pixels(live, steps):
    for _ in range(steps):
        (batch,) = live.next_step(timeout=60)
        yield batch["pixel_values"]


@pytest.fixture(scope="module")
def live_expected(stored):
    """Every live step's pixels built in this process (no workers, no buffers)."""
    with _live(stored, workers=0) as live:
        return [p.clone() for p in _live_pixels(live, 12)]


@pytest.mark.slow  # the store of this module takes 7 s
def test_live_steps_the_trainer_keeps_are_never_overwritten(stored, live_expected):
    with _live(stored, workers=2) as live:
        kept = list(_live_pixels(live, 12))
        for got, want in zip(kept, live_expected, strict=True):
            assert torch.equal(got, want)
        assert len({_shm_file(p) for p in kept}) == len(kept)


@pytest.mark.slow  # the store of this module takes 7 s
def test_live_steps_dropped_lend_their_memory_to_later_ones(stored, live_expected):
    files = []
    with _live(stored, workers=2) as live:
        for got, want in zip(_live_pixels(live, 12), live_expected, strict=True):
            assert torch.equal(got, want)
            files.append(_shm_file(got))
            del got  # the trainer is done with it
    assert len(set(files)) < len(files)


def test_a_batch_that_fails_gives_back_the_buffers_it_took(monkeypatch):
    monkeypatch.setattr(_buffers, "get_worker_info", lambda: SimpleNamespace(id=0))
    buffers = _buffers.BatchBuffers(workers=1, per_worker=2)
    like = torch.zeros(1)
    with pytest.raises(RuntimeError, match="decode failed"), buffers.building():
        taken = buffers.empty(like, (1 << 19,))  # 2 MiB: takes a buffer
        assert taken is not None and _buffers.active is buffers
        raise RuntimeError("decode failed")
    assert _buffers.active is None
    with buffers.building():
        again = buffers.empty(like, (1 << 19,))
    assert again is not None
    # The same buffer, free again (else a second one would have been made).
    assert again.untyped_storage().data_ptr() == taken.untyped_storage().data_ptr()
