"""Video media through the lifecycle: gc and pins keep the clips kept rows reference, export
copies them, verify names damaged ones by video index, debug and the CLI show them.

Every store here holds real clips (``tests/video_clips.py``) put with ``put_video`` and rows
laid out by the real Qwen2-VL processor's adapter; expected values come from what the test
wrote and from the clip bytes, never from the code under test.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import mmstore
from mmstore import debug
from mmstore.cli import main
from mmstore.synth import photo
from tests.family_cases import QWEN_VL, token_ids
from tests.rows import commit_existing
from tests.video_clips import decode_all, make_clip

IMAGE_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_SPAN = "<|vision_start|><|video_pad|><|vision_end|>"
CLIP = {"num_frames": 24, "width": 168, "height": 112, "fps": 12}


@pytest.fixture(scope="module")
def processor():
    """Qwen2-VL's full processor over the small tokenizer, its video side made small (a
    processor of its own: the cached one of ``family_cases`` stays as other tests expect)."""
    proc = QWEN_VL.full(QWEN_VL.image_processor(), QWEN_VL.small_ids)
    proc.video_processor.size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    proc.video_processor.cap_pixels_per_frame = False
    return proc


@pytest.fixture(scope="module")
def vadapter(processor):
    return mmstore.adapter_for(processor)


@pytest.fixture(scope="module")
def clips():
    """Three distinct clips' bytes (distinct hashes)."""
    return [make_clip(**CLIP, seed=seed) for seed in range(3)]


def row(processor, adapter, sample_id, *, images=(), videos=()):
    """A prompt with each image's then each video's placeholder, expanded by the adapter
    (videos sampled at 2 fps), then two completion tokens in the loss."""
    text = "hi " + IMAGE_SPAN * len(images) + VIDEO_SPAN * len(videos) + " look"
    ex = adapter.expand_media(
        token_ids(processor, text), images=list(images), videos=list(videos), fps=2
    )
    assert len(ex.videos) == len(videos)
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=[*ex.tokens, 5, 5],
        prompt_len=len(ex.tokens),
        loss_mask=[False] * len(ex.tokens) + [True, True],
        images=ex.images,
        videos=ex.videos,
        reward=1.0,
        advantage=0.5,
    )


def write(store, adapter, run_id, step, rollouts):
    with store.writer(run_id, step, adapter=adapter) as w:
        w.write_many(rollouts)
    return w.committed[0]


def age(store, uris, seconds=7200.0):
    """Back-date media, as if put long ago: only references can keep them from a gc."""
    past = time.time() - seconds
    for uri in uris:
        os.utime(store.backend.abspath(uri), (past, past))


def present(store, *refs):
    return [store.backend.stat(r.uri) is not None for r in refs]


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))  # same size, other bytes


# -- gc and pins ---------------------------------------------------------------------------


def test_gc_keeps_videos_of_kept_rows_and_frees_them_after_release(
    store, processor, vadapter, clips
):
    a, b, loose = (store.put_video(c) for c in clips)
    write(store, vadapter, "a", 0, [row(processor, vadapter, "a0", videos=[a])])
    write(store, vadapter, "b", 0, [row(processor, vadapter, "b0", videos=[b])])
    age(store, [a.uri, b.uri, loose.uri])

    # Referenced only by videos[].hash of kept rows: kept, however old; the loose clip goes.
    report = mmstore.gc(store, grace_seconds=60)
    assert report.deleted == [loose.uri]
    assert report.referenced == 2
    assert present(store, a, b, loose) == [True, True, False]
    assert mmstore.verify(store).ok

    # A pin of a video ref holds its clip once no row does.
    mmstore.pin(store, "clip-b", [store.rollouts("b")[0].videos[0]])
    mmstore.release_run(store, "a", grace_seconds=0)
    mmstore.release_run(store, "b", grace_seconds=0)
    assert present(store, a, b) == [False, True]
    mmstore.unpin(store, "clip-b")
    assert mmstore.gc(store, grace_seconds=0).deleted == [b.uri]
    assert present(store, b) == [False]


