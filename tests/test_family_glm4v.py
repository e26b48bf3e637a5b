"""What only GLM-4.1V / GLM-4.5V do; the contract every family keeps is
``tests/test_family_contract.py``.

GLM lays images out as Qwen-VL does (``smart_resize`` into a pixel budget, merge windows of
one ``<|image|>`` each, M-RoPE), with its own resize rules and token ids: its chat template
wraps the image token in begin/end-of-image tokens that stay text around the span.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._loading.microbatch import pack
from mmstore._rows.check import Sample
from tests.family_cases import (
    GLM4V,
    GLM4V_IMAGE,
    GLM4V_PUBLISHED,
    GLM4V_SMALL,
    GLM4V_SMALL_SIZE,
    glm4v_processor,
)

# GLM-4.5V's tokenizer moves <|image|> and <|video|> (its config's image_token_id 151363).
GLM45V = {**GLM4V_PUBLISHED, "<|image|>": 151363, "<|video|>": 151364}


def _image(width, height, seed=0):
    """A smooth image with some structure (interpolation differences stay realistic)."""
    y, x = np.mgrid[0:height, 0:width]
    r = 127 + 120 * np.sin(x / 17.0 + seed) * np.cos(y / 23.0)
    g = 255 * x / max(width - 1, 1)
    b = 255 * y / max(height - 1, 1)
    return Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8))


def test_begin_and_end_of_image_stay_text_around_the_span():
    processor = GLM4V.published()
    out = processor(text=[f"hello {GLM4V_IMAGE} look"], images=[_image(300, 200)])
    ids = [int(t) for t in out["input_ids"][0]]
    # The processor replaces only <|image|>: begin/end-of-image are the span's neighbours.
    assert ids[:2] == [2, GLM4V_PUBLISHED["<|begin_of_image|>"]]
    assert ids[-2:] == [GLM4V_PUBLISHED["<|end_of_image|>"], 3]
    assert set(ids[2:-2]) == {GLM4V_PUBLISHED["<|image|>"]}


def test_the_tokenizer_gives_the_begin_of_image_id_too():
    adapter = mmstore.adapter_for(GLM4V.small())
    assert adapter.layout.token_id("image_start_token_id") == GLM4V_SMALL["<|begin_of_image|>"]
    assert adapter.expansion(28, 28) == [GLM4V_SMALL["<|image|>"]] * 9


def test_glm45v_takes_its_image_token_from_its_tokenizer():
    processor = glm4v_processor(Glm4vImageProcessorPil(), GLM45V)
    adapter = mmstore.adapter_for(processor)
    assert adapter.image_token_id == 151363
    out = processor(text=[f"hello {GLM4V_IMAGE}"], images=[_image(300, 200)], return_tensors="np")
    assert out["input_ids"][0, 2:-1].tolist() == adapter.expansion(300, 200)
    assert mmstore.adapter_for(Glm4vImageProcessorPil(), image_token_id=151363).expansion(
        300, 200
    ) == adapter.expansion(300, 200)


def test_a_fixed_size_is_refused():
    # GLM's resize refuses it at call time, the adapter when it is built.
    fixed = Glm4vImageProcessorPil(size={"height": 224, "width": 224})
    with pytest.raises(ValueError, match="shortest_edge"):
        fixed(images=[_image(56, 56)])
    with pytest.raises(mmstore.UnsupportedProcessorError, match="shortest_edge"):
        mmstore.adapter_for(fixed)


def test_fingerprint_differs_from_qwen_vl_with_the_same_numbers():
    same = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}
    glm = mmstore.adapter_for(Glm4vImageProcessorPil(size=same))
    qwen = mmstore.adapter_for(Qwen2VLImageProcessorPil(size=same))
    assert dict(glm.layout.parameters) == dict(qwen.layout.parameters)
    assert glm.fingerprint != qwen.fingerprint


@pytest.mark.parametrize(("width", "height"), [(1, 201), (201, 1), (3, 700), (300, 1)])
def test_the_processor_refuses_the_aspect_ratios_the_adapter_refuses(width, height):
    with pytest.raises(ValueError, match="aspect ratio"):
        Glm4vImageProcessorPil()(images=[_image(width, height)])


def test_sizes_that_need_no_resampling_give_the_same_pixels_in_both_backends():
    """The contract bounds the backends' difference where they resample; where the layout
    keeps the size (or the image is constant), they agree to bf16."""
    pil = Glm4vImageProcessorPil(size=GLM4V_SMALL_SIZE)
    fast = Glm4vImageProcessor(size=GLM4V_SMALL_SIZE)
    for width, height in [(112, 112), (112, 84), (56, 140), (1, 1)]:
        image = _image(width, height)
        a = pil(images=[image], return_tensors="pt")
        b = fast(images=[image], return_tensors="pt")
        assert a["image_grid_thw"].tolist() == b["image_grid_thw"].tolist()
        torch.testing.assert_close(a["pixel_values"].bfloat16(), b["pixel_values"].bfloat16())


def test_position_ids_refuse_adjacent_images():
    adapter = mmstore.adapter_for(GLM4V.small())
    expansion = adapter.expansion(28, 28)
    grid = {"image_grid_thw": torch.tensor([adapter.grid(28, 28)])}
    with pytest.raises(mmstore.InvalidRolloutError, match="between adjacent images"):
        adapter.position_ids(torch.tensor(expansion + expansion), [grid, grid])
    # In a packed micro-batch the refusal names the sample (readers refuse such rows first).
    ids = torch.tensor(expansion + expansion)
    where = {"file": "f.parquet", "run_id": "r", "step": 0, "sample_id": "touching"}
    sample = Sample(
        "touching",
        None,
        ids,
        torch.ones(len(ids), dtype=torch.bool),
        None,
        0,
        0.0,
        0.0,
        [grid, grid],
        where=where,
    )
    with pytest.raises(mmstore.InvalidRolloutError, match="between adjacent images") as err:
        pack([sample], adapter, add_dummy=False, dtype=torch.float32)
    assert err.value.context == where
