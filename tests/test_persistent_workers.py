"""RolloutLoader(persistent_workers=True): the same batches as a loader that starts its
workers every pass, from the same worker processes, pass after pass.

Workers are told apart by process id: this process's children, read from ``/proc`` (a
persistent loader's workers are the children it added and kept).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import time

import pytest
import torch

import mmstore
from mmstore.synth import write_grpo_steps

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")

# How many images a worker's cache served or made: warm caches are what persistence keeps.
COUNTERS = {"cache_hits", "cache_misses", "node_cache_hits", "node_cache_misses"}
PACKED = {"padded": {}, "packed": {"max_tokens": 400}}


@pytest.fixture(scope="module")
def filled(tmp_path_factory, small_processor):
    """3 steps of GRPO groups (36 samples) in row groups of 5: ragged windows."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("persistent") / "s", create=True)
    adapter = mmstore.adapter_for(small_processor)
    for step in range(3):
        write_grpo_steps(
            store,
            adapter,
            run_id="r",
            steps=[step],
            row_group_size=5,
            groups=3,
            group_size=3 + step,
            images_per_sample=1,
            image_size=(160, 120),
        )
    return store


def loader(store, processor, *, workers=2, persistent=True, form="padded"):
    # No node cache: each loader's workers process their own images, so nothing one test's
    # loader leaves behind reaches another's.
    settings = mmstore.Materialize(dtype=torch.float32, node_cache_bytes=0)
    ds = mmstore.RolloutDataset(store, processor, seed=11, window_units=2, materialize=settings)
    extra = {"persistent_workers": True} if persistent else {}
    return mmstore.RolloutLoader(ds, batch_size=4, num_workers=workers, **PACKED[form], **extra)


def children() -> set[int]:
    """This process's living (not zombie) child processes."""
    me = os.getpid()
    return {
        pid
        for pid, (state, parent) in map(_stat, os.listdir("/proc"))
        if parent == me and state != "Z"
    }


def _stat(entry: str) -> tuple[int, tuple[str, int]]:
    """A ``/proc`` entry's process id, state and parent; ("", 0) for anything else."""
    try:
        with open(f"/proc/{entry}/stat") as f:
            state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        return int(entry), (state, int(parent))
    except (OSError, ValueError):  # not a process, or gone meanwhile
        return 0, ("", 0)


def kill(pid: int) -> None:
    """SIGKILL ``pid`` (the OOM killer's way) and wait until it can be reaped (its every
    thread gone; the thread group's leader shows as a zombie before that), not reaping it:
    that is its DataLoader's part."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still running 10 s after SIGKILL")


def equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return type(a) is type(b) and a == b


def assert_same(got: list[dict], want: list[dict]) -> None:
    """Batch for batch: the same keys, tensors (dtype, shape, values) and values; the cache
    counters aside (a persistent worker's cache is warm)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), i
        differ = [k for k in g.keys() - COUNTERS if not equal(g[k], w[k])]
        assert not differ, (i, differ)


def scenario(lo, after_pass=lambda: None) -> list[dict]:
    """Passes as a trainer runs them: epochs one after another, set_epoch, a peek, a loop
    left early, a resume; every batch handed out, in order (``after_pass`` after each)."""
    out: list[dict] = []

    def add(batches):
        out.extend(batches)
        after_pass()

    add(lo)  # epoch 0
    add(lo)  # epoch 1
    lo.set_epoch(5)
    add(lo)
    add([next(iter(lo))])  # a peek: the next iterator starts epoch 6 over
    add(lo)
    add(b for _, b in zip(range(2), lo, strict=False))  # epoch 7, left after 2 batches
    add(lo)  # starts epoch 7 over
    add(b for _, b in zip(range(3), lo, strict=False))  # epoch 8, left after 3, continued:
    lo.load_state_dict(lo.state_dict())
    add(lo)
    return out


def test_persistent_workers_need_workers(filled, small_processor):
    with pytest.raises(mmstore.InvalidArgumentError, match="persistent_workers"):
        loader(filled, small_processor, workers=0)
    with pytest.raises(mmstore.InvalidArgumentError, match="persistent_workers"):
        mmstore.RolloutLoader(
            mmstore.RolloutDataset(filled, small_processor), num_workers=1, persistent_workers=1
        )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("form", sorted(PACKED))
def test_the_same_batches_from_the_same_workers(filled, small_processor, form, workers):
    want = scenario(loader(filled, small_processor, workers=workers, persistent=False, form=form))
    lo = loader(filled, small_processor, workers=workers, form=form)
    before, seen = children(), []
    got = scenario(lo, after_pass=lambda: seen.append(children() - before))
    assert_same(got, want)
    assert len(seen[0]) == workers and all(s == seen[0] for s in seen), seen
    lo.close()
    assert not seen[0] & children()


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(PACKED))
def test_resume_at_every_batch(filled, small_processor, form):
    """One persistent loader resumed at every batch of an epoch continues exactly as a loader
    without workers (whose order every worker count shares, tests/test_resume.py)."""
    plain = loader(filled, small_processor, workers=0, persistent=False, form=form)
    plain.set_epoch(1)
    states, want = [plain.state_dict()], []
    for batch in plain:
        want.append(batch)
        states.append(plain.state_dict())
    lo = loader(filled, small_processor, form=form)
    before = children()
    next(iter(lo))
    workers = children() - before
    assert len(workers) == 2
    for cut, state in enumerate(states[:-1]):
        lo.load_state_dict(state)
        assert_same([*lo], want[cut:])
    assert children() - before == workers


