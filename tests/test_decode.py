"""The tensor decode path of torchvision processors: Pillow's pixels, faster.

``decode_rgb_tensor`` (TorchCodec for PNG and JPEG, Pillow for the rest) must give exactly
the pixels of ``decode_rgb`` (Pillow) for every mode a store may hold, refuse what Pillow
refuses with the same typed errors, and the loader's batches must be what the processor
makes of the stored images.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._families import takes_tensors
from mmstore._format.media import decode_rgb, decode_rgb_tensor

from .conftest import SMALL_MAX_PIXELS
from .test_loader import _refs_of, write_steps


def _encoded(pixels: np.ndarray, mode: str, fmt: str, **options) -> bytes:
    image = Image.fromarray(pixels).convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _same_pixels(data: bytes) -> None:
    expected = np.asarray(decode_rgb(data))
    got = decode_rgb_tensor(data)
    assert got.dtype == torch.uint8 and got.shape == (3, *expected.shape[:2])
    assert got.is_contiguous()  # what the processor takes: it copies anything else again
    assert np.array_equal(got.permute(1, 2, 0).numpy(), expected)


_PIXELS = np.random.default_rng(0).integers(0, 256, (37, 53, 4), dtype=np.uint8)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA"])
def test_png_modes_decode_to_pillows_pixels(mode):
    _same_pixels(_encoded(_PIXELS, mode, "PNG"))


def test_png_transparency_chunks_decode_to_pillows_pixels():
    _same_pixels(_encoded(_PIXELS[..., :3], "P", "PNG", transparency=3))
    _same_pixels(_encoded(_PIXELS[..., :3], "RGB", "PNG", transparency=(1, 2, 3)))


def test_16_bit_pngs_keep_pillows_reduction():
    # TorchCodec rescales 16-bit samples; Pillow keeps the high byte. Pillow decides.
    wide = (_PIXELS[..., 0].astype(np.uint16) * 257 + 5).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, format="PNG")
    _same_pixels(buf.getvalue())


@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
@pytest.mark.parametrize("subsampling", [0, 1, 2])
def test_jpeg_decodes_to_pillows_pixels(mode, subsampling):
    _same_pixels(_encoded(_PIXELS[..., :3], mode, "JPEG", quality=90, subsampling=subsampling))


def test_progressive_jpeg_decodes_to_pillows_pixels():
    _same_pixels(_encoded(_PIXELS[..., :3], "RGB", "JPEG", quality=80, progressive=True))


@pytest.mark.parametrize("fmt", ["WEBP", "GIF", "BMP", "TIFF"])
def test_other_formats_decode_through_pillow(fmt):
    _same_pixels(_encoded(_PIXELS[..., :3], "RGB", fmt))


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(1, 40),
    height=st.integers(1, 40),
    mode=st.sampled_from(["L", "RGB", "RGBA", "P"]),
    seed=st.integers(0, 2**16),
)
def test_any_small_png_decodes_to_pillows_pixels(width, height, mode, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    _same_pixels(_encoded(pixels, mode, "PNG"))


def test_truncated_bytes_raise_a_decode_error_naming_the_uri():
    data = _encoded(_PIXELS[..., :3], "RGB", "PNG")
    with pytest.raises(mmstore.ImageDecodeError) as err:
        decode_rgb_tensor(data[: len(data) // 2], where="store://media/x.png")
    assert err.value.context["uri"] == "store://media/x.png"


def test_bombs_are_refused_before_decoding():
    with pytest.raises(mmstore.DecompressionBombError):
        decode_rgb_tensor(_encoded(_PIXELS[..., :3], "RGB", "PNG"), max_pixels=100)


# -- the loader --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(tmp_path_factory, small_processor):
    store = mmstore.Store.open(tmp_path_factory.mktemp("decode") / "s", create=True)
    write_steps(store, mmstore.adapter_for(small_processor))
    return store


@pytest.mark.parametrize("workers", [0, 1])
def test_torchvision_batches_are_the_processors_output(stored, workers):
    processor = Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)
    assert takes_tensors(mmstore.adapter_for(processor).image_processor)
    ds = mmstore.RolloutDataset(stored, processor, shuffle=False, node_cache_bytes=0)
    batch = next(iter(mmstore.RolloutLoader(ds, batch_size=3, num_workers=workers)))
    refs = _refs_of(stored, batch["sample_ids"])
    images = [stored.open_image(r["uri"], r["hash"]) for r in refs]  # Pillow, as users do
    expected = processor(images=images, return_tensors="pt")
    assert torch.equal(batch["pixel_values"], expected["pixel_values"].to(torch.bfloat16))
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    # and the PIL backend's pixels, to bf16 precision
    pil = Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS)
    assert not takes_tensors(mmstore.adapter_for(pil).image_processor)
    reference = pil(images=images, return_tensors="pt")
    assert torch.equal(batch["image_grid_thw"], reference["image_grid_thw"])
    torch.testing.assert_close(
        batch["pixel_values"].float(),
        reference["pixel_values"].to(torch.bfloat16).float(),
        atol=0.04,
        rtol=0.01,
    )
