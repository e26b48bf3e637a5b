"""The rollout writer: validated rows -> one Parquet file, visible once the rollouts table
commits it.

A commit stages the file, fsyncs it, renames it into ``rollouts/run_id=…/step=…/`` and then
adds it to the table in one Delta transaction (path, partition values, size, row count). A
process killed between the rename and the transaction leaves a file no version lists: an
orphan, never read, that gc removes after the grace period.

Rows are checked against every invariant (and their media must exist) as they are
written; a refused row raises and leaves the writer, and the store, as they were. Row groups
are encoded as they fill (each on a thread beside the writer's, see :class:`_Encoding`), so
memory holds compressed bytes, not Python rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import uuid
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._families import (
    Family,
    Layout,
    known_layouts,
    layout_for_fingerprint,
    layout_from_record,
    special_token_ids,
    video_half,
)
from mmstore._format.columns import (
    META_COLUMNS,
    Column,
    column_array,
    declared,
    encode,
    value_array,
)
from mmstore._format.models import (
    LIST_DTYPES,
    ImageRef,
    Rollout,
    VideoRef,
    list_array,
    released,
)
from mmstore._format.paths import check_partition, check_producer, part_path
from mmstore._format.schema import ROLLOUT_SCHEMA, file_metadata
from mmstore._rows.continuation import Row, whole
from mmstore._rows.invariants import check_rollout
from mmstore._rows.readback import read_rollouts
from mmstore._rows.runs import (
    column_mismatch,
    record_columns,
    record_layouts,
    run_columns,
    run_layouts,
)
from mmstore._rows.table import CommitResult, TableFile
from mmstore._rows.versions import commit_files, table_of
from mmstore._storage.store import Storage
from mmstore.errors import InvalidArgumentError, InvalidRolloutError, NoMatchError

log = logging.getLogger("mmstore")

# Rows are a few KB to a few hundred KB; 128 rows keep row groups (the unit of work the
# loader shards) fine-grained while pages stay large enough for zstd.
DEFAULT_ROW_GROUP_SIZE = 128

# Encodings, chosen by measurement: `python -m benchmarks.bench_write --scale 2` prints this
# table for 512 realistic rows (3.6k tokens, 2 image refs, GRPO groups of 8, Zipf text,
# completion logprobs; 15 MB as Arrow) in row groups of 128. Bytes are exact; times are the
# median of 9 runs on a busy 2-core VM:
#   snappy, dictionary on (pq.write_table default)   3.96 MB  76 ms
#   zstd, dictionary on every column                 3.50 MB  82 ms
#   zstd, dictionary off                             2.43 MB  73 ms
#   + logprobs BYTE_STREAM_SPLIT                     2.30 MB  52 ms  <- chosen
#   + tokens DELTA_BINARY_PACKED instead             3.06 MB  53 ms
#   + tokens BYTE_STREAM_SPLIT as well               2.15 MB  50 ms  (splitting INT32 is a 2024
#                                                                     addition to the Parquet
#                                                                     format: older readers fail)
# Per column a dictionary never wins under zstd: tokens 949 vs 796 KB, logprobs 2.52 vs
# 1.60 MB; the strings repeated within a GRPO group (group_id, image uri/hash) are 0.5-4 KB
# either way, since zstd finds those repeats inside a row group by itself. zstd level 1
# (pyarrow's default) was as small as level 3 and faster.
DICTIONARY_COLUMNS: list[str] = []
COLUMN_ENCODING = {"logprobs.list.element": "BYTE_STREAM_SPLIT"}
ZSTD_LEVEL = 1
# Min/max statistics only where a predicate can use them; list columns get none.
STATISTICS_COLUMNS = ["sample_id", "group_id", "prompt_len", "reward", "advantage"]
# A CRC-32 of every page, checked on every read (open_rollout_file): a flipped bit in a page
# becomes a CorruptFileError instead of different tokens. Readers that ignore checksums
# (older pyarrow, other engines) read the files as before.
PAGE_CHECKSUMS = True


def parquet_options(extra: Mapping[str, Column] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``pyarrow.parquet.ParquetWriter`` for rollout files (with the
    run's ``extra`` columns: their float values byte-stream split as ``logprobs`` are,
    measured by ``benchmarks/bench_columns.py``: top-32 logprobs 0.90x -> 0.79x of raw)."""
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": DICTIONARY_COLUMNS or False,
        "column_encoding": {**COLUMN_ENCODING, **_split_floats(extra or {})},
        "write_statistics": STATISTICS_COLUMNS,
        "write_page_checksum": PAGE_CHECKSUMS,
    }


