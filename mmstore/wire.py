"""A compact wire form for one media ref inside a request: a prefix + compact JSON.

``mmraw:`` + JSON is an image ref (:class:`ImageRef`), ``mmvid:`` + JSON a video ref
(:class:`VideoRef`, its ``frames`` a JSON list of indices): the prefix names the kind, so a
server knows what it is parsing before it parses. Plain JSON (not base64) keeps refs
readable in request logs and costs ~25% fewer bytes; the prefix makes a wire ref
recognisable among ordinary strings. Decoding is strict: any malformed input is a
:class:`WireFormatError`, never another exception.
"""

from __future__ import annotations

from typing import Any, overload

from pydantic import ValidationError

from mmstore._format.models import MAX_REF_FRAMES, ImageRef, VideoRef
from mmstore.errors import WireFormatError

PREFIX = "mmraw:"
VIDEO_PREFIX = "mmvid:"
# A ref is ~250 characters; anything far larger is not a ref and is refused before parsing.
MAX_WIRE_CHARS = 8192
# A video ref is an image ref's fields plus num_frames, fps and up to MAX_REF_FRAMES frame
# indices, each at most 10 digits (an int32) and a comma: the image bound plus exactly what
# the longest valid frames list needs (~53 K characters), so every valid ref round-trips.
MAX_VIDEO_WIRE_CHARS = MAX_WIRE_CHARS + MAX_REF_FRAMES * len(f"{2**31 - 1},")


@overload
def encode(ref: ImageRef) -> str: ...
@overload
def encode(ref: VideoRef) -> str: ...
def encode(ref: ImageRef | VideoRef) -> str:
    """``mmraw:{...}`` (an image ref) or ``mmvid:{...}`` (a video ref), nulls omitted."""
    if isinstance(ref, VideoRef):
        return VIDEO_PREFIX + ref.model_dump_json(exclude_none=True)
    if isinstance(ref, ImageRef):
        return PREFIX + ref.model_dump_json(exclude_none=True)
    raise TypeError(f"wire.encode takes an ImageRef or a VideoRef, got {type(ref).__name__}")


def decode(text: Any) -> ImageRef | VideoRef:
    """Parse a wire ref; refuse anything that is not exactly one valid ImageRef (``mmraw:``)
    or VideoRef (``mmvid:``)."""
    if not isinstance(text, str):
        raise WireFormatError(f"a wire image ref is a str, got {type(text).__name__}")
    if text.startswith(VIDEO_PREFIX):
        return _parse(text, VIDEO_PREFIX, VideoRef, MAX_VIDEO_WIRE_CHARS, "video")
    if len(text) > MAX_WIRE_CHARS:
        # Before the prefix check, as before videos: a huge string is refused unlooked-at.
        raise WireFormatError(f"wire image ref of {len(text)} chars exceeds {MAX_WIRE_CHARS}")
    if not text.startswith(PREFIX):
        raise WireFormatError(
            f"wire image ref must start with {PREFIX!r} (a video ref with {VIDEO_PREFIX!r})",
            head=text[:16],
        )
    return _parse(text, PREFIX, ImageRef, MAX_WIRE_CHARS, "image")


def _parse(
    text: str, prefix: str, model: type[ImageRef] | type[VideoRef], limit: int, kind: str
) -> Any:
    if len(text) > limit:
        raise WireFormatError(f"wire {kind} ref of {len(text)} chars exceeds {limit}")
    # pydantic's own JSON parser, strict: one pass, no Python int/recursion limits to trip
    # over, and a JSON "5" is not the integer 5.
    try:
        return model.model_validate_json(text[len(prefix) :], strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'ref'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise WireFormatError(f"invalid wire {kind} ref: {problems}") from None
    except (TypeError, ValueError) as exc:
        # A model validator that is not pydantic's raising on a wrong type (VideoRef's
        # frames: tuple(5)) is still a malformed ref, never another exception.
        raise WireFormatError(f"invalid wire {kind} ref: {exc}") from None
