"""Server-side resolution of wire-form image refs into processor inputs, or a 400-ready error.

A request names images by ref (``mmstore.wire``), never by pixels. Each ref is checked
cheaply first (wire syntax, family, layout fingerprint, size limit, span length, URI
trust), the request's pixels are bounded from the refs' sizes (``request_too_large``), then
materialized: verified read, safe decode, the real image processor, the processor's grid
against the span. Any failure becomes ``{"error": "invalid_mm_image_ref", "index": i,
"reason": ..., "detail": ...}`` for the first failing ref; nothing raises to the server, not
even ``MemoryError`` (``out_of_memory``).

Materialized images are cached by ``(hash, fingerprint)``: the pixels depend only on the
content and the layout, so a ref that passes its own checks may reuse pixels that another
ref with the same hash paid for. The URI's trust is checked for every ref, hit or miss;
its bytes are read (and verified) only on a miss.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmstore._exceptions import (
    DecompressionBombError,
    HashMismatchError,
    ImageDecodeError,
    ImageSizeError,
    LayoutMismatchError,
    MediaNotFoundError,
    UntrustedURIError,
    WireFormatError,
)
from mmstore._families import adapter_for
from mmstore._format.models import ImageRef
from mmstore._rows.store import Store
from mmstore.integrations._single_flight import SingleFlightLRU
from mmstore.wire import decode

log = logging.getLogger(__name__)

ERROR = "invalid_mm_image_ref"
DEFAULT_CACHE_BYTES = 512 * 2**20
DEFAULT_MAX_REFS = 64
# The pixels one request may build (float32, as the processor returns them): 1 GiB is ~20
# 1080p screenshots at Qwen2-VL's defaults. Checked from the refs' sizes before any decode.
DEFAULT_MAX_REQUEST_BYTES = 2**30

# Store and decode errors -> the reason a client sees. Order matters: subclasses first.
_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (WireFormatError, "malformed_ref"),
    (UntrustedURIError, "untrusted_uri"),
    (MediaNotFoundError, "media_not_found"),
    (HashMismatchError, "hash_mismatch"),
    (DecompressionBombError, "image_too_large"),
    (ImageDecodeError, "undecodable_image"),
    (ImageSizeError, "unsupported_size"),
    (LayoutMismatchError, "grid_mismatch"),
    (MemoryError, "out_of_memory"),
)


class RefRefused(Exception):
    """One ref failed a check; carries the reason a client sees."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Materialized:
    """One image through the processor: what the cache holds for ``(hash, fingerprint)``."""

    tensors: dict[str, np.ndarray]  # the family's image tensors, floats float32, read-only
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