def test_released_rows_keep_their_videos_for_the_grace_period(store, processor, vadapter, clips):
    a = store.put_video(clips[0])
    write(store, vadapter, "a", 0, [row(processor, vadapter, "a0", videos=[a])])
    age(store, [a.uri])
    release = mmstore.release_run(store, "a", grace_seconds=3600)
    # A reader that opened the version before the release may still read the row.
    assert release.gc.deleted == [] and present(store, a) == [True]
    assert mmstore.gc(store, grace_seconds=0).deleted == [a.uri]


def test_pin_rows_holds_the_videos_of_the_pinned_rows(store, processor, vadapter, clips):
    a = store.put_video(clips[0])
    write(store, vadapter, "a", 0, [row(processor, vadapter, "a0", videos=[a])])
    mmstore.pin_rows(store, "ckpt", runs="a")
    assert mmstore.list_pins(store) == {"ckpt": 1}
    age(store, [a.uri])
    mmstore.release_run(store, "a", grace_seconds=0, force=True)
    assert present(store, a) == [True]


def without_videos_column(source_store, store, adapter, image):
    """A committed file as a writer before the ``videos`` column wrote it: written by
    today's writer into a scratch store, the column dropped, committed here."""
    tokens, refs = adapter.expand([7, adapter.image_token_id, 8], [image])
    rollout = mmstore.Rollout(
        sample_id="old0", tokens=tokens, prompt_len=len(tokens), loss_mask=[False] * len(tokens),
        images=refs,
    )  # fmt: skip
    path = write(source_store, adapter, "old", 0, [rollout])
    parquet = pq.ParquetFile(source_store.backend.abspath(path))
    meta = {k: v for k, v in parquet.metadata.metadata.items() if k != b"ARROW:schema"}
    table = parquet.read().drop_columns(["videos"]).replace_schema_metadata(meta)
    os.makedirs(os.path.dirname(store.backend.abspath(path)))
    pq.write_table(table, store.backend.abspath(path), write_page_checksum=True)
    assert "videos" not in pq.read_schema(store.backend.abspath(path)).names
    commit_existing(store, path)
    return path


def test_a_file_from_before_the_videos_column_reads_as_no_videos(
    tmp_path, store, adapter, processor, vadapter, clips
):
    scratch = mmstore.Store.open(tmp_path / "scratch", create=True)
    picture = photo(1, 48, 40)
    image = scratch.put_image(picture)
    assert store.put_image(picture) == image  # the same media in the store under test
    without_videos_column(scratch, store, adapter, image)
    clip = store.put_video(clips[0])
    write(store, vadapter, "new", 0, [row(processor, vadapter, "n0", videos=[clip])])
    loose = store.put_video(clips[1])
    age(store, [image.uri, clip.uri, loose.uri])

    assert mmstore.gc(store, grace_seconds=0).deleted == [loose.uri]
    assert present(store, image, clip) == [True, True]
    assert mmstore.verify(store).ok
    counts = debug.scan(store).select("sample_id", "n_videos").sort("sample_id").collect()
    assert counts.rows() == [("n0", 1), ("old0", 0)]
    assert debug.videos(store).collect()["sample_id"].to_list() == ["n0"]
    assert [len(r.videos) for r in store.rollouts("old")] == [0]


# -- export --------------------------------------------------------------------------------


