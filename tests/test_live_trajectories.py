"""Trajectories committed turn by turn, trained whole by a live loader (``done_column``):
held until a row of the group says done, never split, each row once, across resumes at any
step; with prefix sharing, a trajectory's turns from several commits run their history once.
"""

from __future__ import annotations

from typing import Any

import pytest

import mmstore
from tests.live_workers import micro_record, processor
from tests.store_workers import image_bytes, make_row

RUN = "agent"
DONE = {"done": mmstore.per_sample("bool")}


class Agent:
    """An agent's trajectory written as it happens: each turn a screenshot and an answer,
    continuing the turn before (``parent_id``), its ``done`` True on the last turn."""

    def __init__(self, store: mmstore.Store, name: str, turns: int) -> None:
        self.store, self.name, self.turns = store, name, turns
        self.adapter = mmstore.adapter_for(processor())
        self.written: list[str] = []
        self.full = 0  # the whole sample's tokens after the last turn written

    def turn(self) -> mmstore.Rollout:
        k = len(self.written)
        shot = self.store.put_media(image_bytes(_seed(self.name) + k, 96, 64), ext="png")
        row = make_row(self.adapter, [shot], f"{self.name}-t{k}", group_id=self.name)
        link = {"parent_id": self.written[-1], "prefix_len": self.full} if k else {}
        self.written.append(row.sample_id)
        self.full += len(row.tokens)
        return row.model_copy(update={**link, "columns": {"done": k == self.turns - 1}})


def _seed(name: str) -> int:
    return 10 * sum(map(ord, name))


def group(store: mmstore.Store, name: str, size: int) -> list[mmstore.Rollout]:
    """A one-commit GRPO group (done at once)."""
    adapter = mmstore.adapter_for(processor())
    shot = store.put_media(image_bytes(_seed(name), 96, 64), ext="png")
    rows = [make_row(adapter, [shot], f"{name}-{k}", group_id=name) for k in range(size)]
    return [row.model_copy(update={"columns": {"done": True}}) for row in rows]


def commit(store: mmstore.Store, step: int, rows: list[mmstore.Rollout], **kw: Any) -> None:
    with store.writer(RUN, step, columns=DONE, **kw) as writer:
        writer.write_many(rows)


def live(store: mmstore.Store, **options: Any) -> mmstore.LiveLoader:
    settings = {"runs": [RUN], "batch_size": 4, "done_column": "done"}
    materialize = mmstore.Materialize(dtype="float32", node_cache_bytes=0)
    return mmstore.LiveLoader(store, processor(), materialize=materialize, **settings | options)


def step_ids(loader: mmstore.LiveLoader) -> list[str]:
    return [s for batch in loader.next_step(timeout=0) for s in micro_record(batch)[3]]


def agent_commits(store: mmstore.Store) -> list[list[mmstore.Rollout]]:
    """Two agents interleaved with one-commit groups: A's three turns end at commit 3,
    B's two at commit 2."""
    a, b = Agent(store, "A", 3), Agent(store, "B", 2)
    return [
        [a.turn(), *group(store, "X", 2)],
        [a.turn(), b.turn()],
        [*group(store, "Y", 2), b.turn()],
        [a.turn()],
        group(store, "Z", 2),
    ]


