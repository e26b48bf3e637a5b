"""Four writer processes x 25 commits through ``store.writer(...)`` (the user's path, not
the table directly), locally and on moto_server: every committed row is in the latest
version exactly once, and versions are dense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import mmstore

WORKERS = os.path.join(os.path.dirname(__file__), "store_commit_workers.py")
PROCS, COMMITS, ROWS = 4, 25, 2


def run_writers(root: str, *extra: str) -> list[list[dict]]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, WORKERS, root, "--procs", str(PROCS), "--commits", str(COMMITS),
         "--rows", str(ROWS), *extra],
        capture_output=True, text=True, timeout=240, cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["exit_codes"] == [0] * PROCS, done.stderr
    return out["results"]


def check_every_row_once(store: mmstore.Store, results: list[list[dict]]) -> None:
    commits = [c for child in results for c in child]
    table = store.table
    latest = table.latest_version()
    # Dense versions: one per commit after the creation, each adding exactly its file.
    assert latest == PROCS * COMMITS
    entries = table.entries_after(0)
    assert [e.version for e in entries] == list(range(1, latest + 1))
    by_version = {e.version: e for e in entries}
    for c in commits:
        assert [f.path for f in by_version[c["version"]].added] == [c["path"]]
    for index, child in enumerate(results):  # each producer's pairs, in its commit order
        pairs = [p for c in child for p in by_version[c["version"]].producers]
        key = f"run_id=conc/w{index}"  # the producer's key in its run (issue 39.3)
        assert pairs == [(key, seq) for seq in range(COMMITS)]
    # Every committed row, read from the latest version's files, exactly once.
    files = store.files()
    assert sorted(f.path for f in files) == sorted(c["path"] for c in commits)
    ids: Counter[str] = Counter()
    for file in files:
        data = store.backend.read(file.path)
        column = pq.read_table(pa.BufferReader(data), columns=["sample_id"])["sample_id"]
        ids.update(column.to_pylist())
    expected = {f"w{i}-{s}-{k}" for i in range(PROCS) for s in range(COMMITS) for k in range(ROWS)}
    assert set(ids) == expected and set(ids.values()) == {1}


@pytest.mark.slow  # four writer processes
def test_four_store_writer_processes_keep_every_row_once_locally(tmp_path):
    root = str(tmp_path / "store")
    mmstore.Store.open(root, create=True)
    check_every_row_once(mmstore.Store.open(root), run_writers(root))


@pytest.mark.slow  # four writer processes
def test_four_store_writer_processes_keep_every_row_once_on_s3(s3_options):
    bucket = f"mm-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    root = f"s3://{bucket}/store"
    mmstore.Store.open(root, create=True, s3_options=s3_options)
    results = run_writers(root, "--s3", json.dumps(s3_options))
    check_every_row_once(mmstore.Store.open(root, s3_options=s3_options), results)
