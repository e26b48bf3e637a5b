"""The rollouts Delta table (mmstore._rows.table): commits, versions as snapshots,
exactly-once producers, removal, typed partitions in every Delta reader, S3."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import uuid

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

import mmstore
from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._rows import delta as delta_module
from mmstore._rows import log as log_module
from mmstore._rows.table import (
    TABLE_SCHEMA,
    CommitResult,
    RolloutTable,
    TableFile,
    TableSnapshot,
)
from mmstore._storage.backends import delta_s3_options
from mmstore._storage.store import Storage
from tests.table_workers import rollout_rows, write_part

WORKERS = os.path.join(os.path.dirname(__file__), "table_workers.py")


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage.open(tmp_path / "store", create=True)


@pytest.fixture
def table(storage) -> RolloutTable:
    table = RolloutTable(storage, checkpoint_interval=5)
    table.create()
    return table


@pytest.fixture
def s3_storage(s3_options) -> Storage:
    bucket = f"mm-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    return Storage.open(f"s3://{bucket}/store", create=True, s3_options=s3_options)


def run_workers(*args: str, timeout: float = 240) -> dict:
    done = subprocess.run(
        [sys.executable, WORKERS, *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- creating, committing, reading ---------------------------------------------------------


def test_create_is_idempotent_and_declares_the_row_schema_plus_typed_partitions(storage):
    table = RolloutTable(storage)
    assert not table.exists()
    assert table.create() == 0
    assert table.create() == 0  # an existing table is opened, not replaced
    delta = DeltaTable(table.uri)
    assert delta.metadata().partition_columns == ["run_id", "step"]
    schema = pa.schema(delta.schema().to_arrow())
    assert schema.field("run_id").type == pa.string()
    assert schema.field("step").type == pa.int32()
    # Nested lists and the image-ref struct are taken as they are, as is the metadata string.
    for field in ROLLOUT_SCHEMA:
        assert schema.field(field.name).type.equals(field.type), field.name
    assert delta.metadata().configuration["delta.enableExpiredLogCleanup"] == "false"


@pytest.mark.slow
def test_processes_racing_to_create_the_table_all_find_one_table(storage):
    out = run_workers("create", storage.root, "--procs", "4")
    assert out == {"exit_codes": [0] * 4, "results": [0] * 4}
    log = sorted(f.path for f in storage.backend.list("rollouts/_delta_log"))
    assert log == ["rollouts/_delta_log/00000000000000000000.json"]
    assert RolloutTable(storage).snapshot() == TableSnapshot(0, ())


def test_a_commit_lists_the_file_with_its_partition_values_size_and_rows(table):
    file = write_part(table.storage, "0042", 7, "a", rows=3)
    result = table.commit([file])
    assert result == CommitResult(version=1)
    assert result.committed and not result.duplicate
    snap = table.snapshot()
    assert snap == TableSnapshot(1, (file,))
    assert snap.rows == 3
    assert file.size == table.storage.backend.stat(file.path).size
    (entry,) = table.entries_after(0)
    assert entry.version == 1 and entry.added == (file,) and entry.removed == ()
    assert entry.operation == "WRITE"


def test_one_commit_may_add_several_files(table):
    files = [write_part(table.storage, "r1", step, f"s{step}") for step in range(3)]
    assert table.commit(files).version == 1
    assert table.snapshot().files == tuple(sorted(files, key=lambda f: f.path))


def test_partition_values_stay_typed_in_deltalake_and_polars(table):
    table.commit([write_part(table.storage, "0042", 7, "a", rows=3)])
    table.commit([write_part(table.storage, "007", 12, "b", rows=2)])
    arrow = DeltaTable(table.uri).to_pyarrow_table()
    assert arrow.schema.field("run_id").type == pa.string()
    assert arrow.schema.field("step").type == pa.int32()
    pairs = zip(arrow["run_id"].to_pylist(), arrow["step"].to_pylist(), strict=True)
    assert sorted(set(pairs)) == [("0042", 7), ("007", 12)]
    frame = pl.read_delta(table.uri)
    assert frame.schema["run_id"] == pl.String and frame.schema["step"] == pl.Int32
    lazy = pl.scan_delta(table.uri).filter(pl.col("run_id") == "0042")
    rows = lazy.collect().sort("sample_id")
    assert rows["run_id"].to_list() == ["0042"] * 3
    assert rows["step"].to_list() == [7, 7, 7]
    # The rows themselves read back typed: nested lists, the image struct, metadata.
    first = rows.row(0, named=True)
    assert first["tokens"] == [100, 7, 8, 9] and first["images"][0]["width"] == 56
    assert rows["metadata"].to_list() == [None, json.dumps({"i": 1}), None]
    # A plain Parquet reader reads the same file, without the partition columns.
    plain = pa.parquet.read_table(table.storage.backend.abspath(table.snapshot().files[0].path))
    assert plain.schema.names == ROLLOUT_SCHEMA.names


def test_a_versions_file_list_is_stable_after_later_commits_and_removals(table):
    for step in range(3):
        table.commit([write_part(table.storage, "keep", step, f"k{step}")])
        table.commit([write_part(table.storage, "gone", step, f"g{step}")])
    saved = table.snapshot()
    assert saved.version == 6 and len(saved.files) == 6
    for step in range(3, 9):  # past a checkpoint (every 5 versions here)
        table.commit([write_part(table.storage, "keep", step, f"k{step}")])
    removal = table.remove_run("gone")
    assert sorted(f.path for f in removal.files) == sorted(
        f.path for f in saved.files if f.run_id == "gone"
    )
    assert table.storage.backend.stat(removal.files[0].path) is not None  # bytes stay
    assert table.snapshot(saved.version) == saved
    fresh = RolloutTable(table.storage)  # opened from the log and its checkpoint, anew
    assert fresh.snapshot(saved.version) == saved
    latest = fresh.snapshot()
    assert latest.version == removal.version == 13
    assert {f.run_id for f in latest.files} == {"keep"} and len(latest.files) == 9
    assert fresh.remove_run("gone").version is None  # nothing left to remove


def test_remove_run_leaves_other_runs_and_is_in_the_log(table):
    a = write_part(table.storage, "a", 0, "a")
    b = write_part(table.storage, "b", 0, "b")
    table.commit([a])
    table.commit([b])
    removal = table.remove_run("a")
    assert removal.version == 3 and removal.files == (a,)
    assert table.snapshot().files == (b,)
    (entry,) = table.entries_after(2)
    assert entry.removed == (a.path,) and entry.added == ()


def test_versions_are_dense_and_entries_follow_them_one_by_one(table):
    files = [write_part(table.storage, "r", i, f"f{i}") for i in range(7)]
    versions = [table.commit([f]).version for f in files]
    assert versions == list(range(1, 8))
    entries = table.entries_after(0)
    assert [e.version for e in entries] == versions
    assert [e.added for e in entries] == [(f,) for f in files]
    assert [e.version for e in table.entries_after(3, limit=2)] == [4, 5]
    assert table.entries_after(7) == [] and table.log_entry(8) is None
    assert table.entries_after(-1)[0].version == 0  # the table's creation


def test_checkpoints_are_written_every_interval_and_opening_uses_them(table):
    for i in range(12):
        table.commit([write_part(table.storage, "r", i, f"f{i}")])
    table.join_checkpoint()  # written beside the commits, not on their path
    last = json.loads(table.storage.backend.read("rollouts/_delta_log/_last_checkpoint"))
    assert table.latest_version() - last["version"] < 5  # at most an interval behind
    # Without the JSON entries the checkpoint covers, every version from it on still opens.
    for version in range(last["version"] + 1):
        table.storage.backend.delete(f"rollouts/_delta_log/{version:020d}.json")
    fresh = RolloutTable(table.storage)
    assert len(fresh.snapshot().files) == 12
    assert len(fresh.snapshot(last["version"]).files) == last["version"]
    with pytest.raises(mmstore.TableVersionError, match="no longer be read") as info:
        fresh.snapshot(1)
    assert info.value.version == 1 and info.value.table == table.uri
    with pytest.raises(mmstore.TableVersionError, match="gone"):
        fresh.log_entry(1)
    assert fresh.log_entry(last["version"] + 1) is not None


# -- exactly-once producers ----------------------------------------------------------------


def test_a_retried_producer_seq_commits_nothing_twice(table):
    first = table.commit([write_part(table.storage, "r", 0, "a")], producer="sampler-0", seq=17)
    assert first.version == 1 and first.producer_seq == 17
    again = table.commit([write_part(table.storage, "r", 0, "b")], producer="sampler-0", seq=17)
    assert again == CommitResult(None, True, "sampler-0", 17, producer_seq=17)
    # A seq below the latest that the run never committed: refused, typed (issue 39.3).
    with pytest.raises(mmstore.ProducerConflictError, match="never committed"):
        table.commit([write_part(table.storage, "r", 0, "c")], producer="sampler-0", seq=3)
    other = table.commit([write_part(table.storage, "r", 0, "d")], producer="sampler-1", seq=0)
    assert other.version == 2  # another producer's seqs are its own
    nxt = table.commit([write_part(table.storage, "r", 0, "e")], producer="sampler-0", seq=18)
    assert nxt.version == 3
    names = [f.path.rsplit("-", 1)[1] for f in table.snapshot().files]
    assert names == ["a.parquet", "d.parquet", "e.parquet"]
    assert table.producer_seq("sampler-0") == 18 and table.producer_seq("nobody") is None


def test_producer_seqs_survive_a_checkpoint_and_a_fresh_open(table):
    for seq in range(7):  # past the checkpoint at 5 versions
        table.commit([write_part(table.storage, "r", 0, f"s{seq}")], producer="p", seq=seq)
    fresh = RolloutTable(table.storage)
    assert fresh.producer_seq("p") == 6
    retry = fresh.commit([write_part(table.storage, "r", 0, "retry")], producer="p", seq=4)
    assert retry.duplicate and len(fresh.snapshot().files) == 7


@pytest.mark.slow
def test_a_crash_after_the_commit_then_a_retry_in_another_process_commits_nothing(table):
    crashed = subprocess.run(
        [sys.executable, WORKERS, "crash", table.storage.root, "--name", "one",
         "--producer", "sampler-3", "--seq", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert crashed.returncode == 17, crashed.stderr  # died without a word after committing
    retry_file = write_part(table.storage, "crash", 0, "one", rows=3)  # the same file again
    retry = table.commit([retry_file], producer="sampler-3", seq=5)
    # The pair's entry lists this very file: it is this commit, made already (issue 39.1).
    assert not retry.duplicate and retry.version == 1 and retry.producer_seq == 5
    assert table.snapshot().files == (retry_file,)
    assert [e.producers for e in table.entries_after(0)] == [(("run_id=crash/sampler-3", 5),)]


@pytest.mark.slow
def test_racing_commits_of_the_same_pair_commit_once(table):
    out = run_workers("same-pair", table.storage.root, "--procs", "3", "--commits", "6")
    assert out["exit_codes"] == [0, 0, 0]
    attempts = [a for child in out["results"] for a in child]
    for seq in range(6):
        this = [a for a in attempts if a["seq"] == seq]
        assert sum(not a["dup"] for a in this) == 1, this
        assert all(a["dup"] == (a["version"] is None) for a in this)
    won = sorted(a["path"] for a in attempts if not a["dup"])
    assert sorted(f.path for f in table.snapshot().files) == won
    assert table.latest_version() == 6
    key = "run_id=pair/p"  # the producer's key in its run (issue 39.3)
    assert [e.producers for e in table.entries_after(0)] == [((key, s),) for s in range(6)]


# -- concurrent writers ----------------------------------------------------------------------


def check_concurrent_writers(table: RolloutTable, out: dict, procs: int, commits: int) -> None:
    """Every committed file is in the latest version exactly once, and the versions the
    commits made are exactly 1..N, each adding the file its committer reported."""
    assert out["exit_codes"] == [0] * procs
    done = [c for child in out["results"] for c in child]
    assert len(done) == procs * commits and not any(c["dup"] for c in done)
    assert sorted(c["version"] for c in done) == list(range(1, procs * commits + 1))
    snap = table.snapshot()
    assert snap.version == procs * commits
    paths = [f.path for f in snap.files]
    assert len(paths) == len(set(paths))
    assert sorted(paths) == sorted(c["path"] for c in done)
    by_version = {e.version: e for e in table.entries_after(0)}
    assert sorted(by_version) == list(range(1, procs * commits + 1))
    for c in done:
        assert [f.path for f in by_version[c["version"]].added] == [c["path"]]
    for index in range(procs):  # each producer's seqs in its own commit order
        mine = [c["version"] for c in out["results"][index]]
        assert mine == sorted(mine)
        assert table.producer_seq(f"w{index}") == commits - 1


@pytest.mark.slow
def test_four_writer_processes_commit_every_file_once_locally(table):
    out = run_workers("writers", table.storage.root, "--procs", "4", "--commits", "25")
    check_concurrent_writers(table, out, 4, 25)


@pytest.mark.slow  # ~20 s: moto_server answers every request of 100 racing commits alone
def test_four_writer_processes_commit_every_file_once_on_s3(s3_storage, s3_options):
    table = RolloutTable(s3_storage, checkpoint_interval=20)
    table.create()
    out = run_workers(
        "writers", s3_storage.root, "--s3", json.dumps(s3_options), "--procs", "4",
        "--commits", "25",
    )  # fmt: skip
    check_concurrent_writers(table, out, 4, 25)
    typed = pl.read_delta(table.uri, storage_options=table.storage_options)
    assert typed.schema["run_id"] == pl.String and typed.schema["step"] == pl.Int32
    assert typed.height == 100


def test_s3_table_reads_versions_removes_and_dedups(s3_storage):
    table = RolloutTable(s3_storage, checkpoint_interval=3)
    table.create()
    files = [write_part(s3_storage, "0042", i, f"f{i}") for i in range(4)]
    for i, f in enumerate(files):
        assert table.commit([f], producer="p", seq=i).version == i + 1
    again = write_part(s3_storage, "0042", 2, "again")  # seq 2's rows, another file
    assert table.commit([again], producer="p", seq=2).duplicate
    saved = table.snapshot(2)
    assert table.remove_run("0042").version == 5
    assert RolloutTable(s3_storage).snapshot(2) == saved and table.snapshot().files == ()
    assert [e.version for e in table.entries_after(3)] == [4, 5]
    arrow = DeltaTable(table.uri, version=4, storage_options=table.storage_options)
    assert arrow.to_pyarrow_table().schema.field("step").type == pa.int32()


def test_on_s3_commits_are_mmstores_own_entries_put_if_absent(s3_storage, monkeypatch):
    """With boto3, an S3 commit is a conditional PUT of mmstore's own log entry (no delta-rs
    snapshot of every live file); a PUT of a version another commit took is refused by the
    store, and the commit goes on at the next version."""
    assert s3_storage.backend.conditional_put
    table = RolloutTable(s3_storage)
    table.create()
    other = RolloutTable(s3_storage)  # another writer, behind: it last read version 0
    other.latest_version()
    assert table.commit([write_part(s3_storage, "r", 0, "a")]).version == 1
    entry = json.loads(table._log.read_json(1).splitlines()[0])  # commitInfo first
    assert entry["commitInfo"]["engineInfo"] == "mmstore"
    assert not s3_storage.backend.put_if_absent(
        "rollouts/_delta_log/00000000000000000001.json", b"{}"
    )  # the store itself refuses to replace an entry
    assert other.commit([write_part(s3_storage, "r", 1, "b")]).version == 2
    assert [f.path.split("/")[-1][:6] for f in table.snapshot().files] == ["part-a", "part-b"]


def test_s3_options_without_a_boto3_twin_commit_through_delta_rs():
    from mmstore._storage.backends import conditional_put_client

    assert conditional_put_client({"role_arn": "arn:aws:iam::1:role/x"}) is None
    assert conditional_put_client({"anonymous": True}) is None


# -- schema evolution ------------------------------------------------------------------------


def test_a_new_nullable_column_reads_as_null_in_files_without_it(table):
    old = write_part(table.storage, "r", 0, "old", rows=2)
    table.commit([old])
    column = pa.field("extra_score", pa.int64())
    assert table.add_columns([column]) == 2
    assert table.add_columns([column]) is None  # already there: no commit
    new = write_part(table.storage, "r", 1, "new", rows=2, extra_column=True)
    table.commit([new])
    frame = pl.read_delta(table.uri).sort("sample_id")
    assert frame.schema["extra_score"] == pl.Int64
    assert frame["extra_score"].to_list() == [0, 1, None, None]
    arrow = DeltaTable(table.uri).to_pyarrow_table()
    assert sorted(arrow["extra_score"].to_pylist(), key=str) == [0, 1, None, None]
    # An older version keeps its schema.
    assert "extra_score" not in pl.read_delta(table.uri, version=1).columns
    with pytest.raises(mmstore.InvalidArgumentError, match="nullable"):
        table.add_columns([pa.field("x", pa.int64(), nullable=False)])


# -- errors, arguments, plain data -----------------------------------------------------------


def test_a_store_without_a_table_raises_a_typed_error(storage):
    table = RolloutTable(storage)
    with pytest.raises(mmstore.TableNotFoundError, match="no rollouts table") as info:
        table.latest_version()
    assert isinstance(info.value, FileNotFoundError) and info.value.table == table.uri
    with pytest.raises(mmstore.TableNotFoundError):
        table.commit([write_part(storage, "r", 0, "a")])


def test_a_version_the_table_does_not_have_raises(table):
    table.commit([write_part(table.storage, "r", 0, "a")])
    expected = re.escape("no version 5 (latest is 1)")
    with pytest.raises(mmstore.TableVersionError, match=expected) as info:
        table.snapshot(5)
    assert isinstance(info.value, LookupError)
    assert info.value.version == 5 and info.value.table == table.uri
    for bad in (-1, True, "3", 1.0):
        with pytest.raises(mmstore.InvalidArgumentError):
            table.snapshot(bad)


@pytest.mark.parametrize(
    "change",
    [
        {"path": "rollouts/run_id=r/step=1/part-x.parquet"},  # another step's directory
        {"path": "rollouts/run_id=r/step=0/sub/part-x.parquet"},
        {"path": "rollouts/run_id=r/step=0/part-x.json"},
        {"path": "rollouts/run_id=r/step=0/_hidden.parquet"},
        {"run_id": "../r"},
        {"step": -1},
        {"step": 2**31},
        {"step": True},
        {"size": -5},
        {"rows": 1.5},
    ],
)
def test_a_malformed_file_is_refused_and_nothing_is_committed(table, change):
    fields = {"path": "rollouts/run_id=r/step=0/part-x.parquet", "run_id": "r", "step": 0,
              "size": 10, "rows": 1, **change}  # fmt: skip
    with pytest.raises(mmstore.InvalidArgumentError):
        table.commit([TableFile(**fields)])
    assert table.latest_version() == 0


def test_commit_arguments_are_checked(table):
    file = write_part(table.storage, "r", 0, "a")
    for kwargs in ({"producer": "p"}, {"seq": 1}, {"producer": "", "seq": 1},
                   {"producer": "p", "seq": -1}, {"producer": "p", "seq": True}):  # fmt: skip
        with pytest.raises(mmstore.InvalidArgumentError):
            table.commit([file], **kwargs)
    with pytest.raises(mmstore.InvalidArgumentError):
        table.commit([])
    with pytest.raises(mmstore.InvalidArgumentError):
        table.commit(file)  # type: ignore[arg-type]
    assert table.latest_version() == 0


def test_a_commit_that_keeps_conflicting_gives_up_with_a_typed_error(table, monkeypatch):
    # Another writer that always wins the next version (and whose entry cannot be read).
    monkeypatch.setattr(log_module, "LOG_COMMIT_ATTEMPTS", 3)
    monkeypatch.setattr(table._log, "_put_entry", lambda version, text: False)
    with pytest.raises(mmstore.TableConflictError, match="3 attempts") as info:
        table.commit([write_part(table.storage, "r", 0, "a")], producer="p", seq=0)
    assert isinstance(info.value, RuntimeError) and info.value.table == table.uri
    assert table.latest_version() == 0


@pytest.mark.parametrize("log_writer", [True, False], ids=["own log", "delta-rs"])
def test_a_removal_that_keeps_conflicting_gives_up_with_a_typed_error(
    table, monkeypatch, log_writer
):
    table.commit([write_part(table.storage, "r", 0, "a")])
    backend = type(table.storage.backend)
    if log_writer:  # another writer that always wins the next version
        real = backend.write_atomic

        def loses(self, rel, data, **kwargs):
            return False if "_delta_log/" in rel else real(self, rel, data, **kwargs)

        monkeypatch.setattr(delta_module, "LOG_COMMIT_ATTEMPTS", 3)
        monkeypatch.setattr(backend, "write_atomic", loses)
    else:  # a store that cannot put if absent: delta-rs removes

        def always_loses(*args, **kwargs):
            raise CommitFailedError("Failed to commit transaction: Concurrent transaction failed.")

        monkeypatch.setattr(backend, "puts_if_absent", property(lambda self: False))
        monkeypatch.setattr(delta_module, "COMMIT_ATTEMPTS", 3)
        monkeypatch.setattr(table._delta, "_transact", always_loses)
    with pytest.raises(mmstore.TableConflictError, match="3 attempts") as info:
        table.remove_run("r")
    assert info.value.table == table.uri
    assert table.latest_version() == 1


# -- mmstore's own log writer (local stores) -------------------------------------------------


def test_a_commit_writes_a_protocol_correct_log_entry_that_delta_rs_reads(table):
    file = write_part(table.storage, "0042", 3, "a", rows=2)
    result = table.commit([file], producer="sampler-0", seq=9)
    raw = table.storage.backend.read(f"rollouts/_delta_log/{result.version:020d}.json")
    actions = [json.loads(line) for line in raw.decode().splitlines()]
    assert [next(iter(a)) for a in actions] == ["commitInfo", "txn", "add"]
    info, txn, add = actions[0]["commitInfo"], actions[1]["txn"], actions[2]["add"]
    assert info["operation"] == "WRITE" and info["timestamp"] > 0
    assert len(info[log_module.COMMIT_ID_KEY]) == 32
    key = "run_id=0042/sampler-0"  # the producer in its run (issue 39.3)
    assert txn["appId"] == key and txn["version"] == 9 and txn["lastUpdated"] > 0
    assert add["path"] == "run_id=0042/step=3/part-a.parquet"
    assert add["partitionValues"] == {"run_id": "0042", "step": "3"}
    assert add["size"] == file.size and add["dataChange"] is True
    assert add["modificationTime"] > 0 and json.loads(add["stats"]) == {"numRecords": 2}
    delta = DeltaTable(table.uri)
    assert delta.version() == 1 and delta.transaction_version(key) == 9
    assert delta.history(1)[0]["operation"] == "WRITE"
    assert delta.to_pyarrow_table().num_rows == 2


@pytest.mark.slow
def test_a_warm_commit_reads_two_entries_whatever_the_tables_size(table, monkeypatch):
    """No listing, no checkpoint, no replay, no delta-rs table: one failed read of the next
    version's entry and one of the newest it read (still there: no other engine cleaned the
    log up past it), then the entry is written; at 3 files as at 40 (past checkpoints)."""
    # (one read more than before round 4: see test_log_trust's writer that read the log
    # before a cleanup)

    def no_delta_rs_table():
        raise AssertionError("a commit loaded the table's files through delta-rs")

    monkeypatch.setattr(table._delta, "_table", no_delta_rs_table)
    backend = type(table.storage.backend)
    seen: list[str] = []
    real_read, real_list = backend.read, backend.list
    monkeypatch.setattr(backend, "read", lambda b, rel: seen.append(rel) or real_read(b, rel))
    monkeypatch.setattr(
        backend, "list", lambda b, rel: seen.append(f"list {rel}") or real_list(b, rel)
    )
    for i in range(40):
        file = write_part(table.storage, "r", i, f"f{i}")
        seen.clear()
        version = table.commit([file], producer="p", seq=i).version
        if i in (2, 39):
            entries = [f"rollouts/_delta_log/{v:020d}.json" for v in (version, version - 1)]
            # (the newest is not read again where it is the checkpoint this head read)
            assert seen in (entries, entries[:1]), (i, seen)
    table.join_checkpoint()  # checkpoints (every 5 versions) were written beside
    last = real_read(table.storage.backend, "rollouts/_delta_log/_last_checkpoint")
    assert json.loads(last)["version"] == 39  # delta-rs's rule: the versions 4, 9, ...
    assert len(RolloutTable(table.storage).snapshot().files) == 40


def test_a_stale_table_object_reads_the_commits_it_missed(table):
    """Two table objects of one store (two processes): each commit finds the version
    after what the other committed, and the producer seqs it recorded."""
    other = RolloutTable(table.storage)
    assert table.commit([write_part(table.storage, "r", 0, "a")], producer="p", seq=0).version == 1
    assert other.commit([write_part(table.storage, "r", 0, "b")], producer="p", seq=1).version == 2
    assert other.remove_run("r").version == 3  # a delta-rs commit in between
    again = table.commit([write_part(table.storage, "r", 0, "c")], producer="p", seq=1)
    assert again.duplicate and again.producer_seq == 1
    assert table.commit([write_part(table.storage, "q", 0, "d")], producer="p", seq=2).version == 4
    assert [f.path for f in other.snapshot().files] == ["rollouts/run_id=q/step=0/part-d.parquet"]


@pytest.mark.slow
def test_the_latest_snapshot_follows_the_log_near_and_far_behind(table):
    """A table object keeps the latest version's files up to date from the log: after a
    few commits it reads only their entries; far behind (past a checkpoint) it reopens.
    Either way it lists what a fresh open lists."""
    other = RolloutTable(table.storage, checkpoint_interval=5)
    assert table.snapshot().files == ()
    for count in (2, 17):  # near (below the interval), then far behind
        for i in range(count):
            other.commit(
                [write_part(table.storage, "keep" if i % 2 else "gone", i, f"{count}-{i}")]
            )
        other.remove_run("gone")
        other.join_checkpoint()
        fresh = RolloutTable(table.storage)
        assert table.snapshot() == fresh.snapshot() == table.replay()
        assert table.latest_version() == fresh.latest_version()
        assert table.snapshot(table.latest_version()) == fresh.snapshot()


def test_a_protocol_the_log_writer_does_not_follow_is_refused(table):
    table.commit([write_part(table.storage, "r", 0, "a")])
    DeltaTable(table.uri).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    with pytest.raises(mmstore.SchemaVersionError, match="writer version 4") as info:
        table.commit([write_part(table.storage, "r", 0, "b")])
    assert info.value.table == table.uri and table.latest_version() == 2


def test_results_are_plain_data_that_pickle(table):
    file = write_part(table.storage, "r", 0, "a")
    result = table.commit([file], producer="p", seq=0)
    for value in (result, table.snapshot(), table.entries_after(0), table.remove_run("r")):
        assert pickle.loads(pickle.dumps(value)) == value
    clone = pickle.loads(pickle.dumps(table))
    assert clone.latest_version() == table.latest_version()


@pytest.mark.slow
def test_a_forked_child_gets_a_typed_error_instead_of_a_panic(table):
    file = write_part(table.storage, "r", 0, "a")
    table.commit([file])
    report = run_workers("fork-guard", table.storage.root)
    assert report["delta"] == "TableForkError", report  # a commit needs delta-rs: refused
    assert "forked child" in report["message"]
    assert report["log_entry_version"] == 1  # reading the log's JSON needs no delta-rs
    # Reading a version replays the log without delta-rs: the parent's answer.
    assert report["latest_in_child"] == 1 and report["files_in_child"] == [file.path]
    assert report["parent_after_fork"] == 1


@pytest.mark.slow
def test_replaying_the_log_without_delta_rs_gives_every_versions_files(table):
    """Commits, removals and checkpoints (every 5 versions here): the Python replay agrees
    with delta-rs on every version, and on the latest."""
    for step in range(12):
        table.commit([write_part(table.storage, "keep" if step % 3 else "gone", step, f"f{step}")])
        if step == 7:
            table.remove_run("gone")
    latest = table.latest_version()
    assert latest == 13
    for version in range(latest + 1):
        assert table.replay(version) == table.snapshot(version), version
    assert table.replay() == table.snapshot()
    with pytest.raises(mmstore.TableVersionError, match="no version 14"):
        table.replay(14)
    with pytest.raises(mmstore.TableNotFoundError):
        RolloutTable(Storage.open(table.storage.root + "-none", create=True)).replay()


def test_s3_options_translate_to_delta_rs_options(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    options = {"endpoint_override": "127.0.0.1:9000", "scheme": "http", "access_key": "k",
               "secret_key": "s", "region": "eu-west-1", "allow_bucket_creation": True}  # fmt: skip
    assert delta_s3_options(options) == {
        "conditional_put": "etag",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://minio.example:443")
    monkeypatch.setenv("AWS_REGION", "us-east-2")
    assert delta_s3_options(None) == {
        "conditional_put": "etag",
        "AWS_ENDPOINT_URL": "https://minio.example:443",
        "AWS_REGION": "us-east-2",
    }


def test_table_schema_is_the_row_schema_plus_partitions():
    assert TABLE_SCHEMA.names == [*ROLLOUT_SCHEMA.names, "run_id", "step"]
    assert rollout_rows("x", 2).schema.equals(ROLLOUT_SCHEMA)
