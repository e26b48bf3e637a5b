"""mmstore.debug on a store whose contents the test wrote by hand.

Expected numbers (dedup ratio, bytes, dense pixel bytes, missing media, rewards) are computed
here from what was written, the files on disk and the real image processor, never by calling
the code under test.
"""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image

import mmstore
from mmstore import debug
from mmstore.synth import photo, screenshot

ROW_COLUMNS = [
    "run_id",
    "step",
    "sample_id",
    "group_id",
    "tokens",
    "prompt_len",
    "loss_mask",
    "logprobs",
    "reward",
    "advantage",
    "images",
    "metadata",
    "policy_version",
    "videos",
    "n_videos",  # computed by scan: the length of videos (0 for a file without the column)
]
IMAGE_COLUMNS = [
    "run_id",
    "step",
    "sample_id",
    "group_id",
    "index",
    "uri",
    "hash",
    "width",
    "height",
    "nbytes",
    "offset",
    "length",
    "family",
    "layout_fingerprint",
]


def make_rollout(adapter, sample_id, media, reward, *, completion=6, group=None):
    """Text, then `<start><image><end>` per image, then a completion in the loss."""
    ids = [11, 12]
    for _ in media:
        ids += [13, adapter.image_token_id, 14]
    ids += [15]
    tokens, refs = adapter.expand(ids, media)
    return mmstore.Rollout(
        sample_id=sample_id,
        group_id=group,
        tokens=tokens + list(range(100, 100 + completion)),
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * completion,
        reward=reward,
        advantage=None if reward is None else reward - 0.5,
        images=refs,
    )


class Known:
    """What the fixture wrote: pictures, their media refs, and rows per (run, step)."""

    def __init__(self, store, pictures, media, rows):
        self.store, self.pictures, self.media, self.rows = store, pictures, media, rows
        self.root = Path(store.root)


@pytest.fixture(scope="module")
def known(tmp_path_factory, adapter) -> Known:
    store = mmstore.Store.open(tmp_path_factory.mktemp("known") / "store", create=True)
    pictures = {
        "A": screenshot(1, 160, 120),
        "B": screenshot(2, 200, 150),
        "C": screenshot(3, 320, 200),
        "D": photo(4, 224, 168),
    }
    media = {
        name: store.put_image(pic, format="jpeg" if name == "D" else "png")
        for name, pic in pictures.items()
    }
    A, B, C, D = (media[k] for k in "ABCD")
    rows = {
        ("r1", 0): [
            make_rollout(adapter, "s0", [A, B], 1.0, group="g0"),
            make_rollout(adapter, "s1", [A, B], 0.0, group="g0"),
            make_rollout(adapter, "s2", [A, C], 0.5, group="g1"),
            make_rollout(adapter, "s3", [], None, group="g1"),  # text only, no reward
        ],
        ("r1", 1): [
            make_rollout(adapter, "s4", [C], 1.0),
            make_rollout(adapter, "s5", [D], 0.25, completion=9),
        ],
        ("r2", 0): [make_rollout(adapter, "s0", [A], 0.0)],
    }
    for (run_id, step), rollouts in rows.items():
        with store.writer(run_id=run_id, step=step) as w:
            w.write_many(rollouts)
    # D goes missing after its row was committed (a bad manual cleanup).
    os.remove(store.backend.abspath(D.uri))
    return Known(store, pictures, media, rows)


def test_scan_has_partitions_and_every_column(known):
    frame = debug.scan(known.store)
    assert isinstance(frame, pl.LazyFrame)
    schema = frame.collect_schema()
    assert list(schema) == ROW_COLUMNS
    assert schema["run_id"] == pl.String and schema["step"] == pl.Int32
    df = frame.collect()
    got = {(r, s, sid) for r, s, sid in df.select("run_id", "step", "sample_id").iter_rows()}
    want = {(r, s, x.sample_id) for (r, s), rows in known.rows.items() for x in rows}
    assert got == want and df.height == len(want)
    s2 = df.filter((pl.col("run_id") == "r1") & (pl.col("sample_id") == "s2")).row(0, named=True)
    written = known.rows["r1", 0][2]
    assert s2["tokens"] == written.tokens
    assert s2["loss_mask"] == written.loss_mask
    assert [ref["hash"] for ref in s2["images"]] == [known.media[k].hash for k in "AC"]


