"""A worker's small tensors travel inside the pickle, not in shared memory of their own:
same values, dtypes and shapes in the main process, as ordinary writable tensors."""

from __future__ import annotations

import pickle

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import mmstore
from mmstore._loading import workers as _worker

# The buffer tests' store: batches with pixels large enough to take shared buffers.
from .test_buffers import PROCESSOR
from .test_buffers import stored as stored

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), max_size=3),
    transpose=st.booleans(),
    lazy_conj=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_an_inline_tensor_unpickles_equal_and_owns_its_memory(
    dtype, shape, transpose, lazy_conj, seed
):
    generator = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(shape, generator=generator, dtype=torch.float64) * 50).to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # not contiguous: sent as its values, in order
    if lazy_conj and dtype.is_complex:
        tensor = tensor.conj()  # a view with the conjugate bit set: sent as its values
    got = pickle.loads(pickle.dumps(_worker.Inline(tensor)))
    assert type(got) is torch.Tensor
    assert got.dtype == dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)
    if got.numel():
        got.view(-1)[0] = 1  # writable, and a copy: the sent tensor is unchanged
        assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


def test_only_small_cpu_tensors_are_inlined_however_deep():
    small = torch.zeros(4)
    large = torch.zeros(_worker.INLINE_BYTES // 4)  # exactly the limit: shared memory
    batch = {"a": small, "b": large, "c": [small, (small, "x")], "d": 3, "e": None}
    sent = _worker.inline_small(batch)
    assert isinstance(sent["a"], _worker.Inline) and sent["b"] is large
    assert isinstance(sent["c"][0], _worker.Inline)
    assert isinstance(sent["c"][1], tuple) and isinstance(sent["c"][1][0], _worker.Inline)
    assert sent["c"][1][1] == "x" and sent["d"] == 3 and sent["e"] is None
    assert batch["a"] is small  # the batch itself is not changed


def _loader(store, workers):
    ds = mmstore.RolloutDataset(store, PROCESSOR, seed=3, node_cache_bytes=0)
    return mmstore.RolloutLoader(ds, batch_size=4, num_workers=workers)


@pytest.mark.slow
def test_worker_batches_equal_batches_built_here(stored):
    here = list(_loader(stored, 0))
    sent = list(_loader(stored, 2))
    assert len(sent) == len(here) == 12
    for got, want in zip(sent, here, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), key
                # small tensors came inline (ordinary memory), large ones in shared memory
                small = value.nbytes < _worker.INLINE_BYTES
                assert got[key].is_shared() is not small, key
            else:
                assert got[key] == value, key
    assert any(isinstance(v, torch.Tensor) and v.is_shared() for b in sent for v in b.values()), (
        "no large tensor in these batches: the test shows nothing about them"
    )
