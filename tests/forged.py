"""Forged rows shared by the trust tests of several surfaces (readers, export): v1-schema
Arrow tables built column by column, as another engine could write them, and what the
loader says about a store holding them.

Commit one with :func:`tests.test_reader_trust.forge_table`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import mmstore
from mmstore._format.schema import ROLLOUT_SCHEMA
from tests.store_workers import make_row


def one_row(**columns) -> pa.Table:
    """One row of the v1 schema: ``columns`` as given (Arrow arrays), every other null."""
    arrays = [
        columns.get(f.name, pa.nulls(1, f.type))
        for f in ROLLOUT_SCHEMA
        if f.name in columns or f.nullable
    ]
    names = [f.name for f in ROLLOUT_SCHEMA if f.name in columns or f.nullable]
    return pa.Table.from_arrays(arrays, names=names)


def list_of(values: np.ndarray, name: str) -> pa.ListArray:
    kind = ROLLOUT_SCHEMA.field(name).type
    offsets = pa.array([0, len(values)], pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values, kind.value_type), type=kind)


def huge_row_table(n_tokens: int) -> pa.Table:
    """A text-only row claiming ``n_tokens`` tokens: a few KB of Parquet (one repeated value)."""
    return one_row(
        sample_id=pa.array(["huge"]),
        tokens=list_of(np.full(n_tokens, 7, np.int32), "tokens"),
        prompt_len=pa.array([1], pa.int32()),
        loss_mask=list_of(np.zeros(n_tokens, np.bool_), "loss_mask"),
        images=pa.array([[]], ROLLOUT_SCHEMA.field("images").type),
    )


def many_refs_table(adapter, media, n_refs: int) -> pa.Table:
    """A short valid row whose one image ref is repeated ``n_refs`` times."""
    row = make_row(adapter, [media], "many")
    refs = [row.images[0].model_dump()] * n_refs
    return one_row(
        sample_id=pa.array(["many"]),
        tokens=list_of(np.asarray(row.tokens, np.int32), "tokens"),
        prompt_len=pa.array([row.prompt_len], pa.int32()),
        loss_mask=list_of(np.asarray(row.loss_mask, np.bool_), "loss_mask"),
        images=pa.array([refs], ROLLOUT_SCHEMA.field("images").type),
    )


def assert_names(err, path, sample_id):
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "forged", 0, sample_id), err


def loader_error(store, processor):
    ds = mmstore.RolloutDataset(store, processor, shuffle=False, node_cache_bytes=0)
    with pytest.raises(mmstore.MmstoreError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=2))
    return info.value
