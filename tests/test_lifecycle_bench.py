"""The lifecycle benchmark runs at tiny scale, on a synthetic store that is a valid store."""

from __future__ import annotations

import pyarrow.parquet as pq

import mmstore
from benchmarks.bench_lifecycle import SyntheticStore, run
from mmstore._format.models import table_to_rollouts


def test_synthetic_store_rows_are_valid_and_gc_finds_exactly_the_garbage(tmp_path):
    synthetic = SyntheticStore(str(tmp_path / "store"))
    synthetic.grow(2_000)
    store = synthetic.store
    assert mmstore.verify(store).ok  # every hash real, every ref resolves
    (stat,) = store.rollout_files()
    rows = table_to_rollouts(pq.read_table(store.backend.abspath(stat.path)))
    layout = synthetic.adapter.layout
    for row in rows[:20]:
        mmstore.check_rollout(row, lambda _: layout, image_token_ids=[layout.image_token_id])
    report = mmstore.gc(store, grace_seconds=0, dry_run=True)
    assert len(report.deleted) == synthetic.media - synthetic.referenced.sum() > 0


def test_benchmark_runs_at_tiny_scale():
    result = run(scale=0.0005, reps=1)
    refs = [size["refs"] for size in result["sizes"]]
    assert refs == sorted(refs) and refs[0] < refs[-1]
    assert result["gc_per_ref_growth"] > 0 and result["verify_per_ref_growth"] > 0
