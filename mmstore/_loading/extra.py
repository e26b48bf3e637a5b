"""A batch's extra columns (those asked for with ``columns=``) and each sample's generating
policy version, in the padded and the packed form.

Per-token columns are laid out like ``input_ids``: padded, ``[B, T, *shape]`` with zeros
after each sample; packed, ``[1, T, *shape]``, one segment after another, zeros on filler.
Per-sample columns are one entry per sample (packed: per segment, zero or ``""`` for
filler): a tensor ``[B, *shape]``, or a list for strings. ``policy_versions`` is the row's
``policy_version`` (-1 unknown): padded ``[B]``, packed per token ``[1, T]`` (-1 on filler).
``run_ids`` and ``store_steps`` say where each sample was written (the producer's step, not
the trainer's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmstore._rows.check import Sample
from mmstore.errors import InvalidRolloutError

POLICY_VERSIONS = "policy_versions"
RUN_IDS, STORE_STEPS = "run_ids", "store_steps"
FILLER_VERSION = -1


def padded_columns(samples: Sequence[Sample[Any, Any]], width: int) -> dict[str, Any]:
    """The padded batch's columns, ``policy_versions`` and each sample's run and store
    step (``width``: its token axis)."""
    out: dict[str, Any] = {
        POLICY_VERSIONS: torch.tensor([s.policy_version for s in samples], dtype=torch.int64),
        **origins(samples, 0),
    }
    for name in _names(samples):
        values = [s.columns[name] for s in samples]
        if isinstance(values[0], str):
            out[name] = values
        elif _per_token(samples, name):
            first = _same_shape(values, name, samples, skip=1)
            batch = torch.zeros((len(values), width, *first.shape[1:]), dtype=first.dtype)
            for i, value in enumerate(values):
                batch[i, : len(value)] = value
            out[name] = batch
        else:
            _same_shape(values, name, samples, skip=0)
            out[name] = torch.stack(values)
    return out


def packed_columns(
    samples: Sequence[Sample[Any, Any]], filler_lengths: Sequence[int]
) -> dict[str, Any]:
    """The packed micro-batch's columns and per-token ``policy_versions``: the samples'
    segments, then a filler segment of each of ``filler_lengths`` tokens."""
    versions = [torch.full((len(s.input_ids),), s.policy_version) for s in samples]
    versions += [torch.full((n,), FILLER_VERSION) for n in filler_lengths]
    out: dict[str, Any] = {
        POLICY_VERSIONS: torch.cat(versions).to(torch.int64)[None],
        **origins(samples, len(filler_lengths)),
    }
    for name in _names(samples):
        values = [s.columns[name] for s in samples]
        if isinstance(values[0], str):
            out[name] = values + [""] * len(filler_lengths)
            continue
        per_token = _per_token(samples, name)
        first = _same_shape(values, name, samples, skip=1 if per_token else 0)
        rest = first.shape[1:] if per_token else first.shape
        fill = [
            torch.zeros((n, *rest) if per_token else rest, dtype=first.dtype)
            for n in filler_lengths
        ]
        out[name] = torch.cat(values + fill)[None] if per_token else torch.stack(values + fill)
    return out


def origins(samples: Sequence[Sample[Any, Any]], fillers: int) -> dict[str, Any]:
    """Where each sample was written: its run (``run_ids``) and the producer's step
    (``store_steps``, the ``step`` of ``store.writer(run_id, step)``; not the trainer's
    step), then ``fillers`` filler entries (None, -1)."""
    steps = [s.where.get("step") for s in samples]
    return {
        RUN_IDS: [s.where.get("run_id") for s in samples] + [None] * fillers,
        STORE_STEPS: torch.tensor(
            [-1 if step is None else step for step in steps] + [-1] * fillers, dtype=torch.int64
        ),
    }


def _names(samples: Sequence[Sample[Any, Any]]) -> list[str]:
    return list(samples[0].columns) if samples else []


def _per_token(samples: Sequence[Sample[Any, Any]], name: str) -> bool:
    return name in samples[0].token_columns


def _same_shape(
    values: Sequence[torch.Tensor], name: str, samples: Sequence[Sample[Any, Any]], *, skip: int
) -> torch.Tensor:
    first = values[0]
    for value, sample in zip(values, samples, strict=True):
        if value.shape[skip:] != first.shape[skip:] or value.dtype != first.dtype:
            raise InvalidRolloutError(
                f"column {name!r}: values of shape {tuple(value.shape[skip:])} "
                f"({value.dtype}) and {tuple(first.shape[skip:])} ({first.dtype}) in one batch",
                column=name,
                **sample.where,
            )
    return first
