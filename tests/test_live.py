"""The live loader: steps from the commit log as it grows, exactly once across SIGKILL,
groups whole, staleness bounded and counted, ranks disjoint without talking."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import mmstore
from mmstore._planning.live import UNKNOWN, take_step
from mmstore._rows.table import TABLE_SCHEMA
from mmstore.errors import GroupTooLarge
from tests import live_workers
from tests.live_workers import (
    BATCH_SIZE,
    RUN,
    commit_plan,
    commit_rows,
    live_loader,
    make_row,
    train,
)

HERE = Path(__file__).resolve().parent


def _commit_order(store: mmstore.Store, runs: set[str]) -> list[str]:
    """Sample ids of ``runs`` in commit order: log version, file, row."""
    ids = []
    for entry in store.table.entries_after(-1):
        for file in entry.added:
            if file.run_id in runs:
                table = pq.read_table(store.backend.abspath(file.path), columns=["sample_id"])
                ids += table.column(0).to_pylist()
    return ids


def _write(store, adapter, plan):
    return [sid for commit in plan for sid in commit_rows(store, adapter, commit)]


# -- the step rule, as a pure function --------------------------------------------------


def test_take_step_fills_whole_groups_and_waits_for_more():
    sizes, unknown = np.array([3, 3, 2, 4]), np.full(4, UNKNOWN)
    # 3 + 3 = 6; the next group of 2 would fit (8), then 4 would overflow: waits.
    take = take_step(sizes, unknown, target=8, oldest=None)
    assert (take.consumed, take.trained, take.stale) == (3, (0, 1, 2), ())
    # 3 + 3, then 4 overflows 8: the step is complete at 6 and the group of 4 waits.
    take = take_step(np.array([3, 3, 4]), np.full(3, UNKNOWN), target=8, oldest=None)
    assert (take.consumed, take.trained) == (2, (0, 1))
    # Not enough committed yet, and nothing that proves the step complete: wait.
    assert take_step(np.array([3, 3]), np.full(2, UNKNOWN), target=8, oldest=None) is None
    assert take_step(np.array([], np.int64), np.array([], np.int64), target=8, oldest=0) is None
    with pytest.raises(GroupTooLarge) as err:
        take_step(np.array([2, 9]), np.full(2, UNKNOWN), target=8, oldest=None)
    assert (err.value.index, err.value.size) == (1, 9)


def test_take_step_drops_stale_groups_and_never_unknown_ones():
    sizes = np.array([2, 2, 2, 2, 2])
    policies = np.array([1, UNKNOWN, 3, 0, 5])
    take = take_step(sizes, policies, target=4, oldest=3)
    # group 0 (policy 1) is stale; 1 (unknown) and 2 (3 = oldest) are trained: 4 samples.
    assert (take.consumed, take.trained, take.stale) == (3, (1, 2), (0,))
    take = take_step(sizes[3:], policies[3:], target=4, oldest=3)
    assert take is None  # policy 0 stale, then only 2 fresh samples: wait
    take = take_step(sizes[3:], policies[3:], target=2, oldest=3)
    assert (take.consumed, take.trained, take.stale) == (2, (1,), (0,))


# -- one process ---------------------------------------------------------------------------


def test_live_steps_in_commit_order_packed_and_padded(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    _write(store, adapter, commit_plan(1, 10, other_every=3))
    order = _commit_order(store, {RUN})
    for options in ({}, {"max_tokens": None}):
        live = live_loader(store, max_staleness=None, **options)
        trained = []
        while True:
            try:
                step = live.next_step(timeout=0)
            except mmstore.LiveTimeoutError:
                break
            for batch in step:
                ids = live_workers.micro_record(batch)[3]
                assert batch["num_micro"] >= 1 and batch["step"] == live.step
                trained.append(ids)
        flat = [s for ids in trained for s in ids]
        # Packed micro-batches reorder within a step; the steps are commit-order prefixes.
        assert sorted(flat) == sorted(order[: len(flat)]) and len(set(flat)) == len(flat)
        assert len(order) - len(flat) < BATCH_SIZE  # only an incomplete last step waits
        assert live.stats()["samples"] == len(flat)
        if options:  # padded: one batch per step, rows in commit order
            assert flat == order[: len(flat)]
        live.close()


def test_groups_are_never_split_and_a_step_may_be_smaller(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    plan = [
        {"run": RUN, "seq": 0, "policy": 0, "delay": 0, "groups": [{"size": 3, "image": True}]},
        {"run": RUN, "seq": 1, "policy": 0, "delay": 0, "groups": [{"size": 2, "image": False}]},
        {"run": RUN, "seq": 2, "policy": 0, "delay": 0, "groups": [{"size": 4, "image": True}]},
    ]
    _write(store, adapter, plan)
    live = live_loader(store, max_tokens=None)
    steps = [[b["sample_ids"] for b in live.next_step(timeout=5)] for _ in range(2)]
    # 3 then 2 would overflow 4: step 0 is the group of 3 alone; step 1 the 2, then the 4
    # waits (2 + 4 > 4): step 1 is the group of 2.
    assert steps == [[["c0-g0-0", "c0-g0-1", "c0-g0-2"]], [["c1-g0-0", "c1-g0-1"]]]
    assert [b["sample_ids"] for b in live.next_step(timeout=5)] == [
        [f"c2-g0-{k}" for k in range(4)]
    ]
    _write(store, adapter, [{**plan[0], "seq": 3, "groups": [{"size": 5, "image": False}]}])
    with pytest.raises(mmstore.InvalidArgumentError, match="never split") as err:
        live.next_step(timeout=5)
    assert err.value.run_id == RUN and err.value.step == 3


def test_timeout_consumes_nothing_and_waiting_goes_on(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    group = {"size": 2, "image": False}
    first = {"run": RUN, "seq": 0, "policy": 0, "delay": 0, "groups": [group]}
    live = live_loader(store, max_tokens=None)  # the run does not exist yet
    with pytest.raises(mmstore.LiveTimeoutError) as err:
        live.next_step(timeout=0.05)
    assert err.value.step == 0 and isinstance(err.value, TimeoutError)
    _write(store, adapter, [first])  # half a step
    with pytest.raises(mmstore.LiveTimeoutError, match="2 sample"):
        live.next_step(timeout=0.05)
    state = live.state_dict()
    assert state["step"] == 0 and state["cursor"][:2] == [1, 0]  # nothing consumed
    _write(store, adapter, [{**first, "seq": 1}])
    (batch,) = live.next_step(timeout=5)
    assert batch["sample_ids"] == ["c0-g0-0", "c0-g0-1", "c1-g0-0", "c1-g0-1"]
    assert live.step == 1 and live.stats()["samples"] == 4


@pytest.mark.parametrize("timeout", ["abc", [1], True, -1, float("inf"), float("nan")])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(tmp_path, timeout):
    """Issue 39.15: NaN waited forever, 'abc' and [1] raised bare ValueError/TypeError,
    True was taken as 1 s."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    live = live_loader(store, max_tokens=None)
    with pytest.raises(mmstore.InvalidArgumentError, match="timeout must be a finite number"):
        live.next_step(timeout=timeout)
    with pytest.raises(mmstore.LiveTimeoutError):  # nothing consumed; it waits on
        live.next_step(timeout=0)
    assert live.step == 0


