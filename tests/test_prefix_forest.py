"""Prefix forests (``RolloutLoader(..., max_tokens=..., prefix_sharing=True)``).

The builder (:mod:`mmstore._loading.forest`) against the trie it stands for (a property
test over random sequence sets), the planner's tree costs, and, for every family with its
tiny random model (sdpa and eager): each sample's logits in a forest micro-batch equal the
sample run alone, for a GRPO group forking at a screenshot prompt, a five-turn agent stored
one sample per turn with a screenshot each turn (each turn continues the one before) and an
edited history forking at turn 3; and a loss's gradients equal those of the unshared
micro-batch.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore._loading.forest import build_forest
from mmstore._planning.pack import plan_epoch
from mmstore._rows.lengths import read_row_meta
from tests.families_common import noise
from tests.family_cases import CASES, FamilyCase, store_images, token_ids

# -- the builder --------------------------------------------------------------------------


Prefix = tuple[int, ...]


def _ancestors(keys: Sequence[np.ndarray]) -> tuple[int, set[tuple[Prefix, Prefix]]]:
    """The trie of ``keys``: its node count, and every (node, ancestor-or-self) pair, nodes
    named by their prefix."""
    nodes: set[Prefix] = set()
    pairs = set()
    for k in keys:
        prefix = tuple(k.tolist())
        for end in range(1, len(prefix) + 1):
            nodes.add(prefix[:end])
            pairs |= {(prefix[:end], prefix[:start]) for start in range(1, end + 1)}
    return len(nodes), pairs


sequences = st.lists(
    st.lists(st.integers(-2, 2), min_size=1, max_size=7).map(lambda v: np.asarray(v, np.int64)),
    min_size=1,
    max_size=7,
)


@settings(max_examples=200, deadline=None)
@given(sequences, st.data())
def test_the_forest_is_the_trie_of_its_sequences(keys, data):
    """Random sequence sets (a few keys: many shared prefixes), in any order, some repeated
    or prefixes of others: the forest has one token per trie node, gives every sequence back
    through ``index``, and ``visible_until`` says exactly "ancestor or itself"."""
    extra = data.draw(st.lists(st.sampled_from(range(len(keys))), max_size=3))
    keys = keys + [keys[i][: data.draw(st.integers(1, len(keys[i])))] for i in extra]
    forest = build_forest(keys)
    flat = np.concatenate(keys)
    node_count, pairs = _ancestors(keys)
    assert forest.num_tokens == node_count
    assert np.array_equal(flat[forest.source][forest.index], flat)  # each sequence back
    # Each forest token's prefix: the keys along the path of any sequence through it.
    starts = np.cumsum([0] + [len(k) for k in keys])
    prefix_of: dict[int, tuple[int, ...]] = {}
    for s, k in enumerate(keys):
        for p in range(len(k)):
            node = int(forest.index[starts[s] + p])
            assert prefix_of.setdefault(node, tuple(k[: p + 1].tolist())) == tuple(
                k[: p + 1].tolist()
            )
    n = forest.num_tokens
    q, kv = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    visible = (kv <= q) & (q < forest.visible_until[kv])
    expected = np.array(
        [[(prefix_of[a], prefix_of[b]) in pairs for b in range(n)] for a in range(n)]
    )
    assert np.array_equal(visible, expected)


def test_tree_costs_keep_a_tree_in_one_micro_batch_and_count_it_once():
    """Two trees of a step (a 100-token prompt and three 10-token answers each; a tree
    head costs its length, the others what they add), a budget that holds one tree shared
    but not flat: each tree in one micro-batch, rank loads the shared costs; a tree larger
    than the budget falls back to single samples."""
    lengths = np.array([110, 110, 110, 110, 110, 110])
    shared = np.array([0, 100, 100, 0, 100, 100])
    plan = plan_epoch(
        lengths, np.zeros(6, bool), batch_size=6, world_size=1, budget=140, shared=shared
    )
    micro = plan.micro_of.tolist()
    assert micro[0] == micro[1] == micro[2] and micro[3] == micro[4] == micro[5]
    assert micro[0] != micro[3] and plan.num_micro.tolist() == [2]
    assert plan.rank_tokens.tolist() == [[260]]
    small = plan_epoch(
        lengths, np.zeros(6, bool), batch_size=6, world_size=1, budget=120, shared=shared
    )
    assert small.num_micro.tolist() == [6] and small.rank_tokens.tolist() == [[660]]


# -- every family's tiny model ----------------------------------------------------------------


def _turn(case: FamilyCase, processor: Any, adapter: Any, media: Any, answer: list[int]):
    """One agent turn: the prompt's text around one screenshot, expanded, then ``answer``."""
    tokens, refs = adapter.expand(token_ids(processor, case.text(1)), [media])
    return tokens, refs, answer


