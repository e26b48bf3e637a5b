"""The train-dtype cast inside a torchvision processor (``Family.process(images, dtype)``).

A torchvision backend casts its floats to the train dtype right after normalizing, before the
family's patch shuffles, temporal copies and padding: for every family the result must be bit
for bit the processor's own output cast afterwards, with the caller's processor untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._families import takes_tensors
from mmstore._format.media import decode_rgb_tensor, encode_image
from mmstore._tensors import cast_floats
from tests.families_common import noise

# Small settings of each family's torchvision processor, so that odd sizes stay cheap.
PROCESSORS = {
    "qwen-vl": lambda: Qwen2VLImageProcessor(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28),
    "glm4v": lambda: Glm4vImageProcessor(
        size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}
    ),
    "gemma3": lambda: Gemma3ImageProcessor(size={"height": 56, "width": 56}),
    "pixtral": lambda: PixtralImageProcessor(
        patch_size=8, size={"longest_edge": 64}, spatial_merge_size=2
    ),
    "kimi-k25": lambda: Kimi_K25ImageProcessor(
        max_patches=64, size={"max_height": 16, "max_width": 16}
    ),
}
# Odd sizes, landscape and portrait: Pixtral pads the smaller image of a pair to the larger.
SIZES = [(97, 61), (40, 150), (223, 129)]


def _tensors(sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Decoded uint8 CHW images, as the loader hands them to a torchvision processor."""
    return [decode_rgb_tensor(encode_image(noise(w, h, seed=w))[0]) for w, h in sizes]


@pytest.mark.parametrize("family", sorted(PROCESSORS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_inside_equals_the_processor_then_the_cast(family: str, dtype: torch.dtype) -> None:
    processor = PROCESSORS[family]()
    adapter = mmstore.adapter_for(processor)
    assert adapter.family == family and takes_tensors(adapter.image_processor)
    for images in ([im] for im in _tensors(SIZES)), [_tensors(SIZES[:2])]:
        for batch in images:
            want = cast_floats(adapter.process(batch), dtype)
            got = adapter.process(batch, dtype)
            assert got.keys() == want.keys() == set(adapter.image_inputs)
            for key, value in want.items():
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), key
            assert got["pixel_values"].dtype == dtype
    # The caller's processor was copied, not changed.
    assert "rescale_and_normalize" not in vars(processor)


def test_the_shuffles_after_normalizing_move_the_train_dtype(monkeypatch: Any) -> None:
    """The point of the cast inside: Qwen-VL's patchify (a copy, doubled in time) gets bf16."""
    seen: list[torch.dtype] = []
    patchify = Qwen2VLImageProcessor.patchify

    def spy(self: Any, images: torch.Tensor, **kwargs: Any) -> Any:
        seen.append(images.dtype)
        return patchify(self, images, **kwargs)

    monkeypatch.setattr(Qwen2VLImageProcessor, "patchify", spy)
    adapter = mmstore.adapter_for(PROCESSORS["qwen-vl"]())
    (image,) = _tensors(SIZES[:1])
    adapter.process([image], torch.bfloat16)
    adapter.process([image])
    assert seen == [torch.bfloat16, torch.float32]


def test_a_pil_backend_casts_after_the_processor() -> None:
    """No torchvision steps to cast inside: its float32 output is cast, integers kept."""
    adapter = mmstore.adapter_for(
        PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64}, spatial_merge_size=2)
    )
    image = noise(97, 61)
    want = adapter.process([image])
    got = adapter.process([image], torch.bfloat16)
    assert got["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(got["pixel_values"], torch.from_numpy(want["pixel_values"]).bfloat16())
    assert got["image_sizes"].dtype == torch.int64
    assert torch.equal(got["image_sizes"], torch.from_numpy(want["image_sizes"]))


def test_later_changes_to_the_processor_count() -> None:
    """A copy per call: a setting changed after the adapter was built reaches the processor
    (here Gemma 3's pan-and-scan, which the family then refuses)."""
    processor = PROCESSORS["gemma3"]()
    adapter = mmstore.adapter_for(processor)
    (image,) = _tensors([(90, 30)])
    adapter.process([image], torch.bfloat16)
    processor.do_pan_and_scan = True
    processor.pan_and_scan_min_crop_size = 8
    processor.pan_and_scan_max_num_crops = 4
    processor.pan_and_scan_min_ratio_to_activate = 1.2
    with pytest.raises(mmstore.LayoutMismatchError, match="pan-and-scan"):
        adapter.process([image], torch.bfloat16)
