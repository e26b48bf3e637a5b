"""The rollouts Delta table: commit latency and snapshot cost, against format v1's ways.

    python -m benchmarks.bench_table --scale 1 [--reps 5] [--s3]

Two comparisons, each side by side in one run, interleaved (A B A B ...):

- **Commit latency.** The same encoded rollout file (128 rows of 2-4k tokens with
  completion logprobs, mmstore's Parquet settings, 1.3 MB) committed again and again, one
  run: *rename-only* is format v1's commit (``write_atomic``: staging write, fsync, rename,
  fsync of the directory); *log* is the same write plus a Delta transaction adding the file
  (``RolloutTable.commit`` with a producer and seq: the exactly-once path) into a small
  table; *log, large table* the same into the table of the snapshot test below (``10,000 x
  scale`` files). Each repetition times ``commits`` of each, alternately; figures are
  medians per commit. ``rename_over_log``: higher = mmstore better, 1 = the log costs
  nothing (the issue's goal: at least 1/1.3 = 0.77); ``log_small_over_large``: 1 = flat in
  the table's size.
- **Snapshot / open.** A table of ``10,000 x scale`` committed files of one run (tiny
  Parquet files, 100 a step). *listing* is format v1's snapshot: a recursive listing of
  the run's directory (``backend.list``: names, sizes, mtimes; the ``.parquet`` filter),
  the same files the table lists. *delta latest* opens the table afresh
  (``RolloutTable(storage).snapshot()``) at its worst: the newest checkpoint plus
  ``CHECKPOINT_INTERVAL - 1`` JSON entries after it (the table is built so: that many
  commits share all files but the last that many, the table checkpoints the last of them,
  and the remaining files are committed one by one).
  *delta at checkpoint* opens the checkpointed version: the checkpoint alone, the best
  case. ``listing_over_delta_latest`` / ``listing_over_delta_checkpoint``: higher = mmstore
  better.

With ``--s3`` (or ``S3=1`` in the environment) both also run on moto_server on loopback, on
``S3_FILES x scale`` files, directly and through a proxy adding 30 ms to every request
(``benchmarks._s3.LatencyProxy``), without the large-table commit (moto takes ~5 ms a
request, a table of that size minutes to build). Their ratios carry an ``s3_`` or
``s3_30ms_`` prefix.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import interleaved, paired_ratio, timed
from mmstore._format.schema import ROLLOUT_SCHEMA, file_metadata
from mmstore._rows.table import CHECKPOINT_INTERVAL, RolloutTable, TableFile
from mmstore._rows.writer import parquet_options
from mmstore._storage.backends import FileStat
from mmstore._storage.store import Storage

FULL_FILES = 10_000
S3_FILES = 10_000
ROWS_PER_FILE = 128
RUN = "bench"

# The headline ratios and their directions: benchmarks/run.py's SUITE entry "table".


def rollout_file(seed: int = 0, rows: int = ROWS_PER_FILE) -> bytes:
    """One rollout Parquet file as the writer encodes it: GRPO-like rows of 2-4k tokens
    (Zipf-distributed text), a loss mask and completion logprobs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2000, 4000, rows)
    prompt = (lengths * rng.uniform(0.3, 0.6, rows)).astype(np.int32)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    tokens = np.minimum(rng.zipf(1.2, offsets[-1]), 150_000).astype(np.int32)
    mask = np.concatenate([np.arange(n) >= p for n, p in zip(lengths, prompt, strict=True)])
    completion = lengths - prompt
    lp_offsets = np.r_[0, np.cumsum(completion)].astype(np.int32)
    logprobs = -np.abs(rng.lognormal(-3, 2, lp_offsets[-1])).astype(np.float32)
    reward = (rng.random(rows) < 0.5).astype(np.float32)
    table = pa.Table.from_pydict(
        {
            "sample_id": [f"s{seed}-{i}" for i in range(rows)],
            "group_id": [f"g{seed}-{i // 8}" for i in range(rows)],
            "tokens": pa.ListArray.from_arrays(offsets, pa.array(tokens)),
            "prompt_len": pa.array(prompt),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
            "logprobs": pa.ListArray.from_arrays(lp_offsets, pa.array(logprobs)),
            "reward": pa.array(reward),
            "advantage": pa.array(reward - 0.5),
            "images": pa.array([[]] * rows, ROLLOUT_SCHEMA.field("images").type),
            "metadata": pa.nulls(rows, pa.string()),
        }
    ).cast(ROLLOUT_SCHEMA)
    table = table.replace_schema_metadata(
        {**ROLLOUT_SCHEMA.metadata, **file_metadata(RUN, 0, {}, lengths.tolist())}
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=ROWS_PER_FILE, **parquet_options())
    return sink.getvalue()


