"""Metadata scan rows/s: ``mmstore.debug.scan`` (polars) vs a pyarrow dataset; and the
cost of the loader's read-path checks.

    python -m benchmarks.bench_scan --scale 1

Both scans read the same committed files and the same light columns (what a person filters
on first: ids, rewards, prompt length, the image hashes), with the partition columns.

The loader's row read (``_scan.read_units``: every row group, the loader's columns, page CRCs
verified, value counts checked against the footer) is timed against the same read by plain
pyarrow without any check, interleaved; ``read_checks_cost`` is the fraction of row-read
throughput the checks cost (the loader's whole path, which also decodes and processes
images, loses a far smaller fraction).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from benchmarks._common import cli, interleaved, timed, write_workload
from mmstore import debug
from mmstore._format.schema import ROW_COLUMNS
from mmstore._rows.snapshot import read_units, take_snapshot

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

        units = take_snapshot(store).units

        def checked_read() -> float:
            seconds, table = timed(lambda: read_units(store, units))
            assert table.num_rows == expected
            return expected / seconds

        def plain_read() -> float:
            def read() -> pa.Table:
                files = {u.file: pq.ParquetFile(store.backend.abspath(u.file)) for u in units}
                return pa.concat_tables(
                    files[u.file].read_row_group(u.row_group, columns=ROW_COLUMNS) for u in units
                )

            seconds, table = timed(read)
            assert table.num_rows == expected
            return expected / seconds

        figures = interleaved(
            {
                "polars_rows_per_s": polars_scan,
                "pyarrow_rows_per_s": pyarrow_dataset,
                "checked_read_rows_per_s": checked_read,
                "plain_read_rows_per_s": plain_read,
            },
            reps,
        )
    median = {k: v["median"] for k, v in figures.items()}
    return {
        "rows": expected,
        **figures,
        "polars_over_pyarrow": median["polars_rows_per_s"] / median["pyarrow_rows_per_s"],
        "read_checks_cost": 1 - median["checked_read_rows_per_s"] / median["plain_read_rows_per_s"],
    }


if __name__ == "__main__":
    cli(run, __doc__, reps=5)
