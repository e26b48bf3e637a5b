"""Metadata scan rows/s: ``mmstore.debug.scan`` (polars) vs a pyarrow dataset.

    python -m benchmarks.bench_scan --scale 1

Both read the same committed files and the same light columns (what a person filters on
first: ids, rewards, prompt length, the image hashes), with the partition columns.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pyarrow.dataset as pads

from benchmarks._common import cli, interleaved, timed, write_workload
from mmstore import debug

COLUMNS = ["sample_id", "group_id", "reward", "advantage", "prompt_len"]


def run(scale: float = 1.0, reps: int = 5) -> dict[str, Any]:
    samples = max(64, round(4096 * scale))
    with tempfile.TemporaryDirectory() as tmp:
        store = write_workload(f"{tmp}/s", "screenshots", samples, small_images=True, steps=8)
        expected = sum(
            pads.dataset(store.backend.abspath(f.path)).count_rows() for f in store.rollout_files()
        )

        def polars_scan() -> float:
            seconds, frame = timed(
                lambda: debug.scan(store).select([*COLUMNS, "run_id", "step"]).collect()
            )
            assert frame.height == expected
            return expected / seconds

        def pyarrow_dataset() -> float:
            def read() -> Any:
                files = [store.backend.abspath(f.path) for f in store.rollout_files()]
                ds = pads.dataset(
                    files,
                    format="parquet",
                    partitioning="hive",
                    partition_base_dir=store.backend.abspath("rollouts"),
                )
                return ds.to_table(columns=[*COLUMNS, "run_id", "step"])

            seconds, table = timed(read)
            assert table.num_rows == expected
            return expected / seconds

        figures = interleaved(
            {"polars_rows_per_s": polars_scan, "pyarrow_rows_per_s": pyarrow_dataset}, reps
        )
    return {
        "rows": expected,
        **figures,
        "polars_over_pyarrow": figures["polars_rows_per_s"]["median"]
        / figures["pyarrow_rows_per_s"]["median"],
    }


if __name__ == "__main__":
    cli(run, __doc__, reps=5)
