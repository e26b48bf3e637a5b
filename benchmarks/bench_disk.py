"""Bytes on disk per sample: mmstore vs dense fp32 pixel_values vs inline image bytes.

    python -m benchmarks.bench_disk --scale 1

- dense fp32: what shipping processed ``pixel_values`` costs (the baseline refs replace);
- inline: the same rows with each sample's encoded image bytes in a binary column, one
  Parquet file per step as a trainer's dump would write it (zstd; pyarrow's dictionary
  encoding is left on, so identical images *within* one file are stored once there too);
- mmstore: the rows' Parquet files plus the content-addressed media they reference.

RL repeats prompts every epoch: the workload is written for 2 epochs whose prompts (and so
images) repeat, one step each. Content addressing stores a repeated image once across
files; inline files cannot.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import mmstore
from benchmarks._common import WORKLOADS, cli, processor, write_workload


def measure(store: mmstore.Store) -> dict[str, Any]:
    adapter = mmstore.adapter_for(processor())
    parquet = store.rollout_files()
    rows = dense = inline_bytes = 0
    for f in parquet:  # one inline file per rollout file, i.e. per step
        table = pq.read_table(store.backend.abspath(f.path), partitioning=None)
        rows += table.num_rows
        inline_images = []
        for refs in table.column("images").to_pylist():
            inline_images.append([store.read_media(r["uri"], r["hash"]) for r in refs])
            for r in refs:
                patches, dim = adapter.pixel_shape(r["width"], r["height"])
                dense += patches * dim * 4
        column = pa.array(inline_images, pa.list_(pa.binary()))
        sink = pa.BufferOutputStream()
        pq.write_table(table.append_column("image_bytes", column), sink, compression="zstd")
        inline_bytes += sink.getvalue().size
    media_bytes = sum(f.size for f in store.backend.list("media"))
    stored = media_bytes + sum(f.size for f in parquet)
    return {
        "samples": rows,
        "mmstore_bytes_per_sample": stored / rows,
        "dense_fp32_bytes_per_sample": dense / rows,
        "inline_bytes_per_sample": inline_bytes / rows,
        "dense_over_mmstore": dense / stored,
        "inline_over_mmstore": inline_bytes / stored,
    }


def run(scale: float = 1.0, reps: int = 1) -> dict[str, Any]:
    samples = max(8, round(64 * scale))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in WORKLOADS:
            store = write_workload(
                f"{tmp}/{name}", name, samples, small_images=scale < 0.5, epochs=2
            )
            out[name] = measure(store)
    return out


if __name__ == "__main__":
    cli(run, __doc__, reps=1)