def test_an_abandoned_step_is_not_consumed(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    _write(store, adapter, commit_plan(3, 6, other_every=0))
    live = live_loader(store, max_tokens=64 * 4)  # several micro-batches a step
    it = live.next_step(timeout=5)
    first = next(it)
    del it  # the trainer stopped mid-step (an exception, a preemption)
    assert live.step == 0
    again = list(live.next_step(timeout=5))
    assert live_workers.micro_record(again[0]) == live_workers.micro_record(first)
    assert live.step == 1


def test_staleness_drops_exactly_the_old_groups_and_counts_them(tmp_path, small_processor, caplog):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    plan = [
        {"run": RUN, "seq": c, "policy": p, "delay": 0, "groups": [{"size": 2, "image": False}]}
        for c, p in enumerate([0, 5, 1, 6, 7, 2, 8])
    ]
    _write(store, adapter, plan)
    # Rows that record no policy version: unknown, never stale.
    with store.writer(RUN, 99) as w:
        w.write_many(
            [live_workers.make_row(adapter, [], f"old-{k}", group_id="o") for k in range(2)]
        )
    live = live_loader(store, max_tokens=None, max_staleness=2)
    caplog.set_level(logging.DEBUG, logger="mmstore.live")
    (a,) = live.next_step(policy_version=7, timeout=5)  # oldest allowed: 5
    assert a["sample_ids"] == ["c1-g0-0", "c1-g0-1", "c3-g0-0", "c3-g0-1"]
    assert (a["stale_groups"], a["stale_samples"], a["policy_version"]) == (2, 4, 7)
    (b,) = live.next_step(policy_version=7, timeout=5)
    assert b["sample_ids"] == ["c4-g0-0", "c4-g0-1", "c6-g0-0", "c6-g0-1"]  # c5: policy 2
    assert (b["stale_groups"], b["stale_samples"]) == (1, 2)
    stats = live.stats()
    assert (stats["stale_groups"], stats["stale_samples"], stats["samples"]) == (3, 6, 8)
    named = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(named) == 3 and all("policy version" in m for m in named)
    assert "step 0" in named[0] and "policy version 0" in named[0]
    # Only the policy-less group is left: half a step, never stale.
    with pytest.raises(mmstore.LiveTimeoutError, match="2 sample"):
        live.next_step(policy_version=1000, timeout=0)


def test_state_resumes_in_a_new_loader_and_refuses_other_runs(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    _write(store, adapter, commit_plan(4, 12))
    reference = live_loader(store)
    whole = train(reference, 6)
    first = live_loader(store)
    head = train(first, 3)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    second = live_loader(store, num_workers=2)
    second.load_state_dict(state)
    assert head + train(second, 6) == whole
    assert second.stats() == reference.stats()
    second.close()
    with pytest.raises(mmstore.InvalidArgumentError, match="follows runs"):
        live_loader(store, runs=["other"]).load_state_dict(state)
    # The steps to come may take another shape: the position and the counts carry over.
    wider = live_loader(store, batch_size=8)
    wider.load_state_dict(state)
    assert wider.step == 3 and wider.stats()["samples"] == first.stats()["samples"]
    with pytest.raises(mmstore.InvalidArgumentError, match="cursor"):
        live_loader(store).load_state_dict({**state, "cursor": [1, -1, 0]})
    with pytest.raises(mmstore.InvalidArgumentError, match="not a LiveLoader state"):
        live_loader(store).load_state_dict({"version": 2, "epoch": 0})


def test_a_file_laid_out_for_another_processor_is_refused_by_name(tmp_path, small_processor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    store = mmstore.Store.open(tmp_path / "s", create=True)
    other = mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=128 * 28 * 28))
    plan = [{"run": RUN, "seq": 0, "policy": 0, "delay": 0, "groups": [{"size": 4, "image": True}]}]
    _write(store, other, plan)
    live = live_loader(store)
    for _ in range(2):  # refused again on every call: never skipped, so never lost
        with pytest.raises(mmstore.LayoutMismatchError) as err:
            live.next_step(timeout=5)
        assert err.value.runs == [RUN]
    assert live.state_dict()["cursor"] == [1, 0, 0]


def test_a_damaged_followed_file_is_refused_by_name_and_nothing_before_it_is_lost(
    tmp_path, small_processor
):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    group = {"size": 4, "image": False}
    plan = [{"run": RUN, "seq": c, "policy": 0, "delay": 0, "groups": [group]} for c in (0, 1)]
    _write(store, adapter, plan)
    damaged = store.files()[-1].path
    path = store.backend.abspath(damaged)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])  # its footer gone
    live = live_loader(store, max_tokens=None, batch_size=8)
    for _ in range(2):
        with pytest.raises(mmstore.CorruptFileError) as err:
            live.next_step(timeout=5)
        assert err.value.file == damaged
    assert live.state_dict()["cursor"] == [1, 0, 0]  # the good file before it still waits
    Path(path).write_bytes(data)  # repaired (restored from a copy)
    (batch,) = live.next_step(timeout=5)
    assert len(batch["sample_ids"]) == 8


