"""Per-row planning facts of a snapshot, read without reading any token list.

The packed loader plans an epoch from three facts per row: its length (as the loader will
hand it over, i.e. after ``max_len`` truncation), how many images it keeps, and where GRPO
groups start. They come from the footer's ``mmstore.num_tokens`` (or, for a file without it,
the ``tokens`` list lengths), the ``group_id`` column and the ``images[].offset`` /
``images[].length`` leaf columns: a few integers and short strings per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmstore._format.schema import ROLLOUT_SCHEMA, decode_num_tokens
from mmstore._rows.files import distinct_field, image_leaf, media_leaf, open_rollout_file
from mmstore._rows.invariants import truncation_point
from mmstore._rows.snapshot import Snapshot
from mmstore._storage.store import Storage
from mmstore.errors import CorruptFileError, InvalidRolloutError

if TYPE_CHECKING:
    import pyarrow.parquet as pq


@dataclass(frozen=True)
class RowMeta:
    """Planning facts of every row of a snapshot, units in ``snapshot.units`` order.

    Row ``i`` of unit ``u`` is flat index ``unit_offsets[u] + i``.
    """

    unit_offsets: np.ndarray  # int64 [U + 1]
    lengths: np.ndarray  # int64 [N], tokens the loader hands over (after max_len)
    images: np.ndarray  # int64 [N], images kept
    block_start: np.ndarray  # bool [N], True where a run of one group_id starts
    #: with ``prefixes``: int64 [N], the leading tokens a row shares with the row before it
    #: in its block (tokens and images equal; 0 where a block starts)
    shared: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.lengths)


def read_row_meta(
    store: Storage, snapshot: Snapshot, max_len: int | None = None, *, prefixes: bool = False
) -> RowMeta:
    """The planning facts of ``snapshot``: one footer and three small columns per file
    (with ``prefixes``, the token lists too: what each row shares with the one before)."""
    per_file = {path: read_file_facts(store, path, max_len, prefixes=prefixes)
                for path in snapshot.files}  # fmt: skip
    lengths, images, starts, shared, offsets = [], [], [], [], [0]
    for unit in snapshot.units:
        facts = per_file[unit.file]
        lo = int(facts.row_starts[unit.row_group])
        hi = lo + unit.num_rows
        lengths.append(facts.lengths[lo:hi])
        images.append(facts.images[lo:hi])
        start = facts.block_start[lo:hi].copy()
        if len(start):
            start[0] = True  # a unit is read on its own: its first row starts a block
        starts.append(start)
        if facts.shared is not None:
            shared.append(np.where(start, 0, facts.shared[lo:hi]))
        offsets.append(offsets[-1] + hi - lo)
    return RowMeta(
        np.asarray(offsets, dtype=np.int64),
        np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        np.concatenate(images) if images else np.zeros(0, np.int64),
        np.concatenate(starts) if starts else np.zeros(0, bool),
        (np.concatenate(shared) if shared else np.zeros(0, np.int64)) if prefixes else None,
    )


@dataclass(frozen=True)
class FileFacts:
    """Planning facts of one committed file's rows, in file order, and the small columns
    asked for beside them (``columns``)."""

    meta: pq.FileMetaData
    row_starts: np.ndarray  # int64 [row groups + 1]: first row of each row group
    lengths: np.ndarray  # int64 [rows], tokens the loader hands over (after max_len)
    images: np.ndarray  # int64 [rows], images kept
    block_start: np.ndarray  # bool [rows], True where a run of one group_id starts
    columns: dict[str, pa.ChunkedArray]
    # The image and video layout fingerprints its refs name (read when asked: ``layouts``).
    layouts: frozenset[str] | None = None
    video_layouts: frozenset[str] | None = None
    shared: np.ndarray | None = None  # int64 [rows], with ``prefixes``: see RowMeta
    #: with ``prefixes``: what decides the prefix a row shares with any other row (the
    #: live loader compares rows of one trajectory committed in different files)
    prefix_keys: PrefixKeys | None = None


@dataclass(frozen=True)
class PrefixKeys:
    """What decides how many leading tokens two rows share: each row's first ``lengths``
    tokens, its image spans (offset, length, hash) and its first video's offset."""

    token_values: np.ndarray  # every row's tokens, end to end
    token_starts: np.ndarray  # int64 [rows + 1]: where each row's tokens start in them
    images: pa.ListArray
    first_video: np.ndarray  # int64 [rows], int64 max where a row has no video
    lengths: np.ndarray  # int64 [rows], tokens the loader hands over (after max_len)

    @classmethod
    def of(
        cls,
        tokens: pa.ChunkedArray,
        images: pa.ListArray,
        videos: pa.ChunkedArray | None,
        lengths: np.ndarray,
    ) -> PrefixKeys:
        listed = tokens.combine_chunks()
        return cls(
            listed.values.to_numpy(),
            listed.offsets.to_numpy().astype(np.int64),
            images,
            _first_offsets(videos, len(lengths)),
            lengths,
        )

    def row(self, i: int) -> tuple[np.ndarray, set[tuple[int, int, str]], int]:
        """Row ``i``'s tokens, image spans and first video offset."""
        start = int(self.token_starts[i])
        tokens = self.token_values[start : start + int(self.lengths[i])]
        return tokens, _spans(self.images[i]), int(self.first_video[i])


