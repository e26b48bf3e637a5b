"""Media bytes: content hash, deterministic encoding, safe decoding.

An image means what a viewer shows: its pixels turned upright by its EXIF orientation (a
phone photo's tag 1-8), as Pillow's ``ImageOps.exif_transpose`` turns them, which is what
vLLM (on image bytes and on the PIL images a prompt hands it), transformers' ``load_image``
and TorchCodec give a model. Every reader here agrees: :func:`probe` reports the upright
size (a ref's width and height, from which its span was laid out), :func:`decode_rgb` and
:func:`decode_rgb_tensor` give the upright pixels (metadata dropped, so no engine turns them
again), and in-memory images are turned upright before they are stored (:func:`as_pil`).
Stored bytes stay as they came (``put_image(path)`` keeps a photo's bytes and its tag).
"""

from __future__ import annotations

import io
import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from PIL import Image, UnidentifiedImageError

from mmstore.errors import DecompressionBombError, ImageDecodeError, InvalidArgumentError

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

ORIENTATION_TAG = 0x0112  # EXIF "Orientation"
# Orientation -> the transpose that turns the stored pixels upright (ImageOps.exif_transpose's
# table); 1 and anything else: none.
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Where a PNG may state an orientation Pillow reads: an eXIf chunk, ImageMagick's text profile
# and XMP (their chunk type or keyword is never compressed). Without any of them a PNG has
# none, and its header is all a probe reads; with one, Pillow decodes it to find the chunks.
_PNG_ORIENTATION_SOURCES = (b"eXIf", b"Raw profile type exif", b"XML:com.adobe.xmp")
# Formats whose Pillow plugin turns the image itself: the size it opens with is upright, and
# loading turns the pixels (and drops the tag).
_TURNED_BY_PILLOW = frozenset({"TIFF"})
# The ``info`` keys Pillow's ``getexif`` reads an orientation from, in any format.
_ORIENTATION_KEYS = ("exif", "Raw profile type exif", "XML:com.adobe.xmp", "xmp")
# What TorchCodec reads an orientation from (a JPEG's Exif APP1, a PNG's eXIf chunk), with its
# own parser: bytes holding either go through Pillow's, so that one parser decides everywhere.
_TORCHCODEC_EXIF = {"JPEG": b"Exif\x00\x00", "PNG": b"eXIf"}


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
    """``(format, width, height)`` of the upright image, refusing non-images and bombs.

    The size is the image as shown: a tag that turns it a quarter (orientations 5-8) swaps
    the stored width and height. Read from the header (and, for a PNG that may state an
    orientation, its chunks).
    """
    fmt, width, height, _ = _header(data, max_pixels=max_pixels, where=where)
    return fmt, width, height


def _header(data: bytes, *, max_pixels: int, where: str | None) -> tuple[str, int, int, int]:
    """``(format, upright width, upright height, orientation)``, refusing non-images and
    bombs before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as im:
                fmt, (width, height) = im.format or "", im.size
                within = width * height <= max_pixels
                orientation = _orientation(im, data) if within else 1
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(str(exc), uri=where) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(
            f"not a decodable image ({len(data)} bytes starting {bytes(data[:8])!r}): "
            f"{_pillow_reason(exc)}",
            uri=where,
        ) from None
    if not within:
        raise DecompressionBombError(
            f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}",
            uri=where,
        )
    if orientation >= 5 and fmt not in _TURNED_BY_PILLOW:  # a quarter turn, or a transpose
        width, height = height, width
    return fmt, width, height, orientation


def _orientation(image: Image.Image, data: bytes | None = None) -> int:
    """The EXIF orientation Pillow's ``exif_transpose`` applies to ``image`` (2-8), else 1.

    ``data``, the bytes ``image`` was opened from, spares a PNG without any orientation
    source the decode Pillow's ``getexif`` does to look for chunks after its pixels.
    Unreadable metadata is no orientation, as vLLM treats it.
    """
    if data is not None and image.format == "PNG" and not _png_may_orient(data):
        return 1
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # malformed EXIF or XMP: Pillow's many parse errors
        return 1
    return value if isinstance(value, int) and value in _UPRIGHT else 1


def _png_may_orient(data: bytes) -> bool:
    return any(source in data for source in _PNG_ORIENTATION_SOURCES)


def upright(image: Image.Image, orientation: int | None = None) -> Image.Image:
    """``image`` turned upright by its EXIF orientation (or ``orientation``); unchanged if it
    has none. A turned image keeps no orientation: nothing downstream can turn it twice."""
    if orientation is None:
        image.load()  # first, as exif_transpose does: a TIFF turns itself as it loads
        orientation = _orientation(image)
    method = _UPRIGHT.get(orientation)
    if method is None:
        return image
    turned = image.transpose(method)
    for key in _ORIENTATION_KEYS:  # transpose copies info, the orientation with it
        turned.info.pop(key, None)
    return turned


def decode_rgb(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> Image.Image:
    """Decode to an upright RGB PIL image, checking the pixel limit before decoding any pixel.

    Metadata is dropped (``info`` is empty): the pixels are the image as shown, and an engine
    that applies EXIF orientation itself (vLLM does, to PIL images too) finds none to apply.
    """
    _header(data, max_pixels=max_pixels, where=where)
    return _decode_pil(data, where)


def _decode_pil(data: bytes, where: str | None) -> Image.Image:
    """Pillow's pixels, upright. The orientation is read once they are loaded, as
    ``exif_transpose`` reads it: Pillow turns a TIFF itself as it loads (its tag then gone)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data), formats=FORMATS)
            opened.load()
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(str(exc), uri=where) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(
            f"image bytes do not decode: {_pillow_reason(exc)}", uri=where
        ) from None
    image = upright(opened, _orientation(opened, data))
    image = image if image.mode == "RGB" else image.convert("RGB")
    image.info.clear()
    return image