def test_policy_version_is_a_column_every_reader_sees(tmp_path, small_processor, capsys):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    plan = [
        {"run": RUN, "seq": 0, "policy": 7, "delay": 0, "groups": [{"size": 2, "image": False}]}
    ]
    _write(store, adapter, plan)
    with pytest.raises(mmstore.InvalidRolloutError, match="policy_version"):
        mmstore.Rollout(**{**store.rollouts(RUN)[0].model_dump(), "policy_version": -1})
    assert [r.policy_version for r in store.rollouts(RUN)] == [7, 7]
    frame = mmstore.debug.scan(store).select("policy_version").collect()
    assert frame["policy_version"].to_list() == [7, 7]
    from mmstore import cli

    assert cli.main(["inspect", str(tmp_path / "s"), "--sample", "c0-g0-1"]) == 0
    assert "policy version 7" in capsys.readouterr().out
    from deltalake import DeltaTable

    delta = DeltaTable(str(tmp_path / "s" / "rollouts")).to_pyarrow_table()
    assert delta.column("policy_version").to_pylist() == [7, 7]


def test_a_table_made_before_the_column_gets_it_on_the_next_write(tmp_path, small_processor):
    from deltalake import DeltaTable, Schema

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    uri = str(tmp_path / "s" / "rollouts")
    # Rebuild the table as the previous release made it: no policy_version column.
    shutil.rmtree(uri)
    old = pa.schema([f for f in TABLE_SCHEMA if f.name != "policy_version"])
    DeltaTable.create(uri, Schema.from_arrow(old), partition_by=["run_id", "step"])
    store = mmstore.Store.open(tmp_path / "s")
    plan = [
        {"run": RUN, "seq": 0, "policy": 3, "delay": 0, "groups": [{"size": 2, "image": False}]}
    ]
    _write(store, adapter, plan)
    assert DeltaTable(uri).to_pyarrow_table().column("policy_version").to_pylist() == [3, 3]


