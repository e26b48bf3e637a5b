"""Lifecycle on the table's log: a release removes rows from the latest version only; gc
deletes bytes no needed version lists (the grace period, pins holding versions); an
interrupted release finishes when run again."""

from __future__ import annotations

import time

import pytest

import mmstore
from mmstore._lifecycle import gc as gc_module
from mmstore.synth import photo
from tests.rows import commit


def put(store, seeds):
    return [store.put_image(photo(seed, 48, 40)) for seed in seeds]


@pytest.fixture
def runs(store, adapter):
    shared, only_a, only_b = put(store, [1, 2, 3])
    files = {
        "a": commit(store, adapter, "a", 0, [[shared, only_a]]),
        "b": commit(store, adapter, "b", 0, [[shared, only_b]])
        + commit(store, adapter, "b", 1, [[only_b]]),
    }
    return store, files, {"shared": shared, "a": only_a, "b": only_b}


def there(store, paths):
    return [store.backend.stat(p) is not None for p in paths]


def test_released_rows_stay_readable_through_the_grace_period(runs, small_processor):
    store, files, media = runs
    before = mmstore.RolloutDataset(store, small_processor, shuffle=False)  # version 3
    report = mmstore.release_run(store, "b", grace_seconds=0.5)
    assert report.version == 4 and sorted(report.removed_files) == sorted(files["b"])
    assert [f.run_id for f in store.files()] == ["a"]
    assert {f.run_id for f in store.files(3)} == {"a", "b"}  # version 3 still lists b
    # Within the grace period a reader of version 3 reads every row, media included.
    assert report.gc.rollout_files_deleted == [] and there(store, files["b"]) == [True, True]
    ids = [s for b in mmstore.RolloutLoader(before, batch_size=4) for s in b["sample_ids"]]
    assert sorted(ids) == ["a-0-0", "b-0-0", "b-1-0"]
    time.sleep(0.6)  # the removal is now older than the grace period
    later = mmstore.gc(store, grace_seconds=0.5)
    assert sorted(later.rollout_files_deleted) == sorted(files["b"])
    assert later.deleted == [media["b"].uri]  # shared media stays with run a
    assert there(store, files["b"]) == [False, False]
    assert mmstore.verify(store, grace_seconds=0).ok


def test_a_pinned_version_keeps_its_rows_and_media(runs, small_processor):
    store, files, media = runs
    mmstore.pin_rows(store, "ckpt", version=3)  # every file of version 3
    pinned = mmstore._lifecycle.pins.read_pin_records(store)["ckpt"]
    assert pinned.table_version == 3 and pinned.files == {*files["a"], *files["b"]}
    with pytest.raises(mmstore.PinnedRowsError, match="ckpt"):
        mmstore.release_run(store, "b", grace_seconds=0)
    mmstore.release_run(store, "b", grace_seconds=0, force=True)
    assert mmstore.gc(store, grace_seconds=0).rollout_files_deleted == []
    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False, version=3)
    ids = [s for b in mmstore.RolloutLoader(ds, batch_size=4) for s in b["sample_ids"]]
    assert sorted(ids) == ["a-0-0", "b-0-0", "b-1-0"]  # the pinned version reads whole
    assert mmstore.verify(store, grace_seconds=0).ok
    mmstore.unpin(store, "ckpt")
    report = mmstore.gc(store, grace_seconds=0)
    assert sorted(report.rollout_files_deleted) == sorted(files["b"])
    assert report.deleted == [media["b"].uri]


def test_a_release_killed_after_its_rows_went_finishes_when_run_again(runs, monkeypatch):
    store, files, media = runs

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a process killed between the removal and its gc

    monkeypatch.setattr(gc_module, "_collect", killed)
    with pytest.raises(KeyboardInterrupt):
        mmstore.release_run(store, "b", grace_seconds=0)
    monkeypatch.undo()
    assert [f.run_id for f in store.files()] == ["a"]  # the rows went
    assert there(store, files["b"]) == [True, True]
    assert store.backend.stat("runs/b/release.json") is not None  # the release's marker
    report = mmstore.release_run(store, "b", grace_seconds=0)  # finishes the job
    assert report.removed_files == [] and report.version is None
    assert sorted(report.gc.rollout_files_deleted) == sorted(files["b"])
    assert report.gc.deleted == [media["b"].uri]
    assert store.backend.stat("runs/b/release.json") is None  # done
    with pytest.raises(mmstore.NoMatchError, match="runs a"):
        mmstore.release_run(store, "b")  # done: nothing left to finish


def test_a_dry_run_release_changes_nothing(runs):
    store, files, media = runs
    listed = store.listed_rollout_files()
    dry = mmstore.release_run(store, "b", grace_seconds=0, dry_run=True)
    assert sorted(dry.removed_files) == sorted(files["b"])
    assert sorted(dry.gc.rollout_files_deleted) == sorted(files["b"])
    assert dry.gc.deleted == [media["b"].uri]
    kept = mmstore.release_run(store, "b", dry_run=True)  # within the default grace
    assert kept.gc.rollout_files_deleted == [] and kept.gc.deleted == []
    assert store.table.latest_version() == 3 and store.listed_rollout_files() == listed


def test_gc_reads_the_log_not_a_listing_for_what_is_committed(runs):
    """A Parquet file dropped into rollouts/ by hand is no version's: gc treats it as an
    orphan (after the grace period), and its media is not kept alive by it."""
    store, files, media = runs
    stray = "rollouts/run_id=zz/step=0/part-stray-00000.parquet"
    with open(store.backend.abspath(files["b"][1]), "rb") as f:
        store.backend.write_atomic(stray, f.read())
    assert [f.run_id for f in store.files()] == ["a", "b", "b"]  # the stray is not read
    report = mmstore.release_run(store, "b", grace_seconds=0).gc
    assert sorted(report.rollout_files_deleted) == sorted([*files["b"], stray])
    assert report.deleted == [media["b"].uri]  # the stray copy kept none of b's media