def tiny_file() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"sample_id": ["s"]}), sink)
    return sink.getvalue()


# -- commit latency --------------------------------------------------------------------------


class Committer:
    """Commits the same bytes under fresh names, format v1's way or through the log."""

    def __init__(self, storage: Storage, data: bytes, table: RolloutTable | None) -> None:
        self.storage, self.data, self.table = storage, data, table
        self.producer = f"bench-{uuid.uuid4().hex[:8]}"
        self.seq = 0

    def commit_once(self) -> float:
        rel = f"rollouts/run_id={RUN}/step=0/part-{self.producer}-{self.seq:06d}.parquet"
        start = time.perf_counter()
        self.storage.backend.write_atomic(rel, self.data, replace=False)
        if self.table is not None:
            file = TableFile(rel, RUN, 0, len(self.data), ROWS_PER_FILE)
            result = self.table.commit([file], producer=self.producer, seq=self.seq)
            assert result.committed
        seconds = time.perf_counter() - start
        self.seq += 1
        return seconds

    def median_of(self, commits: int) -> float:
        return statistics.median(self.commit_once() for _ in range(commits))


def commit_latency(
    root: str, commits: int, reps: int, large: RolloutTable | None, s3: dict[str, Any] | None
) -> dict[str, Any]:
    data = rollout_file()
    rename_store = Storage.open(f"{root}/rename", create=True, s3_options=s3)
    log_store = Storage.open(f"{root}/log", create=True, s3_options=s3)
    table = RolloutTable(log_store)
    table.create()
    sides: dict[str, Callable[[], float]] = {
        "rename_only": _bound(Committer(rename_store, data, None), commits),
        "log": _bound(Committer(log_store, data, table), commits),
    }
    if large is not None:
        sides["log_large_table"] = _bound(Committer(large.storage, data, large), commits)
    figures = interleaved(sides, reps)
    out: dict[str, Any] = {
        "file_bytes": len(data),
        "commits_per_rep": commits,
        "median_ms": {k: round(v["median"] * 1e3, 2) for k, v in figures.items()},
        "rename_over_log": figures["rename_only"]["median"] / figures["log"]["median"],
        "paired_rename_over_log": paired_ratio(figures, "rename_only", "log"),
    }
    if large is not None:
        large_median = figures["log_large_table"]["median"]
        out["log_small_over_large"] = figures["log"]["median"] / large_median
    return out


def _bound(committer: Committer, commits: int) -> Callable[[], float]:
    return lambda: committer.median_of(commits)


# -- snapshot / open -------------------------------------------------------------------------


def build_table(storage: Storage, files: int, threads: int = 1) -> RolloutTable:
    """``files`` tiny files of one run (100 a step) in a new table, committed as the module
    docstring says: ``interval - 1`` shared commits (the table checkpoints the last), then
    ``interval - 1`` single ones."""
    data = tiny_file()
    table = RolloutTable(storage)
    table.create()
    rels = [f"rollouts/run_id={RUN}/step={i // 100}/part-{i:06d}.parquet" for i in range(files)]

    def put(rel: str) -> None:
        storage.backend.write_atomic(rel, data, durable=False)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, rels))
    tail = CHECKPOINT_INTERVAL - 1
    groups = [list(g) for g in np.array_split(np.array(rels[:-tail]), tail)]
    groups += [[rel] for rel in rels[-tail:]]
    for group in groups:
        steps = [int(rel.split("step=")[1].split("/")[0]) for rel in group]
        pairs = zip(group, steps, strict=True)
        table.commit([TableFile(rel, RUN, step, len(data), 1) for rel, step in pairs])
    return table


def listing(storage: Storage) -> list[FileStat]:
    """Format v1's snapshot of the run: every Parquet file under its directory."""
    found = storage.backend.list(f"rollouts/run_id={RUN}")
    return sorted((f for f in found if f.path.endswith(".parquet")), key=lambda f: f.path)


