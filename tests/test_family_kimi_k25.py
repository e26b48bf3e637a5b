"""What only Kimi-K2.5 does; the contract every family keeps is ``tests/test_family_contract.py``.

MoonViT's native-resolution layout (torchvision backend only): an image is scaled down to a
patch budget and padded to whole merge windows; one ``<|media_pad|>`` per window, inside the
chat template's ``<|media_begin|>image<|media_content|>…<|media_end|>``. vLLM takes its
images as "vision_chunk" items.
"""

from __future__ import annotations

import pytest
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

import mmstore
from mmstore.integrations import vllm
from mmstore.synth import photo
from tests.family_cases import KIMI_K25, KIMI_K25_PUBLISHED, KIMI_K25_SMALL, rollout


def test_the_footer_record_holds_the_layout_and_the_token_ids():
    adapter = mmstore.adapter_for(Kimi_K25ImageProcessor())
    assert adapter.layout.params() == {
        "family": "kimi-k25",
        "patch_size": 14,
        "merge_size": 2,
        "max_patches": 16384,
        "max_size_per_side": 512,
        "image_token_id": 163605,
        "pad_token_id": 163839,
    }
    # 1-D RoPE and no token types: the DeepSeek-V3 text model takes neither.
    assert adapter.position_rows == 1 and adapter.token_type_input is None


def test_the_dummy_image_is_one_token():
    adapter = mmstore.adapter_for(KIMI_K25.small())
    assert adapter.grid(*adapter.dummy_size) == (1, 2, 2)
    assert adapter.expansion(*adapter.dummy_size) == [KIMI_K25_SMALL["<|media_pad|>"]]
    assert adapter.expansion(56, 42) == [KIMI_K25_SMALL["<|media_pad|>"]] * 4


def test_unequal_height_and_width_limits_are_refused():
    lopsided = Kimi_K25ImageProcessor()
    lopsided.size = {"max_height": 512, "max_width": 256}
    with pytest.raises(mmstore.UnsupportedProcessorError, match="max_height and max_width"):
        mmstore.adapter_for(lopsided)


def test_vllm_takes_each_image_as_a_vision_chunk_in_its_template(tmp_path):
    # vLLM's Kimi-K2.5 (vllm/model_executor/models/kimi_k25.py) writes an image as
    # "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" (get_placeholder_str)
    # and its _get_prompt_updates replaces [media_placeholder_token_id] by that id repeated.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    processor = KIMI_K25.published()
    media = [store.put_image(photo(1, 56, 42)), store.put_image(photo(2, 300, 200))]
    row = rollout(KIMI_K25, processor, "v", media)
    request = vllm.to_vllm_prompt(store, row)
    ids = request["prompt_token_ids"]
    pads = [i for i, t in enumerate(ids) if t == KIMI_K25_PUBLISHED["<|media_pad|>"]]
    assert len(pads) == 2
    assert all(ids[p - 1] == KIMI_K25_PUBLISHED["<|media_content|>"] for p in pads)
    assert all(ids[p + 1] == KIMI_K25_PUBLISHED["<|media_end|>"] for p in pads)
    # Each image a VisionChunkImage dict: its type, the image and its uuid.
    chunks = request["multi_modal_data"]["vision_chunk"]
    assert [c["type"] for c in chunks] == ["image", "image"]
    assert [c["image"].size for c in chunks] == [(56, 42), (300, 200)]
    assert [c["uuid"] for c in chunks] == [m.hash for m in media]