def _sample(sample_id: str, group: str, turns: Sequence[Any]) -> mmstore.Rollout:
    """A sample of the whole history ``turns``: the loss on its last answer only (one
    sample per turn, as trainers store agents today)."""
    tokens: list[int] = []
    refs = []
    for prompt, turn_refs, answer_tokens in turns:
        refs += [r.model_copy(update={"offset": r.offset + len(tokens)}) for r in turn_refs]
        tokens += prompt + answer_tokens
    answer = len(turns[-1][2])
    mask = [False] * (len(tokens) - answer) + [True] * answer
    return mmstore.Rollout(
        sample_id=sample_id, group_id=group, tokens=tokens, prompt_len=len(tokens) - answer,
        loss_mask=mask, images=refs, reward=1.0, advantage=0.5,
    )  # fmt: skip


def trajectories(case: FamilyCase, store: mmstore.Store) -> list[mmstore.Rollout]:
    """A GRPO group of three answers to one screenshot prompt; a five-turn agent, one
    sample per turn, a screenshot each turn (two of them shown twice); its history edited
    at turn 3 (another screenshot of the same size, another answer), continued for a turn."""
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    a, b, c = (store.put_image(image) for image in store_images(case))
    w = [token_ids(processor, word)[0] for word in case.words]
    group = [_sample(f"g{k}", "g", [_turn(case, processor, adapter, a, answer)])
             for k, answer in enumerate([[w[2], w[3]], [w[3]], [w[2], w[2], w[3]]])]  # fmt: skip
    turns = [_turn(case, processor, adapter, m, [w[2 + t % 2], w[3]])
             for t, m in enumerate([a, b, c, a, b])]  # fmt: skip
    chain = [_sample(f"t{t + 1}", "agent", turns[: t + 1]) for t in range(5)]
    # The edit: another screenshot of the same size (the same placeholder tokens).
    other = store.put_image(noise(*case.store_sizes[2], seed=99))
    edited = _turn(case, processor, adapter, other, [w[3], w[3], w[2]])
    fork = [_sample("e3", "agent", [*turns[:2], edited]),
            _sample("e4", "agent", [*turns[:2], edited, turns[3]])]  # fmt: skip
    return group + chain[:3] + fork + chain[3:]


@pytest.fixture(scope="module", params=list(CASES.values()), ids=str)
def forest_store(request, tmp_path_factory):
    case = request.param
    store = mmstore.Store.open(tmp_path_factory.mktemp(case.family) / "store", create=True)
    rows = trajectories(case, store)
    with store.writer("r", 0, adapter=mmstore.adapter_for(case.small())) as writer:
        writer.write_many(rows)
    return case, store, rows


def _loaders(store, case, max_tokens):
    ds = mmstore.RolloutDataset(store, case.small(), dtype=torch.float32, shuffle=False)
    return (
        mmstore.RolloutLoader(ds, batch_size=len(ds), max_tokens=max_tokens, prefix_sharing=True),
        mmstore.RolloutLoader(ds, batch_size=len(ds), max_tokens=max_tokens),
        mmstore.RolloutLoader(ds, batch_size=1),
    )


