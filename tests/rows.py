"""Hand-made rollout files for the lifecycle tests: exact rows over given media; and how a
test commits a Parquet file that another engine (or a test, by hand) wrote into the store."""

from __future__ import annotations

import pyarrow.parquet as pq

import mmstore
from mmstore._format.paths import partition_of
from mmstore._rows.table import TableFile


def commit_existing(store: mmstore.Store, *paths: str) -> int:
    """Commit Parquet files already written at ``paths`` (store-relative, under their
    ``run_id=…/step=…/`` partition) to the rollouts table, as another engine's writer
    would: one transaction adding each with its partition values, size and row count.
    Format 2 reads only what the log lists; return the version that lists them."""
    files = []
    for path in paths:
        run_id, step = partition_of(path)
        stat = store.backend.stat(path)
        assert stat is not None, path
        rows = pq.ParquetFile(store.backend.abspath(path)).metadata.num_rows
        files.append(TableFile(path, run_id, step, stat.size, rows))
    version = store.table.commit(files).version
    assert version is not None
    return version


def commit(store, adapter, run_id, step, media_rows):
    """Commit one file with a row per entry of ``media_rows`` (each a list of MediaRefs).

    Row ``i`` is ``<run>-<step>-<i>`` with reward ``i``; returns the committed file paths.
    """
    with store.writer(run_id=run_id, step=step, adapter=adapter) as w:
        for i, media in enumerate(media_rows):
            ids = [7, *([adapter.image_token_id, 8] * len(media))]
            tokens, refs = adapter.expand(ids, media)
            w.write(
                mmstore.Rollout(
                    sample_id=f"{run_id}-{step}-{i}",
                    tokens=tokens,
                    prompt_len=len(tokens),
                    loss_mask=[False] * len(tokens),
                    images=refs,
                    reward=float(i),
                )
            )
    return w.committed
