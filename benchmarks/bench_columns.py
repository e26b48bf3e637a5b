"""Extra columns (issue 40): what top-32 logprobs and routed experts stored beside the rows
cost a loader that does not ask for them, on disk, and to write.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_columns --scale 1 [--reps 3] [--out DIR]

Two stores are written from the same rows, in one run: *plain* (no extra column) and
*columns* (the run declares ``topk_ids`` = ``per_token("int32", (32,))``, ``topk_logprobs``
= ``per_token("float32", (32,))`` and ``experts`` = ``per_token("int16", (60, 8))``, every row
carrying a value for every token, prompt included). Rows: text-heavy RL rows, GRPO groups
of 8 sharing 1 or 2 prompt screenshots (800x600 PNG, 609 tokens each in Qwen2-VL's layout),
Zipf-distributed text (100-500 prompt tokens, then 50-250 after each image) and a 200-1800
token completion: 1.0-4.0k tokens a row; completion logprobs as in ``bench_write``; row
groups of 32 rows in both stores (128 rows of these columns are over 300 MB unencoded).

The extra values are random where real ones are skewed, so their compressibility here is a
worst case: ``topk_ids`` uniform ints in [0, 150000) (drawn with replacement: a duplicate
in 0.3% of tokens), ``topk_logprobs`` sorted descending from a top-1 of
``-lognormal(-3, 2)`` by exponential gaps of mean 0.4 nats (top-32 near -12), ``experts``
uniform ints in [0, 128) (with replacement; 8 distinct of 128 would hold 0.4% less
entropy). Real top-k ids concentrate on frequent tokens and real routing is imbalanced and
correlated across neighbouring tokens: both compress better than this.

Measured:

1. **Bytes read** by a ``RolloutLoader`` (``batch_size=8``, ``num_workers=0``, no node
   cache) over one pass of each store: every byte read through the file objects mmstore
   opens for rollout files (``open_rollout_file`` opens them through the store's
   ``backend.fs``, replaced for the pass by a ``LocalFileSystem`` whose files count what
   Parquet reads: footers, column chunks, page headers). Each pass runs in a process of
   its own, spawned (a fresh interpreter: never a fork of the writing process) (no footer or
   image cache shared between contenders; the counts do not depend on the page cache);
   ``startup`` is the bytes read building the dataset (snapshot, footers, planning),
   ``per_batch`` the bytes read while iterating divided by the batches (start-up
   excluded). ``/proc/self/io`` ``rchar`` over the iteration is kept as a cross-check (it
   also counts the media files and the Delta log). A footer is read with one 64 KiB read
   from the file's end (pyarrow's), so the extra columns' footer entries (3 more column
   chunks a row group) cost start-up bytes only once a footer outgrows that. Figures:
   ``unasked_over_plain`` = bytes per batch, columns store read without asking for any
   column / plain store (goal: within 2% of 1: an unasked column costs nothing);
   ``asked_over_plain``: the same asking for all three.
2. **On-disk size** of each extra column: the ``total_compressed_size`` of its column
   chunks in the file's Parquet metadata over its raw size (``tokens x 32 x 4`` bytes for
   ids and for logprobs, ``tokens x 60 x 8 x 2`` for experts; goal <= 1.3); the codec and
   encodings as the metadata records them. ``alternatives``: the same three columns
   rewritten in memory with other encodings (mmstore's settings are not changed here).
3. **Write cost**: seconds from opening a fresh store to the committed file (media puts,
   ``Rollout`` construction with its validation, ``writer.write``, commit) with the columns
   / without, ``reps`` repetitions alternating which goes first; median and the median of
   the ratio within each repetition. Drawing the values is not timed. The columns are a
   few hundred times the rows' own bytes, so the ratio is mostly their encoding (zstd over
   them, on the writer's encoding thread): the table also gives their MB/s.

Directions: ``unasked_over_plain`` 1 = unasked columns cost nothing (higher is worse);
``*_disk_over_raw`` lower = better (goal <= 1.3); ``write_with_over_without`` lower = better
(the cost of writing the columns, 1 = free).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import statistics
import tempfile
import time
import traceback
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

import mmstore
from benchmarks._common import cli, paired_ratio, processor
from benchmarks.bench_write import _refs, _text
from mmstore._format.media import content_hash, encode_image, media_path
from mmstore._rows.writer import parquet_options
from mmstore.synth import VISION_END, VISION_START, screenshot

GROUP_SIZE = 8
IMAGE_SIZE = (800, 600)
ROW_GROUP_SIZE = 32
PASS_TIMEOUT = 600  # seconds one read pass may take before the benchmark gives up
BATCH_SIZE = 8
TOPK = 32
EXPERTS = (60, 8)
VOCAB = 150_000
NUM_EXPERTS = 128
COLUMNS = {
    "topk_ids": mmstore.per_token("int32", (TOPK,)),
    "topk_logprobs": mmstore.per_token("float32", (TOPK,)),
    "experts": mmstore.per_token("int16", EXPERTS),
}
RAW_BYTES_PER_TOKEN = {"topk_ids": TOPK * 4, "topk_logprobs": TOPK * 4, "experts": 60 * 8 * 2}

# Headline rows for benchmarks/run.py: (label, path in the result, start-up: "in",
# "excluded" or "n/a", as run.py defines them).
HEADLINE = [
    (
        "bytes read per batch, columns unasked / no columns stored (1 = free)",
        "unasked_over_plain",
        "excluded",
    ),
    ("bytes read per batch, columns asked / no columns stored", "asked_over_plain", "excluded"),
    ("top-32 ids + logprobs on disk / raw (<= 1.3)", "topk_disk_over_raw", "n/a"),
    ("routed experts 60x8 int16 on disk / raw (<= 1.3)", "experts_disk_over_raw", "n/a"),
    ("write time with columns / without (lower = better)", "write_with_over_without", "in"),
]


# -- the rows ------------------------------------------------------------------------------


def workload(
    groups: int, seed: int = 0
) -> tuple[list[list[bytes]], list[list[dict[str, Any]]], list[list[dict[str, np.ndarray]]]]:
    """Encoded images per group, each group's rows as dicts (with their image refs), and each
    row's extra column values."""
    adapter = mmstore.adapter_for(processor())
    rng = np.random.default_rng(seed)
    images: list[list[bytes]] = []
    rows: list[list[dict[str, Any]]] = []
    extras: list[list[dict[str, np.ndarray]]] = []
    for g in range(groups):
        n_images = 1 + g % 2
        shots = [screenshot(seed * 100_003 + g * 7 + i, *IMAGE_SIZE) for i in range(n_images)]
        images.append([encode_image(s)[0] for s in shots])
        media = [_media_ref(data) for data in images[-1]]
        prompt: list[int] = _text(rng, int(rng.integers(100, 500)))
        for _ in range(n_images):
            prompt += [VISION_START, *[adapter.image_token_id] * adapter.num_tokens(*IMAGE_SIZE)]
            prompt += [VISION_END]
            prompt += _text(rng, int(rng.integers(50, 250)))
        group, group_extras = [], []
        for k in range(GROUP_SIZE):
            completion = _text(rng, int(rng.integers(200, 1800)))
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
                "metadata": '{"kind": "screenshot", "turns": 1}',
            }
            group.append({**row, "images": _refs(adapter, row, media)})
            group_extras.append(extra_values(rng, len(row["tokens"])))
        rows.append(group)
        extras.append(group_extras)
    return images, rows, extras


