"""mmstore upgrade: a format-1 store (rollout files, no commit log) becomes format 2 in
place, files untouched, pins carried over; killed with SIGKILL at any point, a rerun
finishes it and nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import mmstore
from mmstore.cli import main
from mmstore.synth import write_grpo_steps
from tests.store_workers import to_format_1, tree

WORKERS = os.path.join(os.path.dirname(__file__), "store_workers.py")


def format_1_store(root, adapter):
    """A store as format 1 wrote it: two runs, a pin; then the log and records dropped."""
    store = mmstore.Store.open(root, create=True)
    for run in ("b", "a"):
        write_grpo_steps(store, adapter, run_id=run, steps=range(3), groups=1, group_size=2,
                         image_size=(96, 64))  # fmt: skip
    mmstore.pin_rows(store, "old-pin", runs="a")
    rows = store.rollouts()
    pin = (root / "pins" / "old-pin.json").read_text()
    doc = json.loads(pin)
    doc.pop("table_version"), doc.pop("files")
    (root / "pins" / "old-pin.json").write_text(json.dumps({**doc, "version": 1}))
    to_format_1(str(root))
    return rows


def test_upgrade_commits_the_files_in_sorted_order_and_keeps_them(tmp_path, adapter,
                                                                  small_processor):  # fmt: skip
    root = tmp_path / "s"
    rows = format_1_store(root, adapter)
    before = {p: v for p, v in tree(root).items() if p.startswith("rollouts")}
    with pytest.raises(mmstore.UpgradeRequiredError, match="mmstore upgrade"):
        mmstore.Store.open(root)
    report = mmstore.upgrade(root, batch_files=4)
    assert report.upgraded and report.files_committed == 6 and report.runs_recorded == 2
    assert report.table_version == 2  # two commits of at most 4 files
    store = mmstore.Store.open(root)
    assert store.manifest["format_version"] == 2 and "upgraded" in store.manifest
    added = [f.path for e in store.table.entries_after(0) for f in e.added]
    assert added == sorted(added) == sorted(before)
    # No file rewritten or moved: same bytes, same inode, same timestamps.
    after = {p: v for p, v in tree(root).items() if p.startswith("rollouts") and "_delta" not in p}
    assert after == before
    assert store.rollouts() == rows
    assert sorted(f.path for f in store.backend.list("runs")) == [
        f"runs/{run}/{adapter.fingerprint}.json" for run in ("a", "b")
    ]
    # The format-1 pin (media only) is carried over: gc keeps its media.
    pinned = json.loads((root / "pins" / "old-pin.json").read_text())
    assert pinned["version"] == 1 and "files" not in pinned
    assert mmstore.list_pins(store) == {"old-pin": len(pinned["hashes"])} and pinned["hashes"]
    assert mmstore.verify(store).ok
    ds = mmstore.RolloutDataset(store, small_processor)
    assert ds.version == 2 and len(ds) == len(rows)
    # Again: nothing to do.
    again = mmstore.upgrade(root)
    assert not again.upgraded and again.files_already_committed == 6


def test_upgrade_refuses_a_file_no_table_can_list(tmp_path, adapter):
    root = tmp_path / "s"
    format_1_store(root, adapter)
    deep = root / "rollouts" / "run_id=a" / "step=0" / "sub" / "x.parquet"
    deep.parent.mkdir()
    deep.write_bytes(b"PAR1")
    with pytest.raises(mmstore.CorruptFileError, match="directly under") as err:
        mmstore.upgrade(root)
    assert err.value.files == ["rollouts/run_id=a/step=0/sub/x.parquet"]
    assert json.loads((root / "mmstore.json").read_text())["format_version"] == 1


def test_cli_upgrade(tmp_path, adapter, capsys):
    root = tmp_path / "s"
    format_1_store(root, adapter)
    assert main(["inspect", str(root)]) == 1
    assert f"mmstore upgrade {root}" in capsys.readouterr().err
    assert main(["upgrade", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files_committed"] == 6
    assert main(["upgrade", str(root)]) == 0
    assert "format-2 store already" in capsys.readouterr().out


def test_upgrade_on_s3(s3_store, adapter):
    store = s3_store
    write_grpo_steps(store, adapter, run_id="r", steps=range(2), groups=1, group_size=2,
                     image_size=(96, 64))  # fmt: skip
    rows = store.rollouts()
    for prefix in ("rollouts/_delta_log", "runs"):
        store.backend.delete_tree(prefix)
    manifest = {**store.manifest, "format_version": 1}
    store.backend.write_atomic("mmstore.json", json.dumps(manifest).encode())
    with pytest.raises(mmstore.UpgradeRequiredError):
        mmstore.Store.open(store.root, s3_options=store.s3_options)
    report = mmstore.upgrade(store.root, s3_options=store.s3_options)
    assert report.files_committed == 2
    upgraded = mmstore.Store.open(store.root, s3_options=store.s3_options)
    assert upgraded.rollouts() == rows


@pytest.mark.slow  # a SIGKILL loop
def test_sigkill_at_random_points_of_upgrades_loses_nothing(tmp_path):
    """50 upgrades (one commit per file, so a kill lands between, in and after commits),
    each killed at a random moment; after every kill the store is checked: every file
    there, the table lists a sorted prefix of them once each, a format-1 store refuses to
    open, a finished one is a whole format-2 store with its pin (tests/store_workers.py)."""
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, WORKERS, "upgrade", str(root), "--trials", "50", "--seed", "5"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    print(outcome)
    assert outcome["killed"] + outcome["finished"] == 50
    assert outcome["killed"] >= 25 and outcome["upgraded"] >= 2, outcome


UPGRADER = """
import json, os, sys, time
import mmstore
root, ready, go = sys.argv[1:4]
open(ready, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.001)
report = mmstore.upgrade(root, batch_files=1)
print(json.dumps(report.to_dict()))
"""


@pytest.mark.slow  # processes racing
@pytest.mark.parametrize("trial", range(2))
def test_two_upgrades_at_once_commit_each_file_once(tmp_path, adapter, trial):
    """Two processes upgrade the same store at the same moment (one commit per file, so
    their commits interleave): each file is added by one log entry, once (it used to be
    added twice, 39-40 of 40: a live loader from version 0 trained those rows twice)."""
    root = tmp_path / "s"
    rows = format_1_store(root, adapter)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPGRADER, str(root), str(tmp_path / f"ready{i}"), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline, "the upgraders did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sum(r["files_committed"] for r in reports) == 6, reports
    store = mmstore.Store.open(root)
    added = [f.path for e in store.table.entries_after(0) for f in e.added]
    assert len(added) == len(set(added)) == 6 and added == sorted(added)
    assert store.rollouts() == rows
    report = mmstore.verify(store)
    assert report.ok, report.problems


def test_verify_reports_a_file_the_log_adds_twice(tmp_path, adapter):
    """The latest version lists the file once, yet a loader following the log trains it
    twice: verify names the file and the version that added it again."""
    root = tmp_path / "s"
    format_1_store(root, adapter)
    mmstore.upgrade(root)
    store = mmstore.Store.open(root)
    first = store.table.log_entry(1)
    again = store.backend.read("rollouts/_delta_log/00000000000000000001.json")
    latest = store.table.latest_version()
    name = f"rollouts/_delta_log/{latest + 1:020d}.json"
    store.backend.write_atomic(
        name, again.replace(b'"mmstore.commitId":"', b'"mmstore.commitId":"x')
    )
    store = mmstore.Store.open(root)
    assert len(store.files()) == len(first.added)  # the version lists each once
    report = mmstore.verify(store)
    twice = [p for p in report.problems if p.kind == "file_added_twice"]
    assert not report.ok and sorted(p.file for p in twice) == sorted(f.path for f in first.added)
    assert all(f"log version {latest + 1}" in p.message for p in twice)
