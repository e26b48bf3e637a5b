"""Generation outputs -> rows (issue 40, item 3): transformers' ``generate`` of a tiny
random-weight model is a real engine here; vLLM's ``RequestOutput`` is read from its
documented shape (vLLM does not install beside this torch; ``scripts/vllm_check.py`` runs
the real one on a GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import mmstore
from mmstore.integrations import hf, vllm
from tests.families_common import noise, train_loss
from tests.family_cases import QWEN_VL


@pytest.fixture
def engine(tmp_path):
    """A store, the small Qwen2-VL processor, its tiny model, and one prompt with two
    images (expanded by the processor, as an engine's prompt ids are)."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    processor = QWEN_VL.small()
    images = [noise(56, 84, seed=1), noise(112, 56, seed=2)]
    media = [store.put_image(image) for image in images]
    inputs = processor(text=[QWEN_VL.text(2)], images=images, return_tensors="pt")
    model = QWEN_VL.tiny_model(torch.float32, "eager")
    return store, processor, model, media, inputs


def test_generate_output_becomes_a_group_that_the_model_trains_on(engine):
    store, processor, model, media, inputs = engine
    adapter = mmstore.adapter_for(processor)
    torch.manual_seed(0)
    out = model.generate(
        **inputs,
        do_sample=True,
        num_return_sequences=4,
        max_new_tokens=6,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=processor.tokenizer.pad_token_id,
        # A policy never samples image placeholders (the writer refuses one outside a span);
        # a random one over 32 tokens would.
        suppress_tokens=sorted(adapter.special_token_ids),
    )
    prompt = inputs["input_ids"][0].tolist()
    rows = hf.rollouts(
        out,
        adapter,
        prompt,
        media,
        eos_token_id=model.generation_config.eos_token_id,
        group_id="g0",
        policy_version=7,
        topk=3,
    )
    # transformers' own account of the sampled tokens' logprobs
    expected = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert [r.sample_id for r in rows] == ["g0-0", "g0-1", "g0-2", "g0-3"]
    for i, row in enumerate(rows):
        m = len(row.tokens) - len(prompt)
        assert row.tokens == out.sequences[i, : len(prompt) + m].tolist()
        assert row.prompt_len == len(prompt) and row.loss_mask == [False] * len(prompt) + [True] * m
        np.testing.assert_allclose(row.logprobs[len(prompt) :], expected[i, :m].numpy(), atol=1e-5)
        # the spans where the processor expanded the images: the first image token's run
        first = prompt.index(adapter.image_token_id)
        assert row.images[0].offset == first and len(row.images) == 2
        assert row.columns["topk_ids"].shape == (len(row.tokens), 3)
        sampled_rank = row.columns["topk_logprobs"][len(prompt) :].max(axis=1)
        assert (sampled_rank >= np.asarray(row.logprobs[len(prompt) :]) - 1e-6).all()
    with store.writer("gen", 0, columns=hf.topk_columns(3), adapter=adapter) as w:
        w.write_many(rows)
    assert {r.sample_id: r for r in store.rollouts()} == {r.sample_id: r for r in rows}
    ds = mmstore.RolloutDataset(
        store,
        processor,
        shuffle=False,
        columns=["topk_logprobs"],
        materialize=mmstore.Materialize(dtype="float32", node_cache_bytes=0),
    )
    loader = mmstore.RolloutLoader(ds, batch_size=4)
    (batch,) = list(loader)
    assert batch["policy_versions"].tolist() == [7] * 4
    assert torch.isfinite(train_loss(model, loader, batch))


def test_generate_output_of_another_prompt_is_refused(engine):
    _store, processor, model, media, inputs = engine
    adapter = mmstore.adapter_for(processor)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=2, return_dict_in_generate=True)
    prompt = inputs["input_ids"][0].tolist()
    with pytest.raises(mmstore.InvalidArgumentError, match="do not start with prompt_ids"):
        hf.rollouts(out, adapter, [*prompt[:-1], prompt[0]], media, eos_token_id=None, group_id="g")
    with pytest.raises(mmstore.InvalidRolloutError) as info:  # one image short
        hf.rollouts(out, adapter, prompt, media[:1], eos_token_id=None, group_id="g")
    assert "image" in str(info.value)
    rows = hf.rollouts(out, adapter, prompt, media, eos_token_id=None, group_id="g")
    assert rows[0].logprobs is None  # no scores asked for: no logprobs


# -- vLLM's RequestOutput, as documented ------------------------------------------------------


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = "stop"


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True
    extra: dict = field(default_factory=dict)


def completion(index: int, tokens: list[int], k: int, seed: int) -> CompletionOutput:
    """Logprobs as vLLM gives them with ``SamplingParams(logprobs=k)``: per position the
    top-k by rank, and the sampled token (with its own rank where it is outside them)."""
    rng = np.random.default_rng(seed)
    positions = []
    for token in tokens:
        values = np.sort(-rng.random(k + 1).astype(np.float32) * 4)[::-1]
        top = {
            int(t): Logprob(float(v), rank=r + 1)
            for r, (t, v) in enumerate(
                zip(rng.choice(30, k, replace=False), values[:k], strict=True)
            )
        }
        if token not in top:
            top[token] = Logprob(float(values[k]), rank=k + 3)
        positions.append(top)
    cumulative = sum(p[t].logprob for p, t in zip(positions, tokens, strict=True))
    return CompletionOutput(index, "", tokens, cumulative, positions)


def test_a_vllm_request_output_becomes_one_row_per_completion(engine):
    store, processor, _, media, inputs = engine
    adapter = mmstore.adapter_for(processor)
    prompt = inputs["input_ids"][0].tolist()
    outputs = [completion(i, [5 + i, 7, 9, i + 1], k=2, seed=i) for i in range(3)]
    request = RequestOutput("r0", None, prompt, None, outputs)
    rows = vllm.rollouts(request, adapter, media, group_id="q0", policy_version=2, topk=2)
    for row, out in zip(rows, outputs, strict=True):
        assert row.tokens == prompt + out.token_ids
        sampled = [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert row.logprobs[len(prompt) :] == pytest.approx(sampled)
        assert sum(row.logprobs) == pytest.approx(out.cumulative_logprob)
        ranked = [sorted(p.items(), key=lambda kv: kv[1].rank)[:2] for p in out.logprobs]
        assert row.columns["topk_ids"][len(prompt) :].tolist() == [
            [t for t, _ in r] for r in ranked
        ]
        assert row.images == adapter.locate(prompt, images=media).images
    with store.writer("vllm", 0, columns=vllm.topk_columns(2), adapter=adapter) as w:
        w.write_many(rows)
    assert len(store.rollouts(run_id="vllm")) == 3
    plain = vllm.rollouts(
        RequestOutput("r1", None, prompt, None, [CompletionOutput(0, "", [3, 4], None, None)]),
        adapter,
        media,
        sample_ids=["only"],
    )
    assert plain[0].logprobs is None and plain[0].sample_id == "only"
    with pytest.raises(mmstore.InvalidArgumentError, match="logprobs=k"):
        vllm.rollouts(
            RequestOutput("r2", None, prompt, None, [CompletionOutput(0, "", [3], None, None)]),
            adapter,
            media,
            group_id="g",
            topk=2,
        )