def shared_between(a: PrefixKeys, i: int, b: PrefixKeys, j: int) -> int:
    """The leading tokens row ``i`` of ``a`` and row ``j`` of ``b`` share."""
    return _common(a.row(i), b.row(j))


def _common(
    a: tuple[np.ndarray, set[tuple[int, int, str]], int],
    b: tuple[np.ndarray, set[tuple[int, int, str]], int],
) -> int:
    """Equal leading tokens, cut where an image span of either differs from the other's and
    at either's first video (a video's tokens are never shared)."""
    (a_tokens, a_spans, a_video), (b_tokens, b_spans, b_video) = a, b
    n = min(len(a_tokens), len(b_tokens), a_video, b_video)
    differ = np.flatnonzero(a_tokens[:n] != b_tokens[:n])
    common = int(differ[0]) if len(differ) else int(n)
    unmatched = [o for o, _, _ in a_spans ^ b_spans if o < common]
    return min([common, *unmatched])


def read_file_facts(
    store: Storage,
    path: str,
    max_len: int | None,
    columns: Sequence[str] = (),
    *,
    layouts: bool = False,
    prefixes: bool = False,
) -> FileFacts:
    """The planning facts of file ``path``: its footer and a few small columns (plus
    ``columns``; one the file lacks, a later-added optional column, reads as nulls; with
    ``layouts``, the layout fingerprints of its image and video refs, in the same read;
    with ``prefixes``, what each row shares with the row before it in its block)."""
    parquet = open_rollout_file(store, path)
    meta = parquet.metadata
    row_starts = np.zeros(meta.num_row_groups + 1, dtype=np.int64)
    np.cumsum([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], out=row_starts[1:])
    leaves = [image_leaf(parquet, "offset", file=path), image_leaf(parquet, "length", file=path)]
    video_leaf = None
    if layouts:
        video_leaf = media_leaf(parquet, "videos", "layout_fingerprint", file=path)
        leaves += [image_leaf(parquet, "layout_fingerprint", file=path)]
        leaves += [video_leaf] if video_leaf is not None else []
    lengths = decode_num_tokens(meta.metadata, meta.num_rows)
    if prefixes:
        leaves += [image_leaf(parquet, "hash", file=path)]
        video_offsets = media_leaf(parquet, "videos", "offset", file=path)
        leaves += [video_offsets] if video_offsets is not None else []
    with_tokens = lengths is None or prefixes
    wanted = ["group_id", *leaves, *columns] + (["tokens"] if with_tokens else [])
    try:
        # A few small columns: Arrow's thread pool costs more to wake than it saves here.
        table = parquet.read(columns=list(dict.fromkeys(wanted)), use_threads=False)
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f"unreadable rollout file: {exc}", file=path) from None
    if lengths is None:
        lengths = pc.list_value_length(table.column("tokens")).to_numpy().astype(np.int64)
    refs = table.column("images").combine_chunks()
    images = pc.list_value_length(refs).to_numpy(zero_copy_only=False).astype(np.int64)
    if max_len is not None:
        lengths, images = _truncated(parquet, path, lengths, images, refs, max_len)
    extra = {}
    for name in columns:
        if name in table.column_names:
            extra[name] = table.column(name)
        else:
            # (a declared column the file lacks has no type here: all nulls)
            kind = ROLLOUT_SCHEMA.field(name).type if name in ROLLOUT_SCHEMA.names else pa.null()
            extra[name] = pa.chunked_array([pa.nulls(meta.num_rows, kind)])
    image_layouts = video_layouts = None
    if layouts:
        image_layouts = _layouts(table, "images")
        video_layouts = _layouts(table, "videos") if video_leaf is not None else frozenset()
    block_start = _block_starts(table.column("group_id"))
    shared = keys = None
    if prefixes:
        videos = table.column("videos") if "videos" in table.column_names else None
        keys = PrefixKeys.of(table.column("tokens"), refs, videos, lengths)
        shared = shared_prefixes(keys, block_start)
    return FileFacts(
        meta,
        row_starts,
        lengths,
        images,
        block_start,
        extra,
        layouts=image_layouts,
        video_layouts=video_layouts,
        shared=shared,
        prefix_keys=keys,
    )


