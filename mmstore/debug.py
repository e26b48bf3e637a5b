"""Look at a store with polars, and draw one sample for people.

``scan``, ``images`` and ``videos`` are lazy polars frames over the committed rollout files
(never ``_staging/``): filters on ``run_id``/``step`` prune whole files, projections read only
the columns asked for. ``summary`` aggregates per run and step what a person checks first: how
many samples and images, how well images dedup, bytes on disk against the bytes dense fp32
``pixel_values`` would take, rewards, and media that has gone missing (video clips count in
the bytes and the missing media; their refs are ``videos``' rows).

**Lazy or eager, by one rule** (polars' own: ``pl.scan_*`` is lazy, ``pl.read_*`` eager):
a frame that only reads rows is a ``LazyFrame`` (``scan``, ``images``, ``videos``: your
filters and projections reach the Parquet reader); an answer whose work is checking the
store itself is a ``DataFrame``, computed when called (``missing_media`` and
``missing_videos`` stat every media file, ``summary`` reads footers and stats media): a lazy
frame would only hide when those requests happen. ``.lazy()`` joins either kind with
the others.

``sample_view`` renders one sample as a PIL image (thumbnails of its images with their spans,
a strip of the sampled frames of each video, and a strip of its tokens marking image and
video spans, prompt vs completion and the loss mask); PIL images display inline in notebooks.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from mmstore._families import (
    Layout,
    family_class,
    family_for_layout,
    is_video_layout,
    layout_for_fingerprint,
    layout_from_record,
)
from mmstore._format.paths import partition_of
from mmstore._format.schema import META_LAYOUTS, ROLLOUT_SCHEMA
from mmstore._format.video import decode_frames
from mmstore._progress import bar
from mmstore._rows.check import read_checked
from mmstore._rows.files import check_run_id, open_rollout_file, reading
from mmstore._rows.store import Store
from mmstore._rows.table import TableFile
from mmstore._storage.backends import S3Backend
from mmstore.errors import (
    CorruptFileError,
    InvalidArgumentError,
    MediaNotFoundError,
    MmstoreError,
    NoMatchError,
    UnsupportedProcessorError,
)

__all__ = [
    "images",
    "missing_media",
    "missing_videos",
    "sample",
    "sample_view",
    "scan",
    "storage_options",
    "summary",
    "thumbnails",
    "token_strip",
    "video_strips",
    "videos",
]

PARTITIONS = {"run_id": pl.String, "step": pl.Int32}
IMAGE_COLUMNS = [
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
# One row of ``videos``: the ref's fields, with ``n_frames`` (how many frames it samples).
VIDEO_COLUMNS = [
    "uri",
    "hash",
    "width",
    "height",
    "nbytes",
    "num_frames",
    "fps",
    "frames",
    "n_frames",
    "offset",
    "length",
    "family",
    "layout_fingerprint",
]
SUMMARY_KEYS = ("run_id", "step")
FP32_BYTES = 4


# -- frames ------------------------------------------------------------------------------


def scan(store: Store, *, version: int | None = None) -> pl.LazyFrame:
    """One row per committed rollout of table ``version`` (None: the latest): ``run_id``,
    ``step``, then the columns, then ``n_videos`` (the row's video refs; 0 for a file
    written before the ``videos`` column, whose ``videos`` read null).

    The file list is the version's, taken now: files committed later are not in it.
    """
    return _scan_files(store, store.files(version)).with_columns(
        n_videos=pl.col("videos").list.len().fill_null(0).cast(pl.Int32)
    )


def images(store: Store, *, version: int | None = None) -> pl.LazyFrame:
    """One row per image ref: the sample it belongs to, its ``index`` in the row, the ref."""
    return _explode_refs(scan(store, version=version))


def videos(store: Store, *, version: int | None = None) -> pl.LazyFrame:
    """One row per video ref: the sample it belongs to, its ``video_index`` in the row, the
    ref, and ``n_frames`` (how many of the clip's frames it samples)."""
    return _explode_videos(_scan_files(store, store.files(version)))


def missing_media(store: Store) -> pl.DataFrame:
    """The image refs whose media file is absent (or unresolvable), with their samples
    (:func:`missing_videos` for video refs)."""
    return _missing(store, images(store).collect())


def missing_videos(store: Store) -> pl.DataFrame:
    """The video refs whose clip is absent (or unresolvable), with their samples."""
    return _missing(store, videos(store).collect())


def _missing(store: Store, refs: pl.DataFrame) -> pl.DataFrame:
    sizes = _media_sizes(store, refs["uri"].unique().to_list())
    return refs.filter(pl.col("uri").replace_strict(sizes, default=None).is_null())


def summary(
    store: Store, by: Sequence[str] = SUMMARY_KEYS, progress: bool | None = None
) -> pl.DataFrame:
    """Per ``by`` group (run and step by default; ``()`` for the whole store):

    ``samples``, ``images`` (refs), ``unique_images`` (distinct hashes), ``dedup_ratio``
    (images / unique_images), ``videos`` (video refs), ``video_frames`` (the frames those
    refs sample), ``parquet_bytes``, ``media_bytes`` (each distinct file once),
    ``disk_bytes`` (both), ``dense_fp32_bytes`` (the ``pixel_values`` a dense pipeline ships:
    every ref, at the processor's resized grid; null where a layout is unknown),
    ``reward_mean``, ``reward_std`` and ``missing_media`` (refs whose file is absent).
    Video clips count in ``media_bytes`` and ``missing_media``; the image columns, and
    ``dense_fp32_bytes``, are of images only.
    """
    keys = list(by)
    unknown = set(keys) - set(SUMMARY_KEYS)
    if unknown:
        raise InvalidArgumentError(f"summary can group by {SUMMARY_KEYS}, not {sorted(unknown)}")
    files = store.files()  # one version: every figure below is of the same files
    scanned = _scan_files(store, files)
    rows = scanned.select(*SUMMARY_KEYS, "reward").collect()
    refs = _ref_facts(store, scanned, files, progress)
    clips = _clip_facts(store, scanned)
    # Every media file a ref names, images and video clips alike: what is on disk or missing.
    media = pl.concat([refs.select(*SUMMARY_KEYS, "uri", "media_size"), clips.drop("n_frames")])
    parquet = pl.DataFrame(
        [(*partition_of(f.path), f.size) for f in files],
        schema={**PARTITIONS, "size": pl.Int64},
        orient="row",
    )
    table = _aggregate(
        rows,
        keys,
        pl.len().cast(pl.Int64).alias("samples"),
        pl.col("reward").cast(pl.Float64).mean().alias("reward_mean"),
        pl.col("reward").cast(pl.Float64).std().alias("reward_std"),
    )
    for part in (
        _aggregate(
            refs,
            keys,
            pl.len().cast(pl.Int64).alias("images"),
            pl.col("hash").n_unique().cast(pl.Int64).alias("unique_images"),
            pl.col("dense_bytes").sum().alias("dense_fp32_bytes"),
            pl.col("dense_bytes").null_count().alias("unknown_layouts"),
        ),
        _aggregate(
            clips,
            keys,
            pl.len().cast(pl.Int64).alias("videos"),
            pl.col("n_frames").sum().cast(pl.Int64).alias("video_frames"),
        ),
        _aggregate(
            media, keys, pl.col("media_size").is_null().sum().cast(pl.Int64).alias("missing_media")
        ),
        _aggregate(
            media.unique([*keys, "uri"]), keys, pl.col("media_size").sum().alias("media_bytes")
        ),
        _aggregate(parquet, keys, pl.col("size").sum().alias("parquet_bytes")),
    ):
        table = _join(table, part, keys)
    counts = ["images", "unique_images", "videos", "video_frames", "missing_media"]
    counts += ["media_bytes", "parquet_bytes"]
    table = table.with_columns(pl.col(counts).fill_null(0).cast(pl.Int64)).with_columns(
        dedup_ratio=pl.when(pl.col("unique_images") > 0).then(
            pl.col("images") / pl.col("unique_images")
        ),
        disk_bytes=pl.col("media_bytes") + pl.col("parquet_bytes"),
        dense_fp32_bytes=pl.when(pl.col("unknown_layouts").fill_null(0) == 0).then(
            pl.col("dense_fp32_bytes").fill_null(0).cast(pl.Int64)
        ),
    )
    columns = [
        *keys,
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
    table = table.select(columns)
    return table.sort(keys) if keys else table


def storage_options(store: Store) -> dict[str, str] | None:
    """polars (object_store) options equivalent to the store's pyarrow S3 options."""
    if not isinstance(store.backend, S3Backend):
        return None
    opts = store.s3_options
    endpoint = opts.get("endpoint_override") or os.environ.get(
        "AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL")
    )
    out: dict[str, str] = {}
    if endpoint:
        endpoint = str(endpoint)
        if "://" not in endpoint:
            endpoint = f"{opts.get('scheme', 'https')}://{endpoint}"
        out["aws_endpoint_url"] = endpoint
        if endpoint.startswith("http://"):
            out["aws_allow_http"] = "true"
    for ours, theirs in (
        ("access_key", "aws_access_key_id"),
        ("secret_key", "aws_secret_access_key"),
        ("session_token", "aws_session_token"),
        ("region", "aws_region"),
    ):
        if opts.get(ours):
            out[theirs] = str(opts[ours])
    return out


# -- one sample --------------------------------------------------------------------------


def sample(
    store: Store,
    sample_id: str,
    *,
    run_id: str | None = None,
    step: int | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """The row of one sample of table ``version`` (None: the latest) as a dict (with
    ``run_id`` and ``step``), read as the loader reads it: page checksums verified, the row
    checked and bounded (a forged row raises the loader's typed error naming file, run, step
    and sample before it becomes Python lists)."""
    context = {"sample_id": sample_id, "run_id": run_id, "step": step}
    chosen = [
        f
        for f in store.files(version)
        if (run_id is None or f.run_id == run_id) and (step is None or f.step == step)
    ]
    for file in chosen:  # before any is read
        check_run_id(file)
    found = [f for f in chosen if _holds_sample(store, f.path, sample_id)]
    if not found:
        raise NoMatchError("no such sample in the store", **context)
    if len(found) > 1:
        places = ", ".join(f"{f.run_id}/{f.step}" for f in found)
        raise NoMatchError(
            f"sample id is in several run/step partitions ({places}); pass run_id and step",
            **context,
        )
    file = found[0]
    parquet = open_rollout_file(store, file.path)
    rows = read_checked(
        parquet, file.path, max_pixels=store.max_image_pixels, sample_ids={sample_id}
    )
    if rows.num_rows > 1:
        raise NoMatchError(
            f"sample id is in {rows.num_rows} rows of one file; pass another", **context
        )
    row = rows.to_pylist()[0]
    return {
        "run_id": file.run_id,
        "step": file.step,
        **{name: row.get(name) for name in ROLLOUT_SCHEMA.names},
    }


def _holds_sample(store: Store, path: str, sample_id: str) -> bool:
    """Whether a committed file has a row ``sample_id`` (its sample_id column only)."""
    parquet = open_rollout_file(store, path)
    with reading(path):
        ids = parquet.read(columns=["sample_id"]).column("sample_id")
        return bool(pc.any(pc.equal(ids, sample_id)).as_py())


# Thumbnails of 1080p screenshots need about a third of their width for UI text to stay legible.
THUMB_SIZE = 640
# What one view draws at most (a row may hold thousands of images and millions of tokens:
# drawn whole, its canvas alone would take gigabytes); the header gives the full counts.
MAX_THUMBNAILS = 32
MAX_STRIP_TOKENS = 2**15


def sample_view(
    store: Store,
    sample_id: str,
    *,
    run_id: str | None = None,
    step: int | None = None,
    thumb: int = THUMB_SIZE,
    version: int | None = None,
) -> Image.Image:
    """A header line, the thumbnails of the sample's images, a strip of sampled frames per
    video (when it has any) and its token strip, stacked (the sample of table ``version``;
    None: the latest)."""
    row = sample(store, sample_id, run_id=run_id, step=step, version=version)
    clips = row.get("videos") or []
    n, prompt = len(row["tokens"]), row["prompt_len"]
    header = (
        f"run {row['run_id']}  step {row['step']}  sample {row['sample_id']}  "
        f"group {row['group_id']}\n"
        f"tokens {n} (prompt {prompt}, completion {n - prompt}, "
        f"loss {sum(row['loss_mask'])})  images {len(row['images'])}  videos {len(clips)}  "
        f"reward {_fmt(row['reward'])}  advantage {_fmt(row['advantage'])}  "
        f"policy {_fmt(row.get('policy_version'))}"
    )
    parts = [_text_block(header)]
    if row["images"] or not clips:  # a video-only row shows no empty image tile
        parts.append(thumbnails(store, row, size=thumb))
    if clips:
        parts.append(video_strips(store, row, size=max(32, thumb // 2)))
    parts.append(token_strip(row))
    width = max(p.width for p in parts)
    out = Image.new("RGB", (width, sum(p.height for p in parts) + 8 * len(parts)), "white")
    y = 0
    for part in parts:
        out.paste(part, (0, y))
        y += part.height + 8
    return out


def thumbnails(
    store: Store, row: dict[str, Any], *, size: int = THUMB_SIZE, limit: int = MAX_THUMBNAILS
) -> Image.Image:
    """The row's images side by side, each scaled to fit ``size`` x ``size`` and labelled
    with its index, size, hash and span; tiles are as tall as the tallest image needs.

    Media that is missing or does not verify shows as a grey square tile saying why. The
    first ``limit`` images are drawn, a last tile counting the rest.
    """
    refs = row["images"][:limit]
    hidden = len(row["images"]) - len(refs)
    font = _font(12)
    label_h = 34
    shown: list[Image.Image | str] = [_thumbnail(store, ref, size) for ref in refs]
    height = max([s.height for s in shown if isinstance(s, Image.Image)] or [size])
    if any(isinstance(s, str) for s in shown):
        height = size
    slots = max(1, len(refs) + (hidden > 0))
    tiles = Image.new("RGB", (slots * (size + 8), height + label_h), "white")
    draw = ImageDraw.Draw(tiles)
    if not refs:
        draw.text((4, 4), "(no images)", fill="gray", font=font)
    if hidden:
        x = len(refs) * (size + 8)
        draw.text((x + 4, height // 2 - 8), f"... and {hidden} more", fill="black", font=font)
    for index, (ref, image) in enumerate(zip(refs, shown, strict=True)):
        x = index * (size + 8)
        if isinstance(image, Image.Image):
            tiles.paste(image, (x + (size - image.width) // 2, (height - image.height) // 2))
        else:
            draw.rectangle([x, 0, x + size - 1, height - 1], fill=(215, 215, 215))
            left = x + (size - draw.textlength(image, font=font)) // 2
            draw.text((left, height // 2 - 8), image, fill=(200, 0, 0), font=font)
        draw.rectangle([x, 0, x + size - 1, height - 1], outline=(190, 190, 190))
        end = ref["offset"] + ref["length"]
        draw.text(
            (x, height + 2),
            f"#{index}  {ref['width']}x{ref['height']}  {ref['hash'][:10]}\n"
            f"tokens [{ref['offset']}, {end})  len {ref['length']}",
            fill="black",
            font=font,
        )
    return tiles


def _thumbnail(store: Store, ref: dict[str, Any], size: int) -> Image.Image | str:
    """The image scaled to fit ``size``, or why it cannot be shown."""
    try:
        image = store.open_image(ref["uri"], ref["hash"])
    except (MmstoreError, OSError) as exc:
        return "MISSING" if isinstance(exc, MediaNotFoundError) else type(exc).__name__
    image.thumbnail((size, size))
    return image


# Frames one video's strip shows at most, spread evenly over those its ref samples (a ref
# may sample thousands); the label gives the full count.
STRIP_FRAMES = 6


def video_strips(
    store: Store,
    row: dict[str, Any],
    *,
    size: int = THUMB_SIZE // 2,
    frames: int = STRIP_FRAMES,
    limit: int = MAX_THUMBNAILS,
) -> Image.Image:
    """One strip per video of the row (the first ``limit``), stacked: up to ``frames`` of
    the frames its ref samples (the first and last included), decoded from the clip and
    side by side, each scaled to fit ``size`` x ``size``; labelled with the video's index,
    clip size, frame count and rate, hash, span and the frame indices shown.

    A clip that is missing, or that does not verify or decode, shows as one grey tile
    saying why.
    """
    clips = row.get("videos") or []
    strips = [_video_strip(store, i, ref, size, frames) for i, ref in enumerate(clips[:limit])]
    if len(clips) > limit:
        strips.append(_text_block(f"... and {len(clips) - limit} more videos"))
    if not strips:
        return _text_block("(no videos)")
    out = Image.new(
        "RGB", (max(s.width for s in strips), sum(s.height + 8 for s in strips)), "white"
    )
    y = 0
    for strip in strips:
        out.paste(strip, (0, y))
        y += strip.height + 8
    return out


def _video_strip(
    store: Store, index: int, ref: dict[str, Any], size: int, frames: int
) -> Image.Image:
    shown = _spread(list(ref["frames"]), frames)
    tiles = _frame_tiles(store, ref, shown, size)
    font = _font(12)
    label_h = 34
    count = 1 if isinstance(tiles, str) else max(1, len(tiles))
    height = size if isinstance(tiles, str) else max([t.height for t in tiles] or [size])
    # Frames are never scaled up: a small clip's tiles are as wide as its frames.
    slot = size if isinstance(tiles, str) else max([t.width for t in tiles] or [size])
    strip = Image.new("RGB", (max(count * (slot + 8), 420), height + label_h), "white")
    draw = ImageDraw.Draw(strip)
    if isinstance(tiles, str):  # why the clip cannot be shown, in a grey tile
        draw.rectangle([0, 0, size - 1, height - 1], fill=(215, 215, 215))
        left = (size - draw.textlength(tiles, font=font)) // 2
        draw.text((left, height // 2 - 8), tiles, fill=(200, 0, 0), font=font)
        draw.rectangle([0, 0, size - 1, height - 1], outline=(190, 190, 190))
    else:
        for i, tile in enumerate(tiles):
            strip.paste(tile, (i * (slot + 8) + (slot - tile.width) // 2, 0))
    end = ref["offset"] + ref["length"]
    draw.text(
        (0, height + 2),
        f"video #{index}  {ref['width']}x{ref['height']}  {ref['num_frames']} frames at "
        f"{ref['fps']:g} fps  {ref['hash'][:10]}  tokens [{ref['offset']}, {end})\n"
        f"{len(ref['frames'])} frames sampled; shown: {', '.join(map(str, shown))}",
        fill="black",
        font=font,
    )
    return strip


def _spread(frames: list[int], n: int) -> list[int]:
    """At most ``n`` of ``frames``, evenly spread, the first and last included."""
    if len(frames) <= n:
        return frames
    if n <= 1:
        return frames[:n]
    return [frames[round(i * (len(frames) - 1) / (n - 1))] for i in range(n)]


def _frame_tiles(
    store: Store, ref: dict[str, Any], indices: list[int], size: int
) -> list[Image.Image] | str:
    """The clip's frames at ``indices`` scaled to fit ``size``, or why they cannot be
    shown (the bytes are hash-checked first, and decoded within the store's pixel limit)."""
    try:
        data = store.read_media(ref["uri"], ref["hash"])
        pixels = decode_frames(data, indices, max_pixels=store.max_image_pixels, where=ref["uri"])
    except (MmstoreError, OSError) as exc:
        return "MISSING" if isinstance(exc, MediaNotFoundError) else type(exc).__name__
    tiles = []
    for frame in pixels:
        tile = Image.fromarray(frame)
        tile.thumbnail((size, size))
        tiles.append(tile)
    return tiles


# Token strip colours: prompt text, completion text (in / out of the loss), image and video
# spans.
PROMPT = (150, 180, 225)
COMPLETION_LOSS = (60, 170, 75)
COMPLETION_NO_LOSS = (200, 225, 200)
IMAGE = ((245, 166, 35), (215, 110, 10))  # alternating, so adjacent images stay apart
VIDEO = ((170, 120, 230), (120, 70, 190))  # alternating too
LOSS_MARK = (20, 20, 20)
PROMPT_END = (220, 0, 0)
LEGEND = (
    (PROMPT, "prompt"),
    (IMAGE[0], "image span (#index)"),
    (VIDEO[0], "video span (v#index)"),
    (COMPLETION_LOSS, "completion, in loss"),
    (COMPLETION_NO_LOSS, "completion, not in loss"),
    (LOSS_MARK, "bar below: loss mask"),
    (PROMPT_END, "completion starts"),
)


def token_strip(
    row: dict[str, Any], *, columns: int = 128, cell: int = 7, limit: int = MAX_STRIP_TOKENS
) -> Image.Image:
    """Every token (the first ``limit``) as a cell, ``columns`` to a line, coloured as the
    legend on top says: prompt, image spans (labelled with the image index), video spans
    (``v#`` and the video index), completion in or out of the loss; a black bar under each
    token in the loss mask, a red mark where the completion starts."""
    tokens, mask, prompt_len = row["tokens"][:limit], row["loss_mask"], row["prompt_len"]
    image_of = _span_owner(row["images"], len(tokens))
    video_of = _span_owner(row.get("videos") or [], len(tokens))
    font = _font(10)
    legend = _legend(font)
    label_h, cell_h, line_h = 11, 12, 11 + 12 + 8
    lines = max(1, -(-len(tokens) // columns))
    strip = Image.new(
        "RGB", (max(columns * cell + 2, legend.width), legend.height + lines * line_h), "white"
    )
    strip.paste(legend, (0, 0))
    draw = ImageDraw.Draw(strip)
    for i in range(len(tokens)):
        x = 1 + (i % columns) * cell
        y = legend.height + (i // columns) * line_h + label_h
        if image_of[i] >= 0:
            colour = IMAGE[image_of[i] % 2]
        elif video_of[i] >= 0:
            colour = VIDEO[video_of[i] % 2]
        elif i < prompt_len:
            colour = PROMPT
        else:
            colour = COMPLETION_LOSS if mask[i] else COMPLETION_NO_LOSS
        draw.rectangle([x, y, x + cell - 2, y + cell_h - 1], fill=colour)
        if mask[i]:
            draw.rectangle([x, y + cell_h + 1, x + cell - 1, y + cell_h + 3], fill=LOSS_MARK)
        if i == prompt_len:
            # A line in the white gap before the token, clear of the cells and the loss bars,
            # under a flag and a label in the label row, where a person sees it.
            draw.rectangle([x - 1, y - 3, x - 1, y + cell_h], fill=PROMPT_END)
            draw.rectangle([x - 1, y - label_h + 1, x + 2, y - 2], fill=PROMPT_END)
            draw.text((x + 5, y - label_h), "completion", fill=PROMPT_END, font=font)
        if image_of[i] >= 0 and (i == 0 or image_of[i - 1] != image_of[i]):
            draw.text((x, y - label_h), f"#{image_of[i]}", fill="black", font=font)
        if video_of[i] >= 0 and (i == 0 or video_of[i - 1] != video_of[i]):
            draw.text((x, y - label_h), f"v#{video_of[i]}", fill="black", font=font)
    return strip


def _span_owner(refs: Sequence[dict[str, Any]], n: int) -> list[int]:
    """For each of ``n`` tokens, the index of the ref whose span holds it, else -1."""
    owner = [-1] * n
    for index, ref in enumerate(refs):
        for i in range(ref["offset"], min(n, ref["offset"] + ref["length"])):
            owner[i] = index
    return owner


def _legend(font: ImageFont.FreeTypeFont | ImageFont.ImageFont) -> Image.Image:
    legend = Image.new("RGB", (1600, 18), "white")
    draw = ImageDraw.Draw(legend)
    x = 2
    for colour, label in LEGEND:
        draw.rectangle([x, 4, x + 10, 14], fill=colour)
        x += 14
        draw.text((x, 3), label, fill="black", font=font)
        x += int(draw.textlength(label, font=font)) + 14
    return legend.crop((0, 0, x, 18))


# -- helpers -----------------------------------------------------------------------------


@functools.cache
def _row_schema() -> pl.Schema:
    # From batches, not Schema.empty_table(): that imports pandas (0.2 s), which the CLI's
    # stats never needs otherwise.
    empty = pa.Table.from_batches([], schema=ROLLOUT_SCHEMA)
    return pl.Schema(pl.from_arrow(empty).schema)  # type: ignore[union-attr]


def _scan_files(store: Store, files: Sequence[TableFile]) -> pl.LazyFrame:
    if not files:
        return pl.LazyFrame(schema={**PARTITIONS, **_row_schema()})
    frame = pl.scan_parquet(
        [_source(store, f.path) for f in files],
        # The schema is known: no file is opened to infer it, so pruned files stay unread.
        schema=_row_schema(),
        hive_partitioning=True,
        hive_schema=PARTITIONS,
        storage_options=storage_options(store),
        # A file written before an optional column (videos, policy_version) reads it null.
        missing_columns="insert",
    )
    return frame.select(*PARTITIONS, *ROLLOUT_SCHEMA.names)


def _explode_refs(rows: pl.LazyFrame) -> pl.LazyFrame:
    refs = rows.select("run_id", "step", "sample_id", "group_id", "images")
    return (
        refs.with_columns(index=pl.int_ranges(pl.col("images").list.len(), dtype=pl.Int32))
        .explode("images", "index")  # rows without images drop out
        .unnest("images")
        .select("run_id", "step", "sample_id", "group_id", "index", *IMAGE_COLUMNS)
    )


def _explode_videos(rows: pl.LazyFrame) -> pl.LazyFrame:
    refs = rows.select("run_id", "step", "sample_id", "group_id", "videos")
    return (
        # Rows without videos (an empty list, or null: a file from before the column) first.
        refs.filter(pl.col("videos").list.len() > 0)
        .with_columns(video_index=pl.int_ranges(pl.col("videos").list.len(), dtype=pl.Int32))
        .explode("videos", "video_index")
        .unnest("videos")
        .with_columns(n_frames=pl.col("frames").list.len().cast(pl.Int32))
        .select("run_id", "step", "sample_id", "group_id", "video_index", *VIDEO_COLUMNS)
    )


def _source(store: Store, rel: str) -> str:
    path = store.backend.abspath(rel)
    return f"s3://{path}" if isinstance(store.backend, S3Backend) else path


def _ref_facts(
    store: Store, scanned: pl.LazyFrame, files: Sequence[TableFile], progress: bool | None
) -> pl.DataFrame:
    """Every image ref with its media file size (null when absent) and dense fp32 bytes."""
    shape = ["layout_fingerprint", "width", "height", "length"]
    refs = _explode_refs(scanned).select(*SUMMARY_KEYS, "uri", "hash", *shape).collect()
    sizes = _media_sizes(store, refs["uri"].unique().to_list())
    layouts = _file_layouts(store, [f.path for f in files], progress)
    shapes = refs.select(shape).unique()
    dense = shapes.with_columns(
        dense_bytes=pl.Series(
            [_dense_bytes(layouts, *key) for key in shapes.iter_rows()], dtype=pl.Int64
        )
    )
    return refs.with_columns(
        media_size=pl.col("uri").replace_strict(sizes, default=None, return_dtype=pl.Int64)
    ).join(dense, on=shape, how="left")


def _clip_facts(store: Store, scanned: pl.LazyFrame) -> pl.DataFrame:
    """Every video ref's run, step, uri, sampled frames and clip size (null when absent)."""
    clips = _explode_videos(scanned).select(*SUMMARY_KEYS, "uri", "n_frames").collect()
    sizes = _media_sizes(store, clips["uri"].unique().to_list()) if clips.height else {}
    return clips.with_columns(
        media_size=pl.col("uri").replace_strict(sizes, default=None, return_dtype=pl.Int64)
    )


def _media_sizes(store: Store, uris: Iterable[str]) -> dict[str, int | None]:
    """Size of each media file, None where it is absent or cannot be resolved.

    Store media comes from one listing; the few absolute URIs are stat'ed one by one.
    """
    listed = {f.path: f.size for f in store.backend.list("media")}
    sizes: dict[str, int | None] = {}
    for uri in uris:
        if "://" not in uri:
            sizes[uri] = listed.get(uri)
            continue
        try:
            stat = store.media_stat(uri)
        except MmstoreError:  # untrusted: unresolvable counts as missing
            stat = None
        sizes[uri] = stat.size if stat else None
    return sizes


def _file_layouts(store: Store, paths: Sequence[str], progress: bool | None) -> dict[str, Layout]:
    """Layouts recorded in the rollout files' key-value metadata (footers only)."""
    layouts: dict[str, Layout] = {}
    for rel in bar(paths, desc="reading footers", unit="file", progress=progress):
        with reading(rel):
            meta = pq.read_metadata(store.backend.abspath(rel), filesystem=store.backend.fs)
        raw = (meta.metadata or {}).get(META_LAYOUTS)
        for fingerprint, layout in _footer_layouts(raw, rel).items():
            layouts.setdefault(fingerprint, layout)
    return layouts


def _footer_layouts(raw: bytes | None, rel: str) -> dict[str, Layout]:
    """The image layouts of one footer's ``mmstore.layouts``, each checked to lay out an
    image (a video layout, which lays out clips, is skipped: dense bytes are images')."""
    try:
        found = json.loads(raw or b"{}")
        layouts = {}
        for fp, record in found.items():
            try:
                layout = layout_from_record(record)
            except UnsupportedProcessorError:  # a family this process does not know
                continue
            if is_video_layout(layout):
                continue
            if any(isinstance(v, int) and v <= 0 for _, v in layout.parameters):
                raise ValueError("non-positive layout parameter")
            _dense_elements(layout, 224, 224, 1)
            layouts[str(fp)] = layout
    # Forged metadata can fail in any way (bad JSON, wrong keys or types, zero sizes, deep
    # nesting); whichever it is, the footer is what is wrong: say so, naming the file.
    except Exception as exc:
        raise CorruptFileError(
            f"unreadable layouts in the footer ({type(exc).__name__}: {exc})", file=rel
        ) from None
    return layouts


def _dense_bytes(
    layouts: dict[str, Layout], fingerprint: str, width: int, height: int, length: int
) -> int | None:
    layout = layouts.get(fingerprint) or layout_for_fingerprint(fingerprint)
    if layout is None:
        return None
    try:
        elements = _dense_elements(layout, width, height, length)
    except MmstoreError:  # a size the family cannot lay out: unknown, not a crash
        return None
    return None if elements is None else elements * FP32_BYTES


def _dense_elements(layout: Layout, width: int, height: int, length: int) -> int | None:
    """The elements of one image's float ``pixel_values`` under ``layout``: the image is
    ``width`` x ``height`` and its span ``length`` tokens. The families mmstore ships are
    computed here from the layout's parameters alone, so that ``summary`` (and ``mmstore
    stats``) import neither transformers nor torch; a family registered by a third party
    asks its own ``pixel_shape``. None where the size cannot be laid out."""
    cls = family_class(layout.family)
    estimate = _DENSE_ESTIMATES.get(f"{cls.__module__}.{cls.__qualname__}")
    if estimate is None:
        return math.prod(family_for_layout(layout).pixel_shape(width, height))
    return estimate(dict(layout.parameters), width, height, length)


def _grid_elements(p: dict[str, Any], width: int, height: int, length: int) -> int | None:
    """Qwen-VL, GLM-4V, Kimi-K2.5: the span is one token per merge window of patches (t x h
    x w / merge²), each patch ``3 x temporal_patch_size x p x p`` values (Kimi: t = 1)."""
    if length <= 0:
        return None
    patch = 3 * p.get("temporal_patch_size", 1) * p["patch_size"] ** 2
    return int(length * p["merge_size"] ** 2 * patch)


def _gemma3_elements(p: dict[str, Any], width: int, height: int, length: int) -> int:
    """Gemma 3: every image is resized to one size."""
    return int(3 * p["resized_height"] * p["resized_width"])


def _pixtral_elements(p: dict[str, Any], width: int, height: int, length: int) -> int | None:
    """Pixtral: fitted within ``longest_edge`` (floored), then each side rounded up to
    whole tokens of ``patch_size x spatial_merge_size`` pixels (transformers'
    ``get_resize_output_image_size``; tests check this against it)."""
    longest, side = p["longest_edge"], p["patch_size"] * p["spatial_merge_size"]
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    if height <= 0 or width <= 0:
        return None
    rows, cols = (height - 1) // side + 1, (width - 1) // side + 1
    return int(3 * rows * side * cols * side)


_DENSE_ESTIMATES: dict[str, Callable[[dict[str, Any], int, int, int], int | None]] = {
    "mmstore._families.qwen_vl.QwenVL": _grid_elements,
    "mmstore._families.glm4v.Glm4v": _grid_elements,
    "mmstore._families.kimi_k25.KimiK25": _grid_elements,
    "mmstore._families.gemma3.Gemma3": _gemma3_elements,
    "mmstore._families.pixtral.Pixtral": _pixtral_elements,
}


def _aggregate(frame: pl.DataFrame, keys: list[str], *aggs: pl.Expr) -> pl.DataFrame:
    return frame.group_by(keys).agg(*aggs) if keys else frame.select(*aggs)


def _join(left: pl.DataFrame, right: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    if not keys:
        return pl.concat([left, right], how="horizontal")
    return left.join(right, on=keys, how="left")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _text_block(text: str, font_size: int = 13) -> Image.Image:
    font = _font(font_size)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    *_, right, bottom = probe.multiline_textbbox((0, 0), text, font=font)
    block = Image.new("RGB", (int(right) + 8, int(bottom) + 6), "white")
    ImageDraw.Draw(block).multiline_text((4, 2), text, fill="black", font=font)
    return block
