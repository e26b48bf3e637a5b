"""Reachability gc, run release and pins: on disk, on S3, and racing live writers."""

from __future__ import annotations

import collections
import os
import random
import threading
import time

import pytest

import mmstore
from mmstore.synth import photo
from tests.rows import commit


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "local" else "s3_store")


def put_photos(store, seeds, size=(48, 40)):
    return [store.put_image(photo(seed, *size)) for seed in seeds]


def age(store, paths, seconds=3600.0):
    """Back-date local files, as if written ``seconds`` ago."""
    past = time.time() - seconds
    for path in paths:
        os.utime(store.backend.abspath(path), (past, past))


def present(store, media):
    return [store.backend.stat(m.uri) is not None for m in media]


def test_gc_sweeps_only_unreferenced_media_older_than_grace(any_store, adapter):
    used, loose_a, loose_b = put_photos(any_store, [1, 2, 3])
    commit(any_store, adapter, "r1", 0, [[used], [used]])

    young = mmstore.gc(any_store, grace_seconds=3600)
    assert young.deleted == [] and young.kept == 3 and young.referenced == 1

    dry = mmstore.gc(any_store, grace_seconds=0, dry_run=True)
    assert dry.dry_run and dry.deleted == sorted([loose_a.uri, loose_b.uri])
    assert dry.bytes_freed == loose_a.nbytes + loose_b.nbytes
    assert present(any_store, [used, loose_a, loose_b]) == [True, True, True]

    real = mmstore.gc(any_store, grace_seconds=0)
    assert real.deleted == dry.deleted and real.bytes_freed == dry.bytes_freed
    assert real.kept == 1 and real.bytes_kept == used.nbytes and real.files_scanned == 1
    assert present(any_store, [used, loose_a, loose_b]) == [True, False, False]
    assert any_store.read_media(used.uri, used.hash)
    assert mmstore.verify(any_store).ok
    assert real.to_dict()["deleted"] == real.deleted


def test_gc_clears_only_stale_staging_entries(store):
    for name in ("old.tmp", "new.tmp"):
        store.backend.write_atomic(f"_staging/{name}", b"partial")
    age(store, ["_staging/old.tmp"])
    report = mmstore.gc(store, grace_seconds=60)
    assert report.staging_cleared == ["_staging/old.tmp"]
    assert store.backend.stat("_staging/old.tmp") is None
    assert store.backend.stat("_staging/new.tmp") is not None


def test_gc_refuses_to_sweep_when_a_rollout_file_is_unreadable(store, adapter):
    used, loose = put_photos(store, [1, 2])
    (path,) = commit(store, adapter, "r1", 0, [[used]])
    full = store.backend.abspath(path)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) // 2)
    with pytest.raises(mmstore.CorruptFileError) as info:
        mmstore.gc(store, grace_seconds=0)
    assert info.value.file == path
    assert present(store, [used, loose]) == [True, True]


def test_gc_rejects_a_bad_grace_period(store):
    with pytest.raises(mmstore.InvalidArgumentError, match="grace_seconds"):
        mmstore.gc(store, grace_seconds=-1)


def test_gc_and_release_refuse_a_store_whose_log_is_gone(store, adapter):
    """Issue 39.2: with its log gone (under a store opened before), gc with grace 0 deleted
    every rollout file and its media as unlisted."""
    import shutil

    used, loose = put_photos(store, [1, 2])
    files = commit(store, adapter, "r1", 0, [[used]])
    reader = mmstore.Store.open(store.root)  # another process's, say
    shutil.rmtree(store.backend.abspath("rollouts/_delta_log"))
    for call in (
        lambda: mmstore.gc(store, grace_seconds=0),
        lambda: mmstore.release_run(store, "r1", grace_seconds=0),
    ):
        with pytest.raises(mmstore.TableNotFoundError, match="no commit log") as err:
            call()
        assert files[0] in str(err.value)
    assert [store.backend.stat(p) is not None for p in files] == [True]
    assert present(store, [used, loose]) == [True, True]
    # A read makes no new, empty log that a gc would then trust.
    with pytest.raises(mmstore.TableNotFoundError, match="lost its commit log"):
        mmstore.verify(reader)
    assert not os.path.exists(store.backend.abspath("rollouts/_delta_log"))


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1, True, "60", None])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused_first(store, adapter, grace):
    """Issue 39.22: a NaN grace collected nothing and said it succeeded; a release with it
    removed the run's rows before anything refused it."""
    used, loose = put_photos(store, [1, 2])
    commit(store, adapter, "r1", 0, [[used]])
    for call in (
        lambda: mmstore.gc(store, grace_seconds=grace),
        lambda: mmstore.release_run(store, "r1", grace_seconds=grace),
        lambda: mmstore.release_run(store, "r1", grace_seconds=grace, dry_run=True),
        lambda: mmstore.verify(store, grace_seconds=grace),
    ):
        with pytest.raises(mmstore.InvalidArgumentError, match="grace_seconds must be a finite"):
            call()
    assert [f.run_id for f in store.files()] == ["r1"] and present(store, [loose]) == [True]


