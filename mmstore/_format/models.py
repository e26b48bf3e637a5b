"""Pydantic models at the edges: one stored media file, one image ref, one rollout row.

Models validate what callers hand in; the hot read path works on Arrow columns directly and
never builds these objects.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from mmstore._format.columns import Column, check_name, column_values
from mmstore._format.schema import OPTIONAL_COLUMNS, ROLLOUT_SCHEMA
from mmstore.errors import InvalidRolloutError

HASH_PATTERN = r"^[0-9a-f]{32}$"
# A video ref names at most this many frames: a model's context holds a few thousand, and a
# forged ref must not make a reader decode a whole long clip.
MAX_REF_FRAMES = 4096
# A stored clip holds at most this many frames (about 9.7 hours at 30 fps): put_video and
# readers count a clip's frames by demuxing, and stop counting past it.
MAX_CLIP_FRAMES = 2**20
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
    """One content-addressed media file in a store: an image, or a video clip (``kind``),
    whose frame count and average frame rate ``put_video`` read from the container."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hash: str = Field(pattern=HASH_PATTERN)
    uri: str = Field(min_length=1)
    width: int = Field(gt=0, le=INT32_MAX)
    height: int = Field(gt=0, le=INT32_MAX)
    nbytes: int | None = Field(default=None, ge=0)
    kind: Literal["image", "video"] = "image"
    num_frames: int | None = Field(default=None, gt=0, le=INT32_MAX)
    fps: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _video_has_frames(self) -> MediaRef:
        if (self.kind == "video") != (self.num_frames is not None and self.fps is not None):
            raise ValueError("a video has num_frames and fps, an image neither")
        return self


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


class VideoRef(BaseModel):
    """One video of a rollout: the clip, the frames its tokens were laid out for, and the
    token span they fill (timestamps included where the family writes them).

    ``frames`` are indices in presentation order, strictly increasing, within the clip's
    ``num_frames``; a frame's timestamp is ``index / fps``, and the rate they were sampled at
    is ``len(frames) / num_frames * fps`` (transformers' ``VideoMetadata.sampled_fps``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str = Field(min_length=1)
    hash: str = Field(pattern=HASH_PATTERN)
    width: int = Field(gt=0, le=INT32_MAX)
    height: int = Field(gt=0, le=INT32_MAX)
    nbytes: int | None = Field(default=None, ge=0)
    num_frames: int = Field(gt=0, le=INT32_MAX)
    fps: float = Field(gt=0, allow_inf_nan=False)
    frames: tuple[int, ...] = Field(min_length=1, max_length=MAX_REF_FRAMES)
    offset: int = Field(ge=0, le=INT32_MAX)
    length: int = Field(gt=0, le=INT32_MAX)
    family: str = Field(min_length=1)
    layout_fingerprint: str = Field(min_length=1)

    @field_validator("frames", mode="before")
    @classmethod
    def _frame_list(cls, value: Any) -> Any:
        value = _to_list(value)  # numpy arrays and tensors of indices, as lists
        if not isinstance(value, list | tuple):
            raise ValueError(f"frames must be a list of frame indices, got {type(value).__name__}")
        return tuple(value)

    @model_validator(mode="after")
    def _frames_in_clip(self) -> VideoRef:
        frames = self.frames
        if any(b <= a for a, b in itertools.pairwise(frames)):
            raise ValueError("frames must be strictly increasing")
        if frames[0] < 0 or frames[-1] >= self.num_frames:
            raise ValueError(f"frames must lie within the clip's {self.num_frames} frames")
        return self

    def model_dump_row(self) -> dict[str, Any]:
        """The ref as its Arrow struct's values."""
        return {**self.model_dump(), "frames": list(self.frames)}

    @property
    def clip_key(self) -> tuple[Any, ...]:
        """Everything of the ref that decides the processed clip and that readers check the
        clip against: a cache keyed by it serves a ref pairing a cached clip's hash with
        another rate, frame count or size nothing (it misses, and is probed)."""
        return (self.hash, self.frames, self.num_frames, self.fps, self.width, self.height)


def _to_list(value: Any) -> Any:
    # numpy arrays and torch tensors arrive from rollout code; store them as plain lists.
    return value.tolist() if hasattr(value, "tolist") else value


# The store keeps float32; rounding on validation makes a Rollout equal itself after a round
# trip through Arrow, and refuses finite values that float32 would turn into infinity.
_FLOAT32 = struct.Struct("<f")


def _float32_array(values: list[float]) -> np.ndarray:
    return _float32_arrays(values)[1]