def test_scan_ignores_staging_and_prunes_partitions(known, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(known.root, root)
    store = mmstore.Store.open(root)
    r1_files = sorted((root / "rollouts" / "run_id=r1").rglob("*.parquet"))
    # An in-flight write sits in _staging: readers never see it.
    staged = root / "_staging" / "rollouts" / "run_id=r9" / "step=0" / "part-x.parquet"
    staged.parent.mkdir(parents=True)
    shutil.copy(r1_files[0], staged)
    assert set(debug.scan(store).collect()["run_id"]) == {"r1", "r2"}
    # Break every r1 file: a filter on run_id must not open them at all.
    for path in r1_files:
        path.write_bytes(b"not parquet")
    only_r2 = debug.scan(store).filter(pl.col("run_id") == "r2").select("sample_id").collect()
    assert only_r2["sample_id"].to_list() == ["s0"]
    with pytest.raises(pl.exceptions.PolarsError):
        debug.scan(store).collect()


def test_scan_projection_reads_only_asked_columns(known):
    plan = debug.scan(known.store).select("sample_id", "reward").explain()
    # Of the columns read from files: every one of ROW_COLUMNS but the computed n_videos.
    assert f"PROJECT 2/{len(ROW_COLUMNS) - 1} COLUMNS" in plan


def test_images_one_row_per_ref(known):
    frame = debug.images(known.store)
    assert isinstance(frame, pl.LazyFrame)
    df = frame.collect()
    assert df.columns == IMAGE_COLUMNS
    want = [
        (run_id, step, x.sample_id, x.group_id, i, ref)
        for (run_id, step), rows in known.rows.items()
        for x in rows
        for i, ref in enumerate(x.images)
    ]
    assert df.height == len(want) == 9
    by_key = {(r["run_id"], r["sample_id"], r["index"]): r for r in df.iter_rows(named=True)}
    for run_id, step, sample_id, group_id, index, ref in want:
        row = by_key[run_id, sample_id, index]
        assert row["step"] == step and row["group_id"] == group_id
        assert {k: row[k] for k in IMAGE_COLUMNS[5:]} == ref.model_dump(exclude={"payload"})
    assert "s3" not in set(df["sample_id"])  # text-only rows have no image rows


def dense_bytes(processor, picture: Image.Image) -> int:
    """Bytes of fp32 pixel_values the real processor makes for one image."""
    pixels = processor(images=[picture.convert("RGB")], return_tensors="np")["pixel_values"]
    return int(np.prod(pixels.shape)) * 4


def test_summary_per_run_and_step(known, small_processor):
    table = debug.summary(known.store)
    assert table.columns == [
        "run_id",
        "step",
        "samples",
        "images",
        "unique_images",
        "dedup_ratio",
        "videos",
        "video_frames",
        "parquet_bytes",
        "media_bytes",
        "disk_bytes",
        "dense_fp32_bytes",
        "reward_mean",
        "reward_std",
        "missing_media",
    ]
    name_of = {m.hash: name for name, m in known.media.items()}
    dense = {name: dense_bytes(small_processor, pic) for name, pic in known.pictures.items()}
    got = {(r["run_id"], r["step"]): r for r in table.iter_rows(named=True)}
    assert list(got) == sorted(known.rows)
    for (run_id, step), rows in known.rows.items():
        names = [name_of[ref.hash] for x in rows for ref in x.images]
        files = [known.root / known.media[n].uri for n in set(names)]
        parquet = sum(
            p.stat().st_size
            for p in (known.root / "rollouts" / f"run_id={run_id}" / f"step={step}").iterdir()
        )
        media = sum(p.stat().st_size for p in files if p.exists())
        rewards = [x.reward for x in rows if x.reward is not None]
        row = got[run_id, step]
        assert row["samples"] == len(rows)
        assert row["images"] == len(names)
        assert row["unique_images"] == len(set(names))
        assert row["dedup_ratio"] == pytest.approx(len(names) / len(set(names)))
        assert row["parquet_bytes"] == parquet
        assert row["media_bytes"] == media
        assert row["disk_bytes"] == parquet + media
        assert row["dense_fp32_bytes"] == sum(dense[n] for n in names)
        assert row["reward_mean"] == pytest.approx(statistics.mean(rewards))
        if len(rewards) > 1:
            assert row["reward_std"] == pytest.approx(statistics.stdev(rewards))
        missing = sum(not (known.root / ref.uri).exists() for x in rows for ref in x.images)
        assert row["missing_media"] == missing
    # The hand-checked figures: A,B,A,B,A,C is 6 refs of 3 images; D is gone from r1/1.
    assert got["r1", 0]["dedup_ratio"] == 2.0
    assert got["r1", 1]["missing_media"] == 1
    assert got["r1", 0]["missing_media"] == got["r2", 0]["missing_media"] == 0


def test_summary_whole_store_and_per_run(known):
    total = debug.summary(known.store, by=())
    assert total.height == 1 and "run_id" not in total.columns
    row = total.row(0, named=True)
    all_rows = [x for rows in known.rows.values() for x in rows]
    hashes = [ref.hash for x in all_rows for ref in x.images]
    present = [m for m in known.media.values() if (known.root / m.uri).exists()]
    assert row["samples"] == len(all_rows) == 7
    assert row["images"] == len(hashes) == 9
    assert row["unique_images"] == len(set(hashes)) == 4
    assert row["dedup_ratio"] == pytest.approx(9 / 4)
    # Whole store: media shared between steps and runs counts once.
    assert row["media_bytes"] == sum((known.root / m.uri).stat().st_size for m in present)
    assert row["missing_media"] == 1
    per_run = debug.summary(known.store, by=["run_id"])
    assert per_run.columns[0] == "run_id" and "step" not in per_run.columns
    assert dict(per_run.select("run_id", "samples").iter_rows()) == {"r1": 6, "r2": 1}
    with pytest.raises(ValueError, match="group_id"):
        debug.summary(known.store, by=["group_id"])


def test_missing_media_names_the_samples(known):
    missing = debug.missing_media(known.store)
    gone = [m for m in known.media.values() if not (known.root / m.uri).exists()]
    assert len(gone) == 1
    assert missing.select("run_id", "step", "sample_id", "index", "uri").rows() == [
        ("r1", 1, "s5", 0, gone[0].uri)
    ]


def test_empty_store(store):
    assert debug.scan(store).collect().columns == ROW_COLUMNS
    assert debug.images(store).collect().height == 0
    assert debug.summary(store).height == 0
    total = debug.summary(store, by=()).row(0, named=True)
    assert total["samples"] == 0 and total["images"] == 0 and total["dedup_ratio"] is None


def test_sample_lookup(known):
    row = debug.sample(known.store, "s2")
    assert (row["run_id"], row["step"], row["prompt_len"]) == (
        "r1",
        0,
        known.rows["r1", 0][2].prompt_len,
    )
    assert debug.sample(known.store, "s0", run_id="r2")["run_id"] == "r2"
    with pytest.raises(mmstore.NoMatchError, match=r"r1/0, r2/0"):
        debug.sample(known.store, "s0")
    with pytest.raises(LookupError, match="no such sample") as err:
        debug.sample(known.store, "nope", run_id="r1")
    assert err.value.sample_id == "nope"


def colour_runs(line: np.ndarray) -> list[tuple[tuple[int, int, int], int]]:
    """Run-length encode the non-white pixels of one image row: [(colour, pixels), ...]."""
    runs: list[tuple[tuple[int, int, int], int]] = []
    for pixel in map(tuple, line):
        if pixel == (255, 255, 255):
            continue
        if runs and runs[-1][0] == pixel:
            runs[-1] = (pixel, runs[-1][1] + 1)
        else:
            runs.append((pixel, 1))
    return runs


def test_token_strip_colours_spans_prompt_and_loss(known):
    row = debug.sample(known.store, "s2")
    n, cell = len(row["tokens"]), 7
    strip = np.asarray(debug.token_strip(row, columns=n, cell=cell))  # one line of cells
    is_prompt = np.all(strip == debug.PROMPT, axis=2).sum(axis=1)
    cells = strip[int(is_prompt.argmax())]
    # Along the cells: text, image #0, text, image #1, text, then the completion; each cell
    # is cell-1 pixels of colour and a white gap (where the red completion mark goes).
    refs = row["images"]
    segments = [
        (debug.PROMPT, refs[0]["offset"]),
        (debug.IMAGE[0], refs[0]["length"]),
        (debug.PROMPT, refs[1]["offset"] - refs[0]["offset"] - refs[0]["length"]),
        (debug.IMAGE[1], refs[1]["length"]),
        (debug.PROMPT, row["prompt_len"] - refs[1]["offset"] - refs[1]["length"]),
        (debug.COMPLETION_LOSS, n - row["prompt_len"]),
    ]
    runs = [(colour, pixels) for colour, pixels in colour_runs(cells) if colour != debug.PROMPT_END]
    assert [c for c, _ in runs] == [c for c, _ in segments]
    for (_, pixels), (_, tokens) in zip(runs, segments, strict=True):
        assert pixels == tokens * (cell - 1)
    # The loss-mask bar: one black line segment under exactly the tokens in the loss.
    is_bar = np.all(strip == debug.LOSS_MARK, axis=2).sum(axis=1)
    assert is_bar.max() == sum(row["loss_mask"]) * cell


def test_thumbnails_show_images_and_missing_tiles(known):
    row = debug.sample(known.store, "s5")  # its only image, D, is missing
    tiles = np.asarray(debug.thumbnails(known.store, row, size=64))
    assert tiles.shape[1] == 64 + 8
    grey = np.all(tiles[:64, :64] == (215, 215, 215), axis=2).mean()
    assert grey > 0.8
    row = debug.sample(known.store, "s2")  # A and C, both present
    tiles = debug.thumbnails(known.store, row, size=64)
    assert tiles.width == 2 * (64 + 8)
    thumbs = [known.pictures[k].copy() for k in ("A", "C")]
    for thumb in thumbs:
        thumb.thumbnail((64, 64))
    height = max(t.height for t in thumbs)  # tiles are no taller than the images need
    assert tiles.height == height + 34
    thumb = thumbs[1]
    tile = np.asarray(tiles)[:height, 72 : 72 + 64]
    # C's thumbnail is pasted whole, centred: find it exactly in the second tile (inside the
    # tile's 1-pixel frame).
    top, left = (height - thumb.height) // 2, (64 - thumb.width) // 2
    pasted = tile[top : top + thumb.height, left : left + thumb.width]
    assert np.array_equal(pasted[1:-1, 1:-1], np.asarray(thumb)[1:-1, 1:-1])


def test_sample_view_renders(known, tmp_path):
    view = debug.sample_view(known.store, "s2", thumb=96)
    assert isinstance(view, Image.Image) and view.mode == "RGB"
    strip = debug.token_strip(debug.sample(known.store, "s2"))
    assert view.width >= strip.width and view.height > 96 + strip.height
    view.save(tmp_path / "view.png")
    assert Image.open(tmp_path / "view.png").size == view.size


def test_s3_store(s3_store, adapter):
    media = s3_store.put_image(screenshot(7, 160, 120))
    with s3_store.writer(run_id="s3run", step=2) as w:
        w.write(make_rollout(adapter, "a", [media], 1.0))
        w.write(make_rollout(adapter, "b", [media], 0.0))
    options = debug.storage_options(s3_store)
    assert options is not None and options["aws_allow_http"] == "true"
    df = debug.scan(s3_store).collect()
    assert df.select("run_id", "step", "sample_id").rows() == [
        ("s3run", 2, "a"),
        ("s3run", 2, "b"),
    ]
    assert debug.images(s3_store).collect()["hash"].to_list() == [media.hash] * 2
    row = debug.summary(s3_store).row(0, named=True)
    assert (row["images"], row["unique_images"], row["dedup_ratio"]) == (2, 1, 2.0)
    assert row["media_bytes"] == media.nbytes and row["missing_media"] == 0
    parquet = sum(f.size for f in s3_store.rollout_files())
    assert row["parquet_bytes"] == parquet > 0
    assert debug.sample_view(s3_store, "a").width > 0


def test_sample_view_draws_a_bounded_canvas_for_a_long_valid_row(store):
    # Within the loader's caps, yet drawn whole: 6,000 tiles of 640 px side by side (7.8 GB
    # of RGB) and 3,125 lines of tokens. What is drawn is bounded; the header counts all.
    refs = [
        {"uri": "media/00/00/none.png", "hash": "0" * 32, "width": 8, "height": 8}
        | {"offset": 2 * k, "length": 1}
        for k in range(6000)
    ]
    n = 400_000
    row = {"images": refs, "tokens": [7] * n, "loss_mask": [False] * n, "prompt_len": 1}
    tiles = debug.thumbnails(store, row)
    assert tiles.width * tiles.height < 50_000_000, tiles.size
    strip = debug.token_strip(row)
    assert strip.width * strip.height < 10_000_000, strip.size