def test_export_copies_the_clips_and_the_export_loads_them(tmp_path, processor, vadapter, clips):
    import torch

    source = mmstore.Store.open(tmp_path / "source", create=True)
    image = source.put_image(photo(2, 56, 56))
    kept, other = source.put_video(clips[0]), source.put_video(clips[1])
    rows = [
        row(processor, vadapter, "s0", images=[image], videos=[kept]),
        row(processor, vadapter, "s1", videos=[kept]),
    ]
    path = write(source, vadapter, "r1", 0, rows)
    write(source, vadapter, "r2", 0, [row(processor, vadapter, "t0", videos=[other])])

    def first_batch(store):
        dataset = mmstore.RolloutDataset(store, processor, runs=["r1"], dtype=torch.float32)
        return next(iter(mmstore.RolloutLoader(dataset, batch_size=2)))

    want = first_batch(source)
    mmstore.export(source, tmp_path / "dump", runs="r1")
    shutil.rmtree(tmp_path / "source")

    dump = mmstore.Store.open(tmp_path / "dump")
    media = {m.path for m in dump.backend.list("media")}
    assert media == {image.uri, kept.uri}  # exactly the media of the exported rows
    assert dump.read_media(kept.uri, kept.hash) == clips[0]
    assert [r.videos for r in dump.rollouts("r1")] == [r.videos for r in rows]
    assert [f.path for f in dump.rollout_files()] == [path]
    report = mmstore.verify(dump)
    assert report.ok and report.refs_checked == 3 and report.media_checked == 2
    got = first_batch(dump)
    assert got["sample_ids"] == want["sample_ids"]
    for name in ("pixel_values_videos", "video_grid_thw", "pixel_values", "input_ids"):
        assert torch.equal(got[name], want[name]), name


def test_export_copies_an_external_clip_in_and_rewrites_its_uri(
    tmp_path, processor, vadapter, clips
):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "clip.mp4").write_bytes(clips[2])
    source = mmstore.Store.open(tmp_path / "source", create=True, trusted_roots=[str(outside)])
    stored = source.put_video(clips[2])
    source.backend.delete(stored.uri)  # the rows name the clip outside the store only
    external = stored.model_copy(update={"uri": f"file://{outside}/clip.mp4"})
    inside = source.put_video(clips[0])
    rows = [
        row(processor, vadapter, "s0", videos=[inside, external]),
        row(processor, vadapter, "s1"),  # text only: its videos stay as they were
    ]
    path = write(source, vadapter, "r1", 0, rows)
    before = pq.read_table(source.backend.abspath(path))

    mmstore.export(source, tmp_path / "dump", runs="r1")
    shutil.rmtree(outside)
    dump = mmstore.Store.open(tmp_path / "dump")  # trusts nothing outside itself
    after = pq.read_table(dump.backend.abspath(path))
    rewritten = [
        None
        if refs is None
        else [{**r, "uri": stored.uri if r["uri"] == external.uri else r["uri"]} for r in refs]
        for refs in before.column("videos").to_pylist()
    ]
    assert rewritten[0][1]["uri"] == stored.uri  # the external ref, now store-relative
    assert after.column("videos").to_pylist() == rewritten
    assert after.drop_columns(["videos"]).equals(before.drop_columns(["videos"]))
    assert dump.read_media(stored.uri, stored.hash) == clips[2]
    assert mmstore.verify(dump).ok


def test_export_of_a_row_whose_clip_is_gone_names_the_video(tmp_path, processor, vadapter, clips):
    source = mmstore.Store.open(tmp_path / "source", create=True)
    kept, lost = source.put_video(clips[0]), source.put_video(clips[1])
    path = write(source, vadapter, "r1", 0, [row(processor, vadapter, "s0", videos=[kept, lost])])
    source.backend.delete(lost.uri)
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        mmstore.export(source, tmp_path / "dump")
    err = info.value
    assert (err.file, err.sample_id, err.video_index) == (path, "s0", 1)


# -- verify --------------------------------------------------------------------------------


@pytest.fixture
def damaged(store, processor, vadapter, clips):
    """Rows whose clips will be damaged: s0 holds an image and clip A, s1 clips A and B."""
    image = store.put_image(photo(3, 56, 56))
    a, b = store.put_video(clips[0]), store.put_video(clips[1])
    path = write(
        store,
        vadapter,
        "r1",
        0,
        [
            row(processor, vadapter, "s0", images=[image], videos=[a]),
            row(processor, vadapter, "s1", videos=[a, b]),
        ],
    )
    assert mmstore.verify(store).ok
    flip_a_byte(store.backend.abspath(a.uri))
    os.unlink(store.backend.abspath(b.uri))
    return store, path, a, b