class RefResolver:
    """Resolves wire refs against ``store`` for one image processor; share one per server.

    ``resolve(wire_refs)`` returns the family's image tensors as numpy arrays, batched in
    ref order (Qwen-VL: ``pixel_values`` float32, all patches; ``image_grid_thw`` int64
    (n, 3)), plus ``"hashes": [str, ...]``, or the error
    dict. Thread-safe; ``cache_bytes`` bounds the processed pixels kept (LRU);
    ``max_request_bytes`` bounds the pixels one request may build (``request_too_large``).
    """

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_refs: int = DEFAULT_MAX_REFS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.store = store
        self.adapter = adapter_for(image_processor)
        self.max_refs = max_refs
        self.max_request_bytes = max_request_bytes
        self._cache: SingleFlightLRU[tuple[str, str], Materialized] = SingleFlightLRU(
            cache_bytes, sizeof=lambda m: m.nbytes
        )

    def stats(self) -> dict[str, int]:
        return self._cache.stats()

    def resolve(self, wire_refs: Any) -> dict[str, Any]:
        try:
            return self._resolve(wire_refs)
        except MemoryError:  # the promise is an answer to every request, even this one
            return _error(None, "out_of_memory", "the server ran out of memory for this request")

    def _resolve(self, wire_refs: Any) -> dict[str, Any]:
        if not isinstance(wire_refs, (list, tuple)):
            return _error(None, "malformed_request", "image refs must be a list of strings")
        if len(wire_refs) > self.max_refs:
            return _error(
                None, "too_many_refs", f"{len(wire_refs)} image refs exceed {self.max_refs}"
            )
        refs: list[ImageRef] = []
        for index, text in enumerate(wire_refs):
            try:
                refs.append(self._admit(text))
            except Exception as exc:
                return _as_error(index, exc)
        over = self._over_budget(refs)
        if over is not None:
            return over
        images: list[Materialized] = []
        for index, ref in enumerate(refs):
            try:
                images.append(self._materialize(ref, index))
            except Exception as exc:
                return _as_error(index, exc)
        try:
            return self._inputs(refs, images)
        except Exception as exc:
            return _as_error(None, exc)

    def _over_budget(self, refs: Sequence[ImageRef]) -> dict[str, Any] | None:
        """The error for a request whose pixels would exceed the budget, before any decode."""
        total = 0
        for index, ref in enumerate(refs):
            total += 4 * math.prod(self.adapter.pixel_shape(ref.width, ref.height))
            if total > self.max_request_bytes:
                return _error(
                    index,
                    "request_too_large",
                    f"the first {index + 1} image refs need {total} bytes of pixels, above "
                    f"the request budget of {self.max_request_bytes}",
                )
        return None

    # -- checks that need no bytes -----------------------------------------------------

    def _admit(self, text: Any) -> ImageRef:
        ref = decode(text)
        adapter = self.adapter
        if ref.family != adapter.family:
            raise RefRefused(
                "family_mismatch", f"ref family {ref.family!r}, processor {adapter.family!r}"
            )
        if ref.layout_fingerprint != adapter.fingerprint:
            raise RefRefused(
                "fingerprint_mismatch",
                f"ref laid out with {ref.layout_fingerprint!r}, this processor is "
                f"{adapter.fingerprint!r}",
            )
        limit = self.store.max_image_pixels
        if ref.width * ref.height > limit:
            raise RefRefused(
                "image_too_large", f"{ref.width}x{ref.height} exceeds the limit of {limit} pixels"
            )
        expected = adapter.num_tokens(ref.width, ref.height)
        if ref.length != expected:
            raise RefRefused(
                "span_length_mismatch",
                f"span of {ref.length} tokens, a {ref.width}x{ref.height} image lays out as "
                f"{expected}",
            )
        self.store.resolve(ref.uri)  # trust, for every ref: a cache hit must not bypass it
        return ref

    # -- bytes -> pixels ---------------------------------------------------------------

    def _materialize(self, ref: ImageRef, index: int) -> Materialized:
        key = (ref.hash, self.adapter.fingerprint)
        image = self._cache.get(key, lambda: self._process(ref))
        if (image.width, image.height) != (ref.width, ref.height):
            raise RefRefused(
                "size_mismatch",
                f"ref says {ref.width}x{ref.height}, the image is {image.width}x{image.height}",
            )
        self.adapter.check_output(image.tensors, ref, sample_id=None, image_index=index)
        return image

    def _process(self, ref: ImageRef) -> Materialized:
        pil = self.store.open_image(ref.uri, ref.hash)
        if (pil.width, pil.height) != (ref.width, ref.height):
            # Before the processor: the budget was computed from the ref's claimed size.
            raise RefRefused(
                "size_mismatch",
                f"ref says {ref.width}x{ref.height}, the image is {pil.width}x{pil.height}",
            )
        tensors = {}
        for key, value in self.adapter.process([pil]).items():
            array = np.ascontiguousarray(value)
            array.flags.writeable = False  # shared by every request that hits this entry
            tensors[key] = array
        return Materialized(tensors, pil.width, pil.height)

    def _inputs(self, refs: Sequence[ImageRef], images: Sequence[Materialized]) -> dict[str, Any]:
        import torch  # torch, and so the loader's stacking, only once images are served

        from mmstore._loading.stack import batch_images

        # Views of the read-only cache entries, no copy: collation concatenates into new
        # memory and never writes its inputs (torch warns about any non-writable array).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            views = [{k: torch.from_numpy(v) for k, v in m.tensors.items()} for m in images]
        batched = batch_images(self.adapter, views)
        return {
            **{k: v.numpy() for k, v in batched.items()},
            "hashes": [ref.hash for ref in refs],
        }


def _as_error(index: int | None, exc: Exception) -> dict[str, Any]:
    """The error dict a failed check becomes."""
    if isinstance(exc, RefRefused):
        return _error(index, exc.reason, exc.detail)
    for kind, reason in _REASONS:
        if isinstance(exc, kind):
            return _error(index, reason, str(exc) or type(exc).__name__)
    # A bug or an environment failure, not the client's ref: log it, still answer.
    log.exception("resolving image ref %s failed unexpectedly", index)
    return _error(index, "internal_error", f"{type(exc).__name__}: {exc}")


def _error(index: int | None, reason: str, detail: str) -> dict[str, Any]:
    return {"error": ERROR, "index": index, "reason": reason, "detail": detail}


def resolve_wire_refs(
    store: Store,
    wire_refs: Any,
    image_processor: Any,
    *,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> dict[str, Any]:
    """One-shot :class:`RefResolver`: refs repeated within the request are processed once.

    A server should build one ``RefResolver`` and keep it, so its cache spans requests.
    """
    resolver = RefResolver(
        store, image_processor, cache_bytes=cache_bytes, max_request_bytes=max_request_bytes
    )
    return resolver.resolve(wire_refs)
