"""Durable writes paid once per commit (issue 14, item 3): ``put_media`` does not fsync; the
commit fsyncs every media file its rows reference (a dedup hit on another writer's copy
included), and only then makes the Parquet file visible. ``tests/test_crash.py`` keeps the
kill -9 guarantees."""

from __future__ import annotations

import os

import pytest

import mmstore
from tests.store_workers import image_bytes, make_row, small_adapter


@pytest.fixture
def events(monkeypatch):
    """Every fsync (the path of the synced file or directory) and rename/link, in order."""
    log: list[tuple[str, str]] = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, *args, **kwargs):
        log.append(("link", os.fspath(dst)))
        return real_link(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        log.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    return log


def test_put_media_pays_no_fsync(tmp_path, events):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    events.clear()
    store.put_media(image_bytes(1))
    assert [e for e in events if e[0] == "fsync"] == []


def test_commit_syncs_referenced_media_before_the_rows(tmp_path, events):
    root = tmp_path / "s"
    adapter = small_adapter()
    other = mmstore.Store.open(root, create=True)
    shared = other.put_media(image_bytes(2))  # another writer's copy, never committed
    store = mmstore.Store.open(root)
    events.clear()
    # A dedup hit: this put writes nothing, the bytes are the other writer's.
    media = [store.put_media(image_bytes(2)), store.put_media(image_bytes(3))]
    assert media[0].uri == shared.uri
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(make_row(adapter, media, "a"))
        w.write(make_row(adapter, media[:1], "b"))
    [rel] = w.committed
    visible = events.index(("link", store.backend.abspath(rel)))
    synced = {path for kind, path in events[:visible] if kind == "fsync"}
    for ref in media:
        path = store.backend.abspath(ref.uri)
        assert path in synced and os.path.dirname(path) in synced
    # Once per file, however many rows reference it.
    fsyncs = [path for kind, path in events if kind == "fsync"]
    assert fsyncs.count(store.backend.abspath(media[0].uri)) == 1


def test_a_second_commit_syncs_what_its_own_rows_reference(tmp_path, events):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()
    first, second = store.put_media(image_bytes(4)), store.put_media(image_bytes(5))
    w = store.writer(run_id="r", step=0, adapter=adapter)
    w.write(make_row(adapter, [first], "a"))
    w.commit()
    events.clear()
    w.write(make_row(adapter, [second], "b"))
    w.commit()
    fsyncs = [path for kind, path in events if kind == "fsync"]
    assert store.backend.abspath(second.uri) in fsyncs
    assert store.backend.abspath(first.uri) not in fsyncs


def test_media_gone_before_commit_is_typed(tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()
    media = store.put_media(image_bytes(6))
    w = store.writer(run_id="r", step=0, adapter=adapter)
    w.write(make_row(adapter, [media], "a"))
    os.unlink(store.backend.abspath(media.uri))
    with pytest.raises(mmstore.MediaNotFoundError):
        w.commit()
    assert store.rollout_files() == []


def test_commit_syncs_every_directory_up_to_the_root_once(tmp_path, events):
    # The new media's directories (media/ab/cd, media/ab, media) and the store root hold
    # entries a power loss must not drop; two files under one root share the upper ones.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()
    media = [store.put_media(image_bytes(6)), store.put_media(image_bytes(7))]
    events.clear()
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(make_row(adapter, media, "a"))
    [rel] = w.committed
    visible = events.index(("link", store.backend.abspath(rel)))
    synced = [path for kind, path in events[:visible] if kind == "fsync"]
    for ref in media:
        directory = os.path.dirname(store.backend.abspath(ref.uri))
        while directory != os.path.dirname(store.backend.base):
            assert directory in synced, directory
            directory = os.path.dirname(directory)
    under_media = [path for path in synced if "/media" in path]
    assert len(under_media) == len(set(under_media))