def upright_bytes(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> tuple[bytes, str, int, int]:
    """``(bytes, format, width, height)``: bytes that any reader decodes to the upright image,
    with or without EXIF orientation support (SGLang applies none, vLLM does). ``data``
    itself when it states no orientation; else a lossless PNG of the upright pixels."""
    fmt, width, height, orientation = _header(data, max_pixels=max_pixels, where=where)
    if orientation == 1:
        return data, fmt, width, height
    encoded, _ = encode_image(_decode_pil(data, where), "png")
    return encoded, "PNG", width, height


def decode_rgb_tensor(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None = None
) -> torch.Tensor:
    """Decode to a uint8 RGB tensor (3, H, W), checking the pixel limit before decoding.

    The same pixels as :func:`decode_rgb` (tests/test_decode.py checks every mode and every
    EXIF orientation), straight to the channels-first tensor a torchvision image processor
    takes: TorchCodec decodes PNG (twice as fast as Pillow on screenshots) and JPEG; Pillow
    the rest, 16-bit PNG (which TorchCodec rescales and Pillow truncates), images carrying
    EXIF (TorchCodec turns them by its own reading of the tag, which need not be Pillow's)
    and all of them where TorchCodec is missing.
    """

    fmt, _, _, orientation = _header(data, max_pixels=max_pixels, where=where)
    decode = _torchcodec_decoder()
    if decode is not None and orientation == 1 and _torchcodec_reads_as_pillow(fmt, data):
        try:
            decoded = decode(data, mode="RGB")  # a channels-first view of (H, W, 3) pixels
        except RuntimeError as exc:
            raise ImageDecodeError(f"image bytes do not decode: {exc}", uri=where) from None
        return _channels_first(decoded.permute(1, 2, 0).numpy())
    return _channels_first(np.asarray(_decode_pil(data, where)))


def _channels_first(pixels: np.ndarray) -> torch.Tensor:
    """(H, W, 3) pixels as a contiguous (3, H, W) tensor. The processor makes its input
    contiguous anyway; numpy's transposing copy takes 2 ms of a 1080p image where torch's
    ``contiguous()`` takes 5 (one thread, here)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def _torchcodec_reads_as_pillow(fmt: str, data: bytes) -> bool:
    """Whether TorchCodec gives Pillow's pixels for these bytes: a JPEG, or an 8-bit PNG, that
    holds no EXIF for TorchCodec to turn the image by."""
    if fmt not in _TORCHCODEC_EXIF or (fmt == "PNG" and _png_bit_depth(data) > 8):
        return False
    return _TORCHCODEC_EXIF[fmt] not in data


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
    0-255?) and tensors whose first and last axes both look like channels are refused. A PIL
    image is turned upright by its EXIF orientation (one opened from a phone photo carries
    it): what vLLM shows a model given the same image, and what the stored copy, which keeps
    no tag, must hold.
    """
    if isinstance(image, Image.Image):
        return upright(image)
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