def test_verify_names_a_corrupted_and_a_deleted_clip_by_video_index(damaged):
    store, path, a, b = damaged
    report = mmstore.verify(store)
    assert not report.ok
    got = [
        (p.kind, p.file, p.run_id, p.step, p.sample_id, p.image_index, p.video_index, p.uri)
        for p in report.problems
    ]
    assert got == [
        ("hash_mismatch", path, "r1", 0, "s0", None, 0, a.uri),
        ("hash_mismatch", path, "r1", 0, "s1", None, 0, a.uri),
        ("missing_media", path, "r1", 0, "s1", None, 1, b.uri),
    ]
    assert "hash to" in report.problems[0].message
    assert report.refs_checked == 4  # one image ref, three video refs
    # Sizes only: the same-size corruption is not seen, the missing clip is.
    quick = mmstore.verify(store, check_hashes=False)
    assert [(p.kind, p.sample_id, p.video_index) for p in quick.problems] == [
        ("missing_media", "s1", 1)
    ]


def test_cli_verify_prints_the_video_index(damaged, capsys):
    store, path, _, b = damaged
    assert main(["verify", store.root]) == 1
    out = capsys.readouterr().out
    assert f"missing_media: media file not found (file={path}" in out
    assert "sample_id=s1, video_index=1, uri=" + b.uri in out
    assert "3 problem(s)" in out


# -- debug ---------------------------------------------------------------------------------


@pytest.fixture
def shown(store, processor, vadapter, clips):
    """Run r1: s0 with an image and clip A, s1 with clips A and B, s2 text only."""
    image = store.put_image(photo(4, 56, 56))
    a, b = store.put_video(clips[0]), store.put_video(clips[1])
    rows = [
        row(processor, vadapter, "s0", images=[image], videos=[a]),
        row(processor, vadapter, "s1", videos=[a, b]),
        row(processor, vadapter, "s2"),
    ]
    write(store, vadapter, "r1", 0, rows)
    return store, rows, {"a": a, "b": b, "image": image}


def test_debug_videos_has_one_row_per_video_ref(shown):
    store, rows, _ = shown
    frame = debug.videos(store).collect()
    want = [
        {"run_id": "r1", "step": 0, "sample_id": x.sample_id, "group_id": None, "video_index": i,
         **ref.model_dump(), "frames": list(ref.frames), "n_frames": len(ref.frames)}
        for x in rows
        for i, ref in enumerate(x.videos)
    ]  # fmt: skip
    assert len(want) == 3 and want[0]["n_frames"] == 4  # 24 frames at 12 fps, sampled at 2
    assert sorted(frame.columns) == sorted(want[0])
    assert frame.select(list(want[0])).to_dicts() == want
    # The rows read back carry the same refs.
    assert [x.videos for x in store.rollouts("r1")] == [x.videos for x in rows]
    counts = debug.scan(store).select("sample_id", "n_videos").sort("sample_id").collect()
    assert counts.rows() == [("s0", 1), ("s1", 2), ("s2", 0)]
    assert debug.images(store).collect()["sample_id"].to_list() == ["s0"]


def test_debug_summary_counts_clip_bytes_and_missing_clips(shown):
    store, _, media = shown
    root = store.root
    sizes = {k: os.path.getsize(os.path.join(root, m.uri)) for k, m in media.items()}
    before = debug.summary(store).row(0, named=True)
    assert before["media_bytes"] == sum(sizes.values())
    assert before["images"] == 1 and before["missing_media"] == 0
    os.unlink(os.path.join(root, media["b"].uri))
    after = debug.summary(store).row(0, named=True)
    assert after["media_bytes"] == sizes["a"] + sizes["image"]
    assert after["missing_media"] == 1
    missing = debug.missing_videos(store)
    assert missing.select("sample_id", "video_index", "uri").rows() == [("s1", 1, media["b"].uri)]
    assert debug.missing_media(store).height == 0  # image refs only, all there


