"""Pydantic models at the edges: one stored media file, one image ref, one rollout row.

Models validate what callers hand in; the hot read path works on Arrow columns directly and
never builds these objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._exceptions import InvalidRolloutError
from ._schema import ROLLOUT_SCHEMA

HASH_PATTERN = r"^[0-9a-f]{32}$"
INT32_MAX = 2**31 - 1

# Keys of dense multimodal tensors that trainers ship around; a rollout never carries them.
DENSE_KEYS = frozenset(
    {
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "image_embeds",
        "multi_modal_inputs",
        "multi_modal_data",
    }
)


class MediaRef(BaseModel):
    """One content-addressed media file in a store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hash: str = Field(pattern=HASH_PATTERN)
    uri: str = Field(min_length=1)
    width: int = Field(gt=0, le=INT32_MAX)
    height: int = Field(gt=0, le=INT32_MAX)
    nbytes: int | None = Field(default=None, ge=0)


class ImageRef(BaseModel):
    """One image of a rollout: where its bytes are, and the token span it fills."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str = Field(min_length=1)
    hash: str = Field(pattern=HASH_PATTERN)
    width: int = Field(gt=0, le=INT32_MAX)
    height: int = Field(gt=0, le=INT32_MAX)
    nbytes: int | None = Field(default=None, ge=0)
    offset: int = Field(ge=0, le=INT32_MAX)
    length: int = Field(gt=0, le=INT32_MAX)
    family: str = Field(min_length=1)
    layout_fingerprint: str = Field(min_length=1)
    payload: str | None = None


def _to_list(value: Any) -> Any:
    # numpy arrays and torch tensors arrive from rollout code; store them as plain lists.
    return value.tolist() if hasattr(value, "tolist") else value


def _as_float32(values: list[float]) -> list[float]:
    # The store keeps float32; rounding here makes a Rollout equal itself after a round trip
    # through Arrow, and refuses finite values that float32 would turn into infinity.
    wide = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        narrow = wide.astype(np.float32)
    if np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise ValueError("value out of float32 range")
    return narrow.tolist()


class Rollout(BaseModel):
    """One training sample: tokens, masks, signals and image refs (never pixels).

    Construction failures raise :class:`InvalidRolloutError` naming the sample.
    """

    model_config = ConfigDict(extra="forbid")

    sample_id: str = Field(min_length=1)
    group_id: str | None = None
    tokens: list[int]
    prompt_len: int = Field(ge=0, le=INT32_MAX)
    loss_mask: list[bool]
    logprobs: list[float] | None = None
    reward: float | None = None
    advantage: float | None = None
    images: list[ImageRef] = Field(default_factory=list)
    metadata: str | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid_rollout(exc, data) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Rollout:
        """Like pydantic's, but failures are :class:`InvalidRolloutError` as in ``__init__``."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise _invalid_rollout(exc, obj) from None

    @model_validator(mode="before")
    @classmethod
    def _refuse_dense_tensors(cls, data: Any) -> Any:
        if isinstance(data, dict):
            dense = sorted(DENSE_KEYS & data.keys())
            if dense:
                raise ValueError(
                    f"dense multimodal tensors {dense} beside image refs are refused: rows "
                    "carry refs, pixels are materialized by the reader"
                )
        return data

    @field_validator("tokens", "loss_mask", "logprobs", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _to_list(value)

    @field_validator("tokens")
    @classmethod
    def _int32_tokens(cls, value: list[int]) -> list[int]:
        if value and (min(value) < -(2**31) or max(value) > INT32_MAX):
            raise ValueError("token ids must fit in int32")
        return value

    @field_validator("reward", "advantage")
    @classmethod
    def _float32_scalar(cls, value: float | None) -> float | None:
        return None if value is None else _as_float32([value])[0]

    @field_validator("logprobs")
    @classmethod
    def _float32_list(cls, value: list[float] | None) -> list[float] | None:
        return None if value is None else _as_float32(value)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_json(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, default=str)


def _invalid_rollout(exc: ValidationError, data: Any) -> InvalidRolloutError:
    for err in exc.errors():  # model_validate runs __init__: keep its error, unwrapped
        if isinstance(original := err.get("ctx", {}).get("error"), InvalidRolloutError):
            return original
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'row'}: {err['msg']}" for err in exc.errors()[:5]
    )
    sample_id = data.get("sample_id") if isinstance(data, dict) else None
    return InvalidRolloutError(f"invalid rollout: {problems}", sample_id=sample_id)


def rollouts_to_table(rollouts: Iterable[Rollout]) -> pa.Table:
    """Rollouts as an Arrow table of the v1 schema."""
    rows = [r.model_dump() for r in rollouts]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def table_to_rollouts(table: pa.Table | pa.RecordBatch) -> list[Rollout]:
    """Arrow rows (of the v1 schema, any extra columns ignored) back as Rollouts."""
    names = [f.name for f in ROLLOUT_SCHEMA]
    return [Rollout(**{k: row[k] for k in names}) for row in table.select(names).to_pylist()]