@pytest.mark.slow
def test_later_passes_start_no_worker_and_keep_caches(filled, small_processor):
    lo = loader(filled, small_processor)
    before = children()
    misses = [sum(b["cache_misses"] for b in lo)]
    workers = children() - before
    for epoch in (0, 0, 3):
        lo.set_epoch(epoch)
        misses.append(sum(b["cache_misses"] for b in lo))
    assert children() - before == workers
    # Each worker still holds images it processed in an earlier pass (the cache keeps those
    # it has met in more than one window, see docs/internals.md): later passes process fewer.
    assert misses[-1] < misses[0], misses


@pytest.mark.slow
def test_close_or_garbage_collection_stops_the_workers(filled, small_processor):
    want = [*loader(filled, small_processor, workers=0, persistent=False)]
    lo = loader(filled, small_processor)
    before = children()
    assert_same([*lo], want)
    first = children() - before
    lo.close()
    assert not first & children()
    lo.set_epoch(0)
    assert_same([*lo], want)  # new workers
    second = children() - before
    assert len(second) == 2 and not second & first
    del lo
    gc.collect()
    assert not second & children()


@pytest.mark.slow
def test_a_worker_killed_between_passes(filled, small_processor):
    lo = loader(filled, small_processor)
    before = children()
    want = [*lo]
    workers = children() - before
    kill(min(workers))
    with pytest.raises(mmstore.WorkerDiedError, match="between passes"):
        next(iter(lo))
    assert not workers & children()  # the survivor was let go too
    lo.set_epoch(0)
    assert_same([*lo], want)  # new workers
    assert len(children() - before) == 2


@pytest.mark.slow
def test_a_worker_killed_during_a_pass(filled, small_processor):
    lo = loader(filled, small_processor)
    before = children()
    want = [*lo]
    lo.set_epoch(0)
    it = iter(lo)
    got = [next(it)]
    state = lo.state_dict()
    workers = children() - before
    assert len(workers) == 2
    for pid in workers:
        kill(pid)
    # DataLoader notices within its 5 s status check; never torch's SIGCHLD RuntimeError.
    with pytest.raises(mmstore.WorkerDiedError, match="while building"):
        got += it
    lo.load_state_dict(state)
    assert_same([*got[:1], *lo], want)
    assert len(children() - before) == 2 and not children() & workers


@pytest.mark.slow
def test_an_older_iterator_raises(filled, small_processor):
    lo = loader(filled, small_processor)
    want = [*lo]
    lo.set_epoch(0)
    older = iter(lo)
    next(older)
    newer = iter(lo)
    got = [next(newer)]
    with pytest.raises(mmstore.InvalidArgumentError, match="newer one"):
        next(older)
    assert_same([*got, *newer], want)


@pytest.mark.slow
def test_a_resume_on_another_snapshot_starts_new_workers(filled, small_processor, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(filled.backend.abspath(""), copy)
    store = mmstore.Store.open(copy)
    old = loader(store, small_processor)
    want = [*old]
    state = old.state_dict()
    old.close()
    adapter = mmstore.adapter_for(small_processor)
    write_grpo_steps(store, adapter, run_id="r", steps=[9], groups=2, image_size=(160, 120))
    lo = loader(store, small_processor)  # reads the new version
    before = children()
    assert len([*lo]) > len(want)
    workers = children() - before
    state["epoch"], state["batches_yielded"] = 0, 0
    lo.load_state_dict(state)  # the old snapshot: its workers hold the new one
    assert_same([*lo], want)
    assert not workers & children()