def _float32_arrays(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as float64 and rounded to float32, refusing finite values beyond float32."""
    wide = np.fromiter(values, dtype=np.float64, count=len(values))  # ~20% under asarray
    with np.errstate(over="ignore"):
        narrow = wide.astype(np.float32)
    if np.any(np.isinf(narrow) & np.isfinite(wide)):
        raise ValueError("value out of float32 range")
    return wide, narrow


def _as_float32(value: float) -> float:
    # One number: struct's C conversion (no numpy call, ~50x cheaper) rounds the same way
    # and raises OverflowError for a finite value beyond float32; inf and nan pass.
    try:
        return float(_FLOAT32.unpack(_FLOAT32.pack(value))[0])
    except OverflowError:
        raise ValueError("value out of float32 range") from None


def _int32_array(values: list[int]) -> np.ndarray:
    """Token ids as int32, refusing ids outside int32: numpy raises OverflowError for any
    Python int beyond the dtype, so one pass converts and checks (~25% under asarray)."""
    try:
        return np.fromiter(values, dtype=np.int32, count=len(values))
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None


# The dtype each per-token list is stored as (the Parquet schema's list element types).
LIST_DTYPES: dict[str, Any] = {"tokens": np.int32, "loss_mask": np.bool_, "logprobs": np.float32}


class _Arrays:
    """numpy arrays of a Rollout's per-token lists, made while validating them.

    Validation already converts ``tokens`` (range check) and ``logprobs`` (float32
    rounding) to numpy; the writer encodes exactly those arrays instead of converting the
    lists again (each conversion costs ~20 ns an element: most of a write). Each array is
    kept with a snapshot of the list it came from, and used only while the row's list still
    equals that snapshot (:func:`list_array`): a list replaced or changed in place after
    validation is converted afresh. Not part of a row's value: every ``_Arrays`` compares
    equal, and pickles and deep copies start empty. The writer releases them once it holds
    the arrays, and rows read back from a store never keep them.
    """

    __slots__ = ("cached",)

    def __init__(self) -> None:
        self.cached: dict[str, tuple[list[Any], np.ndarray]] = {}

    def keep(self, name: str, values: list[Any], array: np.ndarray) -> None:
        array.flags.writeable = False  # shared by every writer the row goes to
        self.cached[name] = (list(values), array)

    def release(self) -> None:
        """Drop the arrays and snapshots (a third more memory than the row's lists): once
        the writer holds the arrays, or for rows read back, which no writer needs."""
        self.cached.clear()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Arrays)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Arrays, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> _Arrays:
        return _Arrays()


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
    videos: list[VideoRef] = Field(default_factory=list)
    metadata: str | None = None
    # The policy (weights version) that generated the sample, for the live loader's
    # staleness bound; a multi-turn sample carries the oldest. None: unknown, never stale.
    policy_version: int | None = Field(default=None, ge=0, le=2**63 - 1)
    # The values of the extra columns its run declares (``store.writer(columns=...)``), by
    # name: per token an array-like of one value per token, per sample a value. Checked
    # and converted by the writer, which knows the declaration.
    columns: dict[str, Any] = Field(default_factory=dict)
    # A continuation: the sample is the first ``prefix_len`` tokens of sample ``parent_id``
    # (same run; written before it, in this commit or an earlier one) followed by what this
    # row holds (its tokens, masks, refs and per-token values are its own part). The writer
    # stores the whole sample; rows read back are whole, with neither set.
    parent_id: str | None = Field(default=None, min_length=1)
    prefix_len: int | None = Field(default=None, ge=0, le=INT32_MAX)
    _arrays: _Arrays = PrivateAttr(default_factory=_Arrays)
    _declared: dict[str, Column] = PrivateAttr(default_factory=dict)

    @property
    def declared_columns(self) -> dict[str, Column]:
        """The declaration of its columns, for a row read back from a store (else empty)."""
        return dict(self._declared)

    def __eq__(self, other: object) -> bool:
        # Column values may be numpy arrays, whose == is elementwise: compared by value.
        if not isinstance(other, Rollout):
            return NotImplemented
        mine, theirs = dict(self.__dict__), dict(other.__dict__)
        columns, other_columns = mine.pop("columns"), theirs.pop("columns")
        return mine == theirs and same_column_values(columns, other_columns)

    __hash__ = None  # type: ignore[assignment]  # mutable, as pydantic models are

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

    @field_validator("videos", mode="before")
    @classmethod
    def _videos(cls, value: Any) -> Any:
        if value is None:  # a file written before the column: no videos
            return []
        if isinstance(value, list | tuple) and any(isinstance(v, MediaRef) for v in value):
            raise ValueError(
                "got a MediaRef (what put_video returns), which has no token span: call "
                "expanded = adapter.expand_media(token_ids, videos=[media, ...]) and pass "
                "expanded.tokens and expanded.videos"
            )
        return value

    @field_validator("images", mode="before")
    @classmethod
    def _refs_not_media(cls, value: Any) -> Any:
        # The usual slip: the MediaRef that put_image returns has no token span yet.
        if isinstance(value, list | tuple) and any(isinstance(v, MediaRef) for v in value):
            raise ValueError(
                "got a MediaRef (what put_image returns), which has no token span: call "
                "tokens, refs = adapter.expand(token_ids, [media, ...]) and pass those refs "
                "(and tokens)"
            )
        return value

    @field_validator("columns", mode="before")
    @classmethod
    def _column_names(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, dict):
            for name, item in value.items():
                check_name(name)
                if item is None:
                    raise ValueError(f"column {name!r} has no value (None)")
        return value

    @field_validator("reward", "advantage")
    @classmethod
    def _float32_scalar(cls, value: float | None) -> float | None:
        return None if value is None else _as_float32(value)

    @model_validator(mode="after")
    def _continuation_pair(self) -> Rollout:
        if (self.parent_id is None) != (self.prefix_len is None):
            raise ValueError("a continuation gives both parent_id and prefix_len, or neither")
        if self.parent_id == self.sample_id:
            raise ValueError(f"sample {self.sample_id!r} cannot continue itself")
        return self

    @model_validator(mode="after")
    def _per_token_arrays(self) -> Rollout:
        # After pydantic's per-element checks, so that the arrays are built from validated
        # lists only; their errors name the field as pydantic's do.
        try:
            field = "tokens"
            self._arrays.keep(field, self.tokens, _int32_array(self.tokens))
            # Validated masks hold Python bools only, which bytes() packs one per byte (3x
            # faster than np.asarray; the fallback in list_array converts anything else).
            mask = np.frombuffer(bytes(self.loss_mask), dtype=np.bool_)
            self._arrays.keep("loss_mask", self.loss_mask, mask)
            if self.logprobs is not None:
                field = "logprobs"
                wide, narrow = _float32_arrays(self.logprobs)
                # Logprobs from a model are float32 already: then the validated list holds
                # exactly the rounded values, and rebuilding it (tolist) would change nothing.
                if not (wide == narrow).all():  # (a nan takes the tolist path: also right)
                    self.logprobs = narrow.tolist()
                self._arrays.keep(field, self.logprobs, narrow)
        except ValueError as exc:
            raise InvalidRolloutError(
                f"invalid rollout: {field}: {exc}", sample_id=self.sample_id
            ) from None
        return self

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


def list_array(rollout: Rollout, name: str) -> np.ndarray | None:
    """The per-token list ``name`` of ``rollout`` as a numpy array of its stored dtype.

    The array validation made when the list still equals what was validated (a list
    comparison: identical elements compare by identity, ~1 ns each); otherwise a fresh
    conversion with the same checks, raising :class:`InvalidRolloutError`.
    """
    values = getattr(rollout, name)
    if values is None:
        return None
    cached = rollout._arrays.cached.get(name)
    if cached is not None and type(values) is list and cached[0] == values:
        return cached[1]
    try:
        if name == "tokens":
            return _int32_array(values)
        if name == "logprobs":
            return _float32_array(values)
        return np.asarray(values, dtype=LIST_DTYPES[name])
    except (ValueError, TypeError) as exc:
        raise InvalidRolloutError(
            f"invalid rollout: {name}: {exc}", sample_id=rollout.sample_id
        ) from None


def released(rollout: Rollout) -> Rollout:
    """``rollout`` without its validation arrays (:meth:`_Arrays.release`)."""
    rollout._arrays.release()
    return rollout


def with_optional_columns(table: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """``table`` with the schema's later-added columns it lacks (an older file's) as nulls."""
    for name in OPTIONAL_COLUMNS:
        if name not in table.column_names:
            field = ROLLOUT_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def same_column_values(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows' column values are equal (arrays by value, dtype aside)."""
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def rollouts_to_table(rollouts: Iterable[Rollout]) -> pa.Table:
    """Rollouts as an Arrow table of the v1 schema."""
    for r in rollouts:
        if r.parent_id is not None:
            raise InvalidRolloutError(
                "a continuation becomes a row when a writer builds it whole (store.writer)",
                sample_id=r.sample_id,
            )
    rows = [{**r.model_dump(), "videos": [v.model_dump_row() for v in r.videos]} for r in rollouts]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def table_to_rollouts(
    table: pa.Table | pa.RecordBatch, columns: Mapping[str, Column] | None = None
) -> list[Rollout]:
    """Arrow rows (of the v1 schema) back as Rollouts, with the values of ``columns`` (a
    file's declaration; any other extra column ignored)."""
    names = [f.name for f in ROLLOUT_SCHEMA]
    table = with_optional_columns(table)
    rows = table.select(names).to_pylist()
    declared = dict(columns or {})
    extra = {n: column_values(table.column(n), c) for n, c in declared.items()}
    out = []
    for i, row in enumerate(rows):
        rollout = Rollout(**{k: row[k] for k in names}, columns={n: v[i] for n, v in extra.items()})
        rollout._declared = declared
        out.append(released(rollout))
    return out