def test_a_trajectory_is_held_until_its_last_turn_then_trained_whole(tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    commits = agent_commits(store)
    loader = live(store)
    steps = []
    for n, rows in enumerate(commits):
        commit(store, n, rows)
        try:
            steps.append(step_ids(loader))
        except mmstore.LiveTimeoutError as exc:
            if n < 2:  # A (and B) held, X waits: nothing to train, and the error says why
                assert "held in" in str(exc)
                assert loader.stats()["held_trajectories"] == n + 1
    # X and Y go while A and B are held; B whole once its last turn is in (commit 2); A
    # whole at commit 3, and alone: A (3) and B (2) overflow a step of 4, as A and Z do.
    assert [sorted(s) for s in steps] == [
        ["X-0", "X-1", "Y-0", "Y-1"],
        ["B-t0", "B-t1"],
        ["A-t0", "A-t1", "A-t2"],
    ]
    assert loader.stats()["held_trajectories"] == 0 and loader.stats()["samples"] == 9
    with pytest.raises(mmstore.LiveTimeoutError):  # Z waits for more
        step_ids(loader)
    # Without done_column each commit's groups are whole at once: A's turns are split.
    assert sorted(step_ids(live(store, done_column=None))) == ["A-t0", "A-t1", "X-0", "X-1"]


def test_a_resume_at_any_step_trains_what_an_uninterrupted_loader_trains(tmp_path):
    """The cursor stays at a held trajectory's first turn while later groups are trained:
    the state names those, and a loader resumed from it skips them."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    for n, rows in enumerate(agent_commits(store)):
        commit(store, n, rows, final=n == 4)
    whole = live(store)
    states, steps = [whole.state_dict()], []
    while not whole.finished:
        steps.append([micro_record(b) for b in whole.next_step(timeout=0)])
        states.append(whole.state_dict())
    assert len(steps) == 4 and states[1]["consumed"]  # X and Y past A's first turn
    trained = [s for step in steps for record in step for s in record[3]]
    assert sorted(trained) == sorted(r.sample_id for c in agent_commits(store) for r in c)
    for k, state in enumerate(states):
        resumed = live(store)
        resumed.load_state_dict(state)
        again = []
        while not resumed.finished:
            again.append([micro_record(b) for b in resumed.next_step(timeout=0)])
        assert again == steps[k:], k


def test_a_runs_final_commit_ends_the_trajectories_it_holds(tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    a = Agent(store, "A", 5)
    commit(store, 0, [a.turn()])
    commit(store, 1, [a.turn()])
    loader = live(store)
    with pytest.raises(mmstore.LiveTimeoutError):
        step_ids(loader)
    commit(store, 2, group(store, "X", 1), final=True)
    assert sorted(step_ids(loader)) == ["A-t0", "A-t1", "X-0"] and loader.finished


def test_prefix_sharing_runs_a_trajectorys_history_once_across_its_commits(tmp_path):
    """A's turns come from three commits; its forest is its last turn's tokens. The budget
    holds A only shared: the planner must see what turns of different commits share."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    a = Agent(store, "A", 3)
    for n in range(3):
        commit(store, n, [a.turn()])
    samples = {s.sample_id: s for s in store.rollouts(RUN)}
    lengths = [len(samples[f"A-t{k}"].tokens) for k in range(3)]
    adapter = mmstore.adapter_for(processor())
    dummy = adapter.num_tokens(*adapter.dummy_size)
    budget = lengths[-1] + dummy + 8
    assert budget - dummy < sum(lengths)  # unshared, A would not fit one micro-batch
    loader = live(store, batch_size=3, max_tokens=budget, prefix_sharing=True)
    (batch,) = list(loader.next_step(timeout=0))
    assert micro_record(batch)[3] == ["A-t0", "A-t1", "A-t2"]
    assert batch["input_ids"].shape[1] == lengths[-1]  # the history once
    flat = batch["input_ids"][0, batch["forest_index"]].tolist()
    cu = batch["cu_seqlens"].tolist()
    for i in range(3):
        assert flat[cu[i] : cu[i + 1]] == samples[f"A-t{i}"].tokens


def test_done_column_is_checked(tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    with pytest.raises(mmstore.InvalidArgumentError, match="column name"):
        live(store, done_column="Done!")
    rows = [r.model_copy(update={"columns": {"done": 1}}) for r in group(store, "X", 1)]
    with store.writer(RUN, 0, columns={"done": mmstore.per_sample("int8")}) as writer:
        writer.write_many(rows)
    with pytest.raises(mmstore.InvalidRolloutError, match="per_sample\\('bool'\\)") as err:
        step_ids(live(store))
    assert err.value.file is not None and f"run_id={RUN}" in err.value.file