def test_in_flight_samples_survive_a_restart_as_a_pinned_run(tmp_path, small_processor):
    """The recipe of docs/live.md: finished-but-unconsumed samples are committed to a run
    the trainer does not follow, pinned with the checkpoint; a teardown's gc keeps them and
    their media; after the restart they are read back, committed where the trainer reads,
    and trained exactly once."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    group = {"size": 2, "image": True}
    _write(store, adapter, [{"run": RUN, "seq": 0, "policy": 0, "delay": 0, "groups": [group]}])
    pending = [{"run": "pending-ckpt-0", "seq": 1, "policy": 0, "delay": 0, "groups": [group]}]
    held = _write(store, adapter, pending)
    mmstore.pin_rows(store, "ckpt-0", runs=["pending-ckpt-0"])
    with pytest.raises(mmstore.PinnedRowsError):
        mmstore.release_run(store, "pending-ckpt-0", grace_seconds=0)
    live = live_loader(store, max_tokens=None)
    with pytest.raises(mmstore.LiveTimeoutError):  # the pending run is not followed
        live.next_step(timeout=0)
    state = live.state_dict()
    mmstore.gc(store, grace_seconds=0)  # the teardown

    back = store.rollouts("pending-ckpt-0")  # after the restart
    assert [r.sample_id for r in back] == held
    with store.writer(RUN, 2, producer="sampler", seq=2) as w:
        w.write_many(back)
    resumed = live_loader(store, max_tokens=None)
    resumed.load_state_dict(state)
    (batch,) = resumed.next_step(timeout=5)  # images materialize: their media was kept
    assert sorted(batch["sample_ids"]) == sorted(["c0-g0-0", "c0-g0-1", *held])
    assert batch["images_missing"] == 0
    mmstore.unpin(store, "ckpt-0")
    mmstore.release_run(store, "pending-ckpt-0", grace_seconds=0)


# -- processes -----------------------------------------------------------------------------


def _producer(tmp_path, root, plan):
    """A producer process committing ``plan`` (random small delays) to the store at root."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    command = [sys.executable, str(HERE / "live_workers.py"), "produce", str(root)]
    return subprocess.Popen([*command, str(plan_file)])


@pytest.mark.slow
def test_consumer_follows_a_producer_process_exactly_once_in_commit_order(
    tmp_path, small_processor
):
    root = tmp_path / "s"
    store = mmstore.Store.open(root, create=True)
    producer = _producer(tmp_path, root, commit_plan(7, 30))
    live = live_loader(store, max_staleness=None, num_workers=2)
    trained = []
    try:
        while True:
            done = producer.poll() is not None  # then every commit is in the log
            try:
                step = live.next_step(timeout=0 if done else 1)
            except mmstore.LiveTimeoutError:
                if done:
                    break
                continue
            trained += [s for b in step for s in live_workers.micro_record(b)[3]]
    finally:
        live.close()
        assert producer.wait(timeout=120) == 0
    order = _commit_order(store, {RUN})
    assert len(set(trained)) == len(trained)
    assert sorted(trained) == sorted(order[: len(trained)])
    assert len(order) - len(trained) < BATCH_SIZE


