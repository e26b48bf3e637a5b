"""Generation outputs -> rows: one :class:`Rollout` per completion of a prompt.

An engine hands back the prompt's ids with its media spans expanded already, and per
completion its token ids and the sampler's logprob of each (optionally the top-k). The
prompt's spans are found with :meth:`Family.locate` (each must be exactly its medium's
layout), and each completion becomes a row: the prompt then the completion, trained on the
completion only (``prompt_len``, ``loss_mask``), its logprobs where it was sampled (0 on the
prompt, outside the loss), the group's id, the generating policy version, and the top-k as
two per-token columns when asked for. The engines' own shapes are read in
:mod:`.vllm` (``RequestOutput``) and :mod:`.hf` (``generate``'s output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmstore._families import Family
from mmstore._format.columns import Column, per_token
from mmstore._format.models import MediaRef, Rollout
from mmstore.errors import InvalidArgumentError

#: The per-token columns the top-k logprobs go to (declare them: :func:`topk_columns`).
TOPK_IDS, TOPK_LOGPROBS = "topk_ids", "topk_logprobs"


def topk_columns(k: int) -> dict[str, Column]:
    """The declaration of the top-``k`` columns, for ``store.writer(columns=...)``."""
    return {TOPK_IDS: per_token("int32", (k,)), TOPK_LOGPROBS: per_token("float32", (k,))}


@dataclass(frozen=True)
class Completion:
    """One completion as an engine gave it: its tokens, the logprob of each (None: not
    asked for) and the top-k ids and logprobs at each position (``[n, k]``, or None)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    topk: tuple[np.ndarray, np.ndarray] | None = None


def completion_rollouts(
    adapter: Family,
    prompt_ids: Sequence[int],
    completions: Sequence[Completion],
    *,
    images: Sequence[MediaRef] = (),
    videos: Sequence[MediaRef] = (),
    frames: Sequence[Sequence[int]] | None = None,
    sample_ids: Sequence[str] | None = None,
    group_id: str | None = None,
    policy_version: int | None = None,
    **fields: Any,
) -> list[Rollout]:
    """One row per completion of one prompt (see the module docstring). ``sample_ids``:
    one per completion (default ``<group_id>-<i>``); ``fields``: any other
    :class:`Rollout` field, the same for every row (``reward`` and ``advantage`` are
    usually set per row later: ``row.model_copy(update=...)``)."""
    if sample_ids is None:
        if group_id is None:
            raise InvalidArgumentError("give sample_ids, or a group_id to name them after")
        sample_ids = [f"{group_id}-{i}" for i in range(len(completions))]
    if len(sample_ids) != len(completions):
        raise InvalidArgumentError(
            f"{len(sample_ids)} sample ids for {len(completions)} completions"
        )
    prompt = adapter.locate(prompt_ids, images=images, videos=videos, frames=frames)
    n = len(prompt.tokens)
    rows = []
    for sample_id, completion in zip(sample_ids, completions, strict=True):
        m = len(completion.token_ids)
        columns = dict(fields.get("columns") or {})
        if completion.topk is not None:
            ids, logprobs = completion.topk
            columns[TOPK_IDS] = np.concatenate([np.zeros((n, ids.shape[1]), np.int32), ids])
            columns[TOPK_LOGPROBS] = np.concatenate(
                [np.zeros((n, logprobs.shape[1]), np.float32), logprobs]
            )
        rows.append(
            Rollout(
                **{k: v for k, v in fields.items() if k != "columns"},
                sample_id=sample_id,
                group_id=group_id,
                tokens=[*prompt.tokens, *completion.token_ids],
                prompt_len=n,
                loss_mask=[False] * n + [True] * m,
                logprobs=None if completion.logprobs is None else [0.0] * n + completion.logprobs,
                images=prompt.images,
                videos=prompt.videos,
                policy_version=policy_version,
                columns=columns,
            )
        )
    return rows
