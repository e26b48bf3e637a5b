"""Every engine reads a store's committed rows right, without mmstore: exactly the rows of
one table version, ``run_id`` a string (leading zeros kept) and ``step`` an integer.

Format 2: ``ROOT/rollouts`` is a Delta table. Delta readers (deltalake, polars, Ray) read a
version's rows typed with no recipe. DuckDB and HF datasets read plain Parquet: they take
the file list of a version (``store.files(version)``, or deltalake's ``file_uris()``) and the
typing recipe of the engine table (docs/engines.md). A listing of the directory is wrong
twice over: it reads files no version lists (released rows kept for the grace period, a
killed writer's orphan) and, left to infer, turns run id ``0042`` into the integer 42. Each
recipe below is the one docs/engines.md shows, apart from the path variables.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import mmstore

RUNS = {"0042": [0, 12], "7": [3]}


def rollout(sample_id: str) -> mmstore.Rollout:
    return mmstore.Rollout(sample_id=sample_id, tokens=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> mmstore.Store:
    """The RUNS rows committed; then a run released (its bytes stay for the grace period)
    and a copy of a file dropped in by hand (no version lists it)."""
    root = str(tmp_path_factory.mktemp("engines") / "store")
    store = mmstore.Store.open(root, create=True)
    for run_id, steps in RUNS.items():
        for step in steps:
            with store.writer(run_id=run_id, step=step) as w:
                for i in range(2):
                    w.write(rollout(f"{run_id}/{step}/{i}"))
    with store.writer(run_id="gone", step=0) as w:
        w.write(rollout("gone/0/0"))
    mmstore.release_run(store, "gone")
    orphan = store.backend.abspath("rollouts/run_id=7/step=3/part-orphan-00000.parquet")
    shutil.copy(store.backend.abspath(store.files()[-1].path), orphan)
    return store


@pytest.fixture(scope="module")
def root(store) -> str:
    return store.root


def expected() -> list[tuple[str, int, str]]:
    return sorted(
        (run_id, step, f"{run_id}/{step}/{i}")
        for run_id, steps in RUNS.items()
        for step in steps
        for i in range(2)
    )


def check(rows: list[tuple[object, object, object]]) -> None:
    assert sorted(rows) == expected()  # exactly the latest version's rows
    assert all(type(r) is str and type(s) is int for r, s, _ in rows)


def test_a_listing_is_what_the_recipes_avoid(root):
    # A listing reads what no version lists: the released row, the orphan's two.
    table = ds.dataset(f"{root}/rollouts", format="parquet", partitioning="hive").to_table()
    assert table.num_rows == len(expected()) + 1 + 2
    # And where every run id looks like a number, it loses its zeros.
    numeric = [str(p) for p in Path(root, "rollouts").glob("run_id=[0-9]*/*/*.parquet")]
    inferred = ds.dataset(numeric, partitioning="hive", partition_base_dir=f"{root}/rollouts")
    assert pa.types.is_integer(inferred.schema.field("run_id").type)


def test_deltalake(root):
    from deltalake import DeltaTable

    table = DeltaTable(f"{root}/rollouts").to_pyarrow_table()
    columns = (table.column(c).to_pylist() for c in ("run_id", "step", "sample_id"))
    check(list(zip(*columns, strict=True)))
    assert table.schema.field("step").type == pa.int32()


def test_pyarrow_dataset_through_deltalake(root):
    from deltalake import DeltaTable

    table = DeltaTable(f"{root}/rollouts").to_pyarrow_dataset().to_table()
    columns = (table.column(c).to_pylist() for c in ("run_id", "step", "sample_id"))
    check(list(zip(*columns, strict=True)))


def test_polars(root):
    import polars as pl

    frame = pl.scan_delta(f"{root}/rollouts").collect()
    check(frame.select("run_id", "step", "sample_id").rows())
    assert frame.schema["step"] == pl.Int32
    eager = pl.read_delta(f"{root}/rollouts")
    check(eager.select("run_id", "step", "sample_id").rows())


def test_an_older_version_reads_as_it_was(store, root):
    import polars as pl

    version = store.table.latest_version() - 1  # before the release: run "gone" is there
    old = pl.scan_delta(f"{root}/rollouts", version=version).collect()
    assert sorted(old["sample_id"]) == sorted([*(s for *_, s in expected()), "gone/0/0"])


def test_duckdb(store, root):
    duckdb = pytest.importorskip("duckdb")
    files = [f"{store.root}/{f.path}" for f in store.files()]  # the latest version's
    rows = duckdb.sql(
        f"SELECT run_id, step, sample_id FROM read_parquet({files!r}, "
        "hive_partitioning = true, hive_types = {'run_id': VARCHAR, 'step': INTEGER})"
    ).fetchall()
    check(rows)


def test_duckdb_with_the_file_list_from_deltalake(root):
    duckdb = pytest.importorskip("duckdb")
    from deltalake import DeltaTable

    files = DeltaTable(f"{root}/rollouts").file_uris()  # without mmstore
    rows = duckdb.sql(
        f"SELECT run_id, step, sample_id FROM read_parquet({files!r}, "
        "hive_partitioning = true, hive_types = {'run_id': VARCHAR, 'step': INTEGER})"
    ).fetchall()
    check(rows)


def test_hf_datasets(store, root):
    datasets = pytest.importorskip("datasets")
    files = [store.backend.abspath(f.path) for f in store.files()]
    part = ds.partitioning(
        pa.schema([("run_id", pa.string()), ("step", pa.int32())]), flavor="hive"
    )
    table = ds.dataset(files, partitioning=part, partition_base_dir=f"{root}/rollouts").to_table()
    hf = datasets.Dataset(table)
    check(list(zip(hf["run_id"], hf["step"], hf["sample_id"], strict=True)))


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # alone with test_ray.py's cluster (see there)
def test_ray_data(root):
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        data = ray.data.read_delta(f"{root}/rollouts")
        check([(r["run_id"], r["step"], r["sample_id"]) for r in data.take_all()])
    finally:
        ray.shutdown()
