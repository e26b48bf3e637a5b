"""Continuations (``Rollout(parent_id=, prefix_len=)``): the writer stores each sample whole.

A tree of segments (a GRPO prompt and its answers, an agent's turns, forks at any token that
ends no span) written as continuations reads back, from every reader that reads rows, as the
same rows written flat; parents come from the same writer or an earlier commit; what cannot
be a continuation is refused by name and the writer stays usable.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore
from tests.live_workers import processor
from tests.store_workers import VISION_END, VISION_START, image_bytes

COLUMNS = {"ref_logprobs": mmstore.per_token("float32"), "task": mmstore.per_sample("string")}


def _segment(adapter: Any, rng: random.Random, media: list[Any]) -> dict[str, Any]:
    """One segment's own part: text, maybe a screenshot, more text; a loss on its end."""
    prompt = [rng.randrange(1000, 150_000) for _ in range(rng.randint(1, 5))]
    for _ in media:
        prompt += [VISION_START, adapter.image_token_id, VISION_END]
        prompt += [rng.randrange(1000, 150_000) for _ in range(rng.randint(0, 3))]
    tokens, refs = adapter.expand(prompt, list(media))
    answer = [rng.randrange(1000, 150_000) for _ in range(rng.randint(1, 4))]
    n = len(tokens) + len(answer)
    return {
        "tokens": tokens + answer,
        "prompt_len": len(tokens),
        "loss_mask": [False] * len(tokens) + [True] * len(answer),
        "logprobs": [round(-rng.random(), 3) for _ in range(n)],
        "images": refs,
        "columns": {"ref_logprobs": [float(-i) for i in range(n)], "task": f"t{rng.randint(0, 9)}"},
    }


def _flat(parent: dict[str, Any] | None, cut: int, own: dict[str, Any]) -> dict[str, Any]:
    """The whole sample by hand: the parent's first ``cut`` tokens (loss off), then ``own``."""
    if parent is None:
        return own
    shifted = [r.model_copy(update={"offset": r.offset + cut}) for r in own["images"]]
    return {
        "tokens": parent["tokens"][:cut] + own["tokens"],
        "prompt_len": cut + own["prompt_len"],
        "loss_mask": [False] * cut + own["loss_mask"],
        "logprobs": parent["logprobs"][:cut] + own["logprobs"],
        "images": [r for r in parent["images"] if r.offset + r.length <= cut] + shifted,
        "columns": {
            "ref_logprobs": parent["columns"]["ref_logprobs"][:cut]
            + own["columns"]["ref_logprobs"],
            "task": own["columns"]["task"],
        },
    }


def _cuts(whole: dict[str, Any]) -> list[int]:
    """Where a child may continue ``whole``: any token boundary outside its spans."""
    inside = {i for r in whole["images"] for i in range(r.offset + 1, r.offset + r.length)}
    return [c for c in range(len(whole["tokens"]) + 1) if c not in inside]


def _tree(seed: int, size: int, store: mmstore.Store, adapter: Any) -> list[dict[str, Any]]:
    """``size`` samples: each a root or the continuation of an earlier one, at a random
    cut; about a third show a screenshot (one of three)."""
    rng = random.Random(seed)
    shots = [store.put_media(image_bytes(k), "png") for k in range(3)]
    samples: list[dict[str, Any]] = []
    for k in range(size):
        media = [rng.choice(shots)] if rng.random() < 0.35 else []
        own = _segment(adapter, rng, media)
        parent = rng.choice([None, *range(k)]) if k else None
        cut = rng.choice(_cuts(samples[parent]["whole"])) if parent is not None else 0
        whole = _flat(samples[parent]["whole"] if parent is not None else None, cut, own)
        samples.append({"id": f"s{k}", "own": own, "parent": parent, "cut": cut, "whole": whole})
    return samples


