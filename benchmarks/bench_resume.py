"""Resume: time to the first batch after ``load_state_dict`` at 10%, 50%, 90% of an epoch.

    python -m benchmarks.bench_resume --scale 1

mmstore seeks with Parquet metadata, so the time should be flat across cut points. The
baseline is replay (what a loader without seek does: iterate from the epoch's start and
discard the batches already seen), measured in the same run on the same store.
"""

from __future__ import annotations

import itertools
import tempfile
from typing import Any

import torch

import mmstore
from benchmarks._common import cli, interleaved, processor, timed, write_workload

BATCH = 8
CUTS = (0.1, 0.5, 0.9)


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    samples = max(40, round(320 * scale))
    proc = processor()
    out: dict[str, Any] = {"samples": samples}
    with tempfile.TemporaryDirectory() as tmp:
        store = write_workload(f"{tmp}/s", "screenshots", samples, small_images=True, steps=4)

        def loader() -> mmstore.RolloutLoader:
            bf16 = mmstore.Materialize(dtype=torch.bfloat16)
            ds = mmstore.RolloutDataset(store, proc, materialize=bf16, seed=1)
            return mmstore.RolloutLoader(ds, batch_size=BATCH)

        total = len(loader())
        reference = [b["sample_ids"] for b in loader()]
        for cut in CUTS:
            k = min(total - 1, int(total * cut))

            def seek(k: int = k) -> float:
                lo = loader()
                lo.load_state_dict({**lo.state_dict(), "batches_yielded": k})
                seconds, batch = timed(lambda: next(iter(lo)))
                assert batch["sample_ids"] == reference[k], "resumed batch differs"
                return seconds

            def replay(k: int = k) -> float:
                seconds, batch = timed(lambda: next(itertools.islice(iter(loader()), k, None)))
                assert batch["sample_ids"] == reference[k]
                return seconds

            figures = interleaved({"mmstore_seek": seek, "replay": replay}, reps)
            out[f"{int(cut * 100)}%"] = {
                **figures,
                "batch": k,
                "replay_over_seek": figures["replay"]["median"] / figures["mmstore_seek"]["median"],
            }
        seeks = [out[f"{int(c * 100)}%"]["mmstore_seek"]["median"] for c in CUTS]
        out["seek_90_over_10"] = seeks[-1] / seeks[0]
    return out


if __name__ == "__main__":
    cli(run, __doc__, reps=3)
