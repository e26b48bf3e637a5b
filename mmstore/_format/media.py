"""Media bytes: content hash, deterministic encoding, safe decoding."""

from __future__ import annotations

import io
import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from PIL import Image, UnidentifiedImageError

from mmstore._exceptions import DecompressionBombError, ImageDecodeError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

HASH_ALGORITHM = "xxh3-128"
# The decompression-bomb limit. 8K (7680x4320) is 33 MP, the largest screen or camera frame a
# rollout plausibly holds; anything above 64 MP (192 MiB of RGB once decoded) is refused from
# its header, before a pixel is decoded. Below Pillow's own limit (89 MP warns, 179 MP
# raises), so ours is the one that fires; Store.open(max_image_pixels=...) changes it.
DEFAULT_MAX_PIXELS = 64_000_000

# Pillow format name -> the extensions a store accepts for it (the first is canonical: a
# put with ext="jpeg" is stored as .jpg, so the same bytes never get two names).
FORMAT_EXTENSIONS = {
    "PNG": ("png",),
    "JPEG": ("jpg", "jpeg"),
    "MPO": ("jpg", "jpeg"),  # multi-picture JPEG, as many cameras write them
    "WEBP": ("webp",),
    "GIF": ("gif",),
    "BMP": ("bmp",),
    "TIFF": ("tiff", "tif"),
}
EXTENSIONS = {ext for exts in FORMAT_EXTENSIONS.values() for ext in exts}
# The only decoders Pillow may try, on put and on read: a stored file of any other format
# (PPM, TGA, DDS, EPS which runs Ghostscript, ...) is refused, never handed to its decoder.
# MPO has no opener of its own: Pillow's JPEG opener returns MPO files as such.
FORMATS = tuple(f for f in FORMAT_EXTENSIONS if f != "MPO")


def content_hash(data: bytes | memoryview) -> str:
    """xxh3-128 of the bytes, as 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def media_path(digest: str, ext: str) -> str:
    """Store-relative path of a media file: ``media/ab/cd/<hash>.<ext>``."""
    return f"media/{digest[0:2]}/{digest[2:4]}/{digest}.{ext}"


def encode_image(image: Image.Image, fmt: str = "png", quality: int = 95) -> tuple[bytes, str]:
    """Encode ``image``; PNG (the default) is lossless and byte-deterministic."""
    fmt = fmt.lower()
    buf = io.BytesIO()
    if fmt == "png":
        if image.mode not in ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16"):
            image = image.convert("RGBA" if "A" in image.mode else "RGB")
        # Level 1: most of level 6's size on UI screenshots at a fraction of the encode time.
        image.save(buf, format="PNG", compress_level=1)
        return buf.getvalue(), "png"
    if fmt in ("jpg", "jpeg"):
        image.convert("RGB").save(buf, format="JPEG", quality=quality)
        return buf.getvalue(), "jpg"
    if fmt == "webp":
        image.save(buf, format="WEBP", lossless=True)
        return buf.getvalue(), "webp"
    raise InvalidArgumentError(f"unsupported image format {fmt!r}; use png, jpeg or webp")


def probe(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> tuple[str, int, int]:
    """``(format, width, height)`` from the header, refusing non-images and bombs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as im:
                fmt, (width, height) = im.format or "", im.size
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(str(exc), uri=where) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(
            f"not a decodable image ({len(data)} bytes starting {bytes(data[:8])!r}): "
            f"{_pillow_reason(exc)}",
            uri=where,
        ) from None
    if width * height > max_pixels:
        raise DecompressionBombError(
            f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}",
            uri=where,
        )
    return fmt, width, height


