"""A compact wire form for one image ref inside a request: ``mmraw:`` + compact JSON.

Plain JSON (not base64) keeps refs readable in request logs and costs ~25% fewer bytes;
the prefix makes a wire ref recognisable among ordinary strings. Decoding is strict: any
malformed input is a :class:`WireFormatError`, never another exception.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from mmstore._exceptions import WireFormatError
from mmstore._format.models import ImageRef

PREFIX = "mmraw:"
# A ref is ~250 characters; anything far larger is not a ref and is refused before parsing.
MAX_WIRE_CHARS = 8192


def encode(ref: ImageRef) -> str:
    """``mmraw:{...}`` with the ref's fields, nulls omitted."""
    return PREFIX + ref.model_dump_json(exclude_none=True)


def decode(text: Any) -> ImageRef:
    """Parse a wire ref; refuse anything that is not exactly one valid ImageRef."""
    if not isinstance(text, str):
        raise WireFormatError(f"a wire image ref is a str, got {type(text).__name__}")
    if len(text) > MAX_WIRE_CHARS:
        raise WireFormatError(f"wire image ref of {len(text)} chars exceeds {MAX_WIRE_CHARS}")
    if not text.startswith(PREFIX):
        raise WireFormatError(f"wire image ref must start with {PREFIX!r}", head=text[:16])
    # pydantic's own JSON parser, strict: one pass, no Python int/recursion limits to trip
    # over, and a JSON "5" is not the integer 5.
    try:
        return ImageRef.model_validate_json(text[len(PREFIX) :], strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'ref'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise WireFormatError(f"invalid wire image ref: {problems}") from None