def _split_floats(extra: Mapping[str, Column]) -> dict[str, str]:
    """The float columns' leaf paths -> BYTE_STREAM_SPLIT (floats only: splitting ints is
    a 2024 addition to Parquet that older readers fail on)."""
    out = {}
    for name, column in extra.items():
        if column.dtype.startswith("float"):
            leaf = ".".join(
                [name, *["list.element"] * ((column.per == "token") + bool(column.shape))]
            )
            out[leaf] = "BYTE_STREAM_SPLIT"
    return out


_FIELDS = tuple(ROLLOUT_SCHEMA.names)  # once: iterating a schema builds Field objects
# (store root, declaration) whose columns this process has seen in the table's schema.
_TABLE_COLUMNS: set[tuple[str, bytes]] = set()


def _buffered(rollout: Rollout) -> dict[str, Any]:
    """One accepted row as the writer buffers it."""
    row = {name: getattr(rollout, name) for name in _FIELDS}
    # The long per-token lists are kept as numpy arrays from write to flush: several times
    # smaller than Python lists, and turned into Arrow lists without a per-element Python
    # loop (model_dump + Table.from_pylist took 2.5x as long). They are the arrays the
    # Rollout's validation already made (read-only, so no caller can change them after
    # write), not a second conversion of the lists: that was a third of a write's time.
    for name in LIST_DTYPES:
        row[name] = list_array(rollout, name)
    row["images"] = [ref.model_dump() for ref in rollout.images]
    row["videos"] = [ref.model_dump_row() for ref in rollout.videos]
    return row


def _table(rows: list[dict[str, Any]], extra: Mapping[str, Column]) -> pa.Table:
    """Buffered rows as an Arrow table of the v1 schema and the ``extra`` columns the run
    declares, column by column."""
    columns = []
    for field in ROLLOUT_SCHEMA:
        values = [row[field.name] for row in rows]
        if field.name in LIST_DTYPES:
            columns.append(_list_array(values, field.type, LIST_DTYPES[field.name]))
        else:
            columns.append(pa.array(values, type=field.type))
    columns += [column_array([row[name] for row in rows], c) for name, c in extra.items()]
    return pa.Table.from_arrays(columns, schema=file_schema(extra))


def file_schema(extra: Mapping[str, Column]) -> pa.Schema:
    """A rollout file's Arrow schema: the v1 schema, then the run's extra columns (nullable,
    as the table's Delta schema has them: files of other runs lack them)."""
    fields = [*ROLLOUT_SCHEMA, *(pa.field(n, c.arrow_type) for n, c in extra.items())]
    return pa.schema(fields, metadata=ROLLOUT_SCHEMA.metadata)


def _list_array(values: list[np.ndarray | None], type: pa.DataType, dtype: Any) -> pa.Array:
    present = [v for v in values if v is not None]
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([0 if v is None else len(v) for v in values], out=offsets[1:])
    flat = np.concatenate(present) if present else np.empty(0, dtype=dtype)
    mask = None if len(present) == len(values) else pa.array([v is None for v in values])
    return pa.ListArray.from_arrays(offsets, flat, type=type, mask=mask)


def rows_digest(step: int, sample_ids: Iterable[str]) -> str:
    """What an exactly-once commit commits, as the log keeps it to compare a pair's later
    commits with: its step and its rows' sample ids (sorted), hashed."""
    text = "\n".join([str(step), *sorted(sample_ids)])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class _Encoding(threading.Thread):
    """One row group encoded (zstd, page checksums) beside the writer's thread.

    pyarrow releases the GIL while it encodes, so the next rows are validated meanwhile
    instead of waiting: encoding is about a quarter of a write's CPU time. The writer keeps
    at most one in flight and waits for it before the next, before closing the file, and
    on abort; a failure is kept and raised there.
    """

    def __init__(self, parquet: pq.ParquetWriter, table: pa.Table, row_group_size: int) -> None:
        # A daemon: an abandoned writer never holds up the interpreter's exit.
        super().__init__(name="mmstore-encode", daemon=True)
        self.parquet = parquet
        self.table: pa.Table | None = table
        self.row_group_size = row_group_size
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            assert self.table is not None
            self.parquet.write_table(self.table, row_group_size=self.row_group_size)
        except BaseException as exc:  # raised in the writer's thread, by _finish_encoding
            self.error = exc
        self.table = None