def _media_ref(data: bytes) -> mmstore.MediaRef:
    """What ``put_media`` returns for ``data`` (computed here: both stores get the same rows)."""
    digest = content_hash(data)
    width, height = IMAGE_SIZE
    uri = media_path(digest, "png")
    return mmstore.MediaRef(hash=digest, uri=uri, width=width, height=height, nbytes=len(data))


def extra_values(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """One row's top-32 ids and logprobs and routed experts for ``n`` tokens (see the module
    docstring for why these distributions)."""
    top1 = -np.abs(rng.lognormal(-3, 2, (n, 1)))
    gaps = rng.exponential(0.4, (n, TOPK - 1))
    logprobs = np.concatenate([top1, top1 - np.cumsum(gaps, axis=1)], axis=1)
    return {
        "topk_ids": rng.integers(0, VOCAB, (n, TOPK), dtype=np.int32),
        "topk_logprobs": logprobs.astype(np.float32),
        "experts": rng.integers(0, NUM_EXPERTS, (n, *EXPERTS), dtype=np.int16),
    }


# -- writing -------------------------------------------------------------------------------


def write_store(
    root: str,
    images: list[list[bytes]],
    rows: list[list[dict[str, Any]]],
    extras: list[list[dict[str, np.ndarray]]] | None,
) -> dict[str, float]:
    """Seconds of each phase, writing with the columns if ``extras`` is given; ``total`` is
    from opening a fresh store to its committed file."""
    phases = dict.fromkeys(("media", "build", "write"), 0.0)
    start = time.perf_counter()
    store = mmstore.Store.open(root, create=True)
    columns = COLUMNS if extras is not None else None
    with store.writer(
        run_id="bench", step=0, columns=columns, row_group_size=ROW_GROUP_SIZE
    ) as writer:
        for g, (group_images, group) in enumerate(zip(images, rows, strict=True)):
            t0 = time.perf_counter()
            for data in group_images:
                store.put_media(data, "png")
            phases["media"] += time.perf_counter() - t0
            for k, row in enumerate(group):
                values = {} if extras is None else extras[g][k]
                t1 = time.perf_counter()
                rollout = mmstore.Rollout(**row, columns=values)  # validation, as callers pay
                t2 = time.perf_counter()
                writer.write(rollout)
                phases["build"] += t2 - t1
                phases["write"] += time.perf_counter() - t2
        t3 = time.perf_counter()
    # The commit waits for the last row groups' encoding (earlier ones encode on a thread
    # beside the writes), then fsyncs and commits.
    phases["commit"] = time.perf_counter() - t3
    phases["total"] = time.perf_counter() - start
    return phases


# -- reading -------------------------------------------------------------------------------


class _Counted:
    """A file whose reads are counted (``counts[path]``), delegating to a pyarrow file."""

    def __init__(self, inner: Any, path: str, counts: dict[str, int]) -> None:
        self._inner, self._path, self._counts = inner, path, counts
        counts.setdefault(path, 0)

    def read(self, nbytes: int | None = None) -> bytes:
        data = self._inner.read() if nbytes is None or nbytes < 0 else self._inner.read(nbytes)
        self._counts[self._path] += len(data)
        return data

    def seek(self, position: int, whence: int = 0) -> int:
        return self._inner.seek(position, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def size(self) -> int:
        return self._inner.size()

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False


class CountingFileSystem(pafs.LocalFileSystem):
    """The local file system, whose input files count every byte read through them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def open_input_file(self, path: Any) -> Any:
        return _Counted(super().open_input_file(path), str(path), self.counts)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _rollout_bytes(counts: dict[str, int]) -> int:
    return sum(n for path, n in counts.items() if "_delta_log" not in path)


def read_pass(root: str, columns: list[str]) -> dict[str, Any]:
    """One loader pass over the store at ``root`` asking for ``columns``: bytes read."""
    store = mmstore.Store.open(root)
    fs = CountingFileSystem()
    store.backend.fs = fs
    rchar0 = _rchar()
    start = time.perf_counter()
    settings = mmstore.Materialize(node_cache_bytes=0, columns=tuple(columns))
    dataset = mmstore.RolloutDataset(store, processor(), shuffle=False, materialize=settings)
    loader = mmstore.RolloutLoader(dataset, batch_size=BATCH_SIZE, num_workers=0)
    startup = _rollout_bytes(fs.counts)
    rchar1 = _rchar()
    batches = samples = 0
    for batch in loader:
        batches += 1
        samples += len(batch["sample_ids"])
        for name in columns:  # the columns asked for arrived, those not asked did not
            assert batch[name].shape[:2] == batch["input_ids"].shape, name
        for name in set(COLUMNS) - set(columns):
            assert name not in batch, name
    seconds = time.perf_counter() - start
    total = _rollout_bytes(fs.counts)
    files = [p for p in fs.counts if "_delta_log" not in p]
    assert files and total > 0, "no rollout file was read through the counting file system"
    return {
        "columns": columns,
        "batches": batches,
        "samples": samples,
        "startup_bytes": startup,
        "iteration_bytes": total - startup,
        "per_batch": (total - startup) / batches,
        "total_bytes": total,
        "rchar_iteration": _rchar() - rchar1,
        "rchar_total": _rchar() - rchar0,
        "files_read": len(files),
        "seconds": seconds,
    }


def read_in_process(root: str, columns: list[str]) -> dict[str, Any]:
    """:func:`read_pass` in a fresh process of its own (spawned: no contender sees another's
    caches, and no fork of a process whose delta-rs runtime exists, which hangs or panics
    in the child: the stores were written here, with a Delta schema change)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_read_into, args=(results, root, columns))
    process.start()
    try:
        outcome = results.get(timeout=PASS_TIMEOUT)
    except queue.Empty:
        process.kill()
        raise RuntimeError(
            f"the read pass gave nothing in {PASS_TIMEOUT} s (exit code {process.exitcode})"
        ) from None
    finally:
        process.join(timeout=30)
    if isinstance(outcome, str):
        raise RuntimeError(f"the read pass failed:\n{outcome}")
    return outcome


def _read_into(results: Any, root: str, columns: list[str]) -> None:
    try:
        results.put(read_pass(root, columns))
    except BaseException:
        results.put(traceback.format_exc())


# -- on disk -------------------------------------------------------------------------------


def disk_sizes(path: str, tokens: int) -> dict[str, Any]:
    """Compressed bytes of each extra column's chunks over its raw bytes, with the codec and
    encodings the file's metadata records."""
    meta = pq.ParquetFile(path).metadata
    out: dict[str, Any] = {}
    for name in COLUMNS:
        compressed = uncompressed = 0
        codecs: set[str] = set()
        encodings: set[str] = set()
        physical = ""
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            for j in range(group.num_columns):
                chunk = group.column(j)
                if chunk.path_in_schema.split(".")[0] != name:
                    continue
                compressed += chunk.total_compressed_size
                uncompressed += chunk.total_uncompressed_size
                codecs.add(chunk.compression)
                encodings.update(chunk.encodings)
                physical = chunk.physical_type
        raw = tokens * RAW_BYTES_PER_TOKEN[name]
        out[name] = {
            "raw_bytes": raw,
            "disk_bytes": compressed,
            "encoded_bytes_before_codec": uncompressed,
            "disk_over_raw": compressed / raw,
            "codec": sorted(codecs),
            "encodings": sorted(encodings),
            "physical_type": physical,
        }
    return out


def alternatives(path: str, rows: int = 8) -> dict[str, dict[str, float]]:
    """The three columns of the file's first ``rows`` rows rewritten in memory with other
    encodings: each column's bytes over its raw bytes, and the seconds to encode (one
    measurement). mmstore's own settings stay as they are."""
    table = pq.ParquetFile(path).read_row_group(0, columns=list(COLUMNS)).slice(0, rows)
    tokens = int(pc.sum(pc.list_value_length(table["experts"])).as_py())
    options = {k: v for k, v in parquet_options().items() if k != "write_statistics"}
    leaf = {name: f"{name}.list.element.list.element" for name in COLUMNS}
    candidates = {
        "mmstore as configured (PLAIN)": {},
        "topk_logprobs BYTE_STREAM_SPLIT": {leaf["topk_logprobs"]: "BYTE_STREAM_SPLIT"},
        "ids + experts DELTA_BINARY_PACKED": {
            leaf["topk_ids"]: "DELTA_BINARY_PACKED",
            leaf["experts"]: "DELTA_BINARY_PACKED",
        },
        "all three BYTE_STREAM_SPLIT": {name: "BYTE_STREAM_SPLIT" for name in leaf.values()},
    }
    out: dict[str, dict[str, float]] = {}
    for label, encoding in candidates.items():
        sink = pa.BufferOutputStream()
        column_encoding = {
            k: v
            for k, v in {**options["column_encoding"], **encoding}.items()
            if k in leaf.values()
        }
        start = time.perf_counter()
        pq.write_table(table, sink, **{**options, "column_encoding": column_encoding or None})
        seconds = time.perf_counter() - start
        written = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata
        sizes = dict.fromkeys(COLUMNS, 0)
        for i in range(written.num_row_groups):
            for j in range(written.num_columns):
                chunk = written.row_group(i).column(j)
                sizes[chunk.path_in_schema.split(".")[0]] += chunk.total_compressed_size
        out[label] = {
            name: round(size / (tokens * RAW_BYTES_PER_TOKEN[name]), 4)
            for name, size in sizes.items()
        }
        out[label]["seconds"] = round(seconds, 3)
    return out


# -- the run -------------------------------------------------------------------------------


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    groups = max(2, round(6 * scale))
    images, rows, extras = workload(groups)
    n_rows = groups * GROUP_SIZE
    tokens = sum(len(row["tokens"]) for group in rows for row in group)
    ways = {"without": None, "with": extras}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in ways}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for rep in range(reps):
            order = list(ways) if rep % 2 == 0 else list(reversed(ways))
            for name in order:
                root = os.path.join(tmp, f"{name}-{rep}")
                for phase, value in write_store(root, images, rows, ways[name]).items():
                    samples[name].setdefault(phase, []).append(value)
                if rep < reps - 1:
                    shutil.rmtree(root)
        plain, with_columns = (os.path.join(tmp, f"{name}-{reps - 1}") for name in ways)
        (part,) = mmstore.Store.open(with_columns).rollout_files()
        (plain_part,) = mmstore.Store.open(plain).rollout_files()
        path = os.path.join(with_columns, part.path)
        disk = disk_sizes(path, tokens)
        other = alternatives(path)
        # Byte counts are exact (the same on every pass), so one pass each.
        read = {
            "plain": read_in_process(plain, []),
            "unasked": read_in_process(with_columns, []),
            "asked": read_in_process(with_columns, list(COLUMNS)),
        }
    total = {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
        for name, v in ((name, samples[name]["total"]) for name in ways)
    }
    phases = {
        name: {phase: statistics.median(v) for phase, v in by_phase.items()}
        for name, by_phase in samples.items()
    }
    topk_raw = disk["topk_ids"]["raw_bytes"] + disk["topk_logprobs"]["raw_bytes"]
    topk_disk = disk["topk_ids"]["disk_bytes"] + disk["topk_logprobs"]["disk_bytes"]
    return {
        "workload": f"{n_rows} rows ({groups} GRPO groups of {GROUP_SIZE}, 1-2 {IMAGE_SIZE[0]}x"
        f"{IMAGE_SIZE[1]} screenshots a group), {tokens / n_rows:.0f} tokens a row on "
        f"average, row groups of {ROW_GROUP_SIZE}; loader batch_size={BATCH_SIZE}, "
        "num_workers=0",
        "direction": "unasked_over_plain: 1 = unasked columns cost nothing; *_disk_over_raw "
        "and write_with_over_without: lower = better",
        "scale": scale,
        "reps": reps,
        "cores": os.cpu_count(),
        "rows": n_rows,
        "tokens": tokens,
        "file_bytes": {"plain": plain_part.size, "columns": part.size},
        "read": read,
        "unasked_over_plain": read["unasked"]["per_batch"] / read["plain"]["per_batch"],
        "asked_over_plain": read["asked"]["per_batch"] / read["plain"]["per_batch"],
        "unasked_startup_over_plain": read["unasked"]["startup_bytes"]
        / read["plain"]["startup_bytes"],
        "disk": disk,
        "topk_disk_over_raw": topk_disk / topk_raw,
        "experts_disk_over_raw": disk["experts"]["disk_over_raw"],
        "alternatives": other,
        "write_seconds": total,
        "write_phases_median": phases,
        "write_with_over_without": total["with"]["median"] / total["without"]["median"],
        "write_paired": paired_ratio(total, "with", "without"),
    }