def test_release_run_keeps_shared_media_and_dry_run_matches(any_store, adapter):
    shared_1, shared_2, only_a, only_b = put_photos(any_store, [1, 2, 3, 4])
    files_a = commit(any_store, adapter, "a", 0, [[shared_1, only_a], [shared_2]])
    files_a += commit(any_store, adapter, "a", 1, [[shared_1]])
    commit(any_store, adapter, "b", 0, [[shared_1, shared_2, only_b]])

    before = any_store.rollout_files()
    dry = mmstore.release_run(any_store, "a", grace_seconds=0, dry_run=True)
    assert sorted(dry.removed_files) == sorted(files_a)
    assert dry.gc.deleted == [only_a.uri]
    assert any_store.rollout_files() == before and present(any_store, [only_a]) == [True]

    real = mmstore.release_run(any_store, "a", grace_seconds=0)
    assert real.removed_files == dry.removed_files and real.gc.deleted == dry.gc.deleted
    assert all("run_id=b/" in f.path for f in any_store.rollout_files())
    assert present(any_store, [shared_1, shared_2, only_a, only_b]) == [True, True, False, True]
    assert mmstore.verify(any_store).ok


def test_pinned_rows_survive_release_of_their_run(store, adapter):
    shared, only_a, loose = put_photos(store, [1, 2, 3])
    [pinned_file] = commit(store, adapter, "a", 0, [[shared, only_a]])
    commit(store, adapter, "b", 0, [[shared]])
    assert mmstore.pin_rows(store, "ckpt-7", runs="a", steps=range(0, 1)) == "pins/ckpt-7.json"
    mmstore.pin(store, "by-hash", [loose.hash])
    assert mmstore.list_pins(store) == {"by-hash": 1, "ckpt-7": 2}

    # The pin holds run a's rows: a release is refused, naming it, and changes nothing.
    with pytest.raises(mmstore.PinnedRowsError, match="ckpt-7") as info:
        mmstore.release_run(store, "a", grace_seconds=0)
    assert info.value.pins == ["ckpt-7"] and info.value.run_id == "a"
    assert {f.run_id for f in store.files()} == {"a", "b"}
    # Forced, the rows leave the latest version, and the pin keeps its copy: the file and
    # its media stay, even with no grace period.
    report = mmstore.release_run(store, "a", grace_seconds=0, force=True)
    assert report.removed_files == [pinned_file]
    assert report.gc.deleted == [] and report.gc.pinned == 3
    assert report.gc.rollout_files_deleted == []
    assert {f.run_id for f in store.files()} == {"b"}
    assert store.backend.stat(pinned_file) is not None
    assert present(store, [shared, only_a, loose]) == [True, True, True]

    mmstore.unpin(store, "ckpt-7")
    after = mmstore.gc(store, grace_seconds=0)
    assert after.deleted == [only_a.uri] and after.rollout_files_deleted == [pinned_file]
    assert store.backend.stat(pinned_file) is None
    assert mmstore.list_pins(store) == {"by-hash": 1}
    assert present(store, [loose]) == [True]


def test_pin_refuses_bad_names_hashes_and_empty_selections(store):
    with pytest.raises(mmstore.InvalidArgumentError, match="pin name"):
        mmstore.pin(store, "../escape", [])
    with pytest.raises(mmstore.InvalidArgumentError, match="32-hex-digit"):
        mmstore.pin(store, "p", ["not-a-hash"])
    with pytest.raises(mmstore.NoMatchError, match="no committed rollout files"):
        mmstore.pin_rows(store, "p", runs=["nope"])
    with pytest.raises(mmstore.NoMatchError, match="no pin named"):
        mmstore.unpin(store, "p")
    store.backend.write_atomic("pins/broken.json", b"{}")
    with pytest.raises(mmstore.CorruptFileError) as info:
        mmstore.gc(store, grace_seconds=0)
    assert info.value.file == "pins/broken.json"