@pytest.mark.slow
@pytest.mark.parametrize("agents", [False, True], ids=["groups", "agents"])
def test_sigkill_of_the_consumer_at_random_points_loses_and_repeats_nothing(
    tmp_path, small_processor, agents
):
    """With ``agents``, trajectories are committed turn by turn among the groups and
    trained whole (``done_column``): the cursor waits at held ones while later groups go."""
    root = tmp_path / "s"
    store = mmstore.Store.open(root, create=True)
    producer = _producer(tmp_path, root, commit_plan(11, 40, agents=agents))
    out = tmp_path / "ckpt.json"
    steps = 16
    options = {"done_column": "done"} if agents else {}
    killed = subprocess.run(
        [
            sys.executable,
            str(HERE / "live_workers.py"),
            "kills",
            str(root),
            str(out),
            str(steps),
            "5",
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert producer.wait(timeout=120) == 0
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert int(killed.stdout.split()[-1]) >= 20
    history = json.loads(out.read_text())["history"]
    # An uninterrupted consumer of the same log, in this process:
    expected = train(live_loader(store, **options), steps)
    # What the checkpoints kept: every step once, each micro-batch as an uninterrupted
    # consumer built it (micro-batches of a step killed before its checkpoint are redone).
    assert history == expected
    if agents:  # each trajectory in one step, all its turns
        step_of: dict[str, set[int]] = {}
        for step, _, _, ids, _ in history:
            for sample_id in ids:
                if "-t" in sample_id:
                    step_of.setdefault(sample_id.rsplit("-t", 1)[0], set()).add(step)
        assert step_of and all(len(s) == 1 for s in step_of.values())
        turns = [r.sample_id for r in store.rollouts(RUN) if "-t" in r.sample_id]
        trained = {s for *_, ids, _ in history for s in ids}
        finished = {s.rsplit("-t", 1)[0] for s in turns if s in trained}
        assert {s for s in turns if s.rsplit("-t", 1)[0] in finished} <= trained


def _rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        store = mmstore.Store.open(root)
        live = live_loader(store)  # rank and world size from the process group
        records = train(live, 6)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, records)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_take_disjoint_shares_with_equal_micro_batches(tmp_path, small_processor):
    root = tmp_path / "s"
    store = mmstore.Store.open(root, create=True)
    _write(store, mmstore.adapter_for(small_processor), commit_plan(13, 30, other_every=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks.json"
    mp.start_processes(
        _rank_main, args=(2, port, str(root), str(out)), nprocs=2, start_method="spawn"
    )
    rank0, rank1 = json.loads(out.read_text())
    one = live_loader(store, batch_size=2 * BATCH_SIZE)  # one rank taking both shares
    whole = train(one, 6)
    for step in range(6):
        mine = [r for r in rank0 if r[0] == step]
        theirs = [r for r in rank1 if r[0] == step]
        assert len(mine) == len(theirs) == mine[0][2]  # equal num_micro on both ranks
        ids0 = [s for r in mine for s in r[3]]
        ids1 = [s for r in theirs for s in r[3]]
        assert not set(ids0) & set(ids1)
        assert sorted(ids0 + ids1) == sorted(s for r in whole if r[0] == step for s in r[3])


def test_on_s3_a_waiting_loader_reads_the_next_entry_at_most_twice_a_second(
    s3_store, small_processor, monkeypatch
):
    adapter = mmstore.adapter_for(small_processor)
    plan = [{"run": RUN, "seq": 0, "policy": 0, "delay": 0, "groups": [{"size": 4, "image": True}]}]
    _write(s3_store, adapter, plan)
    live = live_loader(s3_store, max_tokens=None)
    (batch,) = live.next_step(timeout=30)
    assert batch["sample_ids"] == [f"c0-g0-{k}" for k in range(4)]
    requests = []
    backend = type(s3_store.backend)
    for name in ("read", "read_if_present", "stat", "list"):
        real = getattr(backend, name)
        monkeypatch.setattr(
            backend,
            name,
            lambda self, *a, _real=real, _name=name, **k: (
                requests.append(_name) or _real(self, *a, **k)
            ),
        )
    with pytest.raises(mmstore.LiveTimeoutError):
        live.next_step(timeout=3)
    assert "list" not in requests and 0 < len(requests) <= 2 * 3 + 2


# -- removes, and states of other tables (trust round 4) ---------------------------------


def _one_group_commits(seqs, size=2):
    return [
        {"run": RUN, "seq": s, "policy": 0, "delay": 0, "groups": [{"size": size, "image": True}]}
        for s in seqs
    ]


def _drain(live):
    trained = []
    while True:
        try:
            step = live.next_step(timeout=0)
        except mmstore.LiveTimeoutError:
            return trained
        trained += [s for b in step for s in live_workers.micro_record(b)[3]]


def test_a_released_run_is_not_trained_and_gc_does_not_wedge_the_loader(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    released = _write(store, adapter, _one_group_commits([0, 1]))
    mmstore.release_run(store, RUN, grace_seconds=0)
    mmstore.gc(store, grace_seconds=0)  # the released files' bytes are gone
    kept = _write(store, adapter, _one_group_commits([2, 3]))
    # A loader from the start of the log replays the adds and the remove: it trains only
    # what the table still holds, and never reads a collected file.
    with live_loader(store) as live:
        trained = _drain(live)
    assert sorted(trained) == sorted(kept) and not set(trained) & set(released)


def test_rows_released_while_waiting_are_dropped_and_counted(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    with live_loader(store) as live:
        _write(store, adapter, _one_group_commits([0], size=3))  # waits: a step takes 4
        with pytest.raises(mmstore.LiveTimeoutError):
            live.next_step(timeout=0)
        assert live.stats()["waiting_groups"] == 1
        mmstore.release_run(store, RUN, grace_seconds=0)
        kept = _write(store, adapter, _one_group_commits([1], size=2))
        kept += _write(store, adapter, _one_group_commits([2], size=2))
        trained = _drain(live)
        assert trained == kept
        assert live.stats()["removed_samples"] == 3
        state = live.state_dict()
    with live_loader(store) as resumed:  # a resume counts them as the run did
        resumed.load_state_dict(state)
        assert resumed.stats()["removed_samples"] == 3


def test_a_state_of_another_store_or_beyond_the_log_is_refused(tmp_path, small_processor):
    adapter = mmstore.adapter_for(small_processor)
    stores = [mmstore.Store.open(tmp_path / name, create=True) for name in ("a", "b")]
    for store in stores:
        _write(store, adapter, _one_group_commits([0, 1, 2]))
    with live_loader(stores[0]) as live:
        assert list(live.next_step(timeout=5))
        state = live.state_dict()
    assert state["step"] == 1
    assert state["table"] and isinstance(state["table"], str)
    with live_loader(stores[1]) as other:
        with pytest.raises(mmstore.InvalidArgumentError, match="another table"):
            other.load_state_dict(state)
        far = {**state, "table": None, "cursor": [10**9, 0, 0]}
        with pytest.raises(mmstore.InvalidArgumentError, match="beyond"):
            other.load_state_dict(far)
    # A copy of the store is the same table: its state resumes there.
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    with live_loader(mmstore.Store.open(tmp_path / "copy")) as copy:
        copy.load_state_dict(state)
        assert copy.step == state["step"]


def test_the_remedy_an_error_names_resumes_the_run(tmp_path, small_processor):
    # A group larger than a step: the error says to raise batch_size, and a loader built
    # with it takes the saved state (only the followed runs must stay the same).
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    first = _write(store, adapter, _one_group_commits([0], size=4))
    big = _write(store, adapter, _one_group_commits([1], size=6))
    with live_loader(store, max_tokens=None) as live:
        assert [s for b in live.next_step(timeout=5) for s in b["sample_ids"]] == first
        with pytest.raises(mmstore.InvalidArgumentError, match="raise batch_size"):
            live.next_step(timeout=5)
        state = live.state_dict()
    with live_loader(store, max_tokens=None, batch_size=6) as fixed:
        fixed.load_state_dict(state)
        assert [s for b in fixed.next_step(timeout=5) for s in b["sample_ids"]] == big
    with (
        live_loader(store, runs=[RUN, "other"]) as other_runs,
        pytest.raises(mmstore.InvalidArgumentError, match="runs"),
    ):
        other_runs.load_state_dict(state)


def test_the_max_len_an_over_long_sample_names_resumes_the_run(tmp_path, small_processor):
    # A sample over max_tokens: the error names a max_len that truncates it, and a loader
    # built with that max_len takes the saved state and trains the step, truncated.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    ids = _write(store, adapter, _one_group_commits([0, 1], size=2))
    lengths = [len(r.tokens) for r in store.rollouts()]
    max_tokens = max(lengths) - 2
    with live_loader(store, max_tokens=max_tokens) as live:
        with pytest.raises(mmstore.SampleTooLongError, match=r"set max_len <= \d+") as err:
            list(live.next_step(timeout=5))
        assert live.step == 0
        state = live.state_dict()
    max_len = int(re.search(r"max_len <= (\d+)", str(err.value))[1])
    settings = mmstore.Materialize(dtype="float32", node_cache_bytes=0, max_len=max_len)
    with live_loader(store, max_tokens=max_tokens, materialize=settings) as fixed:
        fixed.load_state_dict(state)
        batches = list(fixed.next_step(timeout=5))
        trained = [s for b in batches for s in live_workers.micro_record(b)[3]]
        assert sorted(trained) == sorted(ids) and fixed.step == 1
        assert all(b["input_ids"].shape[-1] <= max_tokens for b in batches)


def test_a_dead_worker_is_a_typed_error_and_the_step_is_replayed(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    _write(store, adapter, _one_group_commits(range(6), size=2))
    with live_loader(store, max_tokens=40, num_workers=1) as live:
        step = live.next_step(timeout=10)
        first = live_workers.micro_record(next(step))
        assert first[2] > 1  # the step has more micro-batches to come
        for worker in live._loader._iterator._workers:  # the OOM killer's way
            os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(mmstore.WorkerDiedError, match="next_step again"):
            list(step)
        assert live.step == 0  # not consumed
        again = [live_workers.micro_record(b) for b in live.next_step(timeout=10)]
        assert again[0] == first and live.step == 1


def test_a_final_commit_ends_the_run_with_a_short_step_and_totals(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    first, second = (_write(store, adapter, _one_group_commits([s], size=4)) for s in (0, 1))
    rows = [make_row(adapter, [], f"last-{k}", group_id="g") for k in range(4)]
    with live_loader(store, batch_size=6, max_tokens=None) as live:
        # 4 + 4 overflows 6: step 0 is the first group; then 4 wait, and more may come.
        assert [s for b in live.next_step(timeout=5) for s in b["sample_ids"]] == first
        with pytest.raises(mmstore.LiveTimeoutError):
            live.next_step(timeout=0)
        with store.writer(RUN, 2, final=True) as w:
            w.write_many(rows)
        assert [s for b in live.next_step(timeout=5) for s in b["sample_ids"]] == second
        (batch,) = list(live.next_step(timeout=5))  # the producer is done: a short step
        assert batch["sample_ids"] == [r.sample_id for r in rows]
        assert batch["step_samples"] == 4
        assert batch["step_loss_tokens"] == int(batch["loss_mask"].sum()) > 0
        assert live.finished
        with pytest.raises(mmstore.LiveFinishedError):
            live.next_step(timeout=5)
        state = live.state_dict()
    with live_loader(store, batch_size=6, max_tokens=None) as resumed:
        resumed.load_state_dict(state)
        assert resumed.finished


def test_a_short_steps_totals_count_every_ranks_share(tmp_path, small_processor):
    # The totals a loss divides by are the step's, across ranks: each rank reads them from
    # the log alone, so ranks holding different shares report the same totals.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    rows = [make_row(adapter, [], f"s-{k}", group_id=f"g{k // 2}") for k in range(4)]
    with store.writer(RUN, 0, final=True) as w:
        w.write_many(rows)
    shares = []
    for rank in (0, 1):
        with live_loader(store, batch_size=6, max_tokens=None, rank=rank, world_size=2) as live:
            shares.append(list(live.next_step(timeout=5)))
    ids = [[s for b in share for s in b["sample_ids"]] for share in shares]
    assert sorted(ids[0] + ids[1]) == sorted(r.sample_id for r in rows) and all(ids)
    loss_tokens = sum(int(b["loss_mask"].sum()) for share in shares for b in share)
    for batch in (b for share in shares for b in share):
        assert (batch["step_samples"], batch["step_loss_tokens"]) == (4, loss_tokens)
    assert all(int(share[0]["loss_mask"].sum()) < loss_tokens for share in shares)


def test_on_s3_an_idle_poll_is_one_request(s3_store, small_processor):
    # Counted on the wire: boto3's sends, and every call into pyarrow's S3 file system (its
    # failed open of a missing key was asked again with a HEAD and a LIST).
    adapter = mmstore.adapter_for(small_processor)
    _write(s3_store, adapter, _one_group_commits([0], size=4))
    with live_loader(s3_store, max_tokens=None, poll_interval=0.25) as live:
        assert list(live.next_step(timeout=30))
        backend = s3_store.table.storage.backend
        assert backend.conditional_put  # boto3, the s3 extra
        sent, arrow_calls = [], []
        backend._client.meta.events.register(
            "before-send.s3", lambda request, **_: sent.append(request.method)
        )
        real_fs = backend.fs

        class CountingFS:
            def __getattr__(self, name):
                arrow_calls.append(name)
                return getattr(real_fs, name)

        backend.fs = CountingFS()
        try:
            with pytest.raises(mmstore.LiveTimeoutError):
                live.next_step(timeout=2)
        finally:
            backend.fs = real_fs
    polls = 2 / 0.25
    assert arrow_calls == [] and set(sent) == {"GET"}
    assert 0 < len(sent) <= polls + 2


# -- a forged row: every rank decides alike (trust round 4, item 11) ----------------------


def _forged_step(tmp_path):
    """A store whose followed run holds one file of a two-sample step: a valid row, then (in
    rank 1's share) a row whose image span holds a wrong token, as another engine could
    commit it."""
    from tests.test_reader_trust import forge
    from tests.test_reader_trust import make_row as dict_row

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(live_workers.processor())
    media = [store.put_media(live_workers.image_bytes(0, 96, 64), ext="png")]
    good, bad = dict_row(adapter, media, "good"), dict_row(adapter, media, "bad")
    good["group_id"], bad["group_id"] = "g0", "g1"
    bad["tokens"][bad["images"][0]["offset"] + 1] = 7  # inside the span
    path = forge(store, adapter, [good, bad], run=RUN)
    return store, path


@pytest.mark.parametrize("max_tokens", [None, live_workers.MAX_TOKENS], ids=["padded", "packed"])
def test_a_forged_row_in_one_ranks_share_stops_every_rank_alike(tmp_path, max_tokens):
    """Rank 0's share is valid, rank 1's holds the forged row: both raise the same typed error
    at step 0, on every call, and neither trains (a rank that trained would wait for the
    other in its next collective). Releasing the run lets both go on, alike."""
    store, path = _forged_step(tmp_path)
    ranks = [
        live_loader(store, batch_size=1, rank=r, world_size=2, max_tokens=max_tokens)
        for r in range(2)
    ]
    for _ in range(2):  # the same answer again: the file stays first in line
        for live in ranks:
            with pytest.raises(mmstore.InvalidRolloutError) as info:
                live.next_step(timeout=5)
            ctx = info.value.context
            assert (ctx["file"], ctx["run_id"], ctx["sample_id"]) == (path, RUN, "bad")
            assert live.step == 0 and live.stats()["samples"] == 0
    mmstore.release_run(store, RUN, grace_seconds=0)
    for live in ranks:
        with pytest.raises(mmstore.LiveTimeoutError):
            live.next_step(timeout=0)
        assert live.stats()["removed_samples"] == 2
        live.close()


# -- a released final commit; released rows never seen (found by the kill tests) ----------


def test_a_resume_past_a_released_final_commit_ends_and_counts_as_the_uninterrupted_run(
    tmp_path,
):
    """Run B's final commit is released: a loader that saw it before the release and one
    resumed from a state taken before it both learn that B ended (from the log: the file is
    gone) and train A's last short step; and both count B's rows as removed, the resumed
    one from the log's row counts (it never saw the rows)."""
    from tests.store_workers import small_adapter

    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = small_adapter()

    def commit(run, step, ids, final=False):
        with store.writer(run, step, final=final) as w:
            w.write_many([make_row(adapter, [], s, group_id=s) for s in ids])

    def loader():
        return mmstore.LiveLoader(
            store, live_workers.processor(), runs=["A", "B"], batch_size=8, max_tokens=None
        )

    def drain(live):
        out = []
        while True:
            try:
                out += [s for b in live.next_step(timeout=2) for s in b["sample_ids"]]
            except mmstore.LiveFinishedError:
                return sorted(out), live.stats()["removed_samples"]

    commit("A", 0, ["a0", "a1"])
    live = loader()
    with pytest.raises(mmstore.LiveTimeoutError):
        live.next_step(timeout=0)
    state = live.state_dict()
    commit("B", 0, ["b0", "b1"], final=True)
    with pytest.raises(mmstore.LiveTimeoutError):
        live.next_step(timeout=0)
    mmstore.release_run(store, "B", grace_seconds=0)
    commit("A", 1, ["a2"], final=True)
    expected = (["a0", "a1", "a2"], 2)
    assert drain(live) == expected
    resumed = loader()
    resumed.load_state_dict(state)
    assert drain(resumed) == expected


def _forged_rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        live = live_loader(mmstore.Store.open(root), batch_size=1)  # rank, world from gloo
        try:
            live.next_step(timeout=10)
            outcome = ["trained", live.step]
        except mmstore.MmstoreError as exc:
            outcome = [type(exc).__name__, exc.context.get("sample_id")]
        live.close()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, outcome)  # a rank that trained would hang here
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_reach_the_same_decision_on_a_forged_row(tmp_path):
    """Item 11 with real torch.distributed ranks: both raise the same typed error naming
    the forged sample, and both reach the next collective."""
    store, _ = _forged_step(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "decisions.json"
    mp.start_processes(
        _forged_rank_main,
        args=(2, port, str(store.root), str(out)),
        nprocs=2,
        start_method="spawn",
    )
    assert json.loads(out.read_text()) == [["InvalidRolloutError", "bad"]] * 2
