"""The write path encodes the numpy arrays a Rollout's validation made (issue 14, item 3).

Those arrays must say exactly what the old per-list checks said (same rows refused, same
typed errors, same stored values), and must never go stale: a list changed after validation
is what gets checked and written.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from mmstore._format.models import list_array, table_to_rollouts
from tests.store_workers import image_bytes, make_row

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _old_float32(values: list[float]) -> list[float]:
    """The float32 rounding and range rule as the models applied it before the arrays."""
    wide = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        narrow = wide.astype(np.float32)
    if np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise ValueError("value out of float32 range")
    return narrow.tolist()


def _row(**fields):
    n = len(fields.get("tokens", [1]))
    base = {"sample_id": "s", "tokens": [1] * n, "prompt_len": 0, "loss_mask": [True] * n}
    return mmstore.Rollout(**{**base, **fields})


def _same_floats(a: list[float], b: list[float]) -> bool:
    """Bit-for-bit as float64 (tells -0.0 from 0.0, any nan equals any nan)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return x.shape == y.shape and bool(
        np.all((x.view(np.int64) == y.view(np.int64)) | (np.isnan(x) & np.isnan(y)))
    )


@SETTINGS
@given(st.lists(st.integers(-(2**70), 2**70) | st.integers(INT32_MIN - 2, INT32_MAX + 2)))
def test_token_range_rule_is_the_old_one(tokens):
    old_refuses = bool(tokens) and (min(tokens) < INT32_MIN or max(tokens) > INT32_MAX)
    if old_refuses:
        with pytest.raises(mmstore.InvalidRolloutError, match="tokens: token ids must fit"):
            _row(tokens=tokens)
        return
    row = _row(tokens=tokens)
    assert row.tokens == tokens
    array = list_array(row, "tokens")
    assert array.dtype == np.int32 and array.tolist() == tokens


@SETTINGS
@given(st.lists(st.floats(width=64) | st.floats(width=32) | st.integers(-5, 5)))
def test_logprobs_rounding_and_range_rule_are_the_old_ones(logprobs):
    try:
        expected = _old_float32(logprobs)
    except ValueError:
        with pytest.raises(mmstore.InvalidRolloutError, match=r"logprobs: .*float32 range"):
            _row(tokens=[1] * len(logprobs), logprobs=logprobs)
        return
    row = _row(tokens=[1] * len(logprobs), logprobs=logprobs)
    assert _same_floats(row.logprobs, expected)
    assert all(type(v) is float for v in row.logprobs)
    array = list_array(row, "logprobs")
    assert array.dtype == np.float32 and _same_floats(array.tolist(), expected)


@SETTINGS
@given(st.floats(width=64) | st.floats(width=32) | st.integers(-(2**130), 2**130))
def test_scalar_float32_rule_is_the_old_one(value):
    try:
        [expected] = _old_float32([value])
    except (ValueError, OverflowError):
        with pytest.raises(mmstore.InvalidRolloutError, match="float32 range"):
            _row(reward=value)
        return
    assert _same_floats([_row(reward=value).reward], [expected])


@SETTINGS
@given(st.lists(st.booleans() | st.sampled_from([0, 1])))
def test_loss_mask_array_is_the_validated_mask(mask):
    row = _row(tokens=[1] * len(mask), loss_mask=mask)
    assert list_array(row, "loss_mask").tolist() == [bool(m) for m in mask] == row.loss_mask


def test_arrays_are_not_part_of_a_rows_value():
    row = _row(tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -2.0])
    assert row == _row(tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -2.0])
    assert row != _row(tokens=[5, 6, 8], logprobs=[-0.5, -1.0, -2.0])
    for other in (pickle.loads(pickle.dumps(row)), copy.deepcopy(row), row.model_copy()):
        assert other == row
        assert list_array(other, "tokens").tolist() == [5, 6, 7]
    # A pickle (a Ray or DataLoader transfer) carries the row, not a second copy of it.
    assert len(pickle.dumps(row)) < len(pickle.dumps(row.model_dump())) + 200
    with pytest.raises(ValueError, match="read-only"):
        list_array(row, "tokens")[0] = 9


@pytest.fixture
def written(store, adapter):
    """Write rows, return them as read back."""

    def write(rows):
        with store.writer(run_id="r", step=len(store.rollout_files())) as w:
            for row in rows:
                w.write(row)
        (path,) = [f.path for f in store.rollout_files()][-1:]
        table = pq.read_table(store.backend.abspath(path), partitioning=None)
        return [mmstore.Rollout(**r) for r in table.to_pylist()]

    return write


def test_lists_changed_after_validation_are_what_is_written(store, adapter, written):
    media = [store.put_media(image_bytes(1))]
    row = make_row(adapter, media, "a")
    row.loss_mask[-1] = False  # in place
    row.logprobs[0] = 0.1  # in place, not a float32 value: rounded as on construction
    row.tokens = [*row.tokens[:-1], 12345]  # replaced
    expected = mmstore.Rollout(**row.model_dump())
    (back,) = written([row])
    assert back == expected
    assert back.loss_mask[-1] is False and back.tokens[-1] == 12345
    assert back.logprobs[0] == float(np.float32(0.1))
    # model_copy(update=...) (truncate's way) shares the original's arrays: never used.
    short = mmstore.truncate(make_row(adapter, media, "b"), 20)
    assert written([short]) == [short]


def test_lists_broken_after_validation_are_refused(store, adapter):
    media = [store.put_media(image_bytes(1))]
    row = make_row(adapter, media, "a")
    row.tokens[row.images[0].offset] = 7  # in place, inside the image's span
    w = store.writer(run_id="r", step=0)
    with pytest.raises(mmstore.InvalidRolloutError, match="inside the span") as info:
        w.write(row)
    assert (info.value.sample_id, info.value.image_index) == ("a", 0)
    row = make_row(adapter, media, "b")
    row.tokens.append(2**40)  # past int32: typed, naming the sample (was an OverflowError)
    row.loss_mask.append(True)
    row.logprobs = None
    with pytest.raises(mmstore.InvalidRolloutError, match="int32") as info:
        w.write(row)
    assert info.value.sample_id == "b"
    w.commit()
    assert store.rollout_files() == []


def test_arrays_are_released_once_written_and_never_kept_by_reads(store, adapter, written):
    # The snapshots and arrays cost a third more memory than a row's lists: a row the
    # writer buffered, or one read back, does not keep them.
    row = make_row(adapter, [store.put_media(image_bytes(1))], "a")
    assert set(row._arrays.cached) == {"tokens", "loss_mask", "logprobs"}
    (back,) = written([row])
    assert row._arrays.cached == {} and back == row
    for read in (store.rollouts(), table_to_rollouts(pq.read_table(_part(store)))):
        assert read == [row] and read[0]._arrays.cached == {}


def _part(store):
    (stat,) = store.rollout_files()
    return store.backend.abspath(stat.path)
