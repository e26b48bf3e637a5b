"""The read path's cost of trusting nothing: loader throughput with and without the checks.

    python -m benchmarks.bench_trust --scale 1

The loader re-checks every row it reads (spans against tokens, lengths, fields, sizes; see
``mmstore/_rowcheck.py``) and the URI's trust on every image, cache hit or not. "Without"
runs the same loader with those checks replaced by no-ops (rows are still sliced the same
way), in the same run, interleaved A B A B, single process (so no worker hides the cost),
timed in CPU seconds of the process:

- ``screenshots``: the loader workload of ``bench_loader`` (GRPO groups of 8 sharing 2
  screenshots per sample): images are mostly cache hits, the realistic case;
- ``text``: text-only rows of ~3.7k tokens: no image work at all, so the row checks are
  the largest share of the read path they can be (an upper bound of their cost).

Whole-loader throughput on a shared machine varies by more than the checks cost, so the row
path is also timed alone (best of several passes over every row: window, checks, trust):
``check_share_percent`` is its extra CPU time per row over a loader sample's CPU time.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np

import mmstore
from benchmarks._common import WORKLOADS, cli, interleaved, processor
from mmstore._loading.materialize import Materializer
from mmstore._rows import check as _rowcheck
from mmstore._rows.invariants import truncation_point
from mmstore._rows.lookups import family_checker
from mmstore._rows.snapshot import read_units
from mmstore.synth import grpo_rollouts

# Headline rows for benchmarks/run.py: (label, path in the result, start-up: "in",
# "excluded" or "n/a", as run.py defines them).
HEADLINE = [
    ("loader with checks / without, screenshots", "screenshots.checked_over_unchecked", "in"),
    ("loader with checks / without, text-only rows", "text.checked_over_unchecked", "in"),
    (
        "row checks' CPU share of a sample, screenshots (%)",
        "screenshots.check_share_percent",
        "excluded",
    ),
    (
        "row checks' CPU share of a sample, text-only rows (%)",
        "text.check_share_percent",
        "excluded",
    ),
]
BATCH = 8


def _unchecked(self: _rowcheck.RowWindow, i: int, sid: Any) -> tuple[int, int, int]:
    """``RowWindow._check`` without any check: only the sizes and the max_len cut."""
    lo, hi = self.images.range(i)
    n = self.tokens.length(i)
    if self.max_len is None:
        return n, lo, hi - lo
    cut, kept = truncation_point(
        self.images.offset[lo:hi], self.images.length[lo:hi], n, self.max_len
    )
    return cut, lo, kept


def _no_problems(self: Any, max_pixels: int) -> np.ndarray:
    self._max_pixels = max_pixels
    return np.zeros(len(self.offset), dtype=np.int8)


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    with (
        mock.patch.object(_rowcheck.RowWindow, "_check", _unchecked),
        mock.patch.object(_rowcheck._RefColumns, "_problems", _no_problems),
        mock.patch.object(Materializer, "check_trust", lambda self, ref, where: None),
    ):
        yield


def build(root: str, spec: dict[str, Any], samples: int, proc: Any) -> mmstore.Store:
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(proc)
    groups = max(1, samples // spec["group_size"])
    with store.writer(run_id="bench", step=0, row_group_size=64) as w:
        for r in grpo_rollouts(store, adapter, groups=groups, **spec):
            w.write(r)
    return store


def samples_per_s(store: mmstore.Store, proc: Any, checked: bool) -> float:
    """One pass over the store, a fresh dataset (a cold cache) each time, per CPU second of
    this process: on a shared machine, other processes' load does not count."""
    ds = mmstore.RolloutDataset(store, proc, seed=0)
    with contextlib.nullcontext() if checked else checks_off():
        start = time.process_time()
        n = sum(len(b["sample_ids"]) for b in mmstore.RolloutLoader(ds, batch_size=BATCH))
    return n / (time.process_time() - start)


def check_seconds_per_row(store: mmstore.Store, proc: Any, checked: bool, reps: int) -> float:
    """CPU seconds per row of the row path alone (window, checks, trust), best of ``reps``:
    a steadier figure than whole-loader throughput on a busy machine."""
    ds = mmstore.RolloutDataset(store, proc, seed=0)
    table = read_units(store, ds.snapshot.units)
    materializer = ds.materializer()
    best = float("inf")
    with contextlib.nullcontext() if checked else checks_off():
        for _ in range(reps):
            start = time.process_time()
            window = _rowcheck.RowWindow(
                table,
                family_checker(ds.adapter),
                max_pixels=store.max_image_pixels,
                image_token_ids=ds.adapter.special_token_ids,
            )
            for i in range(window.num_rows):
                row = window.row(i)
                for ref in row.images:
                    materializer.check_trust(ref, row.where)
            best = min(best, time.process_time() - start)
    return best / table.num_rows


def run(scale: float = 1.0, reps: int = 5) -> dict[str, Any]:
    samples = max(16, round(256 * scale))
    proc = processor()
    screenshots = dict(WORKLOADS["screenshots"])
    w, h = screenshots["image_size"]
    screenshots["image_size"] = (w // 3, h // 3) if scale < 0.5 else (w, h)
    specs = {
        "screenshots": screenshots,
        "text": {**screenshots, "images_per_sample": 0, "completion_len": 3600},
    }
    results: dict[str, Any] = {"samples": samples, "batch_size": BATCH, "workers": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in specs.items():
            store = build(f"{tmp}/{name}", spec, samples, proc)
            figures = interleaved(
                {
                    "checked": lambda s=store: samples_per_s(s, proc, True),
                    "unchecked": lambda s=store: samples_per_s(s, proc, False),
                },
                reps,
            )
            ratio = figures["checked"]["median"] / figures["unchecked"]["median"]
            per_row = {
                key: check_seconds_per_row(store, proc, key == "checked", reps=max(5, reps))
                for key in ("checked", "unchecked")
            }
            # The checks' own CPU time per row, as a share of a loader sample's CPU time.
            share = (per_row["checked"] - per_row["unchecked"]) * figures["unchecked"]["median"]
            results[name] = {
                "samples_per_s": figures,
                "checked_over_unchecked": ratio,
                "overhead_percent": round(100 * (1 - ratio), 2),
                "row_path_us_per_row": {k: round(v * 1e6, 1) for k, v in per_row.items()},
                "check_share_percent": round(100 * share, 2),
            }
    return results


if __name__ == "__main__":
    cli(run, __doc__, reps=5)
