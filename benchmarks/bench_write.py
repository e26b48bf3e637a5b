"""Write path: mmstore (hash + media put + rows through the writer) vs plain file writes.

    python -m benchmarks.bench_write --scale 1 [--reps 5]

The same encoded images and the same rows go down both paths, in one run, interleaved
(alternating which goes first), each repetition into a fresh directory:

- plain: each image's bytes written with ``open``/``write``, the rows as one Parquet file
  with default ``pq.write_table`` (the rows already as dicts);
- plain + fsync: the same, fsync'ing each file: what durability alone costs;
- mmstore: ``Store.put_media`` per image (hash, header check, staging, link), then
  ``Rollout`` construction (validation) and ``RolloutWriter.write`` (invariants, media
  checks) for each row, and the atomic commit (which fsyncs every media file the rows
  reference, then the Parquet file).

Rows are realistic: GRPO groups of 8 sharing 2 prompt screenshots (1280x720 PNG), 2-4k
tokens (placeholder spans of the real Qwen2-VL layout, Zipf-distributed text), completion
logprobs. It also prints the Parquet encoding table behind ``mmstore._rows.writer``'s settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import mmstore
from mmstore._format.media import content_hash, encode_image, media_path
from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._rows.writer import parquet_options
from mmstore.synth import VISION_END, VISION_START, screenshot

GROUP_SIZE = 8
IMAGES_PER_SAMPLE = 2
IMAGE_SIZE = (1280, 720)

# Headline rows for benchmarks/run.py: (label, path in the result, start-up: "in",
# "excluded" or "n/a", as run.py defines them).
HEADLINE = [
    ("mmstore write / plain write time", "mmstore_over_plain", "in"),
    ("mmstore write / plain+fsync write time", "mmstore_over_plain_fsync", "in"),
    ("mmstore put of present bytes / plain rewrite", "repeat_put_over_rewrite", "n/a"),
    ("mmstore rows bytes / default Parquet bytes", "rows_bytes_over_default", "n/a"),
]


def workload(groups: int, seed: int = 0) -> tuple[list[list[bytes]], list[list[dict[str, Any]]]]:
    """Encoded images per group, and each group's rows as dicts with their image refs.

    The refs are what ``put_media`` returns for those bytes (computed here, untimed: plain
    code would name its files some other way, but both paths must write the same rows).
    """
    adapter = mmstore.adapter_for(_processor())
    rng = np.random.default_rng(seed)
    images: list[list[bytes]] = []
    rows: list[list[dict[str, Any]]] = []
    for g in range(groups):
        shots = [screenshot(seed * 100_003 + g * 7 + i, *IMAGE_SIZE) for i in range(2)]
        images.append([encode_image(s)[0] for s in shots])
        media = [_media_ref(data) for data in images[-1]]
        prompt: list[int] = []
        for _ in range(IMAGES_PER_SAMPLE):
            prompt += _text(rng, int(rng.integers(20, 200)))
            prompt += [VISION_START, *[adapter.image_token_id] * adapter.num_tokens(*IMAGE_SIZE)]
            prompt += [VISION_END]
        prompt += _text(rng, int(rng.integers(50, 300)))
        group = []
        for k in range(GROUP_SIZE):
            completion = _text(rng, int(rng.integers(200, 1500)))
            logprobs = -np.abs(rng.lognormal(-3, 2, len(completion))).astype(np.float32)
            reward = float(rng.random() < 0.5)
            row = {
                "sample_id": f"g{g:05d}-{k:02d}",
                "group_id": f"g{g:05d}",
                "tokens": prompt + completion,
                "prompt_len": len(prompt),
                "loss_mask": [False] * len(prompt) + [True] * len(completion),
                "logprobs": [0.0] * len(prompt) + logprobs.tolist(),
                "reward": reward,
                "advantage": reward - 0.5,
                "metadata": '{"kind": "screenshot", "turns": 2}',
            }
            group.append({**row, "images": _refs(adapter, row, media)})
        rows.append(group)
    return images, rows


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.zipf(1.2, n) % 150_000]


def _refs(
    adapter: mmstore.QwenVLAdapter, row: dict[str, Any], media: list[mmstore.MediaRef]
) -> list[dict[str, Any]]:
    """The image refs of a row whose spans follow each ``VISION_START``."""
    starts = [i + 1 for i, t in enumerate(row["tokens"]) if t == VISION_START]
    return [
        {
            "uri": m.uri,
            "hash": m.hash,
            "width": m.width,
            "height": m.height,
            "nbytes": m.nbytes,
            "offset": start,
            "length": adapter.num_tokens(m.width, m.height),
            "family": adapter.family,
            "layout_fingerprint": adapter.fingerprint,
            "payload": None,
        }
        for start, m in zip(starts, media, strict=True)
    ]


def write_mmstore(
    root: str, images: list[list[bytes]], rows: list[list[dict[str, Any]]]
) -> dict[str, float]:
    """Seconds of each phase; ``total`` is from opening the store to the committed file."""
    phases = dict.fromkeys(("media", "build", "write"), 0.0)
    start = time.perf_counter()
    store = mmstore.Store.open(root, create=True)
    with store.writer(run_id="bench", step=0) as writer:
        for group_images, group in zip(images, rows, strict=True):
            t0 = time.perf_counter()
            media = [store.put_media(data, "png") for data in group_images]
            phases["media"] += time.perf_counter() - t0
            assert [m.uri for m in media] == [r["uri"] for r in group[0]["images"]]
            for row in group:
                t1 = time.perf_counter()
                rollout = mmstore.Rollout(**row)  # validation, as every caller pays it
                t2 = time.perf_counter()
                writer.write(rollout)
                phases["build"] += t2 - t1
                phases["write"] += time.perf_counter() - t2
        t3 = time.perf_counter()
    phases["commit"] = time.perf_counter() - t3
    phases["total"] = time.perf_counter() - start
    # Puts of bytes already present (a GRPO group's samples, the next epoch's prompts).
    t4 = time.perf_counter()
    for group_images in images:
        for data in group_images:
            store.put_media(data, "png")
    phases["repeat_put"] = time.perf_counter() - t4
    (part,) = store.rollout_files()
    phases["rows_bytes"] = part.size
    return phases


def write_plain(
    root: str, images: list[list[bytes]], rows: list[list[dict[str, Any]]], *, fsync: bool
) -> dict[str, float]:
    def write_images() -> None:
        for group_images, group in zip(images, rows, strict=True):
            for data, ref in zip(group_images, group[0]["images"], strict=True):
                with open(os.path.join(root, "media", os.path.basename(ref["uri"])), "wb") as f:
                    f.write(data)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())

    start = time.perf_counter()
    os.makedirs(os.path.join(root, "media"))
    write_images()
    t0 = time.perf_counter()
    path = os.path.join(root, "rows.parquet")
    table = pa.Table.from_pylist([row for group in rows for row in group], schema=ROLLOUT_SCHEMA)
    pq.write_table(table, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    end = time.perf_counter()
    write_images()  # the same bytes again: plain code rewrites them
    phases = {"media": t0 - start, "rows": end - t0, "total": end - start}
    phases["repeat_put"] = time.perf_counter() - end
    phases["rows_bytes"] = os.path.getsize(path)
    return phases


def _media_ref(data: bytes) -> mmstore.MediaRef:
    digest = content_hash(data)
    width, height = IMAGE_SIZE
    uri = media_path(digest, "png")
    return mmstore.MediaRef(hash=digest, uri=uri, width=width, height=height, nbytes=len(data))


_PROCESSOR: Any = None


def _processor() -> Any:
    global _PROCESSOR
    if _PROCESSOR is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        _PROCESSOR = Qwen2VLImageProcessorPil()
    return _PROCESSOR


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def encodings(table: pa.Table, reps: int) -> dict[str, dict[str, Any]]:
    """Bytes and encode time of the rows under each candidate setting; for the two
    dictionary settings also the compressed bytes of each column."""
    base = {"compression": "zstd", "row_group_size": 128}
    split = {"logprobs.list.element": "BYTE_STREAM_SPLIT"}
    candidates: dict[str, dict[str, Any]] = {
        "snappy, dictionary on (pq.write_table default)": {"compression": "snappy"},
        "dictionary on everywhere": {},
        "dictionary off": {"use_dictionary": False},
        "dictionary off, logprobs BYTE_STREAM_SPLIT": {
            "use_dictionary": False,
            "column_encoding": split,
        },
        "dictionary off, tokens DELTA_BINARY_PACKED": {
            "use_dictionary": False,
            "column_encoding": {"tokens.list.element": "DELTA_BINARY_PACKED"},
        },
        "dictionary off, tokens+logprobs BYTE_STREAM_SPLIT": {
            "use_dictionary": False,
            "column_encoding": {**split, "tokens.list.element": "BYTE_STREAM_SPLIT"},
        },
        "mmstore (as configured)": {
            k: v for k, v in parquet_options().items() if k != "write_statistics"
        },
    }
    out: dict[str, dict[str, Any]] = {}
    for name, options in candidates.items():
        times = []
        for _ in range(reps):
            sink = pa.BufferOutputStream()
            start = time.perf_counter()
            pq.write_table(table, sink, **{**base, **options})
            times.append(time.perf_counter() - start)
        data = sink.getvalue()
        out[name] = {"bytes": data.size, "seconds": statistics.median(times)}
        if name in ("dictionary on everywhere", "dictionary off"):
            out[name]["columns"] = _column_bytes(pq.ParquetFile(pa.BufferReader(data)).metadata)
    return out


def _column_bytes(meta: pq.FileMetaData) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for i in range(meta.num_row_groups):
        for j in range(meta.num_columns):
            column = meta.row_group(i).column(j)
            sizes[column.path_in_schema] = (
                sizes.get(column.path_in_schema, 0) + column.total_compressed_size
            )
    return sizes


def run(scale: float = 1.0, reps: int = 5) -> dict[str, Any]:
    groups = max(1, round(32 * scale))
    images, rows = workload(groups)
    ways: dict[str, Callable[[str], dict[str, float]]] = {
        "mmstore": lambda root: write_mmstore(root, images, rows),
        "plain": lambda root: write_plain(root, images, rows, fsync=False),
        "plain_fsync": lambda root: write_plain(root, images, rows, fsync=True),
    }
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in ways}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for rep in range(reps):
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            for name in order:
                root = os.path.join(tmp, f"{name}-{rep}")
                for phase, value in ways[name](root).items():
                    samples[name].setdefault(phase, []).append(value)
                shutil.rmtree(root)
    phases = {
        name: {phase: _stats(values) for phase, values in by_phase.items() if phase != "rows_bytes"}
        for name, by_phase in samples.items()
    }
    total = {name: phases[name]["total"]["median"] for name in ways}
    rows_bytes = {name: int(samples[name]["rows_bytes"][-1]) for name in ways}
    n_rows = groups * GROUP_SIZE
    table = pa.Table.from_pylist([row for group in rows for row in group], schema=ROLLOUT_SCHEMA)
    return {
        "rows": n_rows,
        "images": sum(len(g) for g in images),
        "image_bytes": sum(len(b) for g in images for b in g),
        "mean_tokens": sum(len(row["tokens"]) for g in rows for row in g) / n_rows,
        "reps": reps,
        "seconds": phases,
        "mmstore_over_plain": total["mmstore"] / total["plain"],
        "mmstore_over_plain_fsync": total["mmstore"] / total["plain_fsync"],
        "repeat_put_over_rewrite": phases["mmstore"]["repeat_put"]["median"]
        / phases["plain"]["repeat_put"]["median"],
        "rows_bytes": {"mmstore": rows_bytes["mmstore"], "default": rows_bytes["plain"]},
        "rows_bytes_over_default": rows_bytes["mmstore"] / rows_bytes["plain"],
        "encodings": encodings(table, reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = run(args.scale, args.reps)
    print(json.dumps(result, indent=2))
    print(
        f"mmstore / plain write time: {result['mmstore_over_plain']:.2f}x "
        f"(vs plain + fsync: {result['mmstore_over_plain_fsync']:.2f}x; "
        f"{result['rows']} rows, {result['images']} images); "
        f"put of present bytes / plain rewrite: {result['repeat_put_over_rewrite']:.2f}x; "
        f"rows bytes mmstore / default Parquet: {result['rows_bytes_over_default']:.2f}"
    )


if __name__ == "__main__":
    main()