def snapshot_cost(storage: Storage, files: int, reps: int) -> dict[str, Any]:
    checkpoint = json.loads(storage.backend.read("rollouts/_delta_log/_last_checkpoint"))
    checkpointed = int(checkpoint["version"])
    latest = RolloutTable(storage).latest_version()
    at_checkpoint = len(RolloutTable(storage).snapshot(checkpointed).files)

    def list_files() -> float:
        seconds, found = timed(lambda: listing(storage))
        assert len(found) == files, (len(found), files)
        return seconds

    def open_version(version: int | None, expected: int) -> Callable[[], float]:
        def run() -> float:
            seconds, snap = timed(lambda: RolloutTable(storage).snapshot(version))
            assert len(snap.files) == expected, (len(snap.files), expected)
            return seconds

        return run

    figures = interleaved(
        {
            "listing": list_files,
            "delta_latest": open_version(None, files),
            "delta_checkpoint": open_version(checkpointed, at_checkpoint),
        },
        reps,
    )
    return {
        "files": files,
        "latest_version": latest,
        "checkpoint_version": checkpointed,
        "entries_after_checkpoint": latest - checkpointed,
        "median_ms": {k: round(v["median"] * 1e3, 2) for k, v in figures.items()},
        "listing_over_delta_latest": figures["listing"]["median"]
        / figures["delta_latest"]["median"],
        "listing_over_delta_checkpoint": figures["listing"]["median"]
        / figures["delta_checkpoint"]["median"],
        "paired_listing_over_delta_latest": paired_ratio(figures, "listing", "delta_latest"),
    }


# -- the run ---------------------------------------------------------------------------------


def run_local(scale: float, reps: int) -> dict[str, Any]:
    files = max(3 * CHECKPOINT_INTERVAL, round(FULL_FILES * scale))
    commits = max(5, round(40 * scale))
    with tempfile.TemporaryDirectory(prefix="mmstore-bench-table-") as root:
        storage = Storage.open(f"{root}/big", create=True)
        seconds, table = timed(lambda: build_table(storage, files))
        snapshot = snapshot_cost(storage, files, reps)
        snapshot["build_seconds"] = round(seconds, 1)
        commit = commit_latency(root, commits, reps, table, None)
    return {"commit": commit, "snapshot": snapshot}


@contextmanager
def latency_proxy(target: int, delay: float) -> Iterator[int]:
    """``benchmarks._s3.LatencyProxy`` in a process of its own; yields its port.

    Not in this process: some delta-rs calls (``get_add_actions``, ``is_deltatable``) hold
    the GIL while they wait on storage, and a proxy thread of the same process then cannot
    answer them.
    """
    code = (
        "import sys\n"
        "from benchmarks._s3 import LatencyProxy\n"
        "with LatencyProxy(int(sys.argv[1]), float(sys.argv[2])) as proxy:\n"
        "    print(proxy.port, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(target), str(delay)],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the proxy exits
        proc.wait(timeout=30)


def run_s3(scale: float, reps: int) -> dict[str, Any]:
    import pyarrow.fs as pafs

    from benchmarks._s3 import moto_server, s3_options

    files = max(3 * CHECKPOINT_INTERVAL, round(S3_FILES * scale))
    commits = max(5, round(20 * scale))
    out: dict[str, Any] = {}
    with moto_server() as port:
        pafs.S3FileSystem(**s3_options(port)).create_dir("bench")
        storage = Storage.open("s3://bench/big", create=True, s3_options=s3_options(port))
        seconds, _ = timed(lambda: build_table(storage, files, threads=8))
        for label, delay in (("0ms", 0.0), ("30ms", 0.03)):
            with latency_proxy(port, delay) as proxy_port:
                options = s3_options(proxy_port)
                near = Storage.open("s3://bench/big", s3_options=options)
                out[label] = {
                    "snapshot": snapshot_cost(near, files, reps),
                    "commit": commit_latency(f"s3://bench/{label}", commits, reps, None, options),
                }
        out["0ms"]["snapshot"]["build_seconds"] = round(seconds, 1)
    return out


def run(scale: float = 1.0, reps: int = 3, s3: bool | None = None) -> dict[str, Any]:
    """Every figure described in the module docstring; the headline ratios at the top."""
    result: dict[str, Any] = {"direction": "every ratio: higher = mmstore better (1 = parity)"}
    local = run_local(scale, reps)
    result["local"] = local
    result["rename_over_log"] = local["commit"]["rename_over_log"]
    result["log_small_over_large"] = local["commit"]["log_small_over_large"]
    result["listing_over_delta_latest"] = local["snapshot"]["listing_over_delta_latest"]
    result["listing_over_delta_checkpoint"] = local["snapshot"]["listing_over_delta_checkpoint"]
    if s3 if s3 is not None else os.environ.get("S3") == "1":
        remote = run_s3(scale, reps)
        result["s3"] = remote
        for label, prefix in (("0ms", "s3_"), ("30ms", "s3_30ms_")):
            result[f"{prefix}rename_over_log"] = remote[label]["commit"]["rename_over_log"]
            result[f"{prefix}listing_over_delta_latest"] = remote[label]["snapshot"][
                "listing_over_delta_latest"
            ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also on moto_server")
    args = parser.parse_args()
    print(json.dumps(run(args.scale, args.reps, s3=args.s3), indent=2))


if __name__ == "__main__":
    main()