@pytest.mark.slow
def test_gc_racing_writers_leaves_no_dangling_refs(store, adapter):
    """Writers keep re-using old, unreferenced images (a put of bytes already stored only
    renews the file's timestamp) and committing rows, while gc and run releases sweep with a
    1 s grace period; afterwards every committed ref resolves and verifies.

    Time is sped up: before each gc, every image that no writer is between put and commit
    with is back-dated an hour, so every gc pass finds old unreferenced images that writers
    are about to re-use. Writers pause between writing a row and committing it, so gc lists
    and marks inside that gap.
    """
    grace = 1.0
    blobs = []
    for seed in range(32):
        media = store.put_image(photo(seed, 48, 40))
        blobs.append((media, store.read_media(media.uri, media.hash)))

    stop = threading.Event()
    lock = threading.Lock()
    in_use: collections.Counter[str] = collections.Counter()
    committed_runs: list[str] = []
    deleted: set[str] = set()
    reused_after_delete: set[str] = set()
    errors: list[BaseException] = []
    problems: list[mmstore.Problem] = []

    def write_one(rng, run_id, chosen):
        media = [store.put_media(data, ext="png") for _, data in chosen]
        w = store.writer(run_id=run_id, step=0, adapter=adapter)
        tokens, refs = adapter.expand([7, adapter.image_token_id, 8, adapter.image_token_id], media)
        try:
            w.write(
                mmstore.Rollout(
                    sample_id="s",
                    tokens=tokens,
                    prompt_len=len(tokens),
                    loss_mask=[False] * len(tokens),
                    images=refs,
                )
            )
        except mmstore.MediaNotFoundError:
            return  # gc won the race before the row was accepted: refused loudly, no harm
        time.sleep(rng.uniform(0, 0.03))
        if rng.random() < 0.3:
            w.abort()  # the images stay unreferenced
            return
        w.commit()
        with lock:
            committed_runs.append(run_id)
            reused_after_delete.update(m.hash for m in media if m.hash in deleted)

    def writer(tid):
        rng = random.Random(tid)
        try:
            for i in range(25):
                chosen = rng.sample(blobs, 2)
                with lock:
                    in_use.update(m.hash for m, _ in chosen)
                try:
                    write_one(rng, f"w{tid}-{i}", chosen)
                finally:
                    with lock:
                        in_use.subtract(m.hash for m, _ in chosen)
        except BaseException as exc:
            errors.append(exc)

    def collect(report):
        with lock:
            deleted.update(p.rsplit("/", 1)[1].split(".")[0] for p in report.deleted)

    def collector():
        try:
            while not stop.is_set():
                with lock:
                    idle = [m.uri for m, _ in blobs if in_use[m.hash] <= 0]
                    age(store, [u for u in idle if store.backend.stat(u) is not None])
                collect(mmstore.gc(store, grace_seconds=grace))
                # Every committed ref must resolve at every moment, not only at the end
                # (a later put of the same bytes would hide a ref that dangled meanwhile).
                found = mmstore.verify(store, check_hashes=False).problems
                with lock:
                    problems.extend(found)
                with lock:  # release all but the newest two runs: their images go unreferenced
                    victims = committed_runs[:-2]
                    del committed_runs[:-2]
                for victim in victims:
                    collect(mmstore.release_run(store, victim, grace_seconds=grace).gc)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    gc_thread.join()
    assert errors == []
    assert problems == []

    report = mmstore.verify(store)
    assert report.problems == [] and report.ok
    assert report.refs_checked == 2 * len(committed_runs) > 0
    # The race was real: gc deleted images that writers then put again and committed.
    assert deleted and reused_after_delete


def test_release_of_an_unknown_run_raises_and_removes_nothing(store, adapter):
    commit(store, adapter, "a", 0, [put_photos(store, [1])])
    with pytest.raises(mmstore.NoMatchError, match=r"no run 'typo'.*runs a \(step 0\)"):
        mmstore.release_run(store, "typo", grace_seconds=0)
    with pytest.raises(LookupError):
        mmstore.release_run(store, "typo", dry_run=True)
    assert len(store.rollout_files()) == 1


# -- run layout records ----------------------------------------------------------------------


