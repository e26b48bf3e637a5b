"""export: a step range becomes a self-contained store that outlives its source."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.media import content_hash
from mmstore.synth import photo
from tests import rows


def commit(store, adapter, run_id, step, media_rows):
    """The one file committed by :func:`tests.rows.commit`."""
    return rows.commit(store, adapter, run_id, step, media_rows)[0]


def snapshot(store, paths):
    """Rows and bytes of rollout files, and every media file's bytes by path."""
    files = {p: store.backend.read(p) for p in paths}
    media = {m.path: store.backend.read(m.path) for m in store.backend.list("media")}
    return files, media


def test_export_of_a_step_range_outlives_the_source(tmp_path, adapter):
    source = mmstore.Store.open(tmp_path / "source", create=True)
    shared = source.put_image(photo(0, 48, 40))
    per_step = [source.put_image(photo(10 + s, 48, 40)) for s in range(5)]
    files = {
        s: commit(source, adapter, "r1", s, [[shared, per_step[s]], [per_step[s]]])
        for s in range(5)
    }
    commit(source, adapter, "r2", 1, [[shared, per_step[4]]])  # another run, same step
    wanted = [files[1], files[2]]
    expected_files, all_media = snapshot(source, wanted)
    expected_media = {m.uri: all_media[m.uri] for m in (shared, per_step[1], per_step[2])}

    exported = mmstore.export(source, tmp_path / "dump", runs=["r1"], steps=range(1, 3))
    assert exported.root == str(tmp_path / "dump")
    shutil.rmtree(tmp_path / "source")

    dump = mmstore.Store.open(tmp_path / "dump")
    assert [f.path for f in dump.rollout_files()] == sorted(wanted)
    got_files, got_media = snapshot(dump, wanted)
    assert got_files == expected_files  # byte for byte: rows, row groups, metadata
    assert got_media == expected_media  # exactly the media those rows reference
    assert pq.read_table(dump.backend.abspath(files[2])).column("reward").to_pylist() == [0, 1]
    report = mmstore.verify(dump)
    assert report.ok and report.refs_checked == 6 and report.media_checked == 3


def test_an_export_trains_through_the_loader_after_the_source_is_gone(
    tmp_path, adapter, small_processor
):
    import torch

    from mmstore.synth import write_grpo_steps

    source = mmstore.Store.open(tmp_path / "source", create=True)
    write_grpo_steps(
        source, adapter, run_id="r1", steps=range(4), groups=2, group_size=2, image_size=(96, 64)
    )
    mmstore.export(source, tmp_path / "dump", runs=["r1"], steps=range(1, 3))
    shutil.rmtree(tmp_path / "source")
    # Opened from another path: store-relative URIs keep resolving.
    shutil.move(tmp_path / "dump", tmp_path / "moved")
    dump = mmstore.Store.open(tmp_path / "moved")
    ds = mmstore.RolloutDataset(dump, small_processor, dtype=torch.bfloat16)
    seen = []
    for batch in mmstore.RolloutLoader(ds, batch_size=3, num_workers=1):
        assert batch["pixel_values"].dtype == torch.bfloat16
        assert batch["images_missing"] == 0
        assert int(batch["image_grid_thw"].prod(-1).sum()) == batch["pixel_values"].shape[0]
        seen += batch["sample_ids"]
    assert sorted(seen) == sorted(
        f"g{s}-{g:05d}-{k:02d}" for s in (1, 2) for g in range(2) for k in range(2)
    )


def test_export_copies_external_media_in_and_rewrites_only_their_uris(tmp_path, adapter):
    outside = tmp_path / "outside"
    outside.mkdir()
    photo(3, 48, 40).save(outside / "shot.png")
    data = (outside / "shot.png").read_bytes()
    external = mmstore.MediaRef(
        hash=content_hash(data), uri=f"file://{outside}/shot.png", width=48, height=40
    )
    source = mmstore.Store.open(tmp_path / "source", create=True, trusted_roots=[str(outside)])
    inside = source.put_image(photo(4, 48, 40))
    path = commit(source, adapter, "r1", 0, [[inside, external], [external]])
    before = pq.read_table(source.backend.abspath(path))

    mmstore.export(source, tmp_path / "dump", runs="r1")
    shutil.rmtree(outside)
    dump = mmstore.Store.open(tmp_path / "dump")  # trusts nothing outside itself
    after = pq.read_table(dump.backend.abspath(path))
    local = f"media/{external.hash[:2]}/{external.hash[2:4]}/{external.hash}.png"
    rewritten = [
        [{**ref, "uri": local if ref["uri"] == external.uri else ref["uri"]} for ref in row]
        for row in before.column("images").to_pylist()
    ]
    assert after.column("images").to_pylist() == rewritten
    assert after.drop_columns(["images"]).equals(before.drop_columns(["images"]))
    assert after.schema.metadata == before.schema.metadata
    assert dump.read_media(local, external.hash) == data
    assert mmstore.verify(dump).ok


def test_export_refuses_bad_destinations_selections_and_missing_media(tmp_path, adapter):
    source = mmstore.Store.open(tmp_path / "source", create=True)
    kept, lost = (source.put_image(photo(s, 48, 40)) for s in (1, 2))
    commit(source, adapter, "r1", 0, [[kept]])
    path = commit(source, adapter, "r1", 1, [[kept], [kept, lost]])

    with pytest.raises(mmstore.DestinationExistsError, match="already holds a store"):
        mmstore.export(source, tmp_path / "source")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    with pytest.raises(mmstore.NotAStoreError, match="refusing to create"):
        mmstore.export(source, tmp_path / "busy")
    with pytest.raises(mmstore.NoMatchError, match="no committed rollout files"):
        mmstore.export(source, tmp_path / "none", steps=[7])
    with pytest.raises(mmstore.InvalidArgumentError, match="steps must be ints"):
        mmstore.export(source, tmp_path / "none", steps=["1"])

    source.backend.delete(lost.uri)
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        mmstore.export(source, tmp_path / "broken", steps=1)
    err = info.value
    assert (err.file, err.run_id, err.step, err.sample_id, err.image_index) == (
        path,
        "r1",
        1,
        "r1-1-1",
        1,
    )


def test_export_from_s3_to_disk_and_back_to_s3(s3_store, s3_options, adapter, tmp_path):
    media = [s3_store.put_image(photo(s, 48, 40)) for s in range(3)]
    commit(s3_store, adapter, "r1", 0, [[media[0]]])
    path = commit(s3_store, adapter, "r1", 1, [[media[1], media[2]]])
    dump = mmstore.export(s3_store, tmp_path / "dump", steps=[1])
    assert [f.path for f in dump.rollout_files()] == [path]
    assert dump.backend.read(path) == s3_store.backend.read(path)
    assert sorted(m.path for m in dump.backend.list("media")) == sorted(m.uri for m in media[1:])
    assert mmstore.verify(dump).ok

    bucket = s3_store.root.split("/")[2]
    again = mmstore.export(dump, f"s3://{bucket}/again", s3_options=s3_options)
    assert again.backend.read(path) == s3_store.backend.read(path)
    assert mmstore.verify(again).ok and mmstore.verify(again).media_checked == 2
