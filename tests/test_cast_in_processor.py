"""The train-dtype cast inside a torchvision processor (``Family.process(images, dtype)``).

A torchvision backend casts its floats to the train dtype right after normalizing, before the
family's patch shuffles, temporal copies and padding: for every family the result must be bit
for bit the processor's own output cast afterwards, with the caller's processor untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore import _tensors as tensors
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


# -- the normalization in blocks -------------------------------------------------------------

shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.integers(1, 700)
)  # (images, channels, height, width): rows of up to 700 values, blocks cut anywhere


@settings(max_examples=40, deadline=None)
@given(shape=shapes, layout=st.sampled_from(["contiguous", "channels_last", "5-d"]),
       source=st.sampled_from([torch.uint8, torch.float32]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       block=st.sampled_from([1, 7, 64, 1 << 18]), seed=st.integers(0, 2**16))  # fmt: skip
def test_normalizing_in_blocks_gives_torchvisions_bits(
    shape: tuple[int, int, int, int], layout: str, source: torch.dtype, dtype: torch.dtype,
    block: int, seed: int,
) -> None:  # fmt: skip
    """Any layout a processor hands over (decoded frames are channels last), any block size:
    the bits of transformers' own rescale_and_normalize, then the cast."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(source)
    if layout == "channels_last":
        images = images.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    elif layout == "5-d":
        images = images.unsqueeze(0)
    processor = Qwen2VLImageProcessor()
    mean = (0.48145466, 0.4578275, 0.40821073, 0.5)[: shape[1]]
    std = (0.26862954, 0.26130258, 0.27577711, 0.25)[: shape[1]]
    want = processor.rescale_and_normalize(images.clone(), True, 1 / 255, True, mean, std)
    fused_mean, fused_std, _ = processor._fuse_mean_std_and_rescale_factor(
        do_normalize=True, image_mean=mean, image_std=std, do_rescale=True,
        rescale_factor=1 / 255, device=images.device,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensors, "BLOCK_ELEMENTS", block)
        got = tensors.normalize_in_blocks(images, fused_mean, fused_std, dtype)
    assert got is not None and got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got, want.to(dtype))


def test_a_video_processor_normalizes_in_blocks_and_gives_the_same_bits(
    monkeypatch: Any,
) -> None:
    """Decoded frames (channels last) through Qwen2-VL's video processor with the cast
    inside: the blocks run, and the output is the processor's own, cast."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    calls: list[tuple[int, ...]] = []
    blocks = tensors.normalize_in_blocks
    monkeypatch.setattr(
        tensors, "normalize_in_blocks", lambda i, *a: calls.append(tuple(i.shape)) or blocks(i, *a)
    )
    processor = Qwen2VLVideoProcessor(min_pixels=8 * 28 * 28, max_pixels=32 * 28 * 28)
    frames = torch.from_numpy(np.stack([noise(90, 62, seed=k) for k in range(4)]))
    video = frames.permute(0, 3, 1, 2)  # [T, C, H, W] over channels-last memory
    kwargs = {"return_tensors": "pt", "do_sample_frames": False}
    want = processor(videos=[video], **kwargs)["pixel_values_videos"].to(torch.bfloat16)
    casting = tensors.casting_after_normalize(processor, torch.bfloat16)
    got = casting(videos=[video], **kwargs)["pixel_values_videos"]
    assert calls and got.dtype == torch.bfloat16 and torch.equal(got, want)
