"""Continuations: a row written as the continuation of another (``Rollout(parent_id=,
prefix_len=)``), stored whole.

An agent loop has, at each turn, the turn's own tokens and screenshot; the sample is the
first ``prefix_len`` tokens of its parent (an earlier turn, or a GRPO group's prompt)
followed by them. The writer builds the whole row: the parent's first ``prefix_len`` tokens,
images and videos (each whole: a span never crosses the cut), logprobs and per-token column
values, with the loss mask off there (each token is trained through the sample that owns
it: a parent with a loss is a sample of its own), then the continuation's own part, its
refs shifted by ``prefix_len``. Every reader then sees whole samples, exactly as if they had
been written flat, and the packed loader's ``prefix_sharing`` runs the shared prefixes once.

Stored whole rather than as segments: Parquet's zstd already finds the repeated history
(``benchmarks/bench_forest.py``: a 10-turn screenshot agent stored one sample per turn
takes 1.12x the bytes of each trajectory stored once), and no reader, Delta engine, export,
gc or pin has to resolve ancestors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mmstore._format.columns import Column
from mmstore._format.models import ImageRef, Rollout, VideoRef
from mmstore.errors import InvalidRolloutError

#: A row as the writer buffers it: the schema's fields (long lists as numpy arrays, refs as
#: dicts) and the run's declared column values.
Row = dict[str, Any]


def whole(child: Rollout, parent: Row, columns: Mapping[str, Column]) -> Rollout:
    """The whole sample ``child`` continues ``parent`` into; refuses a cut past the parent's
    end or through one of its image or video spans."""
    cut = child.prefix_len
    assert cut is not None and child.parent_id is not None
    length = len(parent["tokens"])
    if cut > length:
        raise InvalidRolloutError(
            f"prefix_len={cut} is past the end of parent {child.parent_id!r} ({length} tokens)"
        )
    images = [ImageRef(**ref) for ref in parent["images"]]
    videos = [VideoRef(**ref) for ref in parent["videos"]]
    spans: list[tuple[str, list[Any]]] = [("image", images), ("video", videos)]
    for kind, refs in spans:
        for index, ref in enumerate(refs):
            if ref.offset < cut < ref.offset + ref.length:
                raise InvalidRolloutError(
                    f"prefix_len={cut} cuts {kind} {index} of parent {child.parent_id!r} (tokens "
                    f"{ref.offset}..{ref.offset + ref.length - 1}): a span belongs to one "
                    "segment; cut before or after it",
                    **{f"{kind}_index": index},
                )
    return Rollout(
        sample_id=child.sample_id,
        group_id=child.group_id,
        tokens=np.concatenate([parent["tokens"][:cut], np.asarray(child.tokens, np.int32)]),
        prompt_len=cut + child.prompt_len,
        loss_mask=[False] * cut + list(child.loss_mask),
        logprobs=_logprobs(child, parent, cut),
        reward=child.reward,
        advantage=child.advantage,
        images=[r for r in images if r.offset + r.length <= cut] + _shifted(child.images, cut),
        videos=[r for r in videos if r.offset + r.length <= cut] + _shifted(child.videos, cut),
        metadata=child.metadata,
        policy_version=_oldest(child.policy_version, parent["policy_version"]),
        columns=_columns(child, parent, cut, columns),
    )


def _shifted(refs: list[Any], by: int) -> list[Any]:
    return [ref.model_copy(update={"offset": ref.offset + by}) for ref in refs]


def _logprobs(child: Rollout, parent: Row, cut: int) -> list[float] | None:
    """The parent's logprobs over the prefix, then the child's; none unless both have them
    (a prefix without them has no honest value to store)."""
    if child.logprobs is None or parent["logprobs"] is None:
        return None
    return [*parent["logprobs"][:cut].tolist(), *child.logprobs]


def _oldest(mine: int | None, theirs: int | None) -> int | None:
    """A sample carries the oldest policy that generated any of it (the staleness bound)."""
    known = [v for v in (mine, theirs) if v is not None]
    return min(known) if known else None


def _columns(child: Rollout, parent: Row, cut: int, columns: Mapping[str, Column]) -> dict:
    """Per-token values: the parent's over the prefix, then the child's; per-sample: the
    child's. Undeclared names are left for the writer to refuse."""
    out = dict(child.columns)
    for name, column in columns.items():
        if column.per == "token" and name in child.columns and name in parent:
            own = np.asarray(child.columns[name], dtype=column.dtype)
            out[name] = np.concatenate([np.asarray(parent[name], dtype=column.dtype)[:cut], own])
    return out
