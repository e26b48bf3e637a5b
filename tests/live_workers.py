"""Processes of the live loader tests: a producer committing rollouts at random intervals,
and consumers that train through a :class:`mmstore.LiveLoader` and die by SIGKILL.

As a script:

- ``python tests/live_workers.py produce ROOT PLAN``: commit the plan's commits (JSON, see
  :func:`commit_plan`), sleeping its delays, each commit exactly once per (producer, seq).
- ``python tests/live_workers.py kills ROOT OUT STEPS SEED [OPTIONS]``: a parent that
  imports mmstore once, then forks consumers one after another (a fork costs milliseconds,
  an import seconds). Each resumes from ``OUT`` (its last checkpoint: the loader state and the
  history of what it trained, written together atomically, as a trainer saves model and
  loader together) and SIGKILLs itself at a random point of a random later step, until one
  finishes ``STEPS`` steps. Prints the number of kills. ``OPTIONS``: JSON, the live
  loader's options (``{"done_column": "done"}``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import sys
import time
from typing import Any

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.store_workers import fork_child, image_bytes, make_row

SMALL_MAX_PIXELS = 256 * 28 * 28  # as tests/conftest.py
RUN = "live"
BATCH_SIZE = 4
MAX_TOKENS = 2048


def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS)


def commit_plan(
    seed: int, commits: int, *, other_every: int = 4, agents: bool = False
) -> list[dict[str, Any]]:
    """Commits of groups of 1-3 samples (a few with one shared image), policy versions that
    grow by one every 2 commits, delays of 0-40 ms; every ``other_every``-th commit goes to
    a run nobody follows. With ``agents``, the followed run's commits also carry turns of
    agents of 2-4 turns (up to two at once, a screenshot each turn), each turn continuing
    the one before and saying ``done`` on the last: trajectories over several commits."""
    rng = random.Random(seed)
    plan = []
    active: dict[str, int] = {}  # agent -> turns left
    for c in range(commits):
        groups = [
            {"size": rng.randint(1, 3), "image": rng.random() < 0.4}
            for _ in range(rng.randint(1, 3))
        ]
        run = "other" if other_every and c % other_every == other_every - 1 else RUN
        turns = []
        if agents and run == RUN:
            if len(active) < 2 and rng.random() < 0.5:
                active[f"a{c}"] = rng.randint(2, 4)
            for agent in [a for a in active if rng.random() < 0.7]:
                active[agent] -= 1
                turns.append({"agent": agent, "done": active[agent] == 0})
                if not active[agent]:
                    del active[agent]
        plan.append(
            {"run": run, "seq": c, "policy": c // 2, "groups": groups, "delay": rng.random() * 0.04,
             "turns": turns, "done_column": agents}
        )  # fmt: skip
    return plan


def commit_rows(store: mmstore.Store, adapter: Any, commit: dict[str, Any]) -> list[str]:
    """The rows of one planned commit (sample ids ``c<seq>-g<group>-<k>``): their ids."""
    rows = []
    for g, group in enumerate(commit["groups"]):
        media = []
        if group["image"]:
            media = [store.put_media(image_bytes(commit["seq"] * 10 + g, 96, 64), ext="png")]
        for k in range(group["size"]):
            row = make_row(adapter, media, f"c{commit['seq']}-g{g}-{k}", group_id=f"g{g}")
            rows.append(mmstore.Rollout(**{**row.model_dump(), "policy_version": commit["policy"]}))
    rows += [_agent_turn(store, adapter, t["agent"], t["done"]) for t in commit.get("turns", [])]
    columns = {"done": mmstore.per_sample("bool")} if commit.get("done_column") else None
    if columns:
        rows = [r.model_copy(update={"columns": {"done": True, **r.columns}}) for r in rows]
    with store.writer(
        commit["run"], commit["seq"], producer="sampler", seq=commit["seq"], columns=columns
    ) as w:
        w.write_many(rows)
    return [r.sample_id for r in rows]


def _agent_turn(store: mmstore.Store, adapter: Any, agent: str, done: bool) -> mmstore.Rollout:
    """The agent's next turn (``<agent>-t<k>``), continuing its turn before (found in the
    run: the producer keeps no state across restarts)."""
    try:
        committed = store.rollouts(RUN)
    except mmstore.NoMatchError:  # an agent that starts in the run's first commit
        committed = []
    turns = sorted(
        (r for r in committed if r.group_id == agent),
        key=lambda r: int(r.sample_id.rsplit("-t", 1)[1]),
    )
    k = len(turns)
    shot = store.put_media(image_bytes(10 * sum(map(ord, agent)) + k, 96, 64), ext="png")
    row = make_row(adapter, [shot], f"{agent}-t{k}", group_id=agent)
    link = {"parent_id": turns[-1].sample_id, "prefix_len": len(turns[-1].tokens)} if k else {}
    return row.model_copy(update={**link, "columns": {"done": done}})


def produce(root: str, plan: list[dict[str, Any]]) -> None:
    store = mmstore.Store.open(root)
    adapter = mmstore.adapter_for(processor())
    for commit in plan:
        time.sleep(commit["delay"])
        commit_rows(store, adapter, commit)


def live_loader(store: mmstore.Store, **options: Any) -> mmstore.LiveLoader:
    settings = {
        "runs": [RUN],
        "batch_size": BATCH_SIZE,
        "max_tokens": MAX_TOKENS,
        "max_staleness": 2,
        "materialize": mmstore.Materialize(dtype="float32", node_cache_bytes=0),
        **options,
    }
    return mmstore.LiveLoader(store, processor(), **settings)


def micro_record(batch: dict[str, Any]) -> list[Any]:
    """What a test compares of a micro-batch: its place, its samples, a token checksum."""
    fillers = batch["is_filler"].tolist()
    ids = [s for s, filler in zip(batch["sample_ids"], fillers, strict=True) if not filler]
    return [batch["step"], batch["micro"], batch["num_micro"], ids, int(batch["input_ids"].sum())]


def train(live: mmstore.LiveLoader, steps: int, on_micro: Any = None) -> list[list[Any]]:
    """Steps ``live.step .. steps-1`` with policy version = step: their micro-batch records."""
    history = []
    for step in range(live.step, steps):
        for batch in live.next_step(policy_version=step, timeout=60):
            if on_micro is not None:
                on_micro(step, batch)
            history.append(micro_record(batch))
    return history


def _save(out: str, state: dict[str, Any], history: list[Any]) -> None:
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"state": state, "history": history}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def consume(
    root: str, out: str, steps: int, die: tuple[int, str], workers: int, **options: Any
) -> None:
    """Train until ``steps``, checkpointing after each step; SIGKILL at ``die`` = (step,
    point): ``mid`` (after the step's first micro-batch), ``save`` (the step done, before its
    checkpoint) or ``saved`` (just after it)."""
    saved = {"state": None, "history": []}
    if os.path.exists(out):
        with open(out) as f:
            saved = json.load(f)
    store = mmstore.Store.open(root)
    live = live_loader(store, num_workers=workers, **options)
    if saved["state"] is not None:
        live.load_state_dict(saved["state"])
    history = list(saved["history"])
    for step in range(live.step, steps):
        for micro, batch in enumerate(live.next_step(policy_version=step, timeout=60)):
            history.append(micro_record(batch))
            if die == (step, "mid") and micro == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        if die == (step, "save"):
            os.kill(os.getpid(), signal.SIGKILL)
        _save(out, live.state_dict(), history)
        if die == (step, "saved"):
            os.kill(os.getpid(), signal.SIGKILL)
    live.close()


def kills(root: str, out: str, steps: int, seed: int, **options: Any) -> int:
    """Fork consumers until one finishes; each dies at a random point ahead. The kills.
    ``options``: the consumers' live loader options."""
    rng = random.Random(seed)
    killed = 0
    while True:
        done = 0
        if os.path.exists(out):
            with open(out) as f:
                done = json.load(f)["state"]["step"]
        if done >= steps:
            return killed
        ahead = 0 if rng.random() < 0.7 else 1  # mostly in the next step: many kills
        die = (min(done + ahead, steps - 1), rng.choice(["mid", "save", "saved"]))
        workers = rng.choice([0, 0, 2])

        def consumer(die: tuple[int, str] = die, workers: int = workers) -> None:
            # A consumer that hangs says where, and ends, instead of hanging the test.
            faulthandler.dump_traceback_later(120, exit=True)
            consume(root, out, steps, die, workers, **options)

        pid = fork_child(consumer)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed += 1
        elif status:
            raise SystemExit(f"consumer failed with status {status}")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "produce":
        with open(sys.argv[3]) as plan:
            produce(sys.argv[2], json.load(plan))
    elif command == "kills":
        options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
        print(kills(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), **options))
    else:
        raise SystemExit(f"unknown command {command!r}")
