"""Media bytes: content hash, deterministic encoding, safe decoding."""

from __future__ import annotations

import io
import warnings

import xxhash
from PIL import Image, UnidentifiedImageError

from ._exceptions import DecompressionBombError, ImageDecodeError

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
    raise ValueError(f"unsupported image format {fmt!r}; use png, jpeg or webp")


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
        raise ImageDecodeError(f"not a decodable image: {exc}", uri=where) from None
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
        raise ImageDecodeError(f"image bytes do not decode: {exc}", uri=where) from None
    return image if image.mode == "RGB" else image.convert("RGB")
