"""verify: each kind of damage is found, and named by file, run, step, sample and image."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore.synth import photo
from tests import rows


def commit(store, adapter, run_id, step, media_rows):
    """The one file committed by :func:`tests.rows.commit`."""
    return rows.commit(store, adapter, run_id, step, media_rows)[0]


@pytest.fixture
def damaged(store, adapter):
    """Run r1 with three files; three media files that will be damaged, one left whole."""
    whole, corrupt, gone, resized = (store.put_image(photo(s, 48, 40)) for s in range(4))
    files = [
        commit(store, adapter, "r1", 0, [[whole, corrupt], [corrupt]]),
        commit(store, adapter, "r1", 1, [[gone, whole, gone]]),
        commit(store, adapter, "r1", 2, [[resized]]),
    ]
    assert mmstore.verify(store).ok
    return store, files, {"whole": whole, "corrupt": corrupt, "gone": gone, "resized": resized}


def where(problem):
    p = problem
    return (p.kind, p.file, p.run_id, p.step, p.sample_id, p.image_index)


def test_verify_names_each_damaged_ref(damaged):
    store, files, media = damaged
    with open(store.backend.abspath(media["corrupt"].uri), "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))  # one byte flipped, same size
    os.unlink(store.backend.abspath(media["gone"].uri))
    with open(store.backend.abspath(media["resized"].uri), "ab") as f:
        f.write(b"\0")

    report = mmstore.verify(store)
    assert not report.ok
    assert [where(p) for p in report.problems] == [
        ("hash_mismatch", files[0], "r1", 0, "r1-0-0", 1),
        ("hash_mismatch", files[0], "r1", 0, "r1-0-1", 0),
        ("missing_media", files[1], "r1", 1, "r1-1-0", 0),
        ("missing_media", files[1], "r1", 1, "r1-1-0", 2),
        ("hash_mismatch", files[2], "r1", 2, "r1-2-0", 0),
    ]
    assert report.problems[0].uri == media["corrupt"].uri
    assert "hash to" in report.problems[0].message
    assert "bytes" in report.problems[-1].message
    assert (report.files_checked, report.refs_checked, report.media_checked) == (3, 7, 4)

    # Metadata mode reads no media bytes: sizes and existence only.
    quick = mmstore.verify(store, check_hashes=False)
    assert [where(p) for p in quick.problems] == [
        where(p) for p in report.problems if p.sample_id != "r1-0-0" and p.sample_id != "r1-0-1"
    ]
    assert quick.to_dict()["problems"][0]["kind"] == "missing_media"


def test_verify_reports_a_truncated_file_and_checks_the_rest(damaged):
    store, files, media = damaged
    full = store.backend.abspath(files[1])
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) - 9)
    os.unlink(store.backend.abspath(media["resized"].uri))
    for check_hashes in (True, False):
        report = mmstore.verify(store, check_hashes=check_hashes)
        # The log records each file's size: a truncated file is told apart from the one
        # the table committed without reading it.
        assert [where(p) for p in report.problems] == [
            ("size_mismatch", files[1], "r1", 1, None, None),
            ("missing_media", files[2], "r1", 2, "r1-2-0", 0),
        ]
        assert f"records {os.path.getsize(full) + 9}" in report.problems[0].message


def test_verify_reports_an_unreadable_file_of_the_logged_size(damaged):
    store, files, _ = damaged
    full = store.backend.abspath(files[1])
    size = os.path.getsize(full)
    with open(full, "r+b") as f:
        f.write(b"\0" * (size // 2))  # same size, pages overwritten
    report = mmstore.verify(store)
    assert [where(p) for p in report.problems] == [
        ("unreadable_file", files[1], "r1", 1, None, None)
    ]


def test_verify_checks_that_the_log_and_the_files_agree(damaged, adapter):
    store, files, _ = damaged
    os.unlink(store.backend.abspath(files[2]))  # listed, gone
    # An orphan: a file no version lists (a writer killed between rename and commit).
    orphan = "rollouts/run_id=r1/step=9/part-orphan-00000.parquet"
    os.makedirs(os.path.dirname(store.backend.abspath(orphan)))
    with open(store.backend.abspath(files[0]), "rb") as src:
        store.backend.write_atomic(orphan, src.read())
    assert [where(p) for p in mmstore.verify(store).problems] == [
        ("missing_file", files[2], "r1", 2, None, None)
    ]  # the orphan is younger than the grace period: gc would keep it too
    report = mmstore.verify(store, grace_seconds=0)
    assert [where(p) for p in report.problems] == [
        ("missing_file", files[2], "r1", 2, None, None),
        ("orphan_file", orphan, "r1", 9, None, None),
    ]
    # gc deletes exactly what verify reports as orphans, and then they agree again.
    assert mmstore.gc(store, grace_seconds=0).rollout_files_deleted == [orphan]
    assert [p.kind for p in mmstore.verify(store, grace_seconds=0).problems] == ["missing_file"]
    # An older version still lists what it listed; verify checks it as it was.
    assert mmstore.verify(store, version=2).ok


def test_verify_reports_schema_versions_untrusted_uris_duplicates_and_pins(
    store, adapter, tmp_path
):
    outside = tmp_path / "outside"
    outside.mkdir()
    image = photo(5, 48, 40)
    image.save(outside / "x.png")
    trusting = mmstore.Store.open(store.root, trusted_roots=[str(outside)])
    external = mmstore.MediaRef(
        hash=mmstore._format.media.content_hash((outside / "x.png").read_bytes()),
        uri=f"file://{outside}/x.png",
        width=48,
        height=40,
    )
    inside = store.put_image(photo(6, 48, 40))
    external_file = commit(trusting, adapter, "ext", 0, [[external]])
    assert mmstore.verify(trusting).ok

    # Two writers of one run, each unaware of the other's sample_ids.
    first = commit(store, adapter, "dup", 0, [[inside]])
    second = commit(store, adapter, "dup", 0, [[inside]])
    if second < first:
        first, second = second, first

    future = "rollouts/run_id=new/step=0/part-future.parquet"
    os.makedirs(os.path.dirname(store.backend.abspath(future)))
    old = pq.read_table(store.backend.abspath(first))
    pq.write_table(
        old.replace_schema_metadata({b"mmstore.schema_version": b"99"}),
        store.backend.abspath(future),
    )
    rows.commit_existing(store, future)  # as a later mmstore would have committed it
    mmstore.pin(store, "keep", [inside.hash, "f" * 32])

    report = mmstore.verify(store, check_hashes=False)
    assert [where(p) for p in report.problems] == [
        ("invalid_row", second, "dup", 0, "dup-0-0", None),
        ("untrusted_uri", external_file, "ext", 0, "ext-0-0", 0),
        ("schema_version", future, "new", 0, None, None),
        ("missing_media", "pins/keep.json", None, None, None, None),
    ]
    assert "f" * 32 in report.problems[-1].message
    assert "99" in report.problems[2].message


def test_verify_on_s3_and_with_a_progress_bar(s3_store, adapter, capsys):
    kept, lost = (s3_store.put_image(photo(s, 48, 40)) for s in (1, 2))
    path = commit(s3_store, adapter, "r1", 3, [[kept], [lost, kept]])
    assert mmstore.verify(s3_store).ok
    s3_store.backend.delete(lost.uri)
    report = mmstore.verify(s3_store, progress=True)
    assert [where(p) for p in report.problems] == [("missing_media", path, "r1", 3, "r1-3-1", 0)]
    assert "verify" in capsys.readouterr().err