@pytest.mark.slow  # a tiny model per family and attention
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_samples_logits_in_a_forest_equal_the_sample_alone(forest_store, attn):
    case, store, rows = forest_store
    model = case.tiny_model(torch.float32, attn)
    flat_tokens = 2 * sum(len(row.tokens) for row in rows)  # room for all, and a dummy
    forest, packed, alone_loader = _loaders(store, case, max_tokens=flat_tokens)
    alone = {batch["sample_ids"][0]: batch for batch in alone_loader}
    checked = []
    with torch.no_grad():
        # The unshared micro-batch too: a packed Gemma 3 row needs its mask built as well.
        for loader, batch in [(forest, b) for b in forest] + [(packed, b) for b in packed]:
            logits = model(**loader.model_inputs(batch, model)).logits[0, batch["forest_index"]]
            ids = batch["input_ids"][0, batch["forest_index"]]
            cu = batch["cu_seqlens"].tolist()
            for i, sample_id in enumerate(batch["sample_ids"]):
                if batch["is_filler"][i]:
                    continue
                own = alone[sample_id]
                assert ids[cu[i] : cu[i + 1]].tolist() == own["input_ids"][0].tolist()
                inputs = {k: own[k] for k in alone_loader.model_input_names}
                expected = model(**inputs).logits[0]
                torch.testing.assert_close(logits[cu[i] : cu[i + 1]], expected, atol=1e-4, rtol=0)
                checked.append(sample_id)
    assert sorted(checked) == sorted(2 * [row.sample_id for row in rows])
    # The group's prompt, the agent's shared history and its repeated screenshots: once.
    (whole,) = list(forest)
    (unshared,) = list(packed)
    assert whole["input_ids"].shape[1] < unshared["input_ids"].shape[1] / 2
    image_key = next(iter(forest.dataset.adapter.image_inputs))
    if case.family != "kimi-k25":  # its pixel_values are per image, not per patch
        assert whole[image_key].shape[0] < unshared[image_key].shape[0]


@pytest.mark.slow
def test_a_loss_on_a_forest_has_the_gradients_of_the_unshared_micro_batch(forest_store):
    """Per-sample losses (token-mean of each sample's loss tokens, then the mean over
    samples), reduced through ``forest_index``: the same loss and gradients as on the
    unshared packed micro-batch."""
    case, store, rows = forest_store
    flat_tokens = 2 * sum(len(row.tokens) for row in rows)  # room for all, and a dummy
    forest, packed, _ = _loaders(store, case, max_tokens=flat_tokens)
    losses, grads = [], []
    for loader in (forest, packed):
        model = case.tiny_model(torch.float32, "eager")
        (batch,) = list(loader)
        logits = model(**loader.model_inputs(batch, model)).logits[0, batch["forest_index"]]
        ids = batch["input_ids"][0, batch["forest_index"]]
        loss = _per_sample_loss(logits, ids, batch["loss_mask"][0], batch["cu_seqlens"])
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=0)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        # Sums in another order: float32 rounding, relative to the gradient's own scale.
        scale = max(float(grads[1][name].abs().max()), 1e-3)
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5 * scale, rtol=1e-4)


def _per_sample_loss(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor
) -> torch.Tensor:
    """Next-token cross entropy, token-mean within each sample, mean over samples."""
    per_sample = []
    bounds = cu.tolist()
    for lo, hi in itertools.pairwise(bounds):
        on = mask[lo + 1 : hi]
        if not on.any():
            continue
        nll = torch.nn.functional.cross_entropy(
            logits[lo : hi - 1], ids[lo + 1 : hi], reduction="none"
        )
        per_sample.append(nll[on].mean())
    return torch.stack(per_sample).mean()