class RolloutWriter:
    """Use as ``with store.writer(run_id=..., step=...) as w: w.write(rollout)``.

    Nothing is visible until the block exits without an exception (or :meth:`commit` is
    called); then every row written becomes visible at once, as one Parquet file named
    ``part-<writer uuid>-<seq>.parquet`` (unique across processes and hosts) that one new
    table version adds; :attr:`version` is that version.

    Exactly once: a writer given ``producer`` (a name for the process that makes the rows,
    e.g. ``"sampler-0"``) and ``seq`` (that producer's sequence number in the run, growing
    by commit) commits its rows at most once per ``(producer, run_id, seq)``, across
    processes and crashes: a retried commit of the same rows under a pair the run already
    holds commits nothing, sets :attr:`duplicate` and logs a warning (logger ``mmstore``);
    other rows under a used pair raise :class:`ProducerConflictError` (nothing dropped
    silently). Such a writer commits once. A commit that raised (a lost reply, a failure
    after its log entry was durable) is retried by calling :meth:`commit` again: it finds
    its own entry (by the commit id this writer keeps for the file) instead of committing
    the file a second time or calling its own commit a duplicate.

    An image-only token (a family's placeholder, break or end token) outside every image
    span is refused, in rows with images and in text-only rows alike, whenever the writer
    knows the family: the families of the row's own images always count; beyond them, the
    family of ``adapter=`` if given (only its ids: a custom tokenizer's), else the families
    this writer's rows used, else those recorded in the newest committed files of the same
    run, else the adapters built in this process (``mmstore.adapter_for``) when they are all
    of one family. A writer that knows none of these (a fresh process writing text-only rows
    into a new run) cannot tell a placeholder from text. A run's families are recorded at
    ``runs/<run_id>/`` by the commits of its image rows (:mod:`.runs`): one small listing,
    whatever the store's size and however long ago the run's last image was written.
    """

    def __init__(
        self,
        store: Storage,
        run_id: str,
        step: int,
        *,
        adapter: Family | None = None,
        row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
        producer: str | None = None,
        seq: int | None = None,
        final: bool = False,
        columns: Mapping[str, Column | str] | None = None,
    ) -> None:
        check_partition(run_id, step)
        given = declared(columns)
        if not isinstance(final, bool):
            raise InvalidArgumentError(f"final must be True or False, got {final!r}")
        self.final = final
        check_producer(producer, seq)
        if isinstance(row_group_size, bool) or not isinstance(row_group_size, int):
            raise InvalidArgumentError(f"row_group_size must be an int, got {row_group_size!r}")
        if row_group_size <= 0:
            raise InvalidArgumentError(f"row_group_size must be positive, got {row_group_size}")
        self.store = store
        self.run_id = run_id
        self.step = step
        self.writer_id = uuid.uuid4().hex
        self.row_group_size = row_group_size
        self.committed: list[str] = []
        self.producer = producer
        self.seq = seq
        self.version: int | None = None  # the table version the last commit made
        self.duplicate = False  # the table already held (producer, seq): nothing committed
        self.result: CommitResult | None = None  # the last commit's, as the table said
        self._file_rows = 0  # rows in the open (or encoded) file
        self._adapter = adapter
        # The adapter's video half, bound to its tokenizer: its spans are checked exactly.
        self._video = video_half(adapter) if adapter is not None else None
        self._layouts: dict[str, Layout] = {}
        self._run_layouts: list[Layout] | None = None
        self._sample_ids: set[str] = set()
        # This writer's rows, and the committed parents read, as continuations' parents.
        self._rows: dict[str, Row] = {}
        self._known_media: set[tuple[str, str]] = set()
        self._unsynced: set[str] = set()  # URIs the uncommitted rows reference
        self._pending: list[dict[str, Any]] = []
        self._num_tokens: list[int] = []  # of every row in the open file, for its footer
        self._sink: pa.BufferOutputStream | None = None
        self._parquet: pq.ParquetWriter | None = None
        self._encoding: _Encoding | None = None  # the row group being encoded, if any
        self._encoded: bytes | None = None  # a file whose commit failed, kept for the retry
        self._commit_id: str | None = None  # the encoded file's commit, the same on a retry
        self._file_layouts: dict[str, dict[str, Any]] = {}  # the encoded file's layouts
        self._closed = False
        # The run's extra columns: the run's record if it has one (a writer declaring other
        # columns is refused here, before any row), else what this writer declares.
        recorded = run_columns(store, run_id)
        if recorded is not None and given and recorded != given:
            raise column_mismatch(run_id, recorded, given).with_context(step=step)
        self.columns: dict[str, Column] = given if recorded is None else recorded
        self._columns_recorded = recorded is not None
        if self.columns:  # a name another run gave another type: refused before any row
            self._table_columns()

    # -- writing -------------------------------------------------------------------------

    def write(self, rollout: Rollout) -> None:
        """Validate one row and buffer it.

        Raises :class:`InvalidRolloutError` for a row that breaks an invariant (or repeats a
        sample id of this writer), and :class:`MediaNotFoundError`, :class:`HashMismatchError`
        or :class:`UntrustedURIError` for an image ref whose bytes are absent, different or
        not allowed; each names the run, step, sample and image index. A refused row changes
        nothing: the writer stays usable.
        """
        if self._closed:
            raise InvalidRolloutError("writer is closed", run_id=self.run_id, step=self.step)
        if self._encoded is not None:
            raise InvalidRolloutError(
                "a failed commit is pending: call commit() again (or abort()) first",
                run_id=self.run_id,
                step=self.step,
            )
        if self.producer is not None and self.result is not None:
            raise InvalidRolloutError(
                f"this writer's (producer, seq) ({self.producer!r}, {self.seq}) was committed "
                "already: a writer with a producer commits once; open another with the next seq",
                run_id=self.run_id,
                step=self.step,
            )
        if not isinstance(rollout, Rollout):
            raise InvalidRolloutError(
                f"expected an mmstore.Rollout, got {type(rollout).__name__}", run_id=self.run_id
            )
        where = {"run_id": self.run_id, "step": self.step, "sample_id": rollout.sample_id}
        if rollout.sample_id in self._sample_ids:
            raise InvalidRolloutError("duplicate sample_id in this writer", **where)
        if rollout.parent_id is not None:
            try:
                rollout = whole(rollout, self._parent(rollout.parent_id), self.columns)
            except InvalidRolloutError as exc:
                raise exc.with_context(**where) from None
        used: dict[str, Layout] = {}

        def lookup(fingerprint: str) -> Layout | None:
            layout = self._layout(fingerprint)
            if layout is not None:
                used[fingerprint] = layout
            return layout

        token_ids = self._placeholder_ids()
        try:
            check_rollout(rollout, lookup, image_token_ids=token_ids, video=self._video)
            values = self._column_values(rollout)
        except InvalidRolloutError as exc:
            raise exc.with_context(**where) from None
        media: list[tuple[str, int, ImageRef | VideoRef]]
        media = [("image_index", i, r) for i, r in enumerate(rollout.images)]
        media += [("video_index", i, r) for i, r in enumerate(rollout.videos)]
        for key, index, ref in media:
            if (ref.uri, ref.hash) not in self._known_media:
                self.store.ensure_media(ref, **where, **{key: index})
                self._known_media.add((ref.uri, ref.hash))
        for index, video in enumerate(rollout.videos):  # its facts, as its span assumes them
            self.store.check_clip(video, **where, video_index=index)
        # Accepted: only now does the row touch the writer's state.
        self._layouts.update(used)
        self._sample_ids.add(rollout.sample_id)
        self._unsynced.update(ref.uri for _, _, ref in media)
        self._pending.append({**_buffered(rollout), **values})
        self._rows[rollout.sample_id] = self._pending[-1]  # a parent for later rows
        released(rollout)  # the buffer holds the arrays now; the caller's row need not
        self._num_tokens.append(len(rollout.tokens))
        self._file_rows += 1
        if len(self._pending) >= self.row_group_size:
            self._flush_row_group()

    def _parent(self, parent_id: str) -> Row:
        """Sample ``parent_id`` of this run as a row: written by this writer, else committed
        (found by reading the run's files, once per parent and writer)."""
        if parent_id not in self._rows:
            try:
                (found,) = read_rollouts(self.store, self.run_id, sample_ids=parent_id)
            except NoMatchError:
                raise InvalidRolloutError(
                    f"parent {parent_id!r} is not in run {self.run_id!r}: neither written by "
                    "this writer before the continuation nor committed"
                ) from None
            self._rows[parent_id] = {**_buffered(found), **found.columns}
        return self._rows[parent_id]

    def _column_values(self, rollout: Rollout) -> dict[str, Any]:
        """The row's values of the run's columns, as stored: exactly the declared names,
        per-token ones with one value per token."""
        given = rollout.columns
        for name in sorted(given.keys() - self.columns.keys()):
            raise InvalidRolloutError(
                f"column {name!r} is not declared by run {self.run_id!r} (declared: "
                f"{sorted(self.columns) or 'none'}): declare it with "
                "store.writer(..., columns={name: mmstore.per_token(...)})",
                column=name,
            )
        values = {}
        for name, column in self.columns.items():
            if name not in given:
                raise InvalidRolloutError(
                    f"column {name!r} (declared by run {self.run_id!r}) has no value in the row",
                    column=name,
                )
            try:
                values[name] = value_array(column, given[name], len(rollout.tokens))
            except ValueError as exc:
                raise InvalidRolloutError(f"column {name!r}: {exc}", column=name) from None
        return values

    def write_many(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.write(rollout)

    def _placeholder_ids(self) -> frozenset[int]:
        """Image-only token ids no text may hold (the rule in the class docstring).

        One family's image-only token is ordinary text to another (Pixtral's ``[IMG_END]``
        is id 13), so the ids come from the most specific family known: the adapter, then
        the families this writer's rows used, then the run's recorded layouts, then the
        adapters of this process if they are all of one family.
        """
        if self._adapter is not None:
            extra = self._video.special_token_ids if self._video is not None else frozenset()
            return self._adapter.special_token_ids | extra
        layouts = list(self._layouts.values())
        if not layouts:
            if self._run_layouts is None:  # read once per writer
                self._run_layouts = [
                    layout_from_record(record)
                    for record in run_layouts(self.store, self.run_id).values()
                ]
            layouts = self._run_layouts
        if not layouts:
            built = known_layouts()
            layouts = built if len({x.family for x in built}) == 1 else []
        return frozenset().union(*(special_token_ids(x) for x in layouts))

    def _layout(self, fingerprint: str) -> Layout | None:
        if self._adapter is not None and self._adapter.fingerprint == fingerprint:
            return self._adapter.layout
        if self._video is not None and self._video.fingerprint == fingerprint:
            return self._video.layout
        return layout_for_fingerprint(fingerprint)

    def _flush_row_group(self) -> None:
        """Start encoding the pending rows as a row group (see :class:`_Encoding`)."""
        if not self._pending:
            return
        table = _table(self._pending, self.columns)
        self._finish_encoding()  # one row group in flight: row groups stay in order
        if self._parquet is None:
            self._sink = pa.BufferOutputStream()
            self._parquet = pq.ParquetWriter(
                self._sink, file_schema(self.columns), **parquet_options(self.columns)
            )
        self._encoding = _Encoding(self._parquet, table, self.row_group_size)
        self._encoding.start()
        self._pending = []

    def _finish_encoding(self) -> None:
        """Wait for the row group being encoded. If its encoding failed, the file cannot be
        finished: the writer is aborted (nothing of it is committed) and the error raised."""
        encoding, self._encoding = self._encoding, None
        if encoding is None:
            return
        encoding.join()
        if encoding.error is not None:
            self.abort()
            raise encoding.error

    # -- committing ----------------------------------------------------------------------

    def commit(self) -> str | None:
        """Make every row written so far visible as one Parquet file; return its path
        (None when there was nothing to commit, or when :attr:`duplicate`).

        First every media file the rows reference is made durable (``put_media`` does not
        fsync; one batch of fsyncs here, including copies another writer put), then the
        Parquet file, so a committed file never points at missing or torn bytes; then the
        table commits it. If the commit fails (disk full, an unusable ``_staging``, a table
        commit that kept conflicting), the encoded file is kept and nothing torn is left
        behind: call ``commit()`` again to retry; ``write`` refuses rows until then.
        """
        if self._closed:
            raise InvalidRolloutError("writer is closed", run_id=self.run_id, step=self.step)
        # Media first, then the file that names it.
        if self._encoded is None:
            self._flush_row_group()
            if self._parquet is None or self._sink is None:
                return None
            # The media's fsyncs run while the last row group encodes; the file is finished
            # either way, so a failed sync leaves a commit to retry like any failed commit.
            try:
                self.store.sync_media(self._unsynced)
            finally:
                self._encoded = self._encode()
        else:
            self.store.sync_media(self._unsynced)
        rel = part_path(self.run_id, self.step, self.writer_id, len(self.committed))
        # The run's families before its rows: a text-only writer of this run finds them.
        record_layouts(self.store, self.run_id, self._file_layouts)
        self._declare_columns()
        written = self.store.backend.write_atomic(rel, self._encoded, replace=False)
        # A retry after a failure past the rename (the directory's fsync, the table commit)
        # finds its own file in place; any other file under this writer's unique name is not
        # ours.
        if not written and self.store.backend.read(rel) != self._encoded:
            raise FileExistsError(f"rollout file {rel!r} already exists in {self.store.root!r}")
        file = TableFile(rel, self.run_id, self.step, len(self._encoded), self._file_rows)
        if self._commit_id is None:
            self._commit_id = uuid.uuid4().hex
        result = commit_files(
            self.store,
            [file],
            producer=self.producer,
            seq=self.seq,
            commit_id=self._commit_id,
            digest=None if self.producer is None else rows_digest(self.step, self._sample_ids),
            final=self.final,
        )
        self.result = result
        self._encoded = None
        self._commit_id = None
        self._unsynced = set()
        self._file_rows = 0
        if result.duplicate:
            self._drop_duplicate(rel, result)
            return None
        self.version = result.version
        self.committed.append(rel)
        return rel

    def _declare_columns(self) -> None:
        """Before the first file with extra columns: the run's record, then the table's
        Delta schema (once per process and store), so that Delta engines read them typed."""
        if not self.columns:
            return
        self._table_columns()
        if not self._columns_recorded:
            record_columns(self.store, self.run_id, self.columns)
            self._columns_recorded = True

    def _table_columns(self) -> None:
        """The table's Delta schema gets the run's columns (refused where another run gave
        a name another type); once per process and store."""
        key = (self.store.root, encode(self.columns))
        if key not in _TABLE_COLUMNS:
            table_of(self.store).add_columns(
                file_schema(self.columns).field(n) for n in self.columns
            )
            _TABLE_COLUMNS.add(key)

    def _drop_duplicate(self, rel: str, result: CommitResult) -> None:
        """The table holds this (producer, run, seq) already with the same rows, in another
        file (a commit whose entry lists this file is this commit, never a duplicate):
        remove the file no version lists."""
        self.duplicate = True
        self.store.backend.delete(rel)
        log.warning(
            "mmstore: producer %r seq %d was committed before (the producer's latest committed "
            "seq is %s): this commit of run %r step %d committed nothing",
            self.producer,
            self.seq,
            result.producer_seq,
            self.run_id,
            self.step,
        )

    def _encode(self) -> bytes:
        """Close the Parquet writer and return the whole file."""
        self._finish_encoding()
        assert self._parquet is not None and self._sink is not None
        layouts = {fp: layout.params() for fp, layout in sorted(self._layouts.items())}
        self._file_layouts = layouts
        metadata = file_metadata(
            self.run_id, self.step, layouts, self._num_tokens, final=self.final
        )
        if self.columns:
            metadata[META_COLUMNS] = encode(self.columns)
        self._num_tokens = []
        self._parquet.add_key_value_metadata({k.decode(): v.decode() for k, v in metadata.items()})
        self._parquet.close()
        data: bytes = self._sink.getvalue().to_pybytes()
        self._parquet = self._sink = None
        return data

    def abort(self) -> None:
        """Drop everything not yet committed and close the writer."""
        self._pending = []
        self._encoded = None
        self._commit_id = None
        self._num_tokens = []
        self._file_rows = 0
        if self._encoding is not None:
            self._encoding.join()  # never close the Parquet writer under its encoder
            self._encoding = None
        if self._parquet is not None:
            with contextlib.suppress(Exception):  # a writer whose encoding failed
                self._parquet.close()
        self._parquet = self._sink = None
        self._closed = True

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()
            self._closed = True
