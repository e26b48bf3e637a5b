"""EXIF orientation: one meaning on every path (issue 30, item 1).

A stored image means what a viewer shows: its pixels turned upright by its EXIF orientation
(a phone photo's tag), as Pillow's ``ImageOps.exif_transpose`` turns them. That is what the
rollout side's engine shows the policy (vLLM applies the tag to image bytes and to the PIL
images a prompt hands it; so do transformers' ``load_image`` and TorchCodec), so it is what
the trainer must train on. The ref's size is the upright size; both processor backends of the
loader, the device stage, vLLM's prompt, the SGLang request, the wire resolver and debug's
thumbnails all hand on the upright pixels, for every orientation 1-8. A ref of the unturned
size (written before this rule) is refused with a typed error, never trained on.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._format.media import (
    ORIENTATION_TAG,
    content_hash,
    decode_rgb,
    decode_rgb_tensor,
    probe,
    upright_bytes,
)
from mmstore.debug import thumbnails
from mmstore.integrations import vllm

from .conftest import SMALL_MAX_PIXELS

ORIENTATIONS = range(1, 9)
WIDTH, HEIGHT = 168, 84  # Qwen-VL's small layout: grid [1, 6, 12], 18 tokens
PIXELS = np.random.default_rng(7).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
IMG = 151655  # Qwen-VL's image token


def tagged(fmt: str, orientation: int) -> bytes:
    """``PIXELS`` encoded as ``fmt`` with an EXIF orientation tag."""
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format=fmt, exif=exif)
    return buf.getvalue()


def shown(data: bytes) -> np.ndarray:
    """What a viewer (and vLLM) shows of ``data``: Pillow's ``exif_transpose``, RGB, HWC."""
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


def chw(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(pixels)).permute(2, 0, 1)


def row(sample_id: str, media: mmstore.MediaRef, adapter: mmstore.Family) -> mmstore.Rollout:
    tokens, refs = adapter.expand([7, IMG, 8, 9], [media])
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=tokens,
        prompt_len=len(tokens) - 1,
        loss_mask=[False] * (len(tokens) - 1) + [True],
        images=refs,
    )


def processors() -> dict[str, object]:
    return {
        "pil": Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS),
        "torchvision": Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS),
    }


