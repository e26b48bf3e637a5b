"""Format 2: readers read one table version. Datasets name theirs, loader states record it,
a resume reads exactly it, and the ranks of a job agree on it (real gloo processes)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._loading import ranks
from mmstore.synth import write_grpo_steps

SMALL = 256 * 28 * 28
IMAGE = (96, 64)


def write(store, adapter, run_id, steps, **kw):
    kw = {"groups": 2, "group_size": 3, "images_per_sample": 1, "image_size": IMAGE, **kw}
    return write_grpo_steps(store, adapter, run_id=run_id, steps=steps, row_group_size=2, **kw)


def ids(loader):
    return [sid for batch in loader for sid in batch["sample_ids"]]


@pytest.fixture
def two_runs(tmp_path, adapter):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write(store, adapter, "a", [0, 1])
    write(store, adapter, "b", [0])
    return store


# -- a dataset reads one version -------------------------------------------------------------


def test_a_dataset_reads_the_latest_version_or_the_one_it_names(two_runs, small_processor):
    store = two_runs
    assert store.table.latest_version() == 3
    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False)
    assert ds.version == 3 and isinstance(ds.version, int)
    assert list(ds.snapshot.files) == [f.path for f in store.files()]
    old = mmstore.RolloutDataset(store, small_processor, shuffle=False, version=1)
    assert old.version == 1
    assert list(old.snapshot.files) == [f.path for f in store.files(1)]
    assert {f.run_id for f in store.files(1)} == {"a"} and len(old) == 6
    with pytest.raises(mmstore.TableVersionError, match="no version 9"):
        mmstore.RolloutDataset(store, small_processor, version=9)
    with pytest.raises(mmstore.InvalidArgumentError, match="version"):
        mmstore.RolloutDataset(store, small_processor, version=-1)


def test_files_committed_or_released_later_do_not_change_a_version(two_runs, adapter):
    store = two_runs
    before = store.files()
    write(store, adapter, "a", [2])
    mmstore.release_run(store, "b")
    assert store.files(3) == before
    assert {f.run_id for f in store.files()} == {"a"} and len(store.files()) == 3
    assert [r.sample_id for r in store.rollouts(version=3)] == [
        r.sample_id for r in store.rollouts(run_id=["a", "b"], version=3)
    ]


def test_the_state_records_the_version_and_a_resume_reads_exactly_it(
    two_runs, adapter, small_processor
):
    """A resume after later commits and a release of another run reads exactly the saved
    version: the same files, the same batches as an uninterrupted loader."""
    store = two_runs

    def loader():
        ds = mmstore.RolloutDataset(store, small_processor, seed=3, dtype=torch.float32)
        return mmstore.RolloutLoader(ds, batch_size=4)

    reference = ids(loader())
    first = loader()
    head = [sid for _, b in zip(range(2), first, strict=False) for sid in b["sample_ids"]]
    state = first.state_dict()
    assert state["table_version"] == 3 and state["files"] == list(first.dataset.snapshot.files)
    assert first.dataset.state_dict()["table_version"] == 3
    # Meanwhile: more rows of run a, and run b released (its rows leave the latest version).
    write(store, adapter, "a", [5, 6])
    mmstore.release_run(store, "b")
    latest = loader()
    assert latest.dataset.version == 6
    assert "b" not in {u.run_id for u in latest.dataset.snapshot.units}
    latest.load_state_dict(state)
    assert latest.dataset.version == 3
    assert list(latest.dataset.snapshot.files) == state["files"]
    assert head + ids(latest) == reference
    # The dataset's own state resumes the same way.
    ds = mmstore.RolloutDataset(store, small_processor, seed=3, dtype=torch.float32)
    ds.load_state_dict(first.dataset.state_dict())
    assert ds.version == 3 and list(ds.snapshot.files) == state["files"]


def test_a_state_naming_a_file_its_version_does_not_list_is_refused(two_runs, adapter,
                                                                    small_processor):  # fmt: skip
    store = two_runs
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    state = loader.state_dict()
    write(store, adapter, "a", [7])
    newer = [f.path for f in store.files() if f.step == 7]
    with pytest.raises(mmstore.InvalidArgumentError, match="version 3 of the rollouts table"):
        loader.load_state_dict({**state, "files": state["files"] + newer})
    with pytest.raises(mmstore.TableVersionError):
        loader.load_state_dict({**state, "table_version": 99})
    loader.load_state_dict({**state, "table_version": 4, "files": state["files"] + newer})
    assert loader.dataset.version == 4


def test_a_first_format_state_is_read_against_the_latest_version(two_runs, small_processor):
    store = two_runs
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    state = loader.state_dict()
    old = {k: v for k, v in state.items() if k != "table_version"} | {"version": 1}
    loader.load_state_dict(old)
    assert loader.dataset.version == 3 and list(loader.dataset.snapshot.files) == state["files"]


def test_a_resume_whose_files_gc_deleted_says_to_pin_the_version(two_runs, adapter,
                                                                 small_processor):  # fmt: skip
    store = two_runs
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    state = loader.state_dict()
    mmstore.release_run(store, "b", grace_seconds=0)  # no grace: b's bytes go now
    fresh = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    with pytest.raises(mmstore.InvalidArgumentError, match="pin") as err:
        fresh.load_state_dict(state)
    assert "run_id=b" in err.value.file


# -- ranks agree (real gloo processes) -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keep_committing(root: str, stop: str) -> None:
    """A rollout writer committing one small step after another until ``stop`` exists."""
    store = mmstore.Store.open(root)
    adapter = mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=SMALL))
    step = 100
    while not os.path.exists(stop):
        write(store, adapter, "d", [step], groups=1, group_size=2)
        step += 1
        time.sleep(0.02)


def _rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        store = mmstore.Store.open(root)
        processor = Qwen2VLImageProcessorPil(max_pixels=SMALL)
        mmstore.adapter_for(processor)  # warm: rank 0 reads the latest version right away
        start = [store.table.latest_version()]
        dist.broadcast_object_list(start, src=0)
        if rank == 1:  # built later: only after the writer committed several more
            while store.table.latest_version() < start[0] + 10:
                time.sleep(0.01)
        seen = store.table.latest_version()
        ds = mmstore.RolloutDataset(store, processor, seed=1, dtype=torch.float32)
        loader = mmstore.RolloutLoader(ds, batch_size=2)
        even = mmstore.RolloutLoader(ds, batch_size=2, even_ranks=True)
        packed = mmstore.RolloutLoader(ds, batch_size=4, max_tokens=4096)
        report = {
            "seen": seen,
            "version": ds.version,
            "files": list(ds.snapshot.files),
            "len": len(even),
            "num_micro": len(packed),
            "ids": ids(loader),
        }
        state = loader.state_dict()
        # A forged disagreement: rank 1 loads a state of another version.
        if rank == 1:
            state = {**state, "table_version": state["table_version"] - 1}
            state["files"] = [f.path for f in store.files(state["table_version"])]
        try:
            loader.load_state_dict(state)
            report["forged"] = "loaded"
        except mmstore.VersionMismatchError as exc:
            report["forged"] = type(exc).__name__
        # Versions given explicitly must agree too.
        try:
            mmstore.RolloutDataset(store, processor, version=report["version"] - rank)
            report["explicit"] = "built"
        except mmstore.VersionMismatchError:
            report["explicit"] = "VersionMismatchError"
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_built_while_a_writer_commits_read_the_same_version(tmp_path, adapter):
    root = str(tmp_path / "s")
    store = mmstore.Store.open(root, create=True)
    write(store, adapter, "d", [0, 1], groups=2, group_size=4)
    stop = str(tmp_path / "stop")
    ctx = mp.get_context("spawn")
    writer = ctx.Process(target=_keep_committing, args=(root, stop))
    writer.start()
    try:
        deadline = time.monotonic() + 120
        while store.table.latest_version() < 4:  # the writer is up and committing
            assert writer.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        out = str(tmp_path / "report")
        mp.start_processes(_rank, args=(2, _free_port(), root, out), nprocs=2,
                           start_method="spawn")  # fmt: skip
    finally:
        open(stop, "w").close()
        writer.join(60)
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    # Rank 1 saw a newer latest version than the one rank 0 read: alone, they would differ.
    assert r0["seen"] <= r0["version"] == r1["version"] < r1["seen"]
    assert r0["files"] == r1["files"] == [f.path for f in store.files(r0["version"])]
    assert r0["len"] == r1["len"] and r0["num_micro"] == r1["num_micro"]
    everything = {r.sample_id for r in store.rollouts(version=r0["version"])}
    assert set(r0["ids"]) | set(r1["ids"]) == everything
    assert not set(r0["ids"]) & set(r1["ids"])
    # The forged state and the explicit versions that differ raise on both ranks.
    assert r0["forged"] == r1["forged"] == "VersionMismatchError"
    assert r0["explicit"] == r1["explicit"] == "VersionMismatchError"


def test_without_a_process_group_no_rank_is_asked(two_runs, small_processor, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no collective without torch.distributed")

    monkeypatch.setattr(ranks.dist, "all_reduce", refuse)
    ds = mmstore.RolloutDataset(two_runs, small_processor, rank=1, world_size=2)
    assert ds.version == 3


def test_a_rank_forked_after_the_parent_used_the_table_reads_the_same_version(
    two_runs, small_processor
):
    """delta-rs panics in a forked child once its runtime exists in the parent; a dataset
    built there replays the log without it and plans exactly as the parent does."""
    store = two_runs
    parent = mmstore.RolloutDataset(store, small_processor, seed=2)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            ds = mmstore.RolloutDataset(store, small_processor, seed=2)
            report = {"version": ds.version, "files": list(ds.snapshot.files), "len": len(ds)}
            os.write(write_fd, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        report = json.loads(f.read())
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert report == {"version": 3, "files": list(parent.snapshot.files), "len": len(parent)}
