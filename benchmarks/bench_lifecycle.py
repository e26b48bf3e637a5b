"""gc (dry run) and verify (metadata mode) cost per image ref, at growing store sizes.

    python -m benchmarks.bench_lifecycle --scale 1     # full: 1M refs, 100k media files

One synthetic store grows through several sizes (a quarter, half and all of 1M image refs
times ``--scale``, one media file per ten refs, a tenth of the media referenced by nothing);
at each size ``gc(dry_run=True)`` and ``verify(check_hashes=False)`` are timed, interleaved
with their two parts and a baseline: listing ``media/`` (names, sizes, mtimes), gc's mark
(only the ``images[].hash`` leaf column of every committed file) and the baseline mark that
reads whole rows (every column). Time per ref at the largest size over time per ref at the
smallest shows how cost grows (1 = linear).

The point is gc/verify cost, not write cost, so the store is built directly: media files are
small distinct byte strings named by their real content hash (nothing here decodes them),
and rows are Arrow arrays in the v1 schema with valid spans for a 56x56 Qwen2-VL image,
written with pyarrow the way the writer writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from benchmarks._common import interleaved, timed
from mmstore._format.media import content_hash, media_path
from mmstore._format.schema import IMAGE_REF_TYPE, ROLLOUT_SCHEMA, file_metadata
from mmstore._rows.files import referenced_hashes
from mmstore._rows.table import TableFile
from mmstore._rows.writer import DEFAULT_ROW_GROUP_SIZE, parquet_options

FULL_REFS = 1_000_000
SIZES = (0.25, 0.5, 1.0)  # fractions of the full size, measured in this order
REFS_PER_MEDIA = 10
GARBAGE = 0.1  # share of media files no row references
IMAGES_PER_ROW = 4
ROWS_PER_FILE = 2_500
TEXT = 4  # text tokens before each image
SIDE = 56  # 56x56 px = 4 placeholder tokens for Qwen2-VL

# Headline rows for benchmarks/run.py: (label, path in the result, start-up: "in",
# "excluded" or "n/a", as run.py defines them).
HEADLINE = [
    ("gc dry run: time per ref, largest / smallest size (linear = 1)", "gc_per_ref_growth", "n/a"),
    ("verify metadata: time per ref, largest / smallest size (linear = 1)",
     "verify_per_ref_growth", "n/a"),
    ("mark by whole rows / mark by hash leaf, largest size", "full_rows_over_hash_leaf", "n/a"),
]  # fmt: skip


class SyntheticStore:
    """A store that grows: media files first, then rows referencing them (as writers do)."""

    def __init__(self, root: str, seed: int = 0) -> None:
        self.store = mmstore.Store.open(root, create=True)
        self.adapter = mmstore.adapter_for(Qwen2VLImageProcessorPil())
        self.span = self.adapter.num_tokens(SIDE, SIDE)
        self.rng = np.random.default_rng(seed)
        self.live_uris: list[str] = []
        self.live_hashes: list[str] = []
        self.live_sizes: list[int] = []
        self.live_arrays: tuple[pa.Array, pa.Array, pa.Array] | None = None
        self.referenced = np.zeros(0, bool)  # by live index: does any row reference it?
        self.media = 0
        self.refs = 0
        self.files = 0

    def grow(self, refs: int) -> None:
        media = max(1, refs // REFS_PER_MEDIA)
        self._add_media(media - self.media)
        while self.refs < refs:
            rows = min(ROWS_PER_FILE, -(-(refs - self.refs) // IMAGES_PER_ROW))
            self._add_file(rows)

    def _add_media(self, count: int) -> None:
        base = self.store.backend.abspath("")
        for i in range(self.media, self.media + count):
            data = f"mmstore bench media {i:012d} ".encode() * 6
            rel = media_path(content_hash(data), "png")
            path = os.path.join(base, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            if self.rng.random() >= GARBAGE:
                self.live_uris.append(rel)
                self.live_hashes.append(rel.rsplit("/", 1)[1].split(".")[0])
                self.live_sizes.append(len(data))
        self.media += count
        self.live_arrays = (
            pa.array(self.live_uris),
            pa.array(self.live_hashes),
            pa.array(self.live_sizes, pa.int64()),
        )
        self.referenced = np.r_[
            self.referenced, np.zeros(len(self.live_hashes) - len(self.referenced), bool)
        ]

    def _add_file(self, rows: int) -> None:
        run_id, step = "bench", self.files
        table = self._rows(rows, first=self.refs // IMAGES_PER_ROW)
        layouts = {self.adapter.fingerprint: self.adapter.layout.params()}
        table = table.replace_schema_metadata(
            {**ROLLOUT_SCHEMA.metadata, **file_metadata(run_id, step, layouts)}
        )
        rel = f"rollouts/run_id={run_id}/step={step}/part-bench-{step:05d}.parquet"
        path = self.store.backend.abspath(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(table, path, row_group_size=DEFAULT_ROW_GROUP_SIZE, **parquet_options())
        # Format 2: a file is committed when the rollouts table's log lists it.
        size = os.path.getsize(path)
        self.store.table.commit([TableFile(rel, run_id, step, size, table.num_rows)])
        self.files += 1
        self.refs += rows * IMAGES_PER_ROW

    def _rows(self, rows: int, first: int) -> pa.Table:
        n = rows * IMAGES_PER_ROW
        indices = self.rng.integers(0, len(self.live_hashes), size=n)
        self.referenced[indices] = True
        pick = pa.array(indices)
        uris, hashes, sizes = self.live_arrays or ()
        per_row = IMAGES_PER_ROW * (TEXT + self.span)
        offsets = np.tile(np.arange(IMAGES_PER_ROW) * (TEXT + self.span) + TEXT, rows)
        refs = pa.StructArray.from_arrays(
            [
                pc.take(uris, pick),
                pc.take(hashes, pick),
                pa.array(np.full(n, SIDE, np.int32)),
                pa.array(np.full(n, SIDE, np.int32)),
                pc.take(sizes, pick),
                pa.array(offsets.astype(np.int32)),
                pa.array(np.full(n, self.span, np.int32)),
                pa.array(np.full(n, self.adapter.family, object), pa.string()),
                pa.array(np.full(n, self.adapter.fingerprint, object), pa.string()),
                pa.nulls(n, pa.string()),
            ],
            fields=list(IMAGE_REF_TYPE),
        )
        one_row = np.tile(
            np.r_[np.full(TEXT, 1000), np.full(self.span, self.adapter.image_token_id)],
            IMAGES_PER_ROW,
        ).astype(np.int32)
        token_offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * per_row)
        row_ids = np.arange(first, first + rows)
        reward = (self.rng.random(rows) < 0.5).astype(np.float32)
        columns = {
            "sample_id": pa.array([f"s{i:09d}" for i in row_ids]),
            "group_id": pa.array([f"g{i // 8:08d}" for i in row_ids]),
            "tokens": pa.ListArray.from_arrays(token_offsets, pa.array(np.tile(one_row, rows))),
            "prompt_len": pa.array(np.full(rows, per_row, np.int32)),
            "loss_mask": pa.ListArray.from_arrays(
                token_offsets, pa.array(np.zeros(rows * per_row, bool))
            ),
            "logprobs": pa.nulls(rows, ROLLOUT_SCHEMA.field("logprobs").type),
            "reward": pa.array(reward),
            "advantage": pa.array(reward - 0.5),
            "images": pa.ListArray.from_arrays(
                pa.array(np.arange(rows + 1, dtype=np.int32) * IMAGES_PER_ROW), refs
            ),
            "metadata": pa.nulls(rows, pa.string()),
            "policy_version": pa.nulls(rows, pa.int64()),
            "videos": pa.nulls(rows, ROLLOUT_SCHEMA.field("videos").type),
        }
        return pa.Table.from_pydict(columns).cast(ROLLOUT_SCHEMA)


def mark_full_rows(store: mmstore.Store) -> set[str]:
    """Baseline: every hash, by reading whole rows (all columns) of every committed file."""
    found: set[str] = set()
    for stat in store.rollout_files():
        images = pq.read_table(store.backend.abspath(stat.path)).column("images")
        hashes = pc.struct_field(pc.list_flatten(images), "hash")
        found.update(pc.unique(hashes).to_pylist())
    return found


def measure(synthetic: SyntheticStore, reps: int) -> dict[str, Any]:
    store = synthetic.store
    live = int(synthetic.referenced.sum())

    def gc_dry() -> float:
        seconds, report = timed(lambda: mmstore.gc(store, grace_seconds=0, dry_run=True))
        assert len(report.deleted) == synthetic.media - live and report.referenced == live
        return seconds

    def verify_metadata() -> float:
        seconds, report = timed(lambda: mmstore.verify(store, check_hashes=False, progress=False))
        assert report.ok and report.refs_checked == synthetic.refs, report.problems[:3]
        return seconds

    def full_rows() -> float:
        seconds, found = timed(lambda: mark_full_rows(store))
        assert len(found) == live
        return seconds

    def hash_leaf() -> float:
        paths = [f.path for f in store.rollout_files()]
        seconds, found = timed(lambda: referenced_hashes(store, paths, progress=False))
        assert len(found) == live
        return seconds

    def list_media() -> float:
        seconds, listed = timed(lambda: store.backend.list("media"))
        assert len(listed) == synthetic.media
        return seconds

    times = interleaved(
        {
            "gc_dry_run": gc_dry,
            "verify_metadata": verify_metadata,
            "list_media": list_media,
            "mark_hash_leaf": hash_leaf,
            "mark_full_rows": full_rows,
        },
        reps,
    )
    median = {k: v["median"] for k, v in times.items()}
    refs = synthetic.refs
    return {
        "refs": refs,
        "media_files": synthetic.media,
        "rollout_files": synthetic.files,
        "seconds": times,
        "gc_us_per_ref": 1e6 * median["gc_dry_run"] / refs,
        "verify_us_per_ref": 1e6 * median["verify_metadata"] / refs,
        "full_rows_over_hash_leaf": median["mark_full_rows"] / median["mark_hash_leaf"],
    }


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = SyntheticStore(os.path.join(tmp, "store"))
        sizes = []
        for fraction in SIZES:
            synthetic.grow(max(8 * IMAGES_PER_ROW, round(FULL_REFS * scale * fraction)))
            sizes.append(measure(synthetic, reps))
    small, large = sizes[0], sizes[-1]
    return {
        "scale": scale,
        "sizes": sizes,
        "gc_per_ref_growth": large["gc_us_per_ref"] / small["gc_us_per_ref"],
        "verify_per_ref_growth": large["verify_us_per_ref"] / small["verify_us_per_ref"],
        "full_rows_over_hash_leaf": large["full_rows_over_hash_leaf"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="1 = 1M refs / 100k media")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result = run(args.scale, args.reps)
    print(json.dumps(result, indent=2))
    print("refs | media files | rollout files | gc dry run s (us/ref) | verify metadata s "
          "(us/ref) | list media s | mark hash leaf s | mark whole rows s")  # fmt: skip
    for size in result["sizes"]:
        sec = {k: v["median"] for k, v in size["seconds"].items()}
        print(
            f"{size['refs']:,} | {size['media_files']:,} | {size['rollout_files']} | "
            f"{sec['gc_dry_run']:.2f} ({size['gc_us_per_ref']:.2f}) | "
            f"{sec['verify_metadata']:.2f} ({size['verify_us_per_ref']:.2f}) | "
            f"{sec['list_media']:.2f} | {sec['mark_hash_leaf']:.2f} | {sec['mark_full_rows']:.2f}"
        )
    for key in ("gc_per_ref_growth", "verify_per_ref_growth", "full_rows_over_hash_leaf"):
        print(f"{key}: {result[key]:.2f}")


if __name__ == "__main__":
    main()