# The loader's three ways to pixels: the PIL backend, the torchvision backend (TorchCodec
# decodes), and the torchvision backend run by the device stage.
LOADERS = [("pil", {}), ("torchvision", {}), ("torchvision", {"preprocess_device": "cpu"})]
LOADER_IDS = ["pil", "torchvision", "device"]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_every_decoder_gives_the_upright_image(fmt, orientation):
    data = tagged(fmt, orientation)
    want = shown(data)
    quarter = orientation >= 5
    assert want.shape[:2] == ((WIDTH, HEIGHT) if quarter else (HEIGHT, WIDTH))
    assert probe(data) == (fmt, want.shape[1], want.shape[0])
    image = decode_rgb(data)
    assert np.array_equal(np.asarray(image), want)
    # No tag left on it: an engine that turns PIL images by their tag (vLLM) turns it no more.
    assert np.array_equal(np.asarray(ImageOps.exif_transpose(image)), want)
    assert np.array_equal(decode_rgb_tensor(data).permute(1, 2, 0).numpy(), want)
    # Bytes for an engine that ignores the tag (SGLang): a plain decode is upright too.
    plain, _, width, height = upright_bytes(data)
    assert (width, height) == (want.shape[1], want.shape[0])
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(plain)).convert("RGB")), want)
    assert (plain is data) == (orientation == 1)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_a_tagged_photo_is_the_upright_image_on_every_path(tmp_path, fmt, orientation):
    data = tagged(fmt, orientation)
    want = shown(data)
    path = tmp_path / f"photo.{fmt.lower()}"
    path.write_bytes(data)
    store = mmstore.Store.open(tmp_path / "store", create=True)

    media = store.put_image(path)  # the bytes as they came, tag and all
    assert media.hash == content_hash(data)
    assert (media.width, media.height) == (want.shape[1], want.shape[0])
    # The same photo in memory is stored upright and untagged: the same image, the same size.
    in_memory = store.put_image(Image.open(path))
    assert (in_memory.width, in_memory.height) == (media.width, media.height)
    assert np.array_equal(np.asarray(store.open_image(in_memory.uri, in_memory.hash)), want)

    built = processors()
    adapter = mmstore.adapter_for(built["pil"])
    written = row("s", media, adapter)
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(written)
    grid = adapter.integer_tensors(media.width, media.height)["image_grid_thw"].tolist()

    for (backend, options), name in zip(LOADERS, LOADER_IDS, strict=True):
        processor = built[backend]
        ds = mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False)
        (batch,) = list(mmstore.RolloutLoader(ds, batch_size=1, **options))
        image = Image.fromarray(want) if backend == "pil" else chw(want)
        expected = ds.adapter.process([image], torch.float32)
        assert batch["image_grid_thw"].tolist() == grid, name
        assert torch.equal(batch["pixel_values"].cpu(), expected["pixel_values"]), name

    # The rollout side: vLLM's prompt, SGLang's request, the wire resolver.
    prompt = vllm.to_vllm_prompt(store, written)
    (given,) = prompt["multi_modal_data"]["image"]
    assert np.array_equal(np.asarray(given), want)
    assert np.array_equal(np.asarray(ImageOps.exif_transpose(given)), want)  # vLLM's own turn
    request = vllm.to_prefill_request(store, written)
    (url,) = request["image_data"]
    sent = base64.b64decode(url.split(",", 1)[1])
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(sent)).convert("RGB")), want)
    resolved = vllm.resolve_wire_refs(store, [mmstore.wire.encode(written.images[0])], built["pil"])
    assert resolved["image_grid_thw"].tolist() == grid
    np.testing.assert_array_equal(
        resolved["pixel_values"], adapter.process([Image.fromarray(want)])["pixel_values"]
    )

    # debug's thumbnail (the image is smaller than the tile: shown at its own size).
    size = 256
    tile = thumbnails(store, {"images": [written.images[0].model_dump()]}, size=size)
    left = (size - media.width) // 2
    shown_tile = np.asarray(tile)[: media.height, left : left + media.width]
    # The tile's outline is drawn over the image's first and last rows.
    assert np.array_equal(shown_tile[1:-1], want[1:-1])


@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_a_ref_of_the_unturned_size_is_refused_on_every_path(tmp_path, orientation):
    """A ref recording the stored (unturned) size of a quarter-turned photo, as puts did
    before: its span has the upright image's token count (Qwen-VL: 18 either way), so only
    the size tells. Refused, naming the sample and image, whether the image is processed
    (decoded size), found in a cache (processor grid) or handed to vLLM."""
    data = tagged("JPEG", orientation)
    store = mmstore.Store.open(tmp_path / "store", create=True)
    media = store.put_media(data, ext="jpg")
    unturned = media.model_copy(update={"width": media.height, "height": media.width})
    built = processors()
    adapter = mmstore.adapter_for(built["pil"])
    assert adapter.num_tokens(unturned.width, unturned.height) == adapter.num_tokens(
        media.width, media.height
    )
    with store.writer(run_id="alone", step=0, adapter=adapter) as w:
        w.write(row("unturned", unturned, adapter))
    with store.writer(run_id="after", step=0, adapter=adapter) as w:
        w.write(row("good", media, adapter))
        w.write(row("unturned", unturned, adapter))

    for (backend, options), name in zip(LOADERS, LOADER_IDS, strict=True):
        # "alone": processed, refused by its decoded size; "after": "good" cached the pixels
        # first, refused by the cached grid.
        for run in ("alone", "after"):
            ds = mmstore.RolloutDataset(store, built[backend], runs=[run], shuffle=False)
            with pytest.raises(mmstore.LayoutMismatchError) as err:
                list(mmstore.RolloutLoader(ds, batch_size=1, **options))
            assert err.value.sample_id == "unturned", (name, run)
            assert err.value.image_index == 0 and err.value.run_id == run, (name, run)

    with pytest.raises(mmstore.InvalidRolloutError, match="ref") as err:
        vllm.to_vllm_prompt(store, row("unturned", unturned, adapter))
    assert err.value.sample_id == "unturned" and err.value.image_index == 0
