"""Rows -> Arrow -> Parquet file -> back, through pyarrow and through polars; and what the
pydantic models accept and refuse at the edge."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

import mmstore
from mmstore._format.models import (
    DENSE_KEYS,
    MediaRef,
    Rollout,
    rollouts_to_table,
    table_to_rollouts,
)
from mmstore._format.schema import ROLLOUT_SCHEMA, check_schema_version, file_metadata


def _rows(adapter: mmstore.QwenVLAdapter) -> list[Rollout]:
    img = adapter.image_token_id
    media = [
        MediaRef(hash=f"{i:032x}", uri=f"media/00/00/{i:032x}.png", width=w, height=h, nbytes=99)
        for i, (w, h) in enumerate([(640, 480), (56, 56), (28, 5600)])
    ]
    rows = []
    for k, (ids, images) in enumerate(
        [
            ([1, img, 2, 3], media[:1]),
            ([4, img, 5, img, 6], media[1:]),
            ([7, 8, 9], []),  # text-only rows are valid
        ]
    ):
        tokens, refs = adapter.expand(ids, images)
        n = len(tokens)
        rows.append(
            Rollout(
                sample_id=f"s{k}",
                group_id=None if k == 2 else "g0",
                tokens=tokens,
                prompt_len=n - 1,
                loss_mask=[False] * (n - 1) + [True],
                logprobs=None if k == 1 else [-0.25 * (i % 5) for i in range(n)],
                reward=1.0 if k == 0 else None,
                advantage=-0.1 * k,
                images=refs,
                metadata={"k": k, "note": "ü"} if k else None,
            )
        )
    rows[0] = rows[0].model_copy(
        update={"images": [rows[0].images[0].model_copy(update={"payload": '{"crop": 1}'})]}
    )
    return rows


@pytest.fixture
def parquet_file(tmp_path, adapter):
    rows = _rows(adapter)
    layouts = {adapter.fingerprint: adapter.layout.params()}
    metadata = file_metadata("run-7", 3, layouts)
    table = rollouts_to_table(rows)
    path = tmp_path / "part-0.parquet"
    pq.write_table(table.replace_schema_metadata(metadata), path)
    return path, rows, metadata


# Rollout fields no row stores: extra columns (their own columns) and a continuation's link.
WRITE_ONLY = {"columns", "parent_id", "prefix_len"}


def test_round_trip_through_pyarrow(parquet_file):
    path, rows, metadata = parquet_file
    table = pq.read_table(path)
    assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False)
    assert table_to_rollouts(table) == rows
    assert table.to_pylist() == [r.model_dump(exclude=WRITE_ONLY) for r in rows]
    file_meta = pq.read_metadata(path).metadata
    assert {k: file_meta[k] for k in metadata} == metadata
    assert check_schema_version(file_meta, where=str(path)) == mmstore.SCHEMA_VERSION


def test_round_trip_through_polars(parquet_file, adapter):
    path, rows, metadata = parquet_file
    df = pl.read_parquet(path)
    assert df.columns == ROLLOUT_SCHEMA.names
    assert df.to_dicts() == [r.model_dump(exclude=WRITE_ONLY) for r in rows]
    assert table_to_rollouts(df.to_arrow()) == rows

    pl_meta = pl.read_parquet_metadata(path)
    assert {k: pl_meta[k] for k in (k.decode() for k in metadata)} == {
        k.decode(): v.decode() for k, v in metadata.items()
    }
    assert check_schema_version(pl_meta, where=str(path)) == mmstore.SCHEMA_VERSION
    layouts = json.loads(pl_meta["mmstore.layouts"])
    assert layouts == {adapter.fingerprint: adapter.layout.params()}

    # The debugging path: a lazy scan with a predicate, one row per image.
    images = (
        pl.scan_parquet(path)
        .filter(pl.col("images").list.len() > 0)
        .select("sample_id", "images")
        .explode("images")
        .unnest("images")
        .collect()
    )
    expected = [(r.sample_id, ref.offset, ref.length, ref.hash) for r in rows for ref in r.images]
    assert images.select("sample_id", "offset", "length", "hash").rows() == expected
    assert images["layout_fingerprint"].unique().to_list() == [adapter.fingerprint]


def test_polars_written_file_reads_back_as_rollouts(tmp_path, parquet_file):
    # A file rewritten by polars (large_list/large_string types) still converts back.
    path, rows, _ = parquet_file
    again = tmp_path / "polars.parquet"
    pl.read_parquet(path).write_parquet(again)
    assert table_to_rollouts(pq.read_table(again)) == rows


def test_extra_columns_are_ignored_on_the_way_back(adapter):
    rows = _rows(adapter)
    table = rollouts_to_table(rows).append_column("step", [[3] * len(rows)])
    assert table_to_rollouts(table) == rows


# --- what the models accept ---------------------------------------------------------------


def test_numpy_and_torch_token_arrays_are_accepted():
    plain = Rollout(
        sample_id="a",
        tokens=[5, 6, 7],
        prompt_len=1,
        loss_mask=[False, True, True],
        logprobs=[-0.5, -1.0, -2.0],
    )
    from_numpy = Rollout(
        sample_id="a",
        tokens=np.array([5, 6, 7], dtype=np.int64),
        prompt_len=np.int64(1),
        loss_mask=np.array([False, True, True]),
        logprobs=np.array([-0.5, -1.0, -2.0], dtype=np.float32),
    )
    from_torch = Rollout(
        sample_id="a",
        tokens=torch.tensor([5, 6, 7], dtype=torch.int32),
        prompt_len=1,
        loss_mask=torch.tensor([False, True, True]),
        logprobs=torch.tensor([-0.5, -1.0, -2.0], dtype=torch.bfloat16),
    )
    assert from_numpy == plain
    assert from_torch == plain
    assert type(from_torch.tokens[0]) is int
    assert table_to_rollouts(rollouts_to_table([from_torch])) == [plain]


def test_floats_are_stored_as_float32_and_round_trip_exactly():
    row = Rollout(
        sample_id="f", tokens=[1], prompt_len=0, loss_mask=[True], logprobs=[0.1], reward=0.1
    )
    assert row.reward == float(np.float32(0.1))
    assert row.logprobs == [float(np.float32(0.1))]
    assert table_to_rollouts(rollouts_to_table([row])) == [row]
    with pytest.raises(mmstore.InvalidRolloutError, match="float32 range"):
        Rollout(sample_id="f", tokens=[1], prompt_len=0, loss_mask=[True], advantage=1e300)


def test_metadata_dict_becomes_json():
    row = Rollout(
        sample_id="m", tokens=[], prompt_len=0, loss_mask=[], metadata={"b": [1, 2], "a": "x"}
    )
    assert isinstance(row.metadata, str)
    assert json.loads(row.metadata) == {"a": "x", "b": [1, 2]}
    assert row.metadata == json.dumps({"a": "x", "b": [1, 2]}, sort_keys=True)
    assert (
        Rollout(sample_id="m", tokens=[], prompt_len=0, loss_mask=[], metadata="free").metadata
        == "free"
    )


@pytest.mark.parametrize("key", sorted(DENSE_KEYS))
def test_dense_tensors_beside_refs_are_refused(key):
    with pytest.raises(mmstore.InvalidRolloutError, match="dense multimodal tensors") as info:
        Rollout(
            sample_id="d",
            tokens=[1],
            prompt_len=0,
            loss_mask=[True],
            **{key: np.zeros((4, 1176), dtype=np.float32)},
        )
    assert info.value.sample_id == "d"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tokens": [2**31]}, "int32"),
        ({"tokens": [1.5]}, "tokens"),
        ({"prompt_len": -1}, "prompt_len"),
        ({"sample_id": ""}, "sample_id"),
        ({"loss_mask": ["maybe"]}, "loss_mask"),
        ({"images": [{"uri": "x"}]}, "images"),
        ({"pixels": 1}, "pixels"),
    ],
)
def test_invalid_fields_raise_invalid_rollout_error(fields, match):
    base = {"sample_id": "bad", "tokens": [1], "prompt_len": 0, "loss_mask": [True]}
    with pytest.raises(mmstore.InvalidRolloutError, match=match) as info:
        Rollout(**{**base, **fields})
    assert info.value.sample_id == fields.get("sample_id", "bad")


@pytest.mark.parametrize(
    "fields",
    [
        {"hash": "A" * 32},
        {"hash": "0" * 31},
        {"width": 0},
        {"height": -3},
        {"offset": -1},
        {"length": 0},
        {"uri": ""},
        {"extra": 1},
    ],
)
def test_image_ref_refuses_bad_fields(fields):
    good = {
        "uri": "media/x.png",
        "hash": "0" * 32,
        "width": 1,
        "height": 1,
        "offset": 0,
        "length": 4,
        "family": "qwen-vl",
        "layout_fingerprint": "f" * 16,
    }
    mmstore.ImageRef(**good)
    with pytest.raises(ValueError):
        mmstore.ImageRef(**{**good, **fields})


def test_model_validate_raises_the_same_typed_error_as_the_constructor():
    bad = {"sample_id": "s9", "tokens": [1], "prompt_len": 0, "loss_mask": "no"}
    with pytest.raises(mmstore.InvalidRolloutError) as err:
        mmstore.Rollout.model_validate(bad)
    assert err.value.sample_id == "s9"
    assert "loss_mask" in str(err.value) and "Value error" not in str(err.value)