def test_planning_reads_what_each_row_shares(forest_store):
    """The planner's facts: each row's shared prefix with the row before it in its block,
    in tokens and images; an image of the same size but other content ends it (the edited
    turn 3), and a new block shares nothing."""
    case, store, rows = forest_store
    snapshot = mmstore.RolloutDataset(store, case.small(), shuffle=False).spec.snapshot
    meta = read_row_meta(store, snapshot, prefixes=True)
    assert meta.shared is not None
    by_id = {row.sample_id: row for row in rows}
    order = [row.sample_id for row in rows]
    prompt = by_id["g0"].prompt_len  # the group's prompt, screenshot included
    two_turns = len(by_id["t2"].tokens)
    edited_at = by_id["e3"].images[2].offset  # where the other screenshot starts
    whole = {sid: len(row.tokens) for sid, row in by_id.items()}  # a row the next continues
    expected = {"g0": 0, "g1": prompt, "g2": prompt, "t1": 0, "t2": whole["t1"],
                "t3": two_turns, "e3": edited_at, "e4": whole["e3"], "t4": edited_at,
                "t5": whole["t4"]}  # fmt: skip
    assert dict(zip(order, meta.shared.tolist(), strict=True)) == expected
    assert edited_at >= two_turns


def test_forest_options_are_checked(forest_store):
    case, store, _ = forest_store
    ds = mmstore.RolloutDataset(store, case.small(), dtype=torch.float32, shuffle=False)
    with pytest.raises(mmstore.InvalidArgumentError, match="set max_tokens"):
        mmstore.RolloutLoader(ds, batch_size=2, prefix_sharing=True)
    with pytest.raises(mmstore.InvalidArgumentError, match="set max_tokens"):
        mmstore.LiveLoader(store, case.small(), runs=["r"], batch_size=2, prefix_sharing=True)
    forest = mmstore.RolloutLoader(ds, batch_size=len(ds), max_tokens=4096, prefix_sharing=True)
    with pytest.raises(mmstore.InvalidArgumentError, match="model_inputs"):
        forest.model_input_names  # noqa: B018 - the property refuses
    batch = next(iter(forest))
    with pytest.raises(mmstore.InvalidArgumentError, match="needs the model"):
        forest.model_inputs(batch)
    padded = mmstore.RolloutLoader(ds, batch_size=2)
    with pytest.raises(mmstore.InvalidArgumentError, match="no prefix forest"):
        mmstore.forest_attention_mask(next(iter(padded)), case.tiny_model(torch.float32, "eager"))


@pytest.mark.slow
def test_a_live_loader_trains_the_same_forest(forest_store):
    """LiveLoader(prefix_sharing=True): a step's groups as forests; each sample's logits
    equal its logits alone, and the step forwards fewer tokens than unshared."""
    case, store, rows = forest_store
    model = case.tiny_model(torch.float32, "sdpa")
    alone_loader = _loaders(store, case, 4096)[2]
    alone = {batch["sample_ids"][0]: batch for batch in alone_loader}
    forwarded = {}
    for sharing in (True, False):
        live = mmstore.LiveLoader(
            store, case.small(), runs=["r"], batch_size=len(rows), max_tokens=4096,
            prefix_sharing=sharing, materialize=mmstore.Materialize(dtype="float32"),
        )  # fmt: skip
        with live, torch.no_grad():
            batches = live.next_step(policy_version=0, timeout=30)
            forwarded[sharing] = sum(b["input_ids"].shape[1] for b in batches)
            for batch in batches:
                index = batch["forest_index"]
                logits = model(**live.model_inputs(batch, model)).logits[0, index]
                cu = batch["cu_seqlens"].tolist()
                for i, sample_id in enumerate(batch["sample_ids"]):
                    if batch["is_filler"][i]:
                        continue
                    own = alone[sample_id]
                    expected = model(**alone_loader.model_inputs(own)).logits[0]
                    torch.testing.assert_close(
                        logits[cu[i] : cu[i + 1]], expected, atol=1e-4, rtol=0
                    )
    assert forwarded[True] < forwarded[False] / 2