def _rollout(sample: dict[str, Any], samples: list[dict[str, Any]], part: str) -> mmstore.Rollout:
    fields = sample[part]
    continuation = {}
    if part == "own" and sample["parent"] is not None:
        continuation = {"parent_id": samples[sample["parent"]]["id"], "prefix_len": sample["cut"]}
    return mmstore.Rollout(sample_id=sample["id"], group_id="tree", reward=1.0, **fields,
                           **continuation)  # fmt: skip


@pytest.mark.slow  # two stores per example
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10_000), size=st.integers(1, 7), commits=st.integers(1, 3))
def test_a_tree_written_as_continuations_reads_back_as_flat_rows(
    tmp_path_factory, seed, size, commits
):
    """Random trees (forks at any cut outside a span, several levels, screenshots in some
    segments), written as continuations over one to three commits (a parent always before
    its children): every row reads back as the same row written flat."""
    root = tmp_path_factory.mktemp("tree")
    adapter = mmstore.adapter_for(processor())
    store = mmstore.Store.open(root / "cont", create=True)
    flat_store = mmstore.Store.open(root / "flat", create=True)
    samples = _tree(seed, size, store, adapter)
    for k in range(3):  # the same screenshots in the flat store
        flat_store.put_media(image_bytes(k), "png")
    bounds = np.linspace(0, size, commits + 1).astype(int)
    for step, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for target, part in ((store, "own"), (flat_store, "whole")):
            with target.writer("r", step, adapter=adapter, columns=COLUMNS) as writer:
                writer.write_many([_rollout(s, samples, part) for s in samples[lo:hi]])
    got = {r.sample_id: r for r in store.rollouts("r")}
    want = {r.sample_id: r for r in flat_store.rollouts("r")}
    assert got.keys() == want.keys() == {s["id"] for s in samples}
    for sid, row in want.items():
        assert got[sid] == row, sid
    # The rows readers train on: the loader's batches of both stores hold the same tokens.
    for s in (store, flat_store):
        assert mmstore.verify(s).ok


def test_an_agent_commits_each_turn_continuing_the_last(tmp_path):
    """Turn by turn, one commit each, continuing the committed turn before: each row is the
    whole history; the continuation carries the oldest policy version; the packed loader's
    forest forwards the trajectory once."""
    adapter = mmstore.adapter_for(processor())
    store = mmstore.Store.open(tmp_path / "s", create=True)
    rng = random.Random(3)
    previous = None
    for turn in range(4):
        own = _segment(adapter, rng, [store.put_media(image_bytes(turn), "png")])
        own.pop("columns")
        extra = {}
        if previous is not None:
            extra = {"parent_id": previous.sample_id, "prefix_len": len(previous.tokens)}
        row = mmstore.Rollout(sample_id=f"turn{turn}", group_id="agent", policy_version=turn,
                              **own, **extra)  # fmt: skip
        with store.writer("r", turn, adapter=adapter) as writer:
            writer.write(row)
        (previous,) = store.rollouts("r", sample_ids=f"turn{turn}")
        assert previous.parent_id is None and len(previous.images) == turn + 1
        assert previous.policy_version == 0  # the oldest policy that generated any of it
        assert previous.loss_mask.count(True) == len([t for t in own["loss_mask"] if t])
    ds = mmstore.RolloutDataset(store, processor(), shuffle=False)
    forest = mmstore.RolloutLoader(ds, batch_size=4, max_tokens=8192, prefix_sharing=True)
    (batch,) = list(forest)
    assert batch["input_ids"].shape[1] == len(previous.tokens)  # the last turn holds them all


