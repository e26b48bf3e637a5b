"""The log as other Delta engines leave it: mmstore reads only what it can read exactly.

Entries written here by hand are what another committer (Spark, delta-rs, a tool) writes:
newline-delimited JSON actions put at the next version. What mmstore must do with them:
refuse deletion vectors (it would train deleted rows), refuse paths outside the table (it
would read, verify and export another store's files), name a damaged entry and the way
back, refuse files another engine's compaction rewrote without mmstore's footer (and tell a
follower which adds only rearrange rows), survive a log cleanup, and say plainly when a
version is no longer readable.
"""

from __future__ import annotations

import json
import os
import time

import pytest

import mmstore
from mmstore._lifecycle.gc import disk_usage

LOG_DIR = "rollouts/_delta_log"

TOKENS = {"tokens": [1, 2, 3], "prompt_len": 1, "loss_mask": [0, 1, 1]}


def write(store: mmstore.Store, run_id: str, step: int, n: int = 1) -> list[str]:
    with store.writer(run_id=run_id, step=step) as w:
        for i in range(n):
            w.write(mmstore.Rollout(sample_id=f"{run_id}-{step}-{i}", **TOKENS))
    return list(w.committed)


def entry_path(store: mmstore.Store, version: int) -> str:
    return store.backend.abspath(f"{LOG_DIR}/{version:020d}.json")


def actions(store: mmstore.Store, version: int) -> list[dict]:
    with open(entry_path(store, version)) as f:
        return [json.loads(line) for line in f if line.strip()]


def put(store: mmstore.Store, lines: list[dict] | str) -> int:
    """Put an entry at the next version, as another committer would; return its version."""
    version = 0
    while os.path.exists(entry_path(store, version)):
        version += 1
    text = lines if isinstance(lines, str) else "".join(json.dumps(a) + "\n" for a in lines)
    with open(entry_path(store, version), "x") as f:
        f.write(text)
    return version


def info(operation: str) -> dict:
    return {"commitInfo": {"timestamp": int(time.time() * 1000), "operation": operation}}


def an_add(store: mmstore.Store) -> dict:
    """The add action of the first file mmstore committed (version 1)."""
    return next(a["add"] for a in actions(store, 1) if "add" in a)


def readers(store: mmstore.Store, processor):
    """Every way a reader gets at the latest version: the store object that followed the
    log (mmstore's own reading), a fresh one (delta-rs opens it), a dataset, the rows, the
    log follower's entries."""
    return {
        "files": lambda: store.files(),
        "fresh files": lambda: mmstore.Store.open(store.root).files(),
        "dataset": lambda: mmstore.RolloutDataset(store, processor),
        "rows": lambda: store.rollouts(),
        "entries": lambda: store.table.entries_after(0),
        "replay": lambda: store.table.replay(),
        "live": lambda: follow(store, processor),
    }


def live_loader(store: mmstore.Store, processor, batch_size: int = 1) -> mmstore.LiveLoader:
    """A live loader of run r1 from the start of the log."""
    settings = mmstore.Materialize(dtype="float32", node_cache_bytes=0)
    return mmstore.LiveLoader(
        store, processor, runs="r1", batch_size=batch_size, materialize=settings
    )


def drain(live: mmstore.LiveLoader) -> list[str]:
    """The samples of every step until none comes within a second."""
    trained: list[str] = []
    while True:
        try:
            trained += [s for b in live.next_step(timeout=1) for s in b["sample_ids"]]
        except mmstore.LiveTimeoutError:
            return trained


def follow(store: mmstore.Store, processor) -> list[str]:
    """A live loader's samples from the start of the log (its error, if the log holds what
    it must refuse)."""
    with live_loader(store, processor) as live:
        return drain(live)


# -- 4: deletion vectors -------------------------------------------------------------------


def enable_deletion_vectors(store: mmstore.Store) -> int:
    """Another engine's ALTER TABLE ... SET TBLPROPERTIES (delta.enableDeletionVectors)."""
    metadata = next(a["metaData"] for a in actions(store, 0) if "metaData" in a)
    metadata["configuration"]["delta.enableDeletionVectors"] = "true"
    protocol = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors"],
    }
    return put(store, [info("SET TBLPROPERTIES"), {"protocol": protocol}, {"metaData": metadata}])


