"""The prompt dicts against vLLM's own types; runs only where ``import vllm`` works.

Needs no GPU: it checks the TokensPrompt schema and vLLM's multimodal data parser.
"""

from __future__ import annotations

import pytest

vllm_lib = pytest.importorskip(
    "vllm", reason="vllm is not installed (optional extra: pip install 'mmstore[vllm]')"
)

from vllm.inputs import TokensPrompt  # noqa: E402

import mmstore  # noqa: E402
from mmstore.integrations import vllm  # noqa: E402
from mmstore.synth import VISION_END, VISION_START, photo  # noqa: E402


@pytest.fixture
def rollout(store, adapter):
    media = [store.put_image(photo(seed, 84, 56)) for seed in (1, 2)]
    pad = adapter.image_token_id
    prompt = [5, VISION_START, pad, VISION_END, 6, VISION_START, pad, VISION_END, 7]
    tokens, refs = adapter.expand(prompt, media)
    return mmstore.Rollout(
        sample_id="real",
        tokens=tokens,
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens),
        images=refs,
    )


def test_prompt_is_a_tokens_prompt(store, rollout):
    prompt = vllm.to_vllm_prompt(store, rollout)
    keys = TokensPrompt.__required_keys__ | TokensPrompt.__optional_keys__
    assert TokensPrompt.__required_keys__ <= set(prompt) <= keys
    # A TypedDict built from our dict keeps every key: nothing vLLM's type lacks.
    assert dict(TokensPrompt(**prompt)) == prompt
    # Read the annotation raw: some vLLM versions annotate with names only importable
    # under TYPE_CHECKING, which get_type_hints cannot resolve.
    assert TokensPrompt.__annotations__["prompt_token_ids"] in (list[int], "list[int]")
    assert all(type(t) is int for t in prompt["prompt_token_ids"])


def test_multimodal_data_parses_in_vllm(store, rollout):
    from vllm.multimodal.parse import MultiModalDataParser

    prompt = vllm.to_vllm_prompt(store, rollout)
    try:
        parser = MultiModalDataParser()
    except TypeError as exc:  # a later vLLM made its arguments required
        pytest.skip(
            f"MultiModalDataParser() signature changed in vllm {vllm_lib.__version__}: {exc}"
        )
    items = parser.parse_mm_data(prompt["multi_modal_data"])
    assert items.get_count("image") == len(prompt["multi_modal_uuids"]["image"]) == 2
    sizes = [items["image"].get_image_size(i) for i in range(2)]
    assert [(s.width, s.height) for s in sizes] == [(r.width, r.height) for r in rollout.images]
