"""Store.open: local directories and S3 prefixes, the manifest, and what is refused."""

from __future__ import annotations

import json
import shutil
import uuid

import pyarrow.fs as pafs
import pytest

import mmstore
from mmstore._storage.backends import s3_filesystem
from mmstore._storage.manifest import FORMAT_VERSION, MANIFEST
from mmstore.synth import photo
from tests.rows import commit


def test_create_writes_a_manifest_and_reopens(tmp_path):
    root = tmp_path / "new" / "store"
    store = mmstore.Store.open(root, create=True)
    assert store.root == str(root)
    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    assert manifest["hash_algorithm"] == "xxh3-128"
    # Format 2: the rollouts are a Delta table, created empty with the store (version 0).
    assert store.table.latest_version() == 0 and store.files() == []
    assert (root / "rollouts" / "_delta_log" / f"{0:020d}.json").is_file()
    again = mmstore.Store.open(str(root))
    assert again.manifest == manifest
    # create=True on an existing store opens it; the manifest is not rewritten.
    assert mmstore.Store.open(root, create=True).manifest["created"] == manifest["created"]
    assert mmstore.Store.open(f"file://{root}").manifest == manifest


def test_missing_store_needs_create(tmp_path):
    with pytest.raises(mmstore.NotAStoreError, match="create=True") as err:
        mmstore.Store.open(tmp_path / "nowhere")
    assert isinstance(err.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(mmstore.NotAStoreError):
        mmstore.Store.open(tmp_path / "empty")
    assert not (tmp_path / "nowhere").exists()


def test_create_refuses_a_directory_holding_other_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(mmstore.NotAStoreError, match="refusing"):
        mmstore.Store.open(tmp_path / "data", create=True)
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(mmstore.NotAStoreError):
        mmstore.Store.open(tmp_path / "file", create=True)


@pytest.mark.parametrize(
    ("key", "value"), [("format_version", 3), ("format_version", None), ("hash_algorithm", "md5")]
)
def test_unknown_manifest_is_refused(tmp_path, key, value):
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    manifest = json.loads((root / MANIFEST).read_text())
    (root / MANIFEST).write_text(json.dumps({**manifest, key: value}))
    with pytest.raises(mmstore.SchemaVersionError, match=str(value)):
        mmstore.Store.open(root)


def test_a_format_1_store_says_how_to_upgrade(tmp_path):
    root = tmp_path / "old"
    mmstore.Store.open(root, create=True)
    manifest = json.loads((root / MANIFEST).read_text())
    (root / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(mmstore.UpgradeRequiredError, match=f"mmstore upgrade {root}") as err:
        mmstore.Store.open(root)
    assert isinstance(err.value, mmstore.SchemaVersionError) and err.value.root == str(root)
    with pytest.raises(mmstore.UpgradeRequiredError):
        mmstore.Store.open(root, create=True)  # create never rewrites an existing store


def test_manifest_that_is_not_json_is_not_a_store(tmp_path):
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(mmstore.NotAStoreError, match="not JSON"):
        mmstore.Store.open(tmp_path)


def test_unsupported_location_scheme(tmp_path):
    with pytest.raises(mmstore.NotAStoreError, match="scheme"):
        mmstore.Store.open("http://example.com/store", create=True)


# -- S3 ------------------------------------------------------------------------------------


def _bucket(s3_options) -> str:
    bucket = f"mm-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    return bucket


def test_s3_create_reopen_and_refusals(s3_options):
    bucket = _bucket(s3_options)
    fs = s3_filesystem(s3_options)  # one PutObject per small object, as the store writes
    root = f"s3://{bucket}/runs/store"
    with pytest.raises(mmstore.NotAStoreError):
        mmstore.Store.open(root, s3_options=s3_options)
    store = mmstore.Store.open(root, create=True, s3_options=s3_options)
    assert store.root == root
    with fs.open_input_stream(f"{bucket}/runs/store/{MANIFEST}") as f:
        manifest = json.loads(f.read())
    assert manifest["format_version"] == 2
    assert store.table.latest_version() == 0
    assert mmstore.Store.open(root, s3_options=s3_options).manifest == manifest

    with fs.open_output_stream(f"{bucket}/other/data.bin") as f:
        f.write(b"someone else's")
    with pytest.raises(mmstore.NotAStoreError, match="refusing"):
        mmstore.Store.open(f"s3://{bucket}/other", create=True, s3_options=s3_options)

    with fs.open_output_stream(f"{bucket}/runs/store/{MANIFEST}") as f:
        f.write(json.dumps({**manifest, "format_version": 99}).encode())
    with pytest.raises(mmstore.SchemaVersionError):
        mmstore.Store.open(root, s3_options=s3_options)


def test_s3_endpoint_and_credentials_from_the_environment(s3_options, s3_endpoint, monkeypatch):
    bucket = _bucket(s3_options)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    store = mmstore.Store.open(f"s3://{bucket}/store", create=True)  # no s3_options
    media = store.put_media(_png())
    assert store.read_media(media.uri, media.hash) == _png()
    # Explicit options win over the environment.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    reopened = mmstore.Store.open(f"s3://{bucket}/store", s3_options=s3_options)
    assert reopened.read_media(media.uri, media.hash) == _png()


def _png() -> bytes:
    from tests.store_workers import image_bytes

    return image_bytes(3)


def test_a_folder_inside_a_store_points_at_the_root(tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    store.put_image(mmstore_image())
    for inner in ("media", "media/ab", "rollouts/run_id=r1"):
        with pytest.raises(mmstore.NotAStoreError, match="inside the store at") as err:
            mmstore.Store.open(tmp_path / "s" / inner)
        assert repr(str(tmp_path / "s")) in str(err.value)
        assert "create=True" not in str(err.value)


def mmstore_image():
    from PIL import Image

    return Image.new("RGB", (8, 8), "red")


@pytest.mark.parametrize(
    ("key", "value"), [("format_version", True), ("hash_algorithm", 128), ("format", "other")]
)
def test_malformed_manifest_fields_are_refused(tmp_path, key, value):
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    manifest = json.loads((root / MANIFEST).read_text())
    (root / MANIFEST).write_text(json.dumps({**manifest, key: value}))
    with pytest.raises(mmstore.SchemaVersionError, match=key):
        mmstore.Store.open(root)


def test_file_uri_roots(tmp_path):
    spaced = tmp_path / "a b"
    mmstore.Store.open(spaced, create=True)
    assert mmstore.Store.open(f"file://{tmp_path}/a%20b").backend.base == str(spaced)
    with pytest.raises(mmstore.NotAStoreError):
        mmstore.Store.open(f"file://otherhost{tmp_path}/a%20b")


# -- a store without its log (a copy that skipped `_` folders), a `rollouts` that is a file


def test_a_store_copied_without_its_log_refuses_to_open(tmp_path, adapter):
    """Issue 39.2: files, media and run records but no `_delta_log` opened as an empty
    store (a new version 0): every row gone, and gc then deleted them all."""
    root = tmp_path / "store"
    store = mmstore.Store.open(root, create=True)
    media = store.put_image(photo(1, 48, 40))
    (path,) = commit(store, adapter, "r1", 0, [[media]])
    log = root / "rollouts" / "_delta_log"
    saved = tmp_path / "log"
    shutil.copytree(log, saved)
    before = sorted(p.relative_to(root) for p in root.rglob("*") if "_delta_log" not in p.parts)
    for damage in ("gone", "empty", "no version 0"):
        shutil.rmtree(log, ignore_errors=True)
        if damage != "gone":
            shutil.copytree(saved, log)
            for entry in log.iterdir():
                if damage == "empty" or entry.name == f"{0:020d}.json":
                    entry.unlink()
        with pytest.raises(mmstore.TableNotFoundError, match="restore rollouts/_delta_log/") as err:
            mmstore.Store.open(root)
        assert path in str(err.value) and "runs/r1/" in str(err.value), damage
        assert err.value.root == str(root) and err.value.log == "rollouts/_delta_log"
        with pytest.raises(mmstore.TableNotFoundError):
            mmstore.upgrade(root)  # no other way in either
        now = sorted(p.relative_to(root) for p in root.rglob("*") if "_delta_log" not in p.parts)
        assert now == before, damage  # nothing made, nothing deleted
    shutil.rmtree(log)
    shutil.copytree(saved, log)  # restored: as it was
    assert [f.path for f in mmstore.Store.open(root).files()] == [path]
    # The recovery the error names without a copy of the log: commit the files anew.
    shutil.rmtree(log)
    manifest = json.loads((root / MANIFEST).read_text())
    (root / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    mmstore.upgrade(root)
    again = mmstore.Store.open(root)
    assert [f.path for f in again.files()] == [path] and mmstore.verify(again).ok


def test_a_log_that_starts_at_a_checkpoint_opens(store, adapter):
    """Entries below a checkpoint cleaned up (as delta-rs's log cleanup does): the log
    starts at the checkpoint, and the store opens with its rows."""
    media = store.put_image(photo(1, 48, 40))
    paths = [p for step in range(3) for p in commit(store, adapter, "r1", step, [[media]])]
    version = store.table.checkpoint()
    for entry in range(version):
        store.backend.delete(f"rollouts/_delta_log/{entry:020d}.json")
    assert sorted(f.path for f in mmstore.Store.open(store.root).files()) == sorted(paths)


def test_a_store_holding_only_its_manifest_gets_its_table_on_open(tmp_path):
    """A creator killed between the manifest and the table: the next open makes it."""
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    shutil.rmtree(root / "rollouts")
    store = mmstore.Store.open(root)
    assert store.files() == [] and store.table.latest_version() == 0


def test_a_rollouts_file_is_not_a_store(tmp_path):
    """Issue 39.23: `rollouts` a file gave a DeltaError on open and a NotADirectoryError
    from a store object."""
    root = tmp_path / "store"
    store = mmstore.Store.open(root, create=True)
    shutil.rmtree(root / "rollouts")
    (root / "rollouts").write_text("not a folder")
    for call in (lambda: mmstore.Store.open(root), store.files, lambda: mmstore.gc(store)):
        with pytest.raises(mmstore.NotAStoreError, match=r"'rollouts' .* is a file") as err:
            call()
        assert err.value.path == "rollouts" and err.value.root == str(root)
    (root / "rollouts").unlink()
    (root / "rollouts").mkdir()
    (root / "rollouts" / "_delta_log").write_text("not a folder")
    with pytest.raises(mmstore.NotAStoreError, match=r"'rollouts/_delta_log' .* is a file"):
        mmstore.Store.open(root)
