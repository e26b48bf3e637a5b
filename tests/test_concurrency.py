"""Four writer processes released at the same moment into one store, sharing most images."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mmstore
from mmstore._format.media import content_hash
from tests.store_workers import check_store, image_bytes

WORKERS = os.path.join(os.path.dirname(__file__), "store_workers.py")


@pytest.mark.slow  # four writer processes
def test_four_processes_share_images_and_keep_every_row(tmp_path, adapter):
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    writers, shared, rows = 4, 40, 24
    done = subprocess.run(
        [sys.executable, WORKERS, "concurrent", str(root), "--writers", str(writers),
         "--shared", str(shared), "--rows", str(rows)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["exit_codes"] == [0] * writers

    store = mmstore.Store.open(root)
    # Whole media files named by their hash, intact rows, no missing media, no stray files.
    committed = check_store(store, adapter)
    assert sorted(r["sample_id"] for r in committed) == sorted(
        f"w{i}-{k}" for i in range(writers) for k in range(rows)
    )
    # Each distinct image is stored exactly once: 40 shared by all, 4 of each writer's own.
    seeds = [*range(shared), *(10_000 + 100 * i + j for i in range(writers) for j in range(4))]
    expected = {f"{content_hash(image_bytes(seed))}.png" for seed in seeds}
    stored = [f.path.rsplit("/", 1)[1] for f in store.backend.list("media")]
    assert sorted(stored) == sorted(expected)
    assert store.staging_files() == []  # a clean run leaves no staging debris
    # One file per writer, in the step partition the writer chose.
    parts = [f.path.rsplit("/", 1)[0] for f in store.rollout_files()]
    assert sorted(parts) == sorted(f"rollouts/run_id=conc/step={i % 2}" for i in range(writers))