def shared_prefixes(keys: PrefixKeys, block_start: np.ndarray) -> np.ndarray:
    """For each row, how many leading tokens it shares with the row before it when both are
    in one block (:func:`shared_between`); 0 where a block starts."""
    shared = np.zeros(len(keys.lengths), dtype=np.int64)
    before: tuple[int, tuple[np.ndarray, set[tuple[int, int, str]], int]] | None = None
    for i in map(int, np.flatnonzero(~block_start)):
        previous = before[1] if before is not None and before[0] == i - 1 else keys.row(i - 1)
        current = keys.row(i)
        shared[i] = _common(current, previous)
        before = (i, current)
    return shared


def _spans(refs: pa.Scalar) -> set[tuple[int, int, str]]:
    values = refs.values
    if values is None or not len(values):
        return set()
    fields = [values.field(name).to_pylist() for name in ("offset", "length", "hash")]
    return set(zip(*fields, strict=True))


def _first_offsets(videos: pa.ChunkedArray | None, rows: int) -> np.ndarray:
    """Each row's first video offset (``int64`` max where it has none)."""
    first = np.full(rows, np.iinfo(np.int64).max, dtype=np.int64)
    if videos is None:
        return first
    listed = videos.combine_chunks()
    for i in range(rows):
        values = listed[i].values
        if values is not None and len(values):
            first[i] = min(values.field("offset").to_pylist())
    return first


def _layouts(table: pa.Table, column: str) -> frozenset[str]:
    """The layout fingerprints ``table``'s ``column`` refs name."""
    return frozenset(distinct_field(table.column(column), "layout_fingerprint").to_pylist())


def _truncated(
    parquet: pq.ParquetFile,
    path: str,
    lengths: np.ndarray,
    images: np.ndarray,
    refs: pa.ListArray,
    max_len: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and image counts after the loader's ``max_len`` cut (whole images kept)."""
    lengths, images = lengths.copy(), images.copy()
    for row in np.flatnonzero(lengths > max_len):  # only the long rows need their spans
        spans = refs[int(row)].values
        offsets = spans.field("offset").to_pylist() if spans is not None else []
        sizes = spans.field("length").to_pylist() if spans is not None else []
        cut, kept = truncation_point(offsets, sizes, int(lengths[row]), max_len)
        if cut == 0:
            sample_id = parquet.read(columns=["sample_id"]).column(0)[int(row)].as_py()
            raise InvalidRolloutError(
                f"max_len={max_len} cuts inside the first image; nothing would remain",
                file=path,
                sample_id=sample_id,
                image_index=0,
            )
        lengths[row], images[row] = cut, kept
    return lengths, images


def _block_starts(group_ids: pa.ChunkedArray) -> np.ndarray:
    """True where a row's group_id differs from the row before it (or is null)."""
    gids = group_ids.combine_chunks()
    n = len(gids)
    starts = np.ones(n, dtype=bool)
    if n > 1:
        same = pc.equal(gids[1:], gids[:-1]).fill_null(False)
        starts[1:] = ~same.to_numpy(zero_copy_only=False)
    return starts
