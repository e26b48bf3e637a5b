"""Crash safety: writers killed with SIGKILL at random moments leave committed data whole.

A parent process (tests/store_workers.py) forks writer processes that loop over media puts,
row writes and commits, announcing each phase; it kills each writer a random time after a
chosen phase began: during media puts, during the Parquet writes, during the commit (which
spans encoding the file, writing it to staging, its fsync, the rename into place and the
table's commit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mmstore
from tests.store_workers import check_store, image_bytes, make_row

WORKERS = os.path.join(os.path.dirname(__file__), "store_workers.py")


@pytest.mark.slow  # a SIGKILL loop
def test_sigkill_at_random_moments_leaves_committed_data_whole(tmp_path, adapter):
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    done = subprocess.run(
        [sys.executable, WORKERS, "crash", str(root), "--trials", "30", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    kills = json.loads(done.stdout.strip().splitlines()[-1])["kills"]
    assert kills == {"p": 10, "w": 10, "c": 10}, kills  # every writer died by SIGKILL

    store = mmstore.Store.open(root)
    rows = check_store(store, adapter)  # whole files, intact rows, no missing media
    assert rows, "no writer committed anything before being killed"
    assert len({row["sample_id"] for row in rows}) == len(rows)  # nothing committed twice
    print(f"{len(rows)} rows committed; {len(store.staging_files())} files of staging debris")

    # The store stays usable: a new writer commits next to the debris.
    first = rows[0]["images"][0]
    media = store.put_media(store.read_media(first["uri"], first["hash"]))
    with store.writer(run_id="after", step=0) as w:
        w.write(make_row(adapter, [media], "after-0"))
    assert len(check_store(store, adapter)) == len(rows) + 1


def test_the_check_sees_torn_files_and_debris_outside_staging(store, adapter):
    # The crash test is only as strong as check_store: show it catches what a crash could do.
    media = store.put_media(image_bytes(1))
    with store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [media], "s0"))
    assert len(check_store(store, adapter)) == 1
    part = Path(store.backend.abspath(store.rollout_files()[0].path))
    image = Path(store.backend.abspath(media.uri))

    for path in (image, part):
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        with pytest.raises(Exception):  # noqa: B017 - an assertion or a Parquet read error
            check_store(store, adapter)
        path.write_bytes(whole)
    check_store(store, adapter)

    stray = part.with_name(".part.tmp")
    stray.write_bytes(part.read_bytes()[:100])
    with pytest.raises(AssertionError, match="stray file"):
        check_store(store, adapter)
    stray.unlink()

    whole = part.read_bytes()
    part.unlink()  # a file the latest version lists is gone
    with pytest.raises(AssertionError, match="listed files missing"):
        check_store(store, adapter)
    part.write_bytes(whole)

    image.unlink()
    with pytest.raises(AssertionError, match="references missing"):
        check_store(store, adapter)


@pytest.mark.slow  # a SIGKILL loop
def test_sigkill_during_gc_release_export_and_pin_loses_nothing_referenced(tmp_path, adapter):
    # Each trial commits a run over fresh and shared media (plus unreferenced media, all past
    # the grace period), then runs gc, release_run, export or pin_rows + release_run in a
    # process killed with SIGKILL at a random moment of it.
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    done = subprocess.run(
        [sys.executable, WORKERS, "lifecycle", str(root), "--trials", "24", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    ops = json.loads(done.stdout.strip().splitlines()[-1])["ops"]
    print(ops)
    assert all(o["killed"] + o["finished"] == 6 for o in ops.values()), ops
    assert all(o["killed"] for o in ops.values()), ops  # each kind died mid-operation
    assert sum(o["killed"] for o in ops.values()) >= 12, ops

    store = mmstore.Store.open(root)
    check_store(store, adapter)  # every committed row's media is present and whole
    pinned = mmstore._lifecycle.pins.pinned_hashes(store)
    present = {
        p.rsplit("/", 1)[1].split(".")[0] for p in (m.path for m in store.backend.list("media"))
    }
    assert pinned <= present, "a pinned image was swept"
    assert mmstore.verify(store).ok
    for dest in sorted(tmp_path.glob("store-export-*")):
        if (dest / "mmstore.json").exists():  # killed after the export's store was made
            exported = mmstore.Store.open(dest)
            check_store(exported, adapter)
            assert mmstore.verify(exported).ok