def test_run_records_stay_while_a_needed_version_has_the_runs_files(store, adapter):
    (shared,) = put_photos(store, [1])
    for run in ("a", "b"):
        commit(store, adapter, run, 0, [[shared]])
    record = {run: f"runs/{run}/{adapter.fingerprint}.json" for run in ("a", "b")}
    age(store, list(record.values()))  # older than every grace period below
    # Released within the grace period: the version before the release still lists a's
    # files (a reader may hold it), so their records stay.
    assert mmstore.release_run(store, "a", grace_seconds=600).gc.run_records_deleted == []
    # A pin holds b's rows past its release: b's record stays; a's goes, no version
    # anyone needs lists a's files any more.
    mmstore.pin_rows(store, "hold", runs="b")
    dry = mmstore.gc(store, grace_seconds=0, dry_run=True)
    assert dry.run_records_deleted == [record["a"]]
    assert store.backend.stat(record["a"]) is not None  # a dry run deletes nothing
    report = mmstore.release_run(store, "b", grace_seconds=0, force=True)
    assert report.gc.run_records_deleted == [record["a"]]
    assert store.backend.stat(record["a"]) is None
    assert store.backend.stat(record["b"]) is not None
    mmstore.unpin(store, "hold")
    assert mmstore.gc(store, grace_seconds=0).run_records_deleted == [record["b"]]
    assert store.backend.list("runs") == []


def test_young_run_records_and_other_files_under_runs_stay(store, adapter):
    (shared,) = put_photos(store, [1])
    commit(store, adapter, "a", 0, [[shared]])
    record = f"runs/a/{adapter.fingerprint}.json"
    # The record renewed just as gc starts (a writer about to commit run a again): kept
    # until it is older than the grace period.
    age(store, [record], seconds=-60)
    assert mmstore.release_run(store, "a", grace_seconds=0).gc.run_records_deleted == []
    # A release's marker (of a release killed half-way) is not a record: never deleted.
    store.backend.write_atomic("runs/a/release.json", b"{}")
    age(store, [record, "runs/a/release.json"])
    assert mmstore.gc(store, grace_seconds=0).run_records_deleted == [record]
    assert store.backend.stat("runs/a/release.json") is not None


def test_a_writer_renews_its_runs_records(store, adapter, monkeypatch):
    from mmstore._rows import runs as runs_module

    (shared,) = put_photos(store, [1])
    commit(store, adapter, "a", 0, [[shared]])
    record = f"runs/a/{adapter.fingerprint}.json"
    age(store, [record])
    commit(store, adapter, "a", 1, [[shared]])
    assert store.backend.stat(record).mtime < time.time() - 3000  # recorded: not again yet
    monkeypatch.setattr(runs_module, "RENEW_SECONDS", 0.0)
    commit(store, adapter, "a", 2, [[shared]])
    assert store.backend.stat(record).mtime > time.time() - 60  # renewed


# -- what gc reads of the log ----------------------------------------------------------------


@pytest.mark.slow
def test_gc_reads_the_log_after_its_checkpoint_not_every_commit_in_the_grace(
    any_store, adapter, monkeypatch
):
    """Sixty commits within the grace period (checkpoints every 20), on disk and on S3: gc
    reads the entries after the last checkpoint and a binary search's few, not one entry
    per commit; and the files of a run released after the cutoff, which only the
    checkpoint's tombstones name by then, stay."""
    from mmstore._lifecycle.gc import needed_files
    from mmstore._rows.table import CHECKPOINT_INTERVAL

    (shared,) = put_photos(any_store, [1])
    released = commit(any_store, adapter, "gone", 0, [[shared]])
    time.sleep(0.01)
    cutoff = time.time()
    time.sleep(0.01)
    mmstore.release_run(any_store, "gone", grace_seconds=3600)
    for step in range(3 * CHECKPOINT_INTERVAL):
        commit(any_store, adapter, "live", step, [[shared]])
    any_store.table.join_checkpoint()
    reads = collections.Counter()
    real_read = type(any_store.backend).read

    def counting(backend, rel):
        if rel.startswith("rollouts/_delta_log/") and rel.endswith(".json"):
            reads["entries"] += 1
        return real_read(backend, rel)

    monkeypatch.setattr(type(any_store.backend), "read", counting)
    latest, needed = needed_files(any_store, cutoff, {})
    monkeypatch.undo()
    assert latest == 3 * CHECKPOINT_INTERVAL + 2  # creation, commit, release, 60 commits
    assert set(released) <= needed  # removed after the cutoff: a reader may hold them
    # The latest version catching up (an interval at most, then from the checkpoint), the
    # binary search for the cutoff's version (log2 of the versions), the entries after the
    # checkpoint: 31 here, whatever the number of commits within the grace (not ~60).
    assert reads["entries"] <= CHECKPOINT_INTERVAL + 15, reads
    _, after = needed_files(any_store, time.time() + 1, {})  # a cutoff after every commit
    assert not set(released) & after
