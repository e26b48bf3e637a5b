"""Format 2 writers: a commit is one Delta transaction after the rename; exactly-once
producers; a failed table commit retried; the run's family found without a listing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._rows import writer as writer_module
from mmstore._storage.backends import LocalBackend
from tests.store_workers import image_bytes, make_row


def row(adapter, store, sample_id, images=1):
    media = [store.put_media(image_bytes(i)) for i in range(images)]
    return make_row(adapter, media, sample_id, group_id="g")


@pytest.fixture
def no_rollouts_listing(monkeypatch):
    """Fail any listing of ``rollouts/`` (the read and commit paths read the log only)."""
    real = LocalBackend.list

    def listing(self, rel):
        assert not rel.startswith("rollouts"), f"listed {rel}"
        return real(self, rel)

    monkeypatch.setattr(LocalBackend, "list", listing)


def test_a_commit_is_one_table_version_listing_the_file(store, adapter, no_rollouts_listing):
    with store.writer("r1", 3, row_group_size=2) as w:
        for i in range(5):
            w.write(row(adapter, store, f"s{i}"))
    [path] = w.committed
    assert w.version == store.table.latest_version() == 1 and not w.duplicate
    [file] = store.files()
    assert (file.path, file.run_id, file.step, file.rows) == (path, "r1", 3, 5)
    assert file.size == os.path.getsize(store.backend.abspath(path))
    entry = store.table.log_entry(1)
    assert entry.added == (file,) and entry.producers == ()
    # The Parquet file keeps what the first format kept: no partition columns in it.
    assert pq.read_schema(store.backend.abspath(path)).names == mmstore.ROLLOUT_SCHEMA.names
    assert [r.sample_id for r in store.rollouts(run_id="r1", step=3)] == [f"s{i}" for i in range(5)]


def test_a_producer_commits_each_seq_once_and_says_so(store, adapter, caplog):
    first = row(adapter, store, "a")
    with store.writer("r1", 0, producer="sampler-0", seq=17) as w:
        w.write(first)
    assert w.version == 1 and w.result.producer_seq == 17
    # A retry of the same pair (after a timeout, in another process): nothing twice.
    listed = store.listed_rollout_files()
    again = store.writer("r1", 0, producer="sampler-0", seq=17)
    with caplog.at_level(logging.WARNING, logger="mmstore"), again:
        again.write(first)
    assert again.duplicate and again.version is None and again.committed == []
    assert again.result.duplicate and not again.result.committed
    assert "sampler-0" in caplog.text and "seq 17" in caplog.text
    assert store.table.latest_version() == 1
    assert store.listed_rollout_files() == listed  # its renamed file was removed again
    assert [r.sample_id for r in store.rollouts()] == ["a"]
    # An older seq the producer never committed in the run cannot be committed exactly
    # once any more: refused, typed, never dropped silently. The next one commits.
    old = store.writer("r1", 0, producer="sampler-0", seq=3)
    old.write(row(adapter, store, "b"))
    with pytest.raises(mmstore.ProducerConflictError, match="never committed"):
        old.commit()
    with store.writer("r1", 1, producer="sampler-0", seq=18) as nxt:
        nxt.write(row(adapter, store, "b"))
    assert nxt.version == 2 and store.table.producer_seq("sampler-0") == 18


def test_a_producers_writer_commits_once(store, adapter):
    w = store.writer("r1", 0, producer="p", seq=0)
    w.write(row(adapter, store, "a"))
    w.commit()
    with pytest.raises(mmstore.InvalidRolloutError, match="commits once"):
        w.write(row(adapter, store, "b"))
    for producer, seq in [("p", None), (None, 3), ("", 1), ("p", -1), ("p", True)]:
        with pytest.raises(mmstore.InvalidArgumentError):
            store.writer("r1", 0, producer=producer, seq=seq)


def test_a_failed_table_commit_is_retried_by_calling_commit_again(store, adapter, monkeypatch):
    real = writer_module.commit_files
    calls = []

    def flaky(storage, files, **kwargs):
        calls.append(files[0].path)
        if len(calls) == 1:
            raise mmstore.TableConflictError("lost to other commits", table="t")
        return real(storage, files, **kwargs)

    monkeypatch.setattr(writer_module, "commit_files", flaky)
    w = store.writer("r1", 0, producer="p", seq=5)
    w.write(row(adapter, store, "a"))
    with pytest.raises(mmstore.TableConflictError):
        w.commit()
    # Renamed into place but listed by no version: an orphan nobody reads.
    assert store.files() == [] and len(store.listed_rollout_files()) == 1
    with pytest.raises(mmstore.InvalidRolloutError, match="pending"):
        w.write(row(adapter, store, "b"))
    path = w.commit()
    assert calls == [path, path] and [f.path for f in store.files()] == [path]
    assert store.table.latest_version() == 1


def test_a_writer_killed_before_its_commit_leaves_an_orphan_gc_removes(store, adapter,
                                                                       monkeypatch):  # fmt: skip
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as the process dying between the rename and the commit

    monkeypatch.setattr(writer_module, "commit_files", killed)
    with pytest.raises(KeyboardInterrupt), store.writer("r1", 0) as w:
        w.write(row(adapter, store, "a"))
    monkeypatch.undo()
    [orphan] = store.listed_rollout_files()
    assert store.files() == []
    with pytest.raises(mmstore.NoMatchError):
        store.rollouts()
    assert mmstore.gc(store).rollout_files_deleted == []  # within the grace period: kept
    report = mmstore.gc(store, grace_seconds=0)
    assert report.rollout_files_deleted == [orphan.path]
    assert report.rollout_bytes_freed == orphan.size and store.listed_rollout_files() == []


@pytest.mark.slow
def test_a_text_only_writer_finds_its_runs_family_without_listing(tmp_path, adapter):
    """Run r's only images are at step 0, then nine text-only steps. A fresh process writing
    a text-only row with an image-only token into r is refused: the run's family is
    recorded once (runs/r/), whatever came since, and nothing lists rollouts/."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    with store.writer("r", 0) as w:
        w.write(row(adapter, store, "img"))
    for step in range(1, 10):
        with store.writer("r", step, adapter=adapter) as w:
            w.write(row(adapter, store, f"text-{step}", images=0))
    assert [f.path for f in store.backend.list("runs")] == [f"runs/r/{adapter.fingerprint}.json"]
    script = textwrap.dedent(
        f"""
        import mmstore
        from mmstore._storage.backends import LocalBackend
        real = LocalBackend.list
        def listing(self, rel):
            assert not rel.startswith("rollouts"), rel
            return real(self, rel)
        LocalBackend.list = listing
        store = mmstore.Store.open({str(tmp_path / "s")!r})
        row = mmstore.Rollout(sample_id="stray", tokens=[5, 6, {adapter.image_token_id}],
                              prompt_len=1, loss_mask=[False, False, True])
        for run in ("r", "new"):
            try:
                with store.writer(run, 10) as w:
                    w.write(row)
                print(run, "committed")
            except mmstore.InvalidRolloutError as exc:
                print(run, "refused", "outside every image span" in str(exc))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Run r's family is known; a new run's is not (no adapter was built in that process).
    assert done.stdout.split("\n")[:2] == ["r refused True", "new committed"]