def delete_a_row(store: mmstore.Store) -> int:
    """Another engine's DELETE of one row of the first file: the file stays, a deletion
    vector (here inline) marks the row deleted."""
    add = an_add(store)
    vector = {
        "storageType": "i",
        "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f",
        "offset": None,
        "sizeInBytes": 36,
        "cardinality": 1,
    }
    remove = {"path": add["path"], "dataChange": True, "deletionTimestamp": 1}
    return put(
        store, [info("DELETE"), {"remove": remove}, {"add": {**add, "deletionVector": vector}}]
    )


def test_a_table_with_deletion_vectors_is_refused_naming_the_feature(store, small_processor):
    write(store, "r1", 0, 2)
    write(store, "r1", 1)
    store.files()  # the store object follows the log from here on
    enabled = enable_deletion_vectors(store)
    delete_a_row(store)
    for name, read in readers(store, small_processor).items():
        with pytest.raises(mmstore.SchemaVersionError, match="deletionVectors") as caught:
            read()
        assert caught.value.feature == "deletionVectors", name
    assert len(store.files(enabled - 1)) == 2  # versions before it read as they did
    with pytest.raises(mmstore.SchemaVersionError):
        write(store, "r1", 2)  # no commit onto a table mmstore cannot read either


def test_an_add_with_a_deletion_vector_is_refused_without_the_protocol(store, small_processor):
    # However the protocol was changed (a checkpoint mmstore's replay does not start from,
    # a hand-made log), a file with deleted rows is never read as whole.
    write(store, "r1", 0, 2)
    delete_a_row(store)
    for name in ("files", "entries", "replay", "dataset", "live"):
        with pytest.raises(mmstore.SchemaVersionError, match="deletionVectors"):
            readers(store, small_processor)[name]()


def test_a_column_mapped_table_is_refused(store):
    write(store, "r1", 0)
    store.files()
    put(
        store,
        [info("SET TBLPROPERTIES"), {"protocol": {"minReaderVersion": 2, "minWriterVersion": 5}}],
    )
    with pytest.raises(mmstore.SchemaVersionError, match="columnMapping"):
        store.files()


# -- 5: paths outside the table ------------------------------------------------------------


OUTSIDE = [
    "../../other/rollouts/run_id=r1/step=0/part-x.parquet",
    "run_id=r1/step=0/../../../../other/rollouts/run_id=r1/step=0/part-x.parquet",
    "run_id=r1/step=0/%2E%2E/%2E%2E/%2E%2E/other/part-x.parquet",
    "/abs/other/rollouts/run_id=r1/step=0/part-x.parquet",
    "file:///abs/other/rollouts/run_id=r1/step=0/part-x.parquet",
    "s3://bucket/other/rollouts/run_id=r1/step=0/part-x.parquet",
    "run_id=r1//step=0/part-x.parquet",
]


@pytest.mark.parametrize("path", OUTSIDE)
def test_a_log_path_outside_the_table_is_refused_by_every_reader(tmp_path, path, small_processor):
    other = mmstore.Store.open(tmp_path / "other", create=True)
    (foreign,) = write(other, "r1", 0)
    store = mmstore.Store.open(tmp_path / "store", create=True)
    write(store, "r1", 0)
    store.files()
    logged = path.replace("part-x.parquet", foreign.rsplit("/", 1)[1])
    if logged.startswith(("/abs", "file:///abs")):
        logged = logged.replace("/abs", str(tmp_path))
    add = {**an_add(store), "path": logged}
    version = put(store, [info("WRITE"), {"add": add}])
    for name, read in readers(store, small_processor).items():
        with pytest.raises(mmstore.CorruptFileError, match="outside the rollouts table") as caught:
            read()
        assert caught.value.context.get("version") in (version, None), name
    with pytest.raises(mmstore.CorruptFileError, match="outside"):
        mmstore.verify(store)
    dest = tmp_path / "exports" / "dest"
    with pytest.raises(mmstore.CorruptFileError, match="outside"):
        mmstore.export(store, dest)
    assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").rglob("*"))


def test_a_removal_outside_the_table_is_refused_too(store):
    write(store, "r1", 0)
    put(store, [info("DELETE"), {"remove": {"path": "../../x.parquet", "dataChange": True}}])
    with pytest.raises(mmstore.CorruptFileError, match="outside"):
        store.table.entries_after(0)