def test_video_strip_shows_the_sampled_frames_and_missing_clips(shown, clips):
    store, _, media = shown
    sample = debug.sample(store, "s1")
    ref = sample["videos"][1]
    frames = decode_all(clips[1])
    strips = np.asarray(debug.video_strips(store, sample, size=200, frames=3))
    shown_frames = [ref["frames"][0], ref["frames"][2], ref["frames"][-1]]
    assert len(ref["frames"]) == 4 and shown_frames == [0, 12, 18]
    # Second strip (video #1): each shown frame pasted whole, unscaled, side by side.
    top = strips.shape[0] // 2
    tile_h, tile_w = CLIP["height"], CLIP["width"]
    for i, index in enumerate(shown_frames):
        x = i * (tile_w + 8)
        pasted = strips[top : top + tile_h, x : x + tile_w]
        assert np.array_equal(pasted, frames[index]), index
    os.unlink(store.backend.abspath(media["b"].uri))
    strips = np.asarray(debug.video_strips(store, sample, size=64))
    top = strips.shape[0] - (64 + 34 + 8)  # the last strip: one grey tile, then its label
    grey = np.all(strips[top : top + 64, :64] == (215, 215, 215), axis=2).mean()
    assert grey > 0.8


def test_token_strip_colours_video_spans(shown):
    store, _, _ = shown
    sample = debug.sample(store, "s1")
    n, cell = len(sample["tokens"]), 7
    strip = np.asarray(debug.token_strip(sample, columns=n, cell=cell))
    video_cells = [int(np.all(strip == colour, axis=2).sum(axis=1).max()) for colour in debug.VIDEO]
    assert video_cells == [ref["length"] * (cell - 1) for ref in sample["videos"]]


# -- CLI -------------------------------------------------------------------------------------


def test_cli_inspect_shows_the_videos(shown, capsys, tmp_path, monkeypatch):
    store, rows, _ = shown
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["inspect", store.root]) == 0
    listing = capsys.readouterr().out
    header = listing.splitlines()[0].split()
    assert "videos" in header
    at = header.index("videos")
    counts = {line.split()[2]: line.split()[at] for line in listing.splitlines()[1:4]}
    assert counts == {"s0": "1", "s1": "2", "s2": "0"}

    png = tmp_path / "s1.png"
    assert main(["inspect", store.root, "--sample", "s1", "--view", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80
    assert "videos (2):" in out
    spans = [ref.offset for ref in rows[1].videos]
    assert f"video#0 [{spans[0]}," in out and f"video#1 [{spans[1]}," in out
    table = lines[lines.index("videos (2):") + 1 :]
    assert table[0].split()[:5] == ["index", "tokens", "length", "size", "frames"]
    assert [line.split()[0] for line in table[1:3]] == ["0", "1"]
    assert "4 of 24" in table[1] and "168x112" in table[1]
    assert main(["inspect", store.root, "--sample", "s2"]) == 0
    assert "videos (" not in capsys.readouterr().out  # a row without videos reads as before
    with Image.open(png) as view:
        strip = debug.video_strips(store, debug.sample(store, "s1"), size=320)
        assert view.width >= strip.width and view.height > strip.height
        pixels = np.asarray(view.convert("RGB"))
    first = decode_all(make_clip(**CLIP, seed=0))[0]  # video #0's first frame, in the view
    found = [
        y
        for y in range(pixels.shape[0] - first.shape[0])
        if np.array_equal(pixels[y, : first.shape[1]], first[0])
    ]
    assert found, "the first sampled frame of video #0 is not drawn"