def test_a_kept_leaf_keeps_what_it_continues_through_release_and_gc(tmp_path):
    """Only the last turn's step is pinned; the run is released (forced) and collected with
    no grace: the leaf, at the pinned version, still reads whole and loads, the earlier
    turns' screenshots included (a continuation is stored whole: it needs no parent)."""
    adapter = mmstore.adapter_for(processor())
    store = mmstore.Store.open(tmp_path / "s", create=True)
    rng = random.Random(5)
    previous = None
    for turn in range(3):
        own = _segment(adapter, rng, [store.put_media(image_bytes(40 + turn), "png")])
        own.pop("columns")
        extra = {}
        if previous is not None:
            extra = {"parent_id": previous.sample_id, "prefix_len": len(previous.tokens)}
        with store.writer("r", turn, adapter=adapter) as writer:
            writer.write(mmstore.Rollout(sample_id=f"turn{turn}", **own, **extra))
        (previous,) = store.rollouts("r", sample_ids=f"turn{turn}")
    version = writer.version
    mmstore.pin_rows(store, "leaf", runs="r", steps=[2])
    released = mmstore.release_run(store, "r", grace_seconds=0, force=True)
    mmstore.gc(store, grace_seconds=0)
    gone = [p for p in released.removed_files if store.backend.stat(p) is None]
    assert len(released.removed_files) == 3 and len(gone) == 2  # the unpinned turns' files
    (leaf,) = store.rollouts("r", step=2, version=version)
    assert leaf == previous and len(leaf.images) == 3
    ds = mmstore.RolloutDataset(store, processor(), runs=["r"], steps=[2], version=version)
    (batch,) = list(mmstore.RolloutLoader(ds, batch_size=1))
    assert batch["input_ids"][0].tolist() == leaf.tokens
    assert batch["image_grid_thw"].shape[0] == 3 and not batch["images_missing"]


@pytest.fixture
def parent(tmp_path):
    adapter = mmstore.adapter_for(processor())
    store = mmstore.Store.open(tmp_path / "s", create=True)
    own = _segment(adapter, random.Random(1), [store.put_media(image_bytes(0), "png")])
    own.pop("columns")
    with store.writer("r", 0, adapter=adapter) as writer:
        writer.write(mmstore.Rollout(sample_id="p", **own))
    return store, adapter, own


def _child(**changes: Any) -> mmstore.Rollout:
    fields = {"sample_id": "c", "tokens": [5000, 5001], "prompt_len": 1,
              "loss_mask": [False, True], "parent_id": "p", "prefix_len": 3, **changes}  # fmt: skip
    return mmstore.Rollout(**fields)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"parent_id": "nobody"}, "parent 'nobody' is not in run 'r'"),
        ({"prefix_len": 10_000}, "past the end of parent 'p'"),
    ],
)
def test_what_cannot_continue_is_refused_by_name(parent, changes, match):
    store, adapter, own = parent
    with store.writer("r", 1, adapter=adapter) as writer:
        with pytest.raises(mmstore.InvalidRolloutError, match=match) as info:
            writer.write(_child(**changes))
        assert info.value.context["sample_id"] == "c" and info.value.context["step"] == 1
        writer.write(_child())  # the writer stays usable
    (row,) = store.rollouts("r", sample_ids="c")
    assert row.tokens == [*own["tokens"][:3], 5000, 5001]


def test_a_cut_through_a_screenshot_is_refused(parent):
    store, adapter, own = parent
    span = own["images"][0]
    with store.writer("r", 1, adapter=adapter) as writer:
        with pytest.raises(mmstore.InvalidRolloutError, match="cuts image 0 of parent 'p'") as info:
            writer.write(_child(prefix_len=span.offset + 1))
        assert info.value.context["image_index"] == 0
        writer.write(_child(prefix_len=span.offset + span.length))  # right after it: fine


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"prefix_len": None}, "both parent_id and prefix_len"),
        ({"parent_id": None}, "both parent_id and prefix_len"),
        ({"parent_id": "c"}, "cannot continue itself"),
    ],
)
def test_a_half_continuation_is_no_rollout(changes, match):
    with pytest.raises(mmstore.InvalidRolloutError, match=match):
        _child(**changes)