# -- ranks, resume and groups too large to share (Qwen-VL) -------------------------------------


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """Three commits of the trajectories (10 rows each: a group, an agent)."""
    case = CASES["qwen-vl"]
    store = mmstore.Store.open(tmp_path_factory.mktemp("steps") / "store", create=True)
    adapter = mmstore.adapter_for(case.small())
    written = []
    for step in range(3):
        rows = [
            row.model_copy(update={"sample_id": f"{row.sample_id}-{step}",
                                   "group_id": f"{row.group_id}-{step}"})
            for row in trajectories(case, store)
        ]  # fmt: skip
        with store.writer("r", step, adapter=adapter) as writer:
            writer.write_many(rows)
        written += rows
    return case, store, written


def _agent_cost(store, case) -> int:
    """The tokens of one commit's agent tree after sharing (what the planner counts)."""
    snapshot = mmstore.RolloutDataset(store, case.small(), shuffle=False).spec.snapshot
    meta = read_row_meta(store, snapshot, prefixes=True)
    assert meta.shared is not None
    return int((meta.lengths[3:10] - meta.shared[3:10]).sum())


def _forest_loader(store, case, *, rank, max_tokens):
    ds = mmstore.RolloutDataset(
        store, case.small(), dtype=torch.float32, shuffle=False, rank=rank, world_size=2
    )
    return mmstore.RolloutLoader(ds, batch_size=5, max_tokens=max_tokens, prefix_sharing=True)


def _dummy_tokens(case: FamilyCase) -> int:
    adapter = mmstore.adapter_for(case.small())
    return adapter.num_tokens(*adapter.dummy_size)


def _real_ids(batch: dict[str, Any]) -> list[str]:
    fillers = batch["is_filler"].tolist()
    return [sid for sid, filler in zip(batch["sample_ids"], fillers, strict=True) if not filler]


def test_ranks_share_out_whole_trees_and_resume_at_any_micro_batch(three_steps):
    """Two ranks, a budget that holds an agent tree only shared: equal micro-batch counts,
    every sample once, each tree (a group) in one micro-batch within ``max_tokens``; a
    loader restored after any micro-batch gives exactly the rest."""
    case, store, rows = three_steps
    max_tokens = _agent_cost(store, case) + _dummy_tokens(case)
    shares = [list(_forest_loader(store, case, rank=r, max_tokens=max_tokens)) for r in (0, 1)]
    counts = [[b["num_micro"] for b in share] for share in shares]
    assert counts[0] == counts[1]
    where = {sid: (rank, i) for rank, share in enumerate(shares)
             for i, batch in enumerate(share) for sid in _real_ids(batch)}  # fmt: skip
    assert sorted(where) == sorted(row.sample_id for row in rows)
    assert all(b["input_ids"].shape[1] <= max_tokens for share in shares for b in share)
    for group in {row.group_id for row in rows}:
        assert len({where[row.sample_id] for row in rows if row.group_id == group}) == 1, group
    for k in (1, 2, len(shares[0]) - 1):
        first = _forest_loader(store, case, rank=0, max_tokens=max_tokens)
        batches = iter(first)
        for _ in range(k):
            next(batches)
        resumed = _forest_loader(store, case, rank=0, max_tokens=max_tokens)
        resumed.load_state_dict(first.state_dict())
        rest = list(resumed)
        assert [b["sample_ids"] for b in rest] == [b["sample_ids"] for b in shares[0][k:]]
        for got, want in zip(rest, shares[0][k:], strict=True):
            assert torch.equal(got["input_ids"], want["input_ids"])
            assert torch.equal(got["visible_until"], want["visible_until"])


def test_a_tree_larger_than_max_tokens_is_packed_unshared_and_named(three_steps, caplog):
    case, store, rows = three_steps
    longest = max(len(row.tokens) for row in rows)
    max_tokens = longest + _dummy_tokens(case)  # every sample fits, an agent tree does not
    assert _agent_cost(store, case) > longest
    with caplog.at_level(logging.DEBUG, logger="mmstore"):
        share = list(_forest_loader(store, case, rank=0, max_tokens=max_tokens))
    assert "packed unshared" in caplog.text and "'t1-0'" in caplog.text
    assert all(b["input_ids"].shape[1] <= max_tokens for b in share)
