"""The reader's checks: committed rows are trusted only once checked.

Files in ``rollouts/`` may come from any Parquet engine, a copy or a rotting disk, so the
loader (and ``verify``) re-check every row it reads, with the writer's own span rule
(:func:`.invariants.check_spans`), before a row becomes tensors:

- the file's columns are cast to the v1 types (int64 tokens, large lists, another struct
  field order read correctly) or refused naming the file (:func:`conform`);
- each row's sizes are read from Arrow's list offsets before anything is converted: a row
  above :data:`MAX_ROW_TOKENS` or :data:`MAX_ROW_IMAGES` is refused, and ``max_len``
  truncation slices numpy views, so a forged row of millions of tokens costs no Python list;
- masks have the tokens' length, fields are in range, hashes are hex, image sizes are within
  the store's pixel limit (before any layout math or placeholder is computed), and the spans
  of every image hold exactly their family's expansion with no stray image token (the whole
  row, also where ``max_len`` keeps a part: a row refused whole is refused cut).

A bad row raises a typed :class:`MmstoreError` naming the file, run, step and sample (and
the image index where there is one); ``verify`` reports the same errors as problems.

A row that passes is a :class:`Sample`: the one record of a row on its way to the model,
first as numpy views with its image refs, then (:mod:`mmstore._loading.materialize`) as
torch tensors with its images' tensors.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmstore._families import (
    Family,
)
from mmstore._format.columns import Column, flat_values, footer_columns
from mmstore._format.models import ImageRef, VideoRef
from mmstore._format.schema import (
    FILE_COLUMN,
    ROLLOUT_SCHEMA,
    ROW_COLUMNS,
    check_schema_version,
)
from mmstore._rows.files import (
    conform,
    decode_every_page,
    where_of_file,
    with_declared_columns,
)
from mmstore._rows.invariants import check_spans, check_video_spans, truncation_point
from mmstore._rows.lookups import (
    FamilyOf,
    VideoFamilyOf,
    footer_checker,
    footer_video_checker,
    process_video_family,
)
from mmstore.errors import (
    InvalidRolloutError,
    MmstoreError,
)

# No model reads a row this long (the longest contexts are ~1M tokens); a forged row of a few
# KB of Parquet can claim far more, so the reader refuses it before building anything.
MAX_ROW_TOKENS = 2**22
# Real rows hold a handful of images, at most a few hundred (video frames).
MAX_ROW_IMAGES = 2**14

Array = TypeVar("Array")  # numpy views as checked; torch tensors once materialized
Image = TypeVar("Image")  # an ImageRef as checked; the image's tensors once materialized


@dataclass
class Sample(Generic[Array, Image]):
    """One training sample: a row that passed every check, cut to ``max_len``.

    :meth:`RowWindow.row` gives it as ``Sample[np.ndarray, ImageRef]`` (views of the window's
    columns, the kept refs); the loader's materializer turns it into ``Sample[torch.Tensor,
    ...]`` (its own tensors, each image's tensors in the train dtype), not yet padded.
    """

    sample_id: str
    group_id: str | None
    input_ids: Array  # int32 views [cut]; materialized: int64
    loss_mask: Array  # bool [cut]; materialized: zero where an image is missing
    logprobs: Array | None  # float32 [cut]
    prompt_len: int
    reward: float
    advantage: float
    images: list[Image]
    #: the row's videos: VideoRefs as checked; once materialized, each clip's tensors
    videos: list[Any] = field(default_factory=list)
    #: where the row came from: file, run_id, step, sample_id (what its errors name)
    where: dict[str, Any] = field(default_factory=dict)
    #: URIs of media found missing (the ``placeholder_zero_loss`` policy stood in for them)
    missing_uris: list[str] = field(default_factory=list)
    #: the policy version that generated the row (-1: unknown)
    policy_version: int = -1
    #: the extra columns asked for, by name: per token ``[cut, *shape]`` (Array), per
    #: sample a value (an Array of its shape, a number, a str)
    columns: dict[str, Any] = field(default_factory=dict)
    #: which of ``columns`` have a value per token
    token_columns: frozenset[str] = frozenset()
    #: materialized: each image's then each video's span (offset, length) and what makes
    #: its features equal another's: the image's hash ("" where nothing may share it: a
    #: placeholder for missing bytes, a video); prefix sharing compares these
    spans: list[tuple[int, int, str]] = field(default_factory=list)


class RowWindow:
    """The rows of one Arrow table (the v1 loader columns, optionally ``_file``), checked
    one at a time: :meth:`row` returns a :class:`Sample` or raises.

    Columns are turned into numpy once per window; per row only slices are taken, and
    Python objects are built only for the kept part of a row that passed.
    """

    def __init__(
        self,
        table: pa.Table,
        family_of: FamilyOf,
        *,
        max_pixels: int,
        max_len: int | None = None,
        image_token_ids: Iterable[int] = (),
        file: str | None = None,
        video_family_of: VideoFamilyOf | None = None,
    ) -> None:
        self.num_rows = table.num_rows
        self.family_of = family_of
        self.video_family_of = video_family_of or process_video_family
        self.max_pixels = max_pixels
        self.max_len = max_len
        self.image_token_ids = tuple(image_token_ids)
        self._file = file
        self._files = None
        if FILE_COLUMN in table.column_names:
            self._files = _codes(table.column(FILE_COLUMN).combine_chunks())
        self._file_wheres: dict[str | None, dict[str, Any]] = {}
        col = {name: table.column(name).combine_chunks() for name in ROW_COLUMNS}
        # One value per row: Python lists once a window are cheaper than a scalar per call.
        self._scalars = {
            name: col[name].to_pylist()
            for name in ("sample_id", "group_id", "prompt_len", "reward", "advantage")
        }
        self.tokens = _ListColumn(col["tokens"], np.int32)
        self.loss_mask = _ListColumn(col["loss_mask"], np.bool_)
        self.logprobs = _ListColumn(col["logprobs"], np.float32)
        self.images = _RefColumns(col["images"], max_pixels)
        self.videos = col["videos"]
        self._video_counts = pc.fill_null(pc.list_value_length(self.videos), 0).to_numpy(
            zero_copy_only=False
        )
        self._fields_ok = self._rows_fine(col)
        self._policy = _policy_versions(table)
        self._extra = _ExtraColumns(table)

    def _rows_fine(self, col: dict[str, Any]) -> np.ndarray:
        """Per row, vectorized over the window: True if :meth:`_check_fields` would pass
        (rows that are not are re-checked one by one, to say what is wrong)."""
        tokens, mask, logprobs = self.tokens, self.loss_mask, self.logprobs
        n = np.diff(tokens.offsets)
        prompt_len = pc.fill_null(col["prompt_len"], -1).to_numpy(zero_copy_only=False)
        has_id = pc.fill_null(pc.greater(pc.utf8_length(col["sample_id"]), 0), False)
        fine = (
            tokens.valid_rows
            & mask.valid_rows
            & (n <= MAX_ROW_TOKENS)
            & (np.diff(mask.offsets) == n)
            & (~logprobs.valid_rows | (np.diff(logprobs.offsets) == n))
            & (prompt_len >= 0)
            & (prompt_len <= n)
            & has_id.to_numpy(zero_copy_only=False)
        )
        if any(c.has_nulls for c in (tokens, mask, logprobs)):
            fine[:] = False  # rare: let the row-by-row check find which rows
        return fine

    def where(self, i: int, sample_id: Any = None) -> dict[str, Any]:
        """Where row ``i`` came from: its file, run, step and ``sample_id``."""
        file = self._file
        if self._files is not None:
            codes, names = self._files
            file = names[codes[i]]
        if file not in self._file_wheres:
            self._file_wheres[file] = where_of_file(file) if file is not None else {}
        return {**self._file_wheres[file], "sample_id": sample_id}

    def row(self, i: int) -> Sample[np.ndarray, ImageRef]:
        """Row ``i``, checked and cut; a typed error naming file, run, step and sample."""
        sid = self._scalars["sample_id"][i]
        where = self.where(i, sid)
        try:
            cut, lo, kept = self._check(i, sid)
            videos = self._checked_videos(i, cut) if self._video_counts[i] else []
        except MmstoreError as exc:
            raise exc.with_context(**where) from None
        s = self.tokens.start(i)
        logprobs = None
        if self.logprobs.valid(i):
            logprobs = self.logprobs.values[self.logprobs.start(i) :][:cut]
        scalar = self._scalars
        return Sample(
            sample_id=sid,
            group_id=scalar["group_id"][i],
            input_ids=self.tokens.values[s : s + cut],
            loss_mask=self.loss_mask.values[self.loss_mask.start(i) :][:cut],
            logprobs=logprobs,
            prompt_len=min(scalar["prompt_len"][i], cut),
            reward=_float(scalar["reward"][i]),
            advantage=_float(scalar["advantage"][i]),
            images=self.images.refs(lo, kept),
            videos=videos,
            where=where,
            policy_version=int(self._policy[i]),
            columns=self._extra.row(i, cut),
            token_columns=self._extra.per_token,
        )

    def check(self, i: int) -> None:
        """Only the checks of :meth:`row` (``verify``: nothing is built)."""
        sid = self._scalars["sample_id"][i]
        try:
            cut, _, _ = self._check(i, sid)
            if self._video_counts[i]:
                self._checked_videos(i, cut)
        except MmstoreError as exc:
            raise exc.with_context(**self.where(i, sid)) from None

    def _video_refs(self, i: int) -> list[VideoRef]:
        """Row ``i``'s video refs, validated (rows with videos are few: pydantic per ref)."""
        refs = []
        for index, value in enumerate(self.videos[i].as_py() or ()):
            try:
                refs.append(VideoRef.model_validate(value))
            except ValueError as exc:  # pydantic's ValidationError
                raise InvalidRolloutError(
                    f"invalid video ref: {_first_problem(exc)}", video_index=index
                ) from None
            ref = refs[-1]
            if ref.width * ref.height > self.max_pixels:
                raise InvalidRolloutError(
                    f"video frame size {ref.width}x{ref.height} exceeds the store's limit of "
                    f"{self.max_pixels} pixels",
                    video_index=index,
                )
        return refs

    def _checked_videos(self, i: int, cut: int) -> list[VideoRef]:
        """Row ``i``'s video refs, their spans checked against the whole row (as images'
        are), then those inside the first ``cut`` tokens (a row cut inside a video span was
        refused by :meth:`_check`)."""
        refs = self._video_refs(i)
        s, n = self.tokens.start(i), self.tokens.length(i)
        lo, hi = self.images.range(i)
        image_spans = list(zip(self.images.offset[lo:hi], self.images.length[lo:hi], strict=True))
        check_video_spans(
            self.tokens.values[s : s + n],
            refs,
            lambda index: self.video_family_of(refs[index].layout_fingerprint, refs[index].family),
            image_spans,
        )
        return [r for r in refs if r.offset + r.length <= cut]

    def _check(self, i: int, sid: Any) -> tuple[int, int, int]:
        """``(cut, first ref index, refs kept)`` of a row that passes; raises otherwise."""
        n = self._check_fields(i, sid)
        lo, hi = self.images.range(i)
        s = self.tokens.start(i)
        exempt = self._video_spans(i)
        # The whole row is checked, whatever max_len keeps of it: a row refused without
        # max_len is refused with it (a forged span past the cut is still a forged row).
        if lo == hi:  # text only: the span rule reduces to "no image token anywhere"
            check_spans(
                self.tokens.values[s : s + n],
                (),
                (),
                (),
                (),
                _none,
                self.image_token_ids,
                exempt=exempt,
            )
            return self._cut_before_videos(n, exempt), lo, 0
        if hi - lo > min(n, MAX_ROW_IMAGES):
            raise InvalidRolloutError(
                f"{hi - lo} images for {n} tokens: more than the tokens (or "
                f"{MAX_ROW_IMAGES}) can hold"
            )
        self.images.check_fields(lo, hi)
        offsets = self.images.offset[lo:hi]
        lengths = self.images.length[lo:hi]

        def family_of(index: int) -> Family:
            return self.family_of(*self.images.layout_of(lo + index))

        check_spans(
            self.tokens.values[s : s + n],
            offsets,
            lengths,
            self.images.width[lo:hi],
            self.images.height[lo:hi],
            family_of,
            self.image_token_ids,
            exempt=exempt,
        )
        if self.max_len is None:
            return n, lo, hi - lo
        cut, kept = truncation_point(offsets, lengths, n, self.max_len)
        if exempt:  # keep whole videos too: cut before one the cut would split
            cut = self._cut_before_videos(cut, exempt)
            kept = int(np.count_nonzero(offsets + lengths <= cut))
        if cut == 0:
            raise InvalidRolloutError(
                f"max_len={self.max_len} cuts inside the first image; nothing would remain",
                image_index=0,
            )
        return cut, lo, kept

    def _video_spans(self, i: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of row ``i``'s video refs, as stored (checked later)."""
        if not self._video_counts[i]:
            return []
        spans = []
        for index, ref in enumerate(self.videos[i].as_py() or ()):
            offset, length = (ref or {}).get("offset"), (ref or {}).get("length")
            if not isinstance(offset, int) or not isinstance(length, int) or offset < 0:
                raise InvalidRolloutError("video span is not a span of tokens", video_index=index)
            spans.append((offset, length))
        return spans

    def _cut_before_videos(self, cut: int, spans: Sequence[tuple[int, int]]) -> int:
        if self.max_len is not None:
            cut = min(cut, self.max_len)
        for offset, length in spans:
            if offset < cut < offset + length:
                if offset == 0:
                    raise InvalidRolloutError(
                        f"max_len={self.max_len} cuts inside the first video; nothing would remain",
                        video_index=0,
                    )
                return offset
        return cut

    def _check_fields(self, i: int, sid: Any) -> int:
        """The row's scalar fields and list lengths; returns its token count."""
        if self._fields_ok[i]:
            return self.tokens.length(i)
        if not isinstance(sid, str) or not sid:
            raise InvalidRolloutError(f"sample_id {sid!r} is not a non-empty string")
        if not self.tokens.valid(i) or not self.loss_mask.valid(i):
            raise InvalidRolloutError("tokens and loss_mask must not be null")
        n = self.tokens.length(i)
        if n > MAX_ROW_TOKENS:
            raise InvalidRolloutError(
                f"{n} tokens exceed the {MAX_ROW_TOKENS} any row may hold (a forged row?)"
            )
        for name, lists in (("loss_mask", self.loss_mask), ("logprobs", self.logprobs)):
            if lists.valid(i) and lists.length(i) != n:
                raise InvalidRolloutError(f"{name} has {lists.length(i)} entries for {n} tokens")
            if lists.valid(i) and lists.has_null(i):
                raise InvalidRolloutError(f"{name} holds nulls")
        if self.tokens.has_null(i):
            raise InvalidRolloutError("tokens hold nulls")
        prompt_len = self._scalars["prompt_len"][i]
        if prompt_len is None or not 0 <= prompt_len <= n:
            raise InvalidRolloutError(f"prompt_len {prompt_len} is not within the {n} tokens")
        return n


def _policy_versions(table: pa.Table) -> np.ndarray:
    """Each row's ``policy_version`` (-1 where unknown, or a table without the column)."""
    if "policy_version" not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    column = pc.fill_null(table.column("policy_version").combine_chunks(), -1)
    return column.to_numpy(zero_copy_only=False).astype(np.int64)


class _ExtraColumns:
    """The declared columns a reader asked for (:func:`with_declared_columns` appended
    them, checked, with the declaration in the schema's metadata), as numpy once per window:
    a row's values are slices."""

    def __init__(self, table: pa.Table) -> None:
        declared = footer_columns(table.schema.metadata, where={})
        self.per_token = frozenset(
            n for n, c in declared.items() if c.per == "token" and n in table.column_names
        )
        self._values: dict[str, tuple[Column, np.ndarray | list[Any], np.ndarray | None]] = {}
        for name, column in declared.items():
            if name not in table.column_names:
                continue
            array = table.column(name).combine_chunks()
            if column.dtype == "string":
                self._values[name] = (column, array.to_pylist(), None)
            elif column.per == "token":
                offsets = array.offsets.to_numpy()
                self._values[name] = (column, flat_values(array.values, column), offsets)
            else:
                self._values[name] = (column, flat_values(array, column), None)

    def row(self, i: int, cut: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (_, values, offsets) in self._values.items():
            if offsets is not None:  # per token: cut with the tokens
                start = int(offsets[i])
                out[name] = values[start : start + cut]
            else:
                out[name] = values[i]
        return out


def _none(index: int) -> Family:
    raise AssertionError("a row without images has no image family")


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)


class _ListColumn:
    """A list column as numpy offsets, validity and flat values (one conversion a window)."""

    def __init__(self, array: pa.ListArray, dtype: Any) -> None:
        self.offsets = array.offsets.to_numpy()
        self._valid = ~array.is_null().to_numpy(zero_copy_only=False)
        values = array.values
        self._value_nulls = None
        if values.null_count:
            self._value_nulls = values.is_null().to_numpy(zero_copy_only=False)
            values = pc.fill_null(values, pa.scalar(0, values.type))
        self.values = np.asarray(values.to_numpy(zero_copy_only=False), dtype=dtype)

    @property
    def valid_rows(self) -> np.ndarray:
        return self._valid

    @property
    def has_nulls(self) -> bool:
        return self._value_nulls is not None

    def valid(self, i: int) -> bool:
        return bool(self._valid[i])

    def start(self, i: int) -> int:
        return int(self.offsets[i])

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def has_null(self, i: int) -> bool:
        if self._value_nulls is None:
            return False
        return bool(self._value_nulls[self.offsets[i] : self.offsets[i + 1]].any())


_HASH_REGEX = "^[0-9a-f]{32}$"
_REF_STRINGS = ("uri", "hash", "family", "layout_fingerprint")


class _RefColumns:
    """The ``images`` column flattened: numpy ints, per-ref validity, strings kept in Arrow."""

    def __init__(self, array: pa.ListArray, max_pixels: int) -> None:
        self.offsets = array.offsets.to_numpy()
        self._valid_list = ~array.is_null().to_numpy(zero_copy_only=False)
        refs = array.values
        self._fields = {name: pc.struct_field(refs, name) for name in IMAGE_FIELDS}
        ints = {}
        for name in ("offset", "length", "width", "height"):
            # A null (or a null ref) reads as -1: never a valid offset, length or size.
            ints[name] = pc.fill_null(self._fields[name], -1).to_numpy().astype(np.int64)
        self.offset, self.length = ints["offset"], ints["length"]
        self.width, self.height = ints["width"], ints["height"]
        self._problem = self._problems(max_pixels)
        self._layouts: tuple[tuple[np.ndarray, list[Any]], ...] | None = None

    def _problems(self, max_pixels: int) -> np.ndarray:
        """Per ref: 0 if its fields are fine, else 1 + the index of its first failed check."""
        size_ok = (self.width > 0) & (self.height > 0)
        hash_ok = pc.fill_null(pc.match_substring_regex(self._fields["hash"], _HASH_REGEX), False)
        failed = [
            (self.offset < 0) | (self.length <= 0),
            ~size_ok,
            size_ok & (self.width * self.height > max_pixels),
            ~hash_ok.to_numpy(zero_copy_only=False),
            *(self._fields[n].is_null().to_numpy(zero_copy_only=False) for n in _REF_STRINGS),
        ]
        problem = np.zeros(len(self.offset), dtype=np.int8)
        for code in range(len(failed), 0, -1):  # the first failed check wins
            problem[failed[code - 1]] = code
        self._max_pixels = max_pixels
        return problem

    def range(self, i: int) -> tuple[int, int]:
        if not self._valid_list[i]:
            raise InvalidRolloutError("images must be a list, not null")
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def check_fields(self, lo: int, hi: int) -> None:
        bad = np.flatnonzero(self._problem[lo:hi])
        if not bad.size:
            return
        j = lo + int(bad[0])
        o, n, w, h = (int(a[j]) for a in (self.offset, self.length, self.width, self.height))
        messages = [
            f"span [{o}, {o + n}) is not a span of tokens",
            f"image size {w}x{h} is not positive",
            f"image size {w}x{h} exceeds the store's limit of {self._max_pixels} pixels",
            f"hash {self._fields['hash'][j].as_py()!r} is not 32 lowercase hex digits",
            *(f"image {name} is null" for name in _REF_STRINGS),
        ]
        raise InvalidRolloutError(messages[self._problem[j] - 1], image_index=int(bad[0]))

    def layout_of(self, j: int) -> tuple[str, str]:
        if self._layouts is None:  # few distinct values: codes, not a string per ref
            self._layouts = (
                _codes(self._fields["layout_fingerprint"]),
                _codes(self._fields["family"]),
            )
        (fp_codes, fps), (family_codes, families) = self._layouts
        return fps[fp_codes[j]], families[family_codes[j]]

    def hashes(self) -> list[str]:
        """Every ref's hash, in row order (a null one left out: its row fails its check)."""
        return [h for h in self._fields["hash"].to_pylist() if isinstance(h, str)]

    def refs(self, lo: int, kept: int) -> list[ImageRef]:
        """The kept refs as ImageRefs, built without validation (every field was checked)."""
        if not kept:
            return []
        columns = {name: self._fields[name][lo : lo + kept].to_pylist() for name in IMAGE_FIELDS}
        return [
            ImageRef.model_construct(**{name: columns[name][k] for name in IMAGE_FIELDS})
            for k in range(kept)
        ]


def _codes(array: pa.Array) -> tuple[np.ndarray, list[Any]]:
    """A string column as (per-row codes, distinct values): few values, many rows."""
    encoded = pc.dictionary_encode(array)
    codes = pc.fill_null(encoded.indices, 0).to_numpy(zero_copy_only=False)
    return codes, encoded.dictionary.to_pylist() or [None]


IMAGE_FIELDS = tuple(f.name for f in ROLLOUT_SCHEMA.field("images").type.value_type)


def read_checked(
    parquet: pq.ParquetFile,
    path: str,
    *,
    max_pixels: int,
    sample_ids: Collection[str] | None = None,
) -> pa.Table:
    """The rows of an opened committed file (those with ``sample_ids``, if given) as the
    loader trusts them: every page checked against its CRC and value counts
    (:func:`decode_every_page`), columns cast to the v1 types, then each row through the
    loader's checks and bounds (families as :func:`footer_checker` finds them). The first
    bad row raises its typed error naming the file, run, step and sample; no row becomes a
    Python object before.

    For readers without a processor: read-back, export, ``debug``. The columns are the
    loader's and whichever other v1 columns the file has.
    """
    check_schema_version(parquet.metadata.metadata, where=path)
    raw = decode_every_page(parquet, path)
    names = [n for n in ROLLOUT_SCHEMA.names if n in ROW_COLUMNS or n in raw.column_names]
    table = conform(raw, names, file=path)
    declared = footer_columns(parquet.metadata.metadata, where=where_of_file(path))
    table = with_declared_columns(table, raw, declared, file=path)
    if sample_ids is not None:  # Arrow filtering builds no row
        wanted = pa.array(sorted(sample_ids), pa.string())
        table = table.filter(pc.is_in(table.column("sample_id"), wanted))
    family_of, token_ids = footer_checker(parquet.metadata.metadata)
    window = RowWindow(
        table,
        family_of,
        max_pixels=max_pixels,
        image_token_ids=token_ids,
        file=path,
        video_family_of=footer_video_checker(parquet.metadata.metadata),
    )
    for i in range(window.num_rows):
        window.check(i)
    return table


def _first_problem(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        err = errors()[0]
        return f"{'.'.join(str(p) for p in err['loc']) or 'ref'}: {err['msg']}"
    return str(exc)
