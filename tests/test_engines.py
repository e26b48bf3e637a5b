"""Every engine reads a store's rows right, without mmstore: ``run_id`` a string (leading
zeros kept) and ``step`` an integer, by the one-line recipes of the README's engine table.

Without them, hive partition inference turns run id ``0042`` into the integer 42 (pyarrow,
polars, DuckDB, Spark), Ray types ``step`` as a string, and HF datasets drops both columns.
Each recipe below is the README's, word for word apart from the path variable.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import mmstore

RUNS = {"0042": [0, 12], "7": [3]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("engines") / "store")
    store = mmstore.Store.open(root, create=True)
    for run_id, steps in RUNS.items():
        for step in steps:
            with store.writer(run_id=run_id, step=step) as w:
                for i in range(2):
                    w.write(
                        mmstore.Rollout(
                            sample_id=f"{run_id}/{step}/{i}",
                            tokens=[1, 2, 3],
                            prompt_len=1,
                            loss_mask=[0, 1, 1],
                        )
                    )
    return root


def expected() -> list[tuple[str, int, str]]:
    return sorted(
        (run_id, step, f"{run_id}/{step}/{i}")
        for run_id, steps in RUNS.items()
        for step in steps
        for i in range(2)
    )


def check(rows: list[tuple[object, object, object]]) -> None:
    assert sorted(rows) == expected()
    assert all(type(r) is str and type(s) is int for r, s, _ in rows)


def test_default_inference_is_what_the_recipes_fix(root):
    # The reason the table exists: a lone numeric run id loses its zeros by default.
    table = ds.dataset(f"{root}/rollouts", format="parquet", partitioning="hive").to_table()
    assert pa.types.is_integer(table.schema.field("run_id").type)


def test_pyarrow(root):
    part = ds.partitioning(
        pa.schema([("run_id", pa.string()), ("step", pa.int32())]), flavor="hive"
    )
    table = ds.dataset(f"{root}/rollouts", format="parquet", partitioning=part).to_table()
    columns = (table.column(c).to_pylist() for c in ("run_id", "step", "sample_id"))
    check(list(zip(*columns, strict=True)))


def test_polars(root):
    import polars as pl

    frame = pl.scan_parquet(
        f"{root}/rollouts/**/*.parquet", hive_schema={"run_id": pl.String, "step": pl.Int32}
    ).collect()
    check(frame.select("run_id", "step", "sample_id").rows())


def test_duckdb(root):
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(
        f"SELECT run_id, step, sample_id FROM read_parquet('{root}/rollouts/**/*.parquet', "
        "hive_partitioning = true, hive_types = {'run_id': VARCHAR, 'step': INTEGER})"
    ).fetchall()
    check(rows)


def test_hf_datasets(root):
    datasets = pytest.importorskip("datasets")
    part = ds.partitioning(
        pa.schema([("run_id", pa.string()), ("step", pa.int32())]), flavor="hive"
    )
    hf = datasets.Dataset(ds.dataset(f"{root}/rollouts", partitioning=part).to_table())
    check(list(zip(hf["run_id"], hf["step"], hf["sample_id"], strict=True)))


@pytest.mark.slow
def test_ray_data(root):
    ray = pytest.importorskip("ray")
    from ray.data.datasource import Partitioning

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        data = ray.data.read_parquet(
            f"{root}/rollouts",
            partitioning=Partitioning("hive", field_types={"run_id": str, "step": int}),
        )
        check([(r["run_id"], r["step"], r["sample_id"]) for r in data.take_all()])
    finally:
        ray.shutdown()