def decode_rgb(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> Image.Image:
    """Decode to an RGB PIL image, checking the pixel limit before decoding any pixel."""
    probe(data, max_pixels=max_pixels, where=where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            image.load()
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(str(exc), uri=where) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(
            f"image bytes do not decode: {_pillow_reason(exc)}", uri=where
        ) from None
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_rgb_tensor(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> torch.Tensor:
    """Decode to a uint8 RGB tensor (3, H, W), checking the pixel limit before decoding.

    The same pixels as :func:`decode_rgb` (tests/test_decode.py checks every mode), straight
    to the channels-first tensor a torchvision image processor takes: TorchCodec decodes PNG
    (twice as fast as Pillow on screenshots) and JPEG; Pillow the rest, 16-bit PNG (which
    TorchCodec rescales and Pillow truncates) and all of them where TorchCodec is missing.
    """
    import torch

    fmt, _, _ = probe(data, max_pixels=max_pixels, where=where)
    decode = _torchcodec_decoder()
    if decode is not None and (fmt == "JPEG" or (fmt == "PNG" and _png_bit_depth(data) <= 8)):
        try:
            return decode(data, mode="RGB")
        except RuntimeError as exc:
            raise ImageDecodeError(f"image bytes do not decode: {exc}", uri=where) from None
    image = decode_rgb(data, max_pixels=max_pixels, where=where)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def warm_decoder() -> None:
    """Import the tensor decoder now (before DataLoader workers fork: they inherit it)."""
    _torchcodec_decoder()


def _torchcodec_decoder() -> Any:
    try:
        from torchcodec.decoders import decode_image
    except ImportError:  # an optional dependency (the torch extra)
        return None
    return decode_image


def _png_bit_depth(data: bytes) -> int:
    # IHDR is a PNG's first chunk: 8-byte signature, length, type, width, height, bit depth.
    return data[24]


# Pillow names the file object it was handed (`<_io.BytesIO object at 0x7f...>`): noise to
# a reader, and different on every run.
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-f]+>")


def _pillow_reason(exc: BaseException) -> str:
    if isinstance(exc, UnidentifiedImageError):
        return "no image format recognizes these bytes"
    return _OBJECT_REPR.sub("", str(exc)) or type(exc).__name__


IMAGE_INPUTS = (
    "a file path, a PIL image, a uint8 numpy array (HxW, HxWx3 or HxWx4) or a uint8 torch "
    "tensor (CHW or HWC); encoded bytes go to put_media(data, ext=...)"
)
# Channels a uint8 array may carry, last axis, and the PIL mode each becomes.
_ARRAY_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def as_pil(image: Any) -> Image.Image:
    """A PIL image from the in-memory kinds ``put_image`` takes (a path is read elsewhere).

    Only what is unambiguous: uint8 arrays, whose layout the shape decides. Floats (0-1 or
    0-255?) and tensors whose first and last axes both look like channels are refused.
    """
    if isinstance(image, Image.Image):
        return image
    array = _as_array(image)
    if array is None:
        raise InvalidArgumentError(
            f"put_image cannot store a {type(image).__name__}; pass {IMAGE_INPUTS}"
        )
    if array.dtype != np.uint8:
        raise InvalidArgumentError(
            f"put_image takes uint8 pixels, got dtype {array.dtype} (scale floats to 0-255 and "
            "cast to uint8 first)"
        )
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in _ARRAY_MODES:
        raise InvalidArgumentError(
            f"put_image cannot read an array of shape {tuple(array.shape)}; pass {IMAGE_INPUTS}"
        )
    channels = array.shape[2]
    pixels = array[:, :, 0] if channels == 1 else array
    return Image.fromarray(np.ascontiguousarray(pixels), mode=_ARRAY_MODES[channels])


def _as_array(image: Any) -> np.ndarray | None:
    """An HWC (or HW) array from a numpy array or a torch tensor; None for anything else."""
    if isinstance(image, np.ndarray):
        return image
    if type(image).__module__.split(".")[0] != "torch" or not hasattr(image, "detach"):
        return None
    array = image.detach().cpu().numpy()
    if array.ndim != 3:
        return array
    first, last = array.shape[0] in _ARRAY_MODES, array.shape[2] in _ARRAY_MODES
    if first and last:
        raise InvalidArgumentError(
            f"a tensor of shape {tuple(array.shape)} could be CHW or HWC; pass a PIL image or "
            "a numpy array in HWC order"
        )
    # torchvision's convention is CHW; a tensor whose last axis holds the channels is HWC.
    return array.transpose(1, 2, 0) if first else array


def is_path(image: Any) -> bool:
    return isinstance(image, str | os.PathLike)
