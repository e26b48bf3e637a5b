"""Committed rows read back as :class:`Rollout` objects, selected by run, step and sample id.

For replay and inference (``integrations.vllm`` takes a ``Rollout``); bulk analysis is
better served by :func:`mmstore.debug.scan` or any Parquet engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from mmstore._format.columns import Column, footer_columns
from mmstore._format.models import Rollout, table_to_rollouts
from mmstore._rows.check import read_checked
from mmstore._rows.files import check_run_id, open_rollout_file, select_files
from mmstore._rows.snapshot import collected
from mmstore._storage.store import Storage
from mmstore.errors import CorruptFileError, NoMatchError


def read_rollouts(
    store: Storage,
    run_id: str | Iterable[str] | None = None,
    step: int | range | Iterable[int] | None = None,
    sample_ids: str | Iterable[str] | None = None,
    *,
    version: int | None = None,
) -> list[Rollout]:
    """The rows of table ``version`` (None: the latest) matching every given filter, in
    (run, step, file, row) order.

    Raises :class:`NoMatchError` naming what the store holds when a run or step matches
    nothing, naming the sample ids not found, or when the store holds no row at all.
    """
    wanted = None if sample_ids is None else _ids(sample_ids)
    files = select_files(store, run_id, step, version=version)
    for file in files:  # before any is read
        check_run_id(file)
    rows: list[Rollout] = []
    for file in files:
        try:
            table = _read(store, file.path, wanted)
        except CorruptFileError as exc:  # gone: collected since ``version``?
            if version is None or store.backend.stat(file.path) is not None:
                raise
            raise collected(store, version, file.path) or exc from None
        rows.extend(table_to_rollouts(table, _declared(table)))
    missing = sorted(wanted - {r.sample_id for r in rows}) if wanted is not None else []
    if missing or not rows:
        what = f"sample ids {missing[:5]}" if missing else "rollouts"
        raise NoMatchError(
            f"no {what} in the {len(files)} selected rollout files",
            root=store.root,
            run_id=run_id,
            step=step,
        )
    return rows


def _ids(sample_ids: str | Iterable[str]) -> set[str]:
    return {sample_ids} if isinstance(sample_ids, str) else set(sample_ids)


def _declared(table: pa.Table) -> dict[str, Column]:
    """The declared columns :func:`_read` appended (the schema metadata keeps them)."""
    return footer_columns(table.schema.metadata, where={})


def _read(store: Storage, path: str, wanted: set[str] | None) -> pa.Table:
    """A file's rows (those ``wanted``) as the loader trusts them (:func:`read_checked`:
    page checksums, row checks, the token and image caps), before any is a Python object."""
    parquet = open_rollout_file(store, path)
    return read_checked(parquet, path, max_pixels=store.max_image_pixels, sample_ids=wanted)