# -- 20: damaged entries -------------------------------------------------------------------


def damaged(store: mmstore.Store, kind: str) -> str:
    add = an_add(store)
    text = json.dumps(info("WRITE")) + "\n"
    if kind == "torn":
        return text + json.dumps({"add": add})[:40]
    if kind == "garbage":
        return "\x00\x13garbage\xff\n"
    if kind == "no partition values":
        return text + json.dumps({"add": {k: v for k, v in add.items() if k != "partitionValues"}})
    if kind == "non-numeric size":
        return text + json.dumps({"add": {**add, "size": "12x"}})
    if kind == "a list":
        return text + "[1, 2]\n"
    raise AssertionError(kind)


KINDS = ["torn", "garbage", "no partition values", "non-numeric size", "a list"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_entry_is_named_with_its_version_and_the_way_back(store, kind, small_processor):
    write(store, "r1", 0)
    store.files()
    version = put(store, damaged(store, kind))
    for name, read in readers(store, small_processor).items():
        with pytest.raises(mmstore.CorruptFileError, match="damaged") as caught:
            read()
        err = caught.value
        assert err.version == version, name
        assert f"{version:020d}.json" in str(err) and "Restore it from a copy" in str(err), name
    assert len(store.files(1)) == 1  # the versions before it read as they did


@pytest.mark.parametrize("kind", ["torn", "garbage"])
def test_a_commit_after_a_torn_entry_is_refused_typed(store, kind):
    write(store, "r1", 0)
    version = put(store, damaged(store, kind))
    with pytest.raises(mmstore.CorruptFileError, match="damaged") as caught:
        write(store, "r1", 1)
    assert caught.value.version == version


# -- 8: other engines' compaction and log cleanup ------------------------------------------


def test_a_compaction_by_delta_rs_is_refused_naming_the_file_and_the_way_back(
    store, small_processor
):
    from deltalake import DeltaTable

    for _ in range(3):
        write(store, "r1", 0)
    DeltaTable(store.table.uri).optimize.compact()
    (entry,) = store.table.entries_after(3)
    assert entry.operation == "OPTIMIZE"
    (new,) = entry.added
    assert entry.rearranged == {new.path, *entry.removed}  # nothing to train again
    with pytest.raises(mmstore.SchemaVersionError, match=r"no mmstore footer") as caught:
        mmstore.RolloutDataset(store, small_processor)
    err = caught.value
    assert err.file == new.path and err.added_at == 4
    assert "restore(3)" in str(err) and "OPTIMIZE" in str(err)
    # The way back works: the table as it was, mmstore's files read again.
    DeltaTable(store.table.uri).restore(3)
    fresh = mmstore.Store.open(store.root)
    assert len(mmstore.RolloutDataset(fresh, small_processor)) == 3


def test_a_live_loader_trains_each_row_once_across_a_compaction(store, small_processor):
    # delta-rs compacts the files of a step a live loader is half-way through: the rewrite
    # is not trained again, and the rows it moved are not lost either (they are trained from
    # the files they were committed in). A loader started after it trains every row once.
    def commit(c: int, step: int = 0) -> None:
        with store.writer(run_id="r1", step=step) as w:
            w.write_many(mmstore.Rollout(sample_id=f"c{c}-{i}", **TOKENS) for i in range(2))

    from deltalake import DeltaTable

    for c in range(3):
        commit(c)
    every = [f"c{c}-{i}" for c in range(4) for i in range(2)]
    with live_loader(store, small_processor, batch_size=2) as running:
        first = [s for b in running.next_step(timeout=5) for s in b["sample_ids"]]
        DeltaTable(store.table.uri).optimize.compact()
        assert store.table.entries_after(3)[0].operation == "OPTIMIZE"
        commit(3, step=1)
        assert first + drain(running) == every
    with live_loader(store, small_processor, batch_size=2) as fresh:
        assert drain(fresh) == every


def test_a_rewrite_that_keeps_the_footers_is_marked_for_followers(store):
    # Another engine moves mmstore's file (same bytes, footer kept) without changing rows:
    # dataChange false on both actions. The entry says so; replay lists the new file.
    (path,) = write(store, "r1", 0)
    data = store.backend.read(path)
    moved = path.replace(".parquet", "-moved.parquet")
    store.backend.write_atomic(moved, data)
    add = an_add(store)
    relative = moved.removeprefix("rollouts/")
    version = put(
        store,
        [
            info("OPTIMIZE"),
            {"remove": {"path": add["path"], "dataChange": False, "deletionTimestamp": 1}},
            {"add": {**add, "path": relative, "dataChange": False}},
        ],
    )
    (entry,) = store.table.entries_after(version - 1)
    assert entry.rearranged == {path, moved}
    assert [f.path for f in store.table.replay().files] == [moved]
    (first,) = store.table.entries_after(0, limit=1)
    assert first.rearranged == frozenset()  # mmstore's own commits change data


def cleaned_up(store: mmstore.Store, commits: int = 23) -> list[str]:
    """``commits`` one-file commits (a checkpoint at version 19), then delta-rs's
    cleanup_metadata() with a zero log retention: the entries below the checkpoint go."""
    from deltalake import DeltaTable

    files = [p for step in range(commits) for p in write(store, "r1", step)]
    store.table.join_checkpoint()
    table = DeltaTable(store.table.uri)
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    time.sleep(0.05)
    DeltaTable(store.table.uri).cleanup_metadata()
    assert store.backend.stat(f"{LOG_DIR}/{1:020d}.json") is None  # really cleaned up
    return files


def test_a_log_cleanup_by_delta_rs_breaks_neither_gc_verify_nor_release(store):
    files = cleaned_up(store)
    for each in (store, mmstore.Store.open(store.root)):  # the one that followed, a fresh one
        assert sorted(f.path for f in each.files()) == sorted(files)
        report = mmstore.gc(each, grace_seconds=0)
        assert report.rollout_files_deleted == [] and report.table_version == 24
        assert mmstore.verify(each, grace_seconds=0).ok
        assert all(each.backend.stat(p) is not None for p in files)
    fresh = mmstore.Store.open(store.root)
    release = mmstore.release_run(fresh, "r1", grace_seconds=3600)
    assert sorted(release.removed_files) == sorted(files) and release.version == 25
    assert release.gc.rollout_files_deleted == []  # kept through the grace period
    assert sorted(mmstore.gc(fresh, grace_seconds=0).rollout_files_deleted) == sorted(files)


# -- 21: versions gc has collected ---------------------------------------------------------


def test_a_collected_version_says_so_and_pins_refuse_it(store, small_processor):
    write(store, "r1", 0)
    write(store, "r2", 0)
    mmstore.release_run(store, "r1", grace_seconds=0)  # version 3; gc collects r1's file
    for version in (1, 2):
        with pytest.raises(mmstore.TableVersionError, match="no longer readable") as caught:
            mmstore.RolloutDataset(store, small_processor, version=version)
        assert caught.value.version == version and caught.value.removed_at == 3
        assert "readable_versions" in str(caught.value)
        with pytest.raises(mmstore.TableVersionError, match="no longer readable"):
            mmstore.pin_rows(store, "ckpt", version=version)
        with pytest.raises(mmstore.TableVersionError, match="no longer readable"):
            store.rollouts(version=version)
        with pytest.raises(mmstore.TableVersionError, match="no longer readable"):
            mmstore.export(store, store.root + f"-export-{version}", version=version)
    assert mmstore.list_pins(store) == {}
    assert mmstore.readable_versions(store) == [0, 3]
    other = mmstore.Store.open(store.root.replace("/store", "/other"), create=True)
    write(other, "r1", 0)
    write(other, "r2", 0)
    assert mmstore.readable_versions(other) == [0, 1, 2]
    mmstore.pin_rows(store, "ckpt", version=3)  # a readable one pins as before
    assert len(mmstore.RolloutDataset(store, small_processor, version=3)) == 1


# -- 24: history ---------------------------------------------------------------------------


def test_history_tells_a_release_from_a_write_and_names_no_absolute_path(tmp_path):
    from deltalake import DeltaTable

    store = mmstore.Store.open(tmp_path / "s", create=True)
    write(store, "r1", 0)
    mmstore.release_run(store, "r1", grace_seconds=3600)
    history = {h["version"]: h for h in DeltaTable(store.table.uri).history()}
    assert history[1]["operation"] == "WRITE"
    assert history[2]["operation"] == "DELETE"
    assert "r1" in history[2]["operationParameters"]["predicate"]
    assert history[0]["operation"] == "CREATE TABLE"
    assert str(tmp_path) not in json.dumps(history[0])


def test_a_writer_that_read_the_log_before_a_cleanup_commits_where_readers_look(store):
    # A long-lived producer read the log at version 1; another engine then committed, took
    # a checkpoint and cleaned up the entries below it. The producer's next commit must land
    # after the checkpoint: an entry put at a cleaned-up version is seen by no reader, and gc
    # would collect its file as an orphan.
    stale = mmstore.Store.open(store.root)
    write(stale, "r0", 0)
    cleaned_up(mmstore.Store.open(store.root))
    (late,) = write(stale, "r0", 1)
    fresh = mmstore.Store.open(store.root)
    assert late in [f.path for f in fresh.files()]
    assert mmstore.gc(fresh, grace_seconds=0).rollout_files_deleted == []


# -- 16: the log's checkpoints are collected with the versions nobody opens ---------------


def log_files(store: mmstore.Store) -> list[str]:
    return sorted(f.path.rsplit("/", 1)[-1] for f in store.backend.list(LOG_DIR))


def test_gc_bounds_the_log_and_every_version_it_keeps_still_opens(store):
    """85 one-file commits (checkpoints at 19, 39, 59, 79). Before: every entry and every
    checkpoint stays forever (each checkpoint lists every live file: the log grows with the
    square of the commits). gc collects the log below the newest checkpoint at or below
    what it must keep openable, counts it, and everything still reads."""
    from deltalake import DeltaTable

    files = [p for step in range(85) for p in write(store, "r1", step)]
    store.table.join_checkpoint()
    assert len(log_files(store)) == 86 + 4 + 1  # entries 0..85, checkpoints, the hint
    kept_for_grace = mmstore.gc(store, grace_seconds=3600)  # every version is young
    assert kept_for_grace.log_files_deleted == 0 and len(log_files(store)) == 91
    usage = disk_usage(store, grace_seconds=0)
    assert (usage.log_files, usage.log_free_now_files) == (91, 79 + 3)
    report = mmstore.gc(store, grace_seconds=0)
    assert report.log_files_deleted == 82 and report.log_bytes_freed == usage.log_free_now_bytes
    left = log_files(store)
    assert left[0] == f"{79:020d}.checkpoint.parquet" and len(left) == 1 + 7 + 1
    assert disk_usage(store, grace_seconds=0).log_free_now_files == 0
    # Everything reads: this store, a fresh one, delta-rs; commits go on; versions before
    # the checkpoint say plainly that they are gone.
    for each in (store, mmstore.Store.open(store.root)):
        assert sorted(f.path for f in each.files()) == sorted(files)
        assert each.table.first_version() == 79
        assert mmstore.readable_versions(each) == list(range(79, 86))
        assert mmstore.verify(each, grace_seconds=0).ok
    assert len(DeltaTable(store.table.uri).file_uris()) == 85
    more = write(store, "r1", 85)
    assert sorted(f.path for f in mmstore.Store.open(store.root).files()) == sorted(files + more)
    with pytest.raises(mmstore.TableVersionError):
        mmstore.Store.open(store.root).files(version=10)


def test_a_pinned_version_keeps_its_checkpoint_and_the_entries_after_it(store):
    for step in range(30):
        write(store, "r1", step)
    pinned = mmstore.pin_rows(store, "ckpt")  # version 30
    for step in range(30, 65):
        write(store, "r1", step)
    store.table.join_checkpoint()
    mmstore.gc(store, grace_seconds=0)
    assert store.table.first_version() == 19  # the newest checkpoint at or below 30
    assert len(store.files(version=30)) == 30 and pinned
    mmstore.unpin(store, "ckpt")
    mmstore.gc(store, grace_seconds=0)
    assert store.table.first_version() == 59


def test_a_collection_stopped_half_way_opens_from_its_checkpoint(store):
    """gc deletes the oldest first: killed half-way, entries are left below the checkpoint
    it keeps, and the oldest version that opens is still the checkpoint's."""
    for step in range(25):
        write(store, "r1", step)
    store.table.join_checkpoint()
    for version in range(6):  # what a gc killed after six deletes leaves
        os.unlink(entry_path(store, version))
    fresh = mmstore.Store.open(store.root)
    assert fresh.table.first_version() == 19
    assert mmstore.readable_versions(fresh) == list(range(19, 26))
    assert len(fresh.files()) == 25