def table(result: dict[str, Any]) -> str:
    read, disk, w = result["read"], result["disk"], result["write_seconds"]
    mb = 1e6
    raw = sum(d["raw_bytes"] for d in disk.values())

    def passes(name: str) -> str:
        r = read[name]
        return (
            f"| {name} | {r['per_batch']:,.0f} | {r['startup_bytes']:,} | {r['batches']} | "
            f"{r['rchar_iteration'] / r['batches']:,.0f} | {r['seconds']:.1f} |"
        )

    paired = result["write_paired"]
    lines = [
        f"Scale {result['scale']}, {result['reps']} reps, {result['cores']} cores. "
        f"{result['workload']}. Rollout file: {result['file_bytes']['plain'] / mb:.2f} MB "
        f"without columns, {result['file_bytes']['columns'] / mb:.1f} MB with them.",
        "",
        "| figure | value | goal |",
        "|---|---|---|",
        f"| bytes read per batch, columns stored but unasked / no columns stored (1 = free) "
        f"| {result['unasked_over_plain']:.4f} | within 2% of 1 |",
        f"| bytes read per batch, columns asked / no columns stored "
        f"| {result['asked_over_plain']:.1f} | |",
        f"| top-32 ids + logprobs on disk / raw (lower = better) "
        f"| {result['topk_disk_over_raw']:.3f} | <= 1.3 |",
        f"| routed experts 60x8 int16 on disk / raw (lower = better) "
        f"| {result['experts_disk_over_raw']:.3f} | <= 1.3 |",
        f"| write time with columns / without (lower = better) "
        f"| {result['write_with_over_without']:.2f} (paired {paired['median']:.2f}, "
        f"{paired['min']:.2f}-{paired['max']:.2f}) | |",
        "",
        "Bytes read through the rollout files' file objects, one loader pass in a process of "
        "its own each (per batch: while iterating, start-up excluded; start-up: building the "
        "dataset; rchar: /proc/self/io over the iteration, media files and Delta log "
        "included; pass s: dataset build + every batch, images processed included):",
        "",
        "| pass | bytes per batch | start-up bytes | batches | rchar per batch | pass s |",
        "|---|---|---|---|---|---|",
        passes("plain"),
        passes("unasked"),
        passes("asked"),
        "",
        "On disk (codec and encodings from the file's metadata):",
        "",
        "| column | raw | on disk | disk / raw | before codec | physical | codec | encodings |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {d['raw_bytes'] / mb:.1f} MB | {d['disk_bytes'] / mb:.1f} MB | "
            f"{d['disk_over_raw']:.3f} | {d['encoded_bytes_before_codec'] / mb:.1f} MB | "
            f"{d['physical_type']} | {', '.join(d['codec'])} | {', '.join(d['encodings'])} |"
            for name, d in disk.items()
        ),
        "",
        "The same columns of the first 8 rows rewritten with other encodings, zstd level 1 "
        "(disk / raw, and seconds to encode, one measurement; not applied):",
        "",
        "| encoding | " + " | ".join(COLUMNS) + " | encode s |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
        *(
            f"| {label} | "
            + " | ".join(f"{ratios[n]:.3f}" for n in COLUMNS)
            + f" | {ratios['seconds']:.2f} |"
            for label, ratios in result["alternatives"].items()
        ),
        "",
        f"Write, seconds (median, min-max of {result['reps']}; start-up of the store "
        f"included): without {w['without']['median']:.2f} "
        f"({w['without']['min']:.2f}-{w['without']['max']:.2f}), with "
        f"{w['with']['median']:.2f} ({w['with']['min']:.2f}-{w['with']['max']:.2f}), "
        f"{raw / mb:.0f} MB of raw column values: "
        f"{raw / mb / (w['with']['median'] - w['without']['median']):.0f} MB/s extra. "
        "Median phases (s): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "total")
            for name, phases in result["write_phases_median"].items()
        )
        + " (commit: waiting for the last row groups' encoding, fsync, table commit).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    cli(run, __doc__, table=table, name="columns")
