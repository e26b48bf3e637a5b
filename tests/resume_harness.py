"""One save/load-state harness for every stateful stage (torchdata.nodes style).

A stage is an iterable with ``state_dict()`` / ``load_state_dict()``. ``check_resume`` runs
it uninterrupted once, then for each cut point: consumes ``k`` items from a fresh stage,
saves its state, loads that state into another fresh stage (possibly built differently,
e.g. another ``num_workers``) and consumes the rest. The two halves must equal the
uninterrupted run: nothing twice, nothing skipped, same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

Stage = Any  # iterable + state_dict() + load_state_dict()


def run(stage: Stage, limit: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    items = list(itertools.islice(iter(stage), limit))
    return items, stage.state_dict()


def check_resume(
    make: Callable[[], Stage],
    key: Callable[[Any], Hashable],
    cuts: Iterable[int],
    *,
    make_resumed: Callable[[], Stage] | None = None,
) -> list[Hashable]:
    """Assert resuming at every cut reproduces the uninterrupted stream; return that stream."""
    reference = [key(item) for item in run(make())[0]]
    assert len(reference) == len(set(reference)), "the uninterrupted stream repeats items"
    for cut in cuts:
        head, state = run(make(), cut)
        resumed = (make_resumed or make)()
        resumed.load_state_dict(state)
        tail, _ = run(resumed)
        got = [key(item) for item in head] + [key(item) for item in tail]
        assert got == reference, f"resume at {cut} diverged from the uninterrupted stream"
    return reference


def flatten_ids(batches: Sequence[dict[str, Any]]) -> list[str]:
    return [sid for batch in batches for sid in batch["sample_ids"]]
