"""transformers' ``generate`` output -> rows (the engine of a small rollout loop, or a test).

``model.generate(**inputs, do_sample=True, num_return_sequences=G, output_scores=True,
return_dict_in_generate=True)`` on one prompt gives ``sequences`` ``[G, P + C]`` (the prompt,
its media spans expanded by the processor, then each completion padded after its end) and
``scores``, one ``[G, vocab]`` tensor per generated position: the scores the sampler drew
from (after temperature, top-k, top-p), so their log-softmax at the sampled token is the
behaviour logprob an RL loss wants (transformers' ``compute_transition_scores(...,
normalize_logits=True)``). :func:`rollouts` makes one :class:`Rollout` per sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mmstore._families import Family
from mmstore._format.models import MediaRef, Rollout
from mmstore.errors import InvalidArgumentError
from mmstore.integrations._generation import Completion, completion_rollouts, topk_columns

__all__ = ["rollouts", "topk_columns"]


def rollouts(
    output: Any,
    adapter: Family,
    prompt_ids: Sequence[int],
    images: Sequence[MediaRef] = (),
    videos: Sequence[MediaRef] = (),
    *,
    eos_token_id: int | Iterable[int] | None,
    group_id: str | None = None,
    sample_ids: Sequence[str] | None = None,
    policy_version: int | None = None,
    topk: int | None = None,
    frames: Sequence[Sequence[int]] | None = None,
    **fields: Any,
) -> list[Rollout]:
    """One row per sequence of a ``generate`` output of the single prompt ``prompt_ids``
    (the processor's ``input_ids[0]``, spans expanded; ``images``/``videos``: its media as
    the store holds them, in order). Each completion ends at its first ``eos_token_id``
    (kept, trained on) or at the output's end; the padding after it is dropped. With
    ``scores`` in the output, each sampled token's logprob under them (and with ``topk``
    the top-k ids and logprobs as the per-token columns ``topk_ids``/``topk_logprobs``);
    without, no logprobs. Other ``fields`` go to every row (see
    :func:`mmstore.integrations.vllm.rollouts`)."""
    import torch

    sequences = torch.as_tensor(output.sequences)
    prompt = [int(t) for t in prompt_ids]
    if sequences.dim() != 2 or sequences.shape[1] < len(prompt):
        raise InvalidArgumentError(
            f"sequences of shape {tuple(sequences.shape)} do not hold a {len(prompt)}-token prompt"
        )
    if sequences[:, : len(prompt)].tolist() != [prompt] * len(sequences):
        raise InvalidArgumentError(
            "the output's sequences do not start with prompt_ids: pass the input_ids the "
            "model generated from (one prompt; num_return_sequences for a group)"
        )
    generated = sequences[:, len(prompt) :]
    scores = getattr(output, "scores", None)
    logprobs = None
    if scores is not None:
        steps = torch.stack([torch.as_tensor(s).float() for s in scores], dim=1)  # [G, C, V]
        logprobs = torch.log_softmax(steps, dim=-1)
    elif topk:
        raise InvalidArgumentError("topk= needs the output's scores: generate(output_scores=True)")
    stops = set() if eos_token_id is None else _ids(eos_token_id)
    completions = []
    for row in range(len(generated)):
        tokens = generated[row].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        completions.append(
            _completion(tokens[:end], None if logprobs is None else logprobs[row, :end], topk)
        )
    return completion_rollouts(
        adapter,
        prompt,
        completions,
        images=images,
        videos=videos,
        frames=frames,
        sample_ids=sample_ids,
        group_id=group_id,
        policy_version=policy_version,
        **fields,
    )


def _completion(tokens: list[int], logprobs: Any, topk: int | None) -> Completion:
    if logprobs is None:
        return Completion(tokens)
    import torch

    index = torch.tensor(tokens, dtype=torch.int64)[:, None]
    sampled = logprobs.gather(1, index)[:, 0].tolist()
    if not topk:
        return Completion(tokens, sampled)
    values, ids = logprobs.topk(topk, dim=-1)
    return Completion(
        tokens, sampled, (ids.numpy().astype(np.int32), values.numpy().astype(np.float32))
    )


def _ids(value: int | Iterable[int]) -> set[int]:
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}
