"""Exact resume: every stateful stage and the loader through one harness."""

from __future__ import annotations

import pytest
import torch

import mmstore
from mmstore._loading import dataset as _dataset
from mmstore._loading import spec as _spec
from mmstore.synth import write_grpo_steps
from tests.resume_harness import check_resume


@pytest.fixture(scope="module")
def filled(tmp_path_factory, small_processor):
    """3 steps of GRPO groups with uneven row groups (sizes 5), so windows are ragged."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("resume") / "s", create=True)
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


def dataset(store, processor, **kw):
    kw.setdefault("seed", 11)
    kw.setdefault("window_units", 2)
    return mmstore.RolloutDataset(store, processor, dtype=torch.float32, **kw)


def batch_key(batch):
    return tuple(batch["sample_ids"])


@pytest.mark.slow
def test_dataset_samples_resume(filled, small_processor):
    ref = check_resume(
        lambda: dataset(filled, small_processor),
        key=lambda s: s.sample_id,
        cuts=range(0, 36, 3),
    )
    assert len(ref) == 3 * 3 + 3 * 4 + 3 * 5


@pytest.mark.slow
def test_batch_stream_resumes(filled, small_processor):
    ds = dataset(filled, small_processor)

    def make():
        return _dataset._BatchStream(
            ds.spec,
            ds.source,
            epoch=2,
            start=0,
            batch_size=4,
            drop_last=False,
            dummy_image=False,
            pad_token_id=0,
        )

    check_resume(make, key=batch_key, cuts=range(0, 8))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "even"), [(1, False), (2, False), (3, True)])
def test_loader_resumes_at_every_cut(filled, small_processor, world, even):
    for rank in range(world):

        def make(rank=rank):
            ds = dataset(filled, small_processor, rank=rank, world_size=world)
            loader = mmstore.RolloutLoader(ds, batch_size=3, even_ranks=even)
            loader.set_epoch(1)
            return loader

        batches = len(make())
        check_resume(make, key=batch_key, cuts=range(0, batches + 1))


@pytest.mark.slow
def test_loader_resumes_with_other_worker_counts(filled, small_processor):
    def make(workers):
        def build():
            loader = mmstore.RolloutLoader(
                dataset(filled, small_processor), batch_size=4, num_workers=workers
            )
            loader.set_epoch(3)
            return loader

        return build

    for before, after in [(0, 2), (2, 1), (1, 0)]:
        check_resume(make(before), key=batch_key, cuts=[1, 4], make_resumed=make(after))


def test_state_pins_the_snapshot(filled, small_processor, tmp_path):
    """Files committed after the state was taken do not change the resumed epoch."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(filled.backend.abspath(""), copy)
    store = mmstore.Store.open(copy)
    loader = mmstore.RolloutLoader(dataset(store, small_processor), batch_size=4)
    reference = [batch_key(b) for b in loader]
    loader = mmstore.RolloutLoader(dataset(store, small_processor), batch_size=4)
    head = [batch_key(b) for _, b in zip(range(3), loader, strict=False)]
    state = loader.state_dict()
    adapter = mmstore.adapter_for(small_processor)
    write_grpo_steps(store, adapter, run_id="r", steps=[9], groups=2, image_size=(160, 120))
    resumed = mmstore.RolloutLoader(dataset(store, small_processor), batch_size=4)
    resumed.load_state_dict(state)
    assert head + [batch_key(b) for b in resumed] == reference


def test_seek_reads_no_window_before_the_cut(filled, small_processor, monkeypatch):
    loader = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=2)
    plan = loader.dataset.plan(0)
    cut = 10  # batches; samples 20.. lie in a later window
    first_window = plan.window_of(cut * 2)
    assert first_window > 0
    read = []
    real = _spec.read_units
    monkeypatch.setattr(
        _spec, "read_units", lambda store, units, *a: read.append(units) or real(store, units, *a)
    )
    loader.load_state_dict({**loader.state_dict(), "batches_yielded": cut})
    next(iter(loader))
    assert read[0] == plan.windows[first_window]


def test_state_from_other_settings_is_refused(filled, small_processor):
    loader = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4)
    state = loader.state_dict()
    other = mmstore.RolloutLoader(dataset(filled, small_processor, seed=12), batch_size=4)
    with pytest.raises(mmstore.InvalidArgumentError, match="seed"):
        other.load_state_dict(state)


def epoch_loop(loader, epochs, *, start=0, stop_after=None):
    """The customary training loop; ``stop_after`` batches simulates a crash."""
    seen = []
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append(batch_key(batch))
            if len(seen) == stop_after:
                return seen
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("cut", [3, 9, 12])
def test_usual_epoch_loop_keeps_the_resume_point(filled, small_processor, cut):
    """``set_epoch(e)`` at the top of the loop after ``load_state_dict`` must not rewind e
    (cut 9 is epoch 0's last batch, 12 lies in epoch 1)."""
    reference = epoch_loop(mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4), 2)
    first = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4)
    head = epoch_loop(first, 2, stop_after=cut)
    state = first.state_dict()
    resumed = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4)
    resumed.load_state_dict(state)
    tail = epoch_loop(resumed, 2, start=state["epoch"])
    assert head + tail == reference


@pytest.mark.slow
def test_set_epoch_to_another_epoch_starts_it_over(filled, small_processor):
    loader = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4)
    whole = [batch_key(b) for b in loader]  # reads epoch 0, then stands at epoch 1
    loader.set_epoch(0)
    head = [batch_key(b) for _, b in zip(range(2), loader, strict=False)]
    loader.load_state_dict(loader.state_dict())  # continue after the break (issue 42)
    loader.set_epoch(0)  # the current epoch: keeps the resume point
    rest = [batch_key(b) for b in loader]
    assert head + rest == whole
    with pytest.raises(mmstore.InvalidArgumentError):
        loader.set_epoch(-1)


def test_a_new_iterator_starts_the_epoch_over_unless_a_state_was_loaded(filled, small_processor):
    """Issue 42, as torchdata's StatefulDataLoader: a peek (``next(iter(loader))``) or a
    loop left early loses no batch (the next iterator starts the epoch over); a state
    loaded applies to the next iterator, which continues from it."""
    loader = mmstore.RolloutLoader(dataset(filled, small_processor), batch_size=4)
    whole = [batch_key(b) for b in loader]
    assert len(whole) == len(loader) > 3
    loader.set_epoch(0)
    peeked = batch_key(next(iter(loader)))
    assert peeked == whole[0]
    assert [batch_key(b) for b in loader] == whole  # the peeked batch too
    loader.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 2:
            state = loader.state_dict()
            break
    assert [batch_key(b) for b in loader] == whole  # left early: over again
    loader.set_epoch(0)
    loader.load_state_dict(state)
    assert [batch_key(b) for b in loader] == whole[3:]  # loaded: continues
