"""The store distrusts its own disk: damaged media, failed commits and deletes, hostile files
and names, forged loader states, manifests and footers (issue 13, items 8-14; issue 30, item
18). A network error is never reported as damage, and S3's refusal of media is a permission
error (issue 30)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._lifecycle import gc as _lifecycle
from mmstore._rows import files as _refscan
from mmstore._storage import backends as _backends
from mmstore.cli import main
from mmstore.integrations.vllm import resolve_wire_refs
from tests import rows
from tests.rows import commit
from tests.store_workers import image_bytes, make_row


def rows_of(store):
    return sorted(
        r["sample_id"]
        for f in store.rollout_files()
        for r in pq.read_table(store.backend.abspath(f.path), partitioning=None).to_pylist()
    )


# -- item 8: a put repairs damaged bytes at its path --------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate", "fifo", "empty"])
def test_put_repairs_damaged_media(store, adapter, damage):
    data = image_bytes(1)
    media = store.put_media(data)
    path = Path(store.backend.abspath(media.uri))
    if damage == "flip":
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x10
        path.write_bytes(bad)
    elif damage == "truncate":
        path.write_bytes(data[:-10])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
        os.mkfifo(path)
    assert store.put_media(data) == media
    assert path.read_bytes() == data  # good bytes, replaced atomically
    with store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [media], "s0"))
    assert mmstore.verify(store).ok


def test_put_of_present_bytes_rewrites_nothing(store):
    media = store.put_media(image_bytes(2))
    path = store.backend.abspath(media.uri)
    inode = os.stat(path).st_ino
    os.utime(path, (1, 1))
    store.put_media(image_bytes(2))
    assert os.stat(path).st_ino == inode and os.stat(path).st_mtime > 1  # renewed, same file


def test_put_refuses_loudly_where_a_directory_holds_the_path(store):
    media = store.put_media(image_bytes(3))
    path = store.backend.abspath(media.uri)
    os.unlink(path)
    os.mkdir(path)
    os.mkdir(os.path.join(path, "x"))
    with pytest.raises(mmstore.HashMismatchError, match="directory"):
        store.put_media(image_bytes(3))


# -- item 9: a failed commit keeps its rows and leaves nothing torn -----------------------


def _failing_fsync(monkeypatch, code):
    calls = {"n": 0}
    real = os.fsync

    def fsync(fd):
        if calls["n"] == 0:
            calls["n"] += 1
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(_backends.os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_failed_commit_keeps_rows_for_a_retry(store, adapter, monkeypatch, code):
    media = store.put_media(image_bytes(4))
    w = store.writer(run_id="r", step=0, row_group_size=2)
    for k in range(5):
        w.write(make_row(adapter, [media], f"s{k}"))
    _failing_fsync(monkeypatch, code)
    with pytest.raises(OSError) as info:
        w.commit()
    assert info.value.errno == code
    assert store.staging_files() == []  # the torn temp file is gone
    assert store.rollout_files() == []
    with pytest.raises(mmstore.InvalidRolloutError, match="failed commit"):
        w.write(make_row(adapter, [media], "s9"))  # no silent split across two files
    rel = w.commit()
    assert rel is not None and w.committed == [rel]
    assert rows_of(store) == [f"s{k}" for k in range(5)]
    assert w.commit() is None  # committed once, nothing pending


def test_commit_in_a_with_block_fails_loudly_and_can_be_retried(store, adapter):
    media = store.put_media(image_bytes(5))
    staging = store.backend.abspath("_staging")
    shutil.rmtree(staging, ignore_errors=True)
    open(staging, "w").close()  # _staging unusable: a file where the directory goes
    with pytest.raises(OSError), store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [media], "a"))
    os.unlink(staging)
    assert store.rollout_files() == []
    w.commit()
    assert rows_of(store) == ["a"]


def test_a_commit_whose_rename_landed_is_not_committed_twice(store, adapter, monkeypatch):
    media = store.put_media(image_bytes(6))
    w = store.writer(run_id="r", step=0)
    w.write(make_row(adapter, [media], "a"))
    real = _backends._fsync_path
    calls = {"n": 0}

    def fsync_path(path):  # the file is linked into place, then its directory's fsync fails
        if "step=0" in path and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(errno.EIO, "I/O error")
        return real(path)

    monkeypatch.setattr(_backends, "_fsync_path", fsync_path)
    with pytest.raises(OSError):
        w.commit()
    assert w.commit() == store.rollout_files()[0].path
    assert rows_of(store) == ["a"]


# -- item 10: release_run never sweeps media of a file it failed to delete ----------------


def _undeletable(monkeypatch, name):
    real = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path).endswith(name):
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_release_run_reports_files_it_could_not_delete(store, adapter, monkeypatch):
    kept, gone = store.put_media(image_bytes(7)), store.put_media(image_bytes(8))
    [stuck] = commit(store, adapter, "a", 0, [[kept]])
    [freed] = commit(store, adapter, "a", 1, [[gone]])
    _undeletable(monkeypatch, os.path.basename(stuck))
    with pytest.raises(mmstore.DeleteFailedError) as info:
        mmstore.release_run(store, "a", grace_seconds=0)
    monkeypatch.undo()
    assert info.value.files == [stuck] and isinstance(info.value, OSError)
    # The rows left the latest version; the file that survived its delete keeps its media.
    assert store.files() == []
    assert store.backend.stat(stuck) is not None and store.backend.stat(freed) is None
    assert store.backend.stat(kept.uri) is not None  # its media never swept
    assert store.backend.stat(gone.uri) is None
    assert mmstore.verify(store).ok
    # Once the delete can succeed, releasing again finishes the job.
    report = mmstore.release_run(store, "a", grace_seconds=0)
    assert report.removed_files == [] and report.gc.rollout_files_deleted == [stuck]
    assert report.gc.deleted == [kept.uri]
    assert store.backend.stat(stuck) is None


def test_cli_release_exits_non_zero_when_a_delete_fails(store, adapter, monkeypatch, capsys):
    media = store.put_media(image_bytes(9))
    [stuck] = commit(store, adapter, "a", 0, [[media]])
    _undeletable(monkeypatch, os.path.basename(stuck))
    assert main(["release", store.root, "a", "--grace", "0"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "could not be deleted" in err
    assert store.backend.stat(media.uri) is not None


# -- item 11: non-regular files are refused without blocking ------------------------------


def _with_deadline(fn, seconds=20.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked on a FIFO"
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.fixture
def fifo_media(tmp_path, adapter, small_processor):
    """A store with a committed row whose media file is replaced by a FIFO, and a trusted
    external root holding a FIFO too."""
    external = tmp_path / "ext"
    external.mkdir()
    os.mkfifo(external / "x.png")
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=[str(external)])
    media = store.put_media(image_bytes(10))
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(make_row(adapter, [media], "s0"))
    path = store.backend.abspath(media.uri)
    os.unlink(path)
    os.mkfifo(path)
    return store, media, f"file://{external}/x.png"


def test_fifo_media_is_refused_without_blocking(fifo_media, adapter, small_processor):
    store, media, external_uri = fifo_media
    for uri in (media.uri, external_uri):
        with pytest.raises(mmstore.MediaNotFoundError, match="not a regular file"):
            _with_deadline(lambda u=uri: store.read_media(u, media.hash))
        with pytest.raises(mmstore.MediaNotFoundError):
            _with_deadline(lambda u=uri: store.open_image(u, media.hash))
    report = _with_deadline(lambda: mmstore.verify(store))
    assert [p.kind for p in report.problems] == ["missing_media"]

    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False)
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        _with_deadline(lambda: next(iter(mmstore.RolloutLoader(ds, batch_size=1))))
    assert info.value.sample_id == "s0"

    ref = adapter.expand([adapter.image_token_id], [media])[1][0]
    wire = mmstore.wire.encode(ref.model_copy(update={"uri": external_uri}))
    out = _with_deadline(lambda: resolve_wire_refs(store, [wire], small_processor))
    assert out["reason"] == "media_not_found", out


def test_fifo_rollout_file_is_refused_without_blocking(store, adapter):
    media = store.put_media(image_bytes(11))
    [rel] = commit(store, adapter, "a", 0, [[media]])
    path = store.backend.abspath(rel)
    os.unlink(path)
    os.mkfifo(path)
    # The version still lists the file; in its place a FIFO is reported, never opened.
    assert [f.path for f in store.files()] == [rel]
    report = _with_deadline(lambda: mmstore.verify(store))
    assert not report.ok and [p.file for p in report.problems] == [rel]
    assert "not a regular file" in report.problems[0].message
    with pytest.raises(mmstore.CorruptFileError, match="not a regular file"):
        _with_deadline(lambda: _refscan.open_rollout_file(store, rel))


# -- item 12: encoded NUL and over-long names are typed refusals --------------------------


@pytest.mark.parametrize(
    "name", ["x%00.png", "a" * 300 + ".png", "x%0A.png", "/".join(["d" * 200] * 25) + ".png"]
)
def test_encoded_nul_and_over_long_names_are_refused(tmp_path, adapter, small_processor, name):
    trusted = tmp_path / "ext"
    trusted.mkdir()
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=[str(trusted)])
    uri = f"file://{trusted}/{name}"
    digest = "0" * 32
    with pytest.raises(mmstore.UntrustedURIError):
        store.read_media(uri, digest)
    with pytest.raises(mmstore.UntrustedURIError):
        store.open_image(uri, digest)
    media = mmstore.MediaRef(hash=digest, uri=uri, width=56, height=56)
    ref = adapter.expand([adapter.image_token_id], [media])[1][0]
    out = resolve_wire_refs(store, [mmstore.wire.encode(ref)], small_processor)
    assert out["reason"] == "untrusted_uri", out


def test_over_long_store_relative_names_are_refused(store):
    with pytest.raises(mmstore.UntrustedURIError, match="longer"):
        store.read_media("media/ab/cd/" + "a" * 300 + ".png", "0" * 32)


# -- item 13: a loader state names committed files of this store only ---------------------


@pytest.fixture
def two_stores(tmp_path, adapter):
    stores = []
    for name in ("a", "b"):
        s = mmstore.Store.open(tmp_path / name, create=True)
        commit(s, adapter, name, 0, [[s.put_media(image_bytes(12))]])
        stores.append(s)
    return stores


def test_load_state_dict_refuses_files_outside_the_store(two_stores, small_processor, tmp_path):
    mine, other = two_stores
    [theirs] = [f.path for f in other.rollout_files()]
    staged = mine.backend.abspath("_staging/part-x.parquet")
    os.makedirs(os.path.dirname(staged), exist_ok=True)
    shutil.copy(other.backend.abspath(theirs), staged)
    link = mine.backend.abspath("rollouts/run_id=zz/step=0")
    os.makedirs(os.path.dirname(link))
    os.symlink(os.path.dirname(other.backend.abspath(theirs)), link)
    forged = [
        f"../b/{theirs}",
        f"rollouts/../../b/{theirs}",
        other.backend.abspath(theirs),
        "_staging/part-x.parquet",
        f"rollouts/run_id=a/step=0/../../../_staging/{os.path.basename(staged)}",
        "rollouts/run_id=a/step=0/part-missing.parquet",
        f"rollouts/run_id=zz/step=0/{os.path.basename(theirs)}",
        "rollouts/run_id=a/step=0/_part.parquet",
        7,
    ]
    ds = mmstore.RolloutDataset(mine, small_processor, shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=1)
    good_loader, good_ds = loader.state_dict(), ds.state_dict()
    for path in forged:
        with pytest.raises(mmstore.InvalidArgumentError):
            loader.load_state_dict({**good_loader, "files": [path]})
        with pytest.raises(mmstore.InvalidArgumentError):
            ds.load_state_dict({**good_ds, "files": [path]})
    assert list(ds.snapshot.files) == good_ds["files"]
    loader.load_state_dict(good_loader)  # its own state still loads
    assert [b["sample_ids"] for b in loader] == [["a-0-0"]]


def test_a_state_naming_a_file_twice_is_refused(store, adapter, small_processor):
    media = [store.put_media(image_bytes(0, 56, 56))]
    first = rows.commit(store, adapter, "r", 0, [media] * 2)[0]
    rows.commit(store, adapter, "r", 1, [media] * 2)
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    state = loader.state_dict()
    for target in (loader, loader.dataset):
        for files in ([first, first], [*state["files"], first]):
            sub = target.state_dict()
            with pytest.raises(mmstore.InvalidArgumentError, match="twice") as info:
                target.load_state_dict({**sub, "files": files})
            assert info.value.file == first
    loader.load_state_dict(state)  # the state as taken still loads
    assert len(list(loader)) == 2


# -- item 14: forged manifests and footers are typed, one line in the CLI -----------------


@pytest.mark.parametrize("forge", ["directory", "deep", "huge", "fifo"])
def test_forged_manifest_is_not_a_store(tmp_path, forge):
    root = tmp_path / "s"
    mmstore.Store.open(root, create=True)
    manifest = root / "mmstore.json"
    manifest.unlink()
    if forge == "directory":
        manifest.mkdir()
    elif forge == "fifo":
        os.mkfifo(manifest)
    elif forge == "deep":
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    else:
        manifest.write_text(json.dumps({"format_version": 1, "pad": "x" * (2 << 20)}))
    for create in (False, True):
        with pytest.raises(mmstore.NotAStoreError):
            _with_deadline(lambda c=create: mmstore.Store.open(root, create=c))


def test_deeply_nested_pin_is_a_corrupt_file(store):
    os.makedirs(store.backend.abspath("pins"))
    with open(store.backend.abspath("pins/deep.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(mmstore.CorruptFileError, match="pin"):
        mmstore.gc(store)


@pytest.mark.parametrize(
    "layouts",
    [
        "not json",
        '["a list"]',
        '{"fp": "not params"}',
        '{"fp": {"family": "qwen-vl"}}',
        '{"fp": {"family": "qwen-vl", "patch_size": 0, "temporal_patch_size": 2, '
        '"merge_size": 2, "min_pixels": 1, "max_pixels": 100000}}',
        '{"fp": {"family": "qwen-vl", "patch_size": "14", "temporal_patch_size": 2, '
        '"merge_size": 2, "min_pixels": 1, "max_pixels": 100000}}',
        "[" * 50_000 + "]" * 50_000,
    ],
)
def test_stats_on_forged_footer_layouts_is_one_line(store, adapter, capsys, layouts):
    [rel] = commit(store, adapter, "a", 0, [[store.put_media(image_bytes(13))]])
    path = store.backend.abspath(rel)
    table = pq.read_table(path, partitioning=None)
    meta = {**table.schema.metadata, b"mmstore.layouts": layouts.encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)
    assert main(["stats", store.root]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "layouts" in err and rel in err


# -- kill -9 during gc: a claim left behind is put back ---------------------------------


def test_gc_puts_back_media_a_killed_gc_left_claimed(store, adapter):
    media = store.put_media(image_bytes(14))
    path = store.backend.abspath(media.uri)
    # A gc listed it unreferenced and old; a writer renewed it and committed a row using it
    # after the gc's marks; the gc claimed it, and was killed before it put it back.
    with store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [media], "s0"))
    os.rename(path, store.backend.abspath(_lifecycle.claim_path(media.uri)))
    assert not mmstore.verify(store).ok
    report = mmstore.gc(store, grace_seconds=0)
    assert report.deleted == [] and os.path.exists(path)
    assert mmstore.verify(store).ok


# -- verify and network errors; S3 refusals on media ------------------------------------

STALLED = (
    "When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 28, Timeout was reached"
)
# pyarrow's texts for S3's refusals: a HEAD's (no body: the SDK names the code from the
# status) and a GET whose 403 carried a code the SDK does not know.
DENIED = [
    "When reading information for key 'ext/shot.png' in bucket 'locked': AWS Error "
    "ACCESS_DENIED during HeadObject operation: No response body.",
    "When reading 'ext/shot.png' in bucket 'locked': AWS Error UNKNOWN (HTTP status 403) "
    "during GetObject operation: AllAccessDisabled",
]


class FailingFS:
    """A pyarrow file system whose every open and stat fails with ``message`` (pyarrow's own
    text); anything else goes to ``fs``."""

    def __init__(self, fs, message):
        self._fs, self._message = fs, message

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def _fail(self, *args, **kwargs):
        raise OSError(self._message)

    open_input_file = open_input_stream = get_file_info = _fail


def test_verify_raises_a_network_error_instead_of_reporting_damage(store, adapter):
    media = [store.put_media(image_bytes(0, 56, 56))]
    [path] = rows.commit(store, adapter, "r", 2, [media])
    assert mmstore.verify(store).ok
    store.backend.fs = FailingFS(store.backend.fs, STALLED)
    with pytest.raises(mmstore.NetworkError) as info:
        mmstore.verify(store)
    assert info.value.retryable and (info.value.file, info.value.run_id) == (path, "r")


@pytest.mark.parametrize("message", DENIED, ids=["access_denied", "403"])
def test_s3_access_denied_on_media_is_a_media_permission_error(tmp_path, message):
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=["s3://locked/ext"])
    uri = "s3://locked/ext/shot.png"
    backend, _ = store.resolve(uri)
    backend.fs = FailingFS(backend.fs, message)
    for read in (lambda: store.read_media(uri, "0" * 32), lambda: store.media_stat(uri)):
        with pytest.raises(mmstore.MediaPermissionError, match="access denied") as info:
            read()
        assert isinstance(info.value, PermissionError) and info.value.uri == uri
        assert not info.value.retryable
