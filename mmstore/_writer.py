"""The rollout writer: validated rows -> one Parquet file, visible by an atomic rename.

Rows are checked against every invariant (and their media must exist) as they are
written; a refused row raises and leaves the writer, and the store, as they were. Row groups
are encoded as they fill, so memory holds compressed bytes, not Python rows.
"""

from __future__ import annotations

import re
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ._adapters import Layout, layout_for_fingerprint
from ._exceptions import InvalidRolloutError
from ._invariants import check_rollout
from ._models import Rollout
from ._schema import ROLLOUT_SCHEMA, file_metadata

if TYPE_CHECKING:
    from ._adapters import QwenVLAdapter
    from ._store import Store

# Rows are a few KB to a few hundred KB; 128 rows keep row groups (the unit of work the
# loader shards) fine-grained while pages stay large enough for zstd.
DEFAULT_ROW_GROUP_SIZE = 128
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
INT32_MAX = 2**31 - 1

# Chosen by measurement (benchmarks/bench_write.py): dictionaries pay off where values
# repeat (GRPO groups, image hashes and URIs shared in a group, one layout per run); token
# ids compress better as plain pages under zstd than as dictionaries.
DICTIONARY_COLUMNS = [
    "group_id",
    "images.list.item.uri",
    "images.list.item.hash",
    "images.list.item.family",
    "images.list.item.layout_fingerprint",
]
STATISTICS_COLUMNS = ["sample_id", "group_id", "prompt_len", "reward", "advantage"]


def check_partition(run_id: Any, step: Any) -> None:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise InvalidRolloutError(
            f"run_id {run_id!r} must match {RUN_ID_PATTERN.pattern} (it names a directory)",
            run_id=run_id,
        )
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT32_MAX:
        raise InvalidRolloutError(
            f"step {step!r} must be a non-negative int32", run_id=run_id, step=step
        )


class RolloutWriter:
    """Use as ``with store.writer(run_id=..., step=...) as w: w.write(rollout)``."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        step: int,
        *,
        adapter: QwenVLAdapter | None = None,
        row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    ) -> None:
        check_partition(run_id, step)
        self.store = store
        self.run_id = run_id
        self.step = step
        self.writer_id = uuid.uuid4().hex[:16]
        self.row_group_size = row_group_size
        self.committed: list[str] = []
        self._adapter_layout = adapter.layout if adapter is not None else None
        self._layouts: dict[str, Layout] = {}
        self._sample_ids: set[str] = set()
        self._known_media: set[str] = set()
        self._pending: list[dict[str, Any]] = []
        self._sink: pa.BufferOutputStream | None = None
        self._parquet: pq.ParquetWriter | None = None
        self._rows_in_file = 0
        self._closed = False

    # -- writing -------------------------------------------------------------------------

    def write(self, rollout: Rollout) -> None:
        """Validate one row and buffer it; raises InvalidRolloutError (or a media error)."""
        if self._closed:
            raise InvalidRolloutError("writer is closed", run_id=self.run_id, step=self.step)
        if not isinstance(rollout, Rollout):
            raise InvalidRolloutError(
                f"expected an mmstore.Rollout, got {type(rollout).__name__}", run_id=self.run_id
            )
        where = {"run_id": self.run_id, "step": self.step, "sample_id": rollout.sample_id}
        if rollout.sample_id in self._sample_ids:
            raise InvalidRolloutError("duplicate sample_id in this writer", **where)
        token_ids = [self._adapter_layout.image_token_id] if self._adapter_layout else []
        try:
            check_rollout(rollout, self._layout, image_token_ids=token_ids)
        except InvalidRolloutError as exc:
            raise InvalidRolloutError(exc.message, **{**where, **exc.context}) from None
        for index, ref in enumerate(rollout.images):
            if ref.hash not in self._known_media:
                self.store.ensure_media(ref, **where, image_index=index)
                self._known_media.add(ref.hash)
            self._layouts[ref.layout_fingerprint] = self._layout(ref.layout_fingerprint)  # type: ignore[assignment]
        self._sample_ids.add(rollout.sample_id)
        self._pending.append(rollout.model_dump())
        if len(self._pending) >= self.row_group_size:
            self._flush_row_group()

    def write_many(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.write(rollout)

    def _layout(self, fingerprint: str) -> Layout | None:
        if self._adapter_layout is not None and self._adapter_layout.fingerprint == fingerprint:
            return self._adapter_layout
        return layout_for_fingerprint(fingerprint)

    def _flush_row_group(self) -> None:
        if not self._pending:
            return
        table = pa.Table.from_pylist(self._pending, schema=ROLLOUT_SCHEMA)
        if self._parquet is None:
            self._sink = pa.BufferOutputStream()
            self._parquet = pq.ParquetWriter(
                self._sink,
                ROLLOUT_SCHEMA,
                compression="zstd",
                compression_level=3,
                use_dictionary=DICTIONARY_COLUMNS,
                write_statistics=STATISTICS_COLUMNS,
            )
        self._parquet.write_table(table, row_group_size=self.row_group_size)
        self._rows_in_file += table.num_rows
        self._pending = []

    # -- committing ----------------------------------------------------------------------

    def commit(self) -> str | None:
        """Make every row written so far visible as one Parquet file; return its path.

        All media the rows reference was made durable by ``put_media`` before ``write``
        accepted them, so a committed file never points at missing bytes.
        """
        self._flush_row_group()
        if self._parquet is None or self._sink is None:
            return None
        layouts = {fp: layout.params() for fp, layout in self._layouts.items()}
        self._parquet.add_key_value_metadata(
            {
                k.decode(): v.decode()
                for k, v in file_metadata(self.run_id, self.step, layouts).items()
            }
        )
        self._parquet.close()
        data = self._sink.getvalue().to_pybytes()
        seq = len(self.committed)
        rel = (
            f"rollouts/run_id={self.run_id}/step={self.step}/"
            f"part-{self.writer_id}-{seq:05d}.parquet"
        )
        self.store.backend.write_atomic(rel, data, replace=False)
        self.committed.append(rel)
        self._parquet = self._sink = None
        self._rows_in_file = 0
        return rel

    def abort(self) -> None:
        """Drop everything not yet committed."""
        self._pending = []
        if self._parquet is not None:
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
            return
        self.commit()
        self._closed = True
