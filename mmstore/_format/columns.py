"""Extra columns a run declares: the per-token side streams RL losses read (reference-model
logprobs, per-token advantages or loss weights, top-k teacher logprobs, MoE routed experts)
and per-sample values (a difficulty, a judge's score, an environment name).

A declaration is a name and a :class:`Column`: one value per token or per sample, of a
dtype, each value an array of a fixed ``shape`` (``()`` a scalar; top-32 logprob ids
``(32,)``; routed experts of 60 layers x 8 ``(60, 8)``). The writer takes it
(``store.writer(run_id, step, columns={...})``), records it for the run
(``runs/<run_id>/columns.json``) and in each file's footer (``mmstore.columns``), and
refuses any later file of the run that declares otherwise. On disk a per-token column is a
Parquet list (one entry per token) of the value type, a per-sample column the value type;
a shaped value is a fixed-size list of its flattened elements (row-major), so every
Parquet engine reads it, and the table's Delta schema carries it typed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmstore._format.schema import FILE_COLUMN, ROLLOUT_SCHEMA
from mmstore.errors import InvalidArgumentError, InvalidRolloutError

Per = Literal["token", "sample"]
# Value types a column may hold: those Delta Lake has (no unsigned ints, no float16: Delta
# engines must read them typed) and torch has tensors of; strings per sample only (no
# tensor: a list in the batch).
DTYPES = {
    "bool": pa.bool_(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "string": pa.string(),
}
NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Names the row, the table and the batches already use: a column may not shadow them.
RESERVED = frozenset(
    [
        *ROLLOUT_SCHEMA.names,
        "run_id",
        "step",
        FILE_COLUMN,
        "input_ids",
        "attention_mask",
        "position_ids",
        "labels",
        "sample_ids",
        "group_ids",
        "rewards",
        "advantages",
        "policy_versions",
    ]
)
META_COLUMNS = b"mmstore.columns"  # a file's declaration, JSON (see Column.record)
MAX_VALUE_ELEMENTS = 1 << 16  # elements of one value: routed experts are a few hundred


@dataclass(frozen=True)
class Column:
    """One extra column: a value per token or per sample, of ``dtype``, each of ``shape``."""

    per: Per
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.per not in ("token", "sample"):
            raise InvalidArgumentError(f"a column is per 'token' or 'sample', not {self.per!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(
                f"column dtype {self.dtype!r} is not one of {sorted(DTYPES)}"
            )
        shape = self.shape
        if not isinstance(shape, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
        ):
            raise InvalidArgumentError(f"column shape must be positive ints, got {shape!r}")
        if math.prod(shape) > MAX_VALUE_ELEMENTS:
            raise InvalidArgumentError(
                f"column shape {shape} holds over {MAX_VALUE_ELEMENTS} elements a value"
            )
        if self.dtype == "string" and (self.per == "token" or shape):
            raise InvalidArgumentError("string columns are per sample and unshaped")

    @property
    def value_type(self) -> pa.DataType:
        """The Arrow type of one value (a token's or the sample's)."""
        # A shaped value is a plain list of its elements, not a fixed-size one: Delta has
        # no fixed-size arrays, and an engine reading the table (polars) refuses a file
        # whose type differs from the table's. The declaration keeps the shape.
        scalar = DTYPES[self.dtype]
        return pa.list_(scalar) if self.shape else scalar

    @property
    def arrow_type(self) -> pa.DataType:
        """The column's Arrow type: a list of values per row for a per-token column."""
        return pa.list_(self.value_type) if self.per == "token" else self.value_type

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return np.dtype(object if self.dtype == "string" else self.dtype)

    def record(self) -> dict[str, Any]:
        return {"per": self.per, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_record(cls, record: Any) -> Column:
        if not isinstance(record, dict) or set(record) != {"per", "dtype", "shape"}:
            raise ValueError(f"not a column record: {record!r}")
        return cls(record["per"], record["dtype"], tuple(record["shape"]))


def per_token(dtype: str, shape: tuple[int, ...] = ()) -> Column:
    """A column with one value per token (of ``shape``): ``per_token("float32")`` for
    reference logprobs, ``per_token("int16", (60, 8))`` for routed experts."""
    return Column("token", dtype, tuple(shape))


def per_sample(dtype: str, shape: tuple[int, ...] = ()) -> Column:
    """A column with one value per sample (of ``shape``): ``per_sample("float32")``."""
    return Column("sample", dtype, tuple(shape))


def declared(columns: Mapping[str, Column | str] | None) -> dict[str, Column]:
    """A writer's ``columns=``, checked: names and declarations (a bare dtype string is a
    per-sample scalar)."""
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise InvalidArgumentError(f"columns must be a mapping of name to column, got {columns!r}")
    out = {}
    for name, column in columns.items():
        check_name(name)
        if isinstance(column, str):
            column = per_sample(column)
        if not isinstance(column, Column):
            raise InvalidArgumentError(
                f"column {name!r}: give mmstore.per_token(...) or mmstore.per_sample(...), "
                f"got {column!r}"
            )
        out[name] = column
    return dict(sorted(out.items()))


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidArgumentError(
            f"column name {name!r} must match {NAME.pattern} (a Parquet column, a batch key)"
        )
    if name in RESERVED:
        raise InvalidArgumentError(f"column name {name!r} is taken by the row or the batch")


def encode(columns: Mapping[str, Column]) -> bytes:
    return json.dumps({n: c.record() for n, c in sorted(columns.items())}, sort_keys=True).encode()


def decode(raw: bytes | None, *, where: Mapping[str, Any]) -> dict[str, Column]:
    """A footer's or a run record's declaration (none: ``{}``); a damaged one is refused."""
    if raw is None:
        return {}
    try:
        parsed = json.loads(raw)
        return {str(n): Column.from_record(r) for n, r in dict(parsed).items()}
    except (ValueError, TypeError, InvalidArgumentError) as exc:
        raise InvalidRolloutError(f"damaged column declaration: {exc}", **where) from None


def footer_columns(
    metadata: Mapping[bytes, bytes] | None, *, where: Mapping[str, Any]
) -> dict[str, Column]:
    return decode((metadata or {}).get(META_COLUMNS), where=where)


def value_array(column: Column, value: Any, num_tokens: int) -> np.ndarray:
    """A row's value of ``column`` as the array stored (``[num_tokens, *shape]`` per token,
    ``shape`` per sample), or ``ValueError`` saying what is wrong."""
    if column.dtype == "string":
        if not isinstance(value, str):
            raise ValueError(f"a string, got {type(value).__name__}")
        return np.asarray(value, dtype=object)
    array = np.asarray(value)
    expected = ((num_tokens,) if column.per == "token" else ()) + column.shape
    if array.shape != expected:
        unit = f"{num_tokens} tokens" if column.per == "token" else "the sample"
        raise ValueError(f"shape {array.shape}, not {expected} ({unit}, values of {column.shape})")
    target = column.numpy_dtype
    if array.dtype != target and not np.can_cast(array.dtype, target, "same_kind"):
        raise ValueError(f"{array.dtype} values do not fit {column.dtype}")
    return array.astype(target, copy=False)


def column_values(chunked: pa.ChunkedArray | pa.Array, column: Column) -> list[Any]:
    """Each row's value of a stored ``column``: per token an array ``[tokens, *shape]``, per
    sample a scalar (an array of ``shape``, a str); None for a null row."""
    array = chunked.combine_chunks() if isinstance(chunked, pa.ChunkedArray) else chunked
    if column.dtype == "string":
        return list(array.to_pylist())
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    if column.per == "token":
        list_array = array.cast(column.arrow_type)
        offsets = list_array.offsets.to_numpy()
        values = flat_values(list_array.values, column)
        return [
            None if nulls[i] else values[offsets[i] : offsets[i + 1]] for i in range(len(array))
        ]
    values = flat_values(array.cast(column.value_type), column)
    return [None if nulls[i] else values[i] for i in range(len(array))]


def flat_values(values: pa.Array, column: Column) -> np.ndarray:
    """Values of ``column`` (one per token or sample) as ``[n, *shape]`` numpy."""
    if column.shape:  # each value's element count checked first (stored_column)
        values = values.flatten()
    out = values.to_numpy(zero_copy_only=False).astype(column.numpy_dtype, copy=False)
    return out.reshape(-1, *column.shape)


def column_array(values: list[np.ndarray], column: Column) -> pa.Array:
    """Rows' checked values (:func:`value_array`) as the column's Arrow array."""
    if column.dtype == "string":
        return pa.array([str(v) for v in values], pa.string())
    if column.per == "sample":
        flat = np.stack(values).reshape(-1) if values else np.empty(0, column.numpy_dtype)
        return _values(flat, column)
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    empty = np.empty(0, column.numpy_dtype)
    flat = np.concatenate([v.reshape(-1) for v in values]) if values else empty
    return pa.ListArray.from_arrays(
        pa.array(offsets), _values(flat, column), type=column.arrow_type
    )


def _values(flat: np.ndarray, column: Column) -> pa.Array:
    scalars = pa.array(flat, type=DTYPES[column.dtype])
    if not column.shape:
        return scalars
    size = math.prod(column.shape)
    offsets = pa.array(np.arange(0, len(flat) + 1, size, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, scalars, type=column.value_type)


def stored_column(
    array: pa.ChunkedArray | pa.Array, column: Column, num_tokens: np.ndarray
) -> tuple[pa.Array, int | None, str]:
    """A file's ``column`` cast to its declared type and checked row by row against the
    rows' token counts: the array, and the first bad row's index and problem (None, "")."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    try:
        array = array.cast(column.arrow_type)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        return array, 0, f"stored as {array.type}, not the declared {column.arrow_type} ({exc})"
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    if nulls.any():
        return array, int(np.flatnonzero(nulls)[0]), "no value (null)"
    if column.per == "token":
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != num_tokens)
        if len(wrong):
            i = int(wrong[0])
            return array, i, f"{int(lengths[i])} values for {int(num_tokens[i])} tokens"
        values = array.values
    else:
        values = array
    if column.shape and len(values):
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != math.prod(column.shape))
        if len(wrong):
            row = int(wrong[0]) if column.per == "sample" else _row_of(array, int(wrong[0]))
            return array, row, f"a value of {int(lengths[wrong[0]])} elements, not {column.shape}"
    return array, None, ""


def _row_of(array: pa.ListArray, value_index: int) -> int:
    return int(np.searchsorted(array.offsets.to_numpy(), value_index, side="right")) - 1
