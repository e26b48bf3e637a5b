"""vLLM / SGLang requests from stored rollouts: keys, types, alignment, prefix cuts, errors.

None of this needs vLLM; tests/test_vllm_real.py checks the same dicts against vLLM's types.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import mmstore
from mmstore._rows.check import MAX_ROW_IMAGES, MAX_ROW_TOKENS
from mmstore.integrations import vllm
from mmstore.synth import VISION_END, VISION_START, photo, screenshot
from tests.store_workers import image_bytes, make_row


@pytest.fixture
def originals():
    """Two images of different sizes, as drawn (before any store round trip)."""
    return [screenshot(3, 120, 90), photo(4, 64, 100)]


@pytest.fixture
def rollout(store, adapter, originals):
    """Prompt: text <vs><img0><ve> text <vs><img1><ve> text, then a completion."""
    media = [store.put_image(image) for image in originals]
    pad = adapter.image_token_id
    prompt = [11, 12, VISION_START, pad, VISION_END, 13, VISION_START, pad, VISION_END, 14]
    tokens, refs = adapter.expand(prompt, media)
    completion = [21, 22, 23]
    return mmstore.Rollout(
        sample_id="s0",
        tokens=tokens + completion,
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * len(completion),
        images=refs,
    )


def test_prompt_keys_types_and_alignment(store, adapter, rollout, originals):
    prompt = vllm.to_vllm_prompt(store, rollout)

    assert set(prompt) == {"prompt_token_ids", "multi_modal_data", "multi_modal_uuids"}
    ids = prompt["prompt_token_ids"]
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    images = prompt["multi_modal_data"]["image"]
    uuids = prompt["multi_modal_uuids"]["image"]
    assert set(prompt["multi_modal_data"]) == set(prompt["multi_modal_uuids"]) == {"image"}

    # One placeholder per image, each between vision start/end, in span order.
    pads = [i for i, t in enumerate(ids) if t == adapter.image_token_id]
    assert len(pads) == len(images) == len(uuids) == len(rollout.images) == 2
    assert all(ids[p - 1] == VISION_START and ids[p + 1] == VISION_END for p in pads)
    assert uuids == [ref.hash for ref in rollout.images]
    assert all(isinstance(u, str) for u in uuids)
    for image, original in zip(images, originals, strict=True):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), np.asarray(original))

    # Collapsing is the exact inverse of the adapter's expansion: an engine with the same
    # layout re-expands the prompt to the stored tokens.
    media = [
        mmstore.MediaRef(hash=r.hash, uri=r.uri, width=r.width, height=r.height)
        for r in rollout.images
    ]
    again, _ = adapter.expand(ids, media)
    assert again == rollout.tokens


def test_upto_keeps_whole_images_only(store, rollout):
    first, second = rollout.images
    whole = vllm.to_vllm_prompt(store, rollout)

    at_prompt = vllm.to_vllm_prompt(store, rollout, upto=rollout.prompt_len)
    assert at_prompt["multi_modal_uuids"]["image"] == [first.hash, second.hash]
    assert at_prompt["prompt_token_ids"] == whole["prompt_token_ids"][:-3]

    between = second.offset  # after image 0 and the text before image 1
    cut = vllm.to_vllm_prompt(store, rollout, upto=between)
    assert cut["multi_modal_uuids"]["image"] == [first.hash]
    assert len(cut["multi_modal_data"]["image"]) == 1
    assert cut["prompt_token_ids"][-1] == VISION_START

    at_span_end = vllm.to_vllm_prompt(store, rollout, upto=second.offset + second.length)
    assert len(at_span_end["multi_modal_data"]["image"]) == 2

    text_only = vllm.to_vllm_prompt(store, rollout, upto=first.offset)
    assert set(text_only) == {"prompt_token_ids"}
    assert text_only["prompt_token_ids"] == rollout.tokens[: first.offset]
    assert vllm.to_vllm_prompt(store, rollout, upto=0) == {"prompt_token_ids": []}


@pytest.mark.parametrize("where", ["first", "inside"])
def test_upto_inside_a_span_is_refused(store, rollout, where):
    second = rollout.images[1]
    upto = second.offset + (1 if where == "first" else second.length - 1)
    with pytest.raises(mmstore.InvalidRolloutError, match="cuts image span") as info:
        vllm.to_vllm_prompt(store, rollout, upto=upto)
    assert info.value.image_index == 1 and info.value.sample_id == "s0"


@pytest.mark.parametrize("upto", [-1, 10**6, 2.5, True])
def test_upto_out_of_range_is_refused(store, rollout, upto):
    with pytest.raises(mmstore.InvalidRolloutError, match="upto"):
        vllm.to_vllm_prompt(store, rollout, upto=upto)


def test_forged_hash_and_missing_media_name_the_image(store, rollout):
    first, second = rollout.images
    forged = rollout.model_copy(
        update={"images": [first, second.model_copy(update={"hash": "0" * 32})]}
    )
    with pytest.raises(mmstore.HashMismatchError) as info:
        vllm.to_vllm_prompt(store, forged)
    assert (info.value.sample_id, info.value.image_index) == ("s0", 1)

    os.remove(store.backend.abspath(rollout.images[0].uri))
    with pytest.raises(mmstore.MediaNotFoundError) as missing:
        vllm.to_vllm_prompt(store, rollout)
    assert isinstance(missing.value, FileNotFoundError)
    assert (missing.value.image_index, missing.value.uri) == (0, rollout.images[0].uri)


def test_size_that_disagrees_with_the_image_is_refused(store, rollout):
    ref = rollout.images[0]
    lying = rollout.model_copy(
        update={"images": [ref.model_copy(update={"width": ref.width + 1}), rollout.images[1]]}
    )
    with pytest.raises(mmstore.InvalidRolloutError, match="the ref") as info:
        vllm.to_vllm_prompt(store, lying)
    assert info.value.image_index == 0


def test_spans_an_engine_would_misread_are_refused(store, adapter, rollout):
    first = rollout.images[0]
    broken = list(rollout.tokens)
    broken[first.offset + 2] = 7
    with pytest.raises(mmstore.InvalidRolloutError, match="not the qwen-vl expansion"):
        vllm.to_vllm_prompt(store, rollout.model_copy(update={"tokens": broken}))

    stray = list(rollout.tokens)
    stray[0] = adapter.image_token_id
    with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
        vllm.to_vllm_prompt(store, rollout.model_copy(update={"tokens": stray}))

    swapped = rollout.model_copy(update={"images": rollout.images[::-1]})
    with pytest.raises(mmstore.InvalidRolloutError, match="overlaps or precedes"):
        vllm.to_vllm_prompt(store, swapped)

    other = first.model_copy(update={"family": "llava"})
    with pytest.raises(mmstore.InvalidRolloutError, match="unknown layout"):
        vllm.to_vllm_prompt(store, rollout.model_copy(update={"images": [other]}))


def test_text_only_rollout(store):
    row = mmstore.Rollout(sample_id="t", tokens=[1, 2, 3, 4], prompt_len=2, loss_mask=[0, 0, 1, 1])
    assert vllm.to_vllm_prompt(store, row) == {"prompt_token_ids": [1, 2, 3, 4]}
    request = vllm.to_prefill_request(store, row)
    assert "image_data" not in request and "mm_token_expansion_start_len" not in request
    assert request["input_ids"] == [1, 2, 3, 4] and request["logprob_start_len"] == 1


def test_prefill_request_marks_the_whole_sequence_expanded(store, rollout):
    request = vllm.to_prefill_request(store, rollout, temperature=0.7)

    assert request["input_ids"] == rollout.tokens
    assert request["mm_token_expansion_start_len"] == len(rollout.tokens)
    assert request["logprob_start_len"] == rollout.prompt_len - 1
    assert request["return_logprob"] is True
    assert request["sampling_params"]["max_new_tokens"] == 0
    assert request["sampling_params"]["temperature"] == 0.7
    assert len(request["image_data"]) == len(rollout.images)
    for url, ref in zip(request["image_data"], rollout.images, strict=True):
        head, payload = url.split(",", 1)
        assert head in ("data:image/png;base64", "data:image/jpeg;base64")
        assert mmstore._format.media.content_hash(base64.b64decode(payload)) == ref.hash


@pytest.mark.parametrize("prompt_len", [0, "all"])
def test_prefill_needs_a_prompt_and_a_response(store, rollout, prompt_len):
    n = len(rollout.tokens) if prompt_len == "all" else prompt_len
    row = rollout.model_copy(update={"prompt_len": n})
    with pytest.raises(mmstore.InvalidRolloutError, match="prompt and a response"):
        vllm.to_prefill_request(store, row)


def test_vllm_prefill_scores_the_whole_rollout(store, rollout):
    request = vllm.to_vllm_prefill(store, rollout)
    assert request["prompt"] == vllm.to_vllm_prompt(store, rollout)  # PIL compares pixels
    assert request["sampling_params"]["prompt_logprobs"] == 0
    assert request["sampling_params"]["max_tokens"] >= 1


@pytest.mark.slow  # a subprocess
def test_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now raises ImportError
        "from mmstore.integrations import vllm\n"
        "assert callable(vllm.to_vllm_prompt) and callable(vllm.resolve_wire_refs)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_vllm_prompt_refuses_rows_above_the_loaders_caps(store, adapter):
    media = store.put_media(image_bytes(0, 56, 56))
    row = make_row(adapter, [media], "s")
    too_long = mmstore.Rollout.model_construct(
        **{**dict(row), "tokens": [7] * (MAX_ROW_TOKENS + 1), "images": []}
    )
    too_many = mmstore.Rollout.model_construct(**{**dict(row), "images": row.images * 6000})
    for forged, what in ((too_long, "exceed"), (too_many, "6000 images")):
        for build in (vllm.to_vllm_prompt, vllm.to_prefill_request):
            with pytest.raises(mmstore.InvalidRolloutError, match=what) as info:
                build(store, forged)
            assert info.value.sample_id == "s"
    assert MAX_ROW_IMAGES > 6000  # refused as the loader does: more images than tokens
