"""Server-side resolution of wire-form image and video refs into processor inputs, or a
400-ready error.

A request names images and videos by ref (``mmstore.wire``: ``mmraw:`` an image,
``mmvid:`` a video), never by pixels. Each ref is checked cheaply first (wire syntax,
family, layout fingerprint (a video's against the processor's video half), size limit,
span length, URI trust), the request's bytes are bounded from the refs (``request_too_large``:
an image's pixels from its size, a video's processed tensors from its layout's shapes),
then materialized: verified read, safe decode (a video: its container probed and its facts
compared with the ref's, then only the ref's frames decoded), the real image or video
processor, the processor's grid against the span. Any failure becomes ``{"error":
"invalid_mm_image_ref", "index": i, "reason": ..., "detail": ...}`` for the first failing
ref, its index in the request; the name covers video refs too (clients match it, so it
stays). Nothing raises to the server, not even ``MemoryError`` (``out_of_memory``).

Materialized images are cached by ``(hash, fingerprint)``: the pixels depend only on the
content and the layout, so a ref that passes its own checks may reuse pixels that another
ref with the same hash paid for. Videos are cached by every fact of the ref the clip is
checked against (hash, video fingerprint, frames, frame count, rate, size): a ref pairing a
cached clip's hash with other facts misses, and is probed. The URI's trust is checked for
every ref, hit or miss; its bytes are read (and verified) only on a miss.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from mmstore._families import OfLayout, VideoFamily, adapter_for, video_half
from mmstore._format.models import MAX_CLIP_FRAMES, ImageRef, VideoRef
from mmstore._format.video import clip_mismatch, decode_frames, probe_video
from mmstore._rows.store import Store
from mmstore.errors import (
    DecompressionBombError,
    HashMismatchError,
    ImageDecodeError,
    ImageSizeError,
    InvalidArgumentError,
    LayoutMismatchError,
    MediaNotFoundError,
    RefRefused,
    UntrustedURIError,
    VideoBombError,
    VideoDecodeError,
    WireFormatError,
)
from mmstore.integrations._single_flight import SingleFlightLRU
from mmstore.wire import decode

log = logging.getLogger(__name__)

ERROR = "invalid_mm_image_ref"
DEFAULT_CACHE_BYTES = 512 * 2**20
DEFAULT_MAX_REFS = 64
# The pixels one request may build (float32, as the processor returns them): 1 GiB is ~20
# 1080p screenshots at Qwen2-VL's defaults. Checked from the refs' sizes before any decode;
# a video counts its processed tensors' bytes (its layout's placeholder shapes).
DEFAULT_MAX_REQUEST_BYTES = 2**30

# Store and decode errors -> the reason a client sees. Order matters: subclasses first.
_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (WireFormatError, "malformed_ref"),
    (UntrustedURIError, "untrusted_uri"),
    (MediaNotFoundError, "media_not_found"),
    (HashMismatchError, "hash_mismatch"),
    (VideoBombError, "image_too_large"),  # a clip's frames too large, or too many of them
    (DecompressionBombError, "image_too_large"),
    (VideoDecodeError, "undecodable_video"),  # a subclass of ImageDecodeError
    (ImageDecodeError, "undecodable_image"),
    (ImageSizeError, "unsupported_size"),
    (LayoutMismatchError, "grid_mismatch"),
    (MemoryError, "out_of_memory"),
)


@dataclass(frozen=True)
class Materialized:
    """One image (video) through the processor: what the cache holds for its key."""

    tensors: dict[str, np.ndarray]  # the family's image (video) tensors, floats float32, read-only
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


class RefResolver:
    """Resolves wire refs against ``store`` for one processor; share one per server.

    ``resolve(wire_refs)`` returns the family's image tensors as numpy arrays, batched in
    the order of the request's image refs (Qwen-VL: ``pixel_values`` float32, all patches;
    ``image_grid_thw`` int64 (n, 3)), plus ``"hashes": [str, ...]`` (each image's content
    hash, its vLLM uuid), or the error dict. A request holding video refs also gets the video
    half's inputs (``adapter.video.input_names``), concatenated in the order of its video
    refs (Qwen-VL: ``pixel_values_videos`` float32, ``video_grid_thw`` int64 (n, 3);
    Qwen2.5-VL also ``second_per_grid_ts`` float32 (n,)), and ``"video_uuids"``: each
    video's vLLM uuid, as :func:`mmstore.integrations.vllm.video_uuid` gives it; a request
    without video refs gets no video keys. Video refs need a processor with a video half
    (pass the full processor, or an adapter whose video half is bound: an adapter is its own
    adapter); without one they are refused (``video_unsupported``). Thread-safe;
    ``cache_bytes`` bounds the processed tensors kept (LRU; or ``materialize``, a
    :class:`mmstore.Materialize` whose ``cache_bytes`` it applies: the resolver answers in
    float32 numpy and never substitutes missing media, so any other setting moved from its
    default is refused); ``max_request_bytes`` bounds the bytes one request may build
    (``request_too_large``).
    """

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        *,
        cache_bytes: int | None = None,
        max_refs: int = DEFAULT_MAX_REFS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        materialize: Any = None,
    ) -> None:
        cache_bytes = _cache_bound(cache_bytes, materialize)
        self.store = store
        self.adapter = adapter_for(image_processor)
        self.max_refs = max_refs
        self.max_request_bytes = max_request_bytes
        self._cache: SingleFlightLRU[tuple[Any, ...], Materialized] = SingleFlightLRU(
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
        refs: list[ImageRef | VideoRef] = []
        for index, text in enumerate(wire_refs):
            try:
                refs.append(self._admit(text))
            except Exception as exc:
                return _as_error(index, exc)
        try:
            over = self._over_budget(refs)
        except Exception as exc:  # a layout that cannot size a ref it admitted: still an answer
            return _as_error(None, exc)
        if over is not None:
            return over
        materialized: list[Materialized] = []
        for index, ref in enumerate(refs):
            try:
                if isinstance(ref, VideoRef):
                    materialized.append(self._materialize_video(ref, index))
                else:
                    materialized.append(self._materialize(ref, index))
            except Exception as exc:
                return _as_error(index, exc)
        try:
            return self._inputs(refs, materialized)
        except Exception as exc:
            return _as_error(None, exc)

    def _over_budget(self, refs: Sequence[ImageRef | VideoRef]) -> dict[str, Any] | None:
        """The error for a request whose memory would exceed the budget, before any decode:
        every ref's processed tensors (the answer holds them all), and the decoded frames
        of the largest clip (decoded one ref at a time, at full size, then processed)."""
        total = decoding = 0
        for index, ref in enumerate(refs):
            if isinstance(ref, VideoRef):
                size = self._video_bytes(ref)
                total = self.max_request_bytes + 1 if size is None else total + size
                decoding = max(decoding, _decoded_bytes(ref))
            else:
                total += 4 * math.prod(self.adapter.pixel_shape(ref.width, ref.height))
            if total + decoding > self.max_request_bytes:
                return _error(
                    index,
                    "request_too_large",
                    f"the first {index + 1} refs need {total} bytes of processed tensors and "
                    f"{decoding} of decoded frames, above the request budget of "
                    f"{self.max_request_bytes}",
                )
        return None

    def _video_bytes(self, ref: VideoRef) -> int | None:
        """The bytes a video's processed tensors take (float32), from its layout's shapes;
        None when even their zero placeholder cannot be allocated (lazily: calloc'd pages
        are never touched)."""
        try:
            shapes = self._video().placeholder(ref)
        except MemoryError:
            return None
        return sum(
            (4 if np.issubdtype(a.dtype, np.floating) else a.dtype.itemsize) * a.size
            for a in shapes.values()
        )

    # -- checks that need no bytes -----------------------------------------------------

    def _admit(self, text: Any) -> ImageRef | VideoRef:
        ref = decode(text)
        if isinstance(ref, VideoRef):
            return self._admit_video(ref)
        adapter = self.adapter
        self._admit_layout(ref, adapter, "image")
        expected = adapter.num_tokens(ref.width, ref.height)
        if ref.length != expected:
            raise RefRefused(
                "span_length_mismatch",
                f"span of {ref.length} tokens, a {ref.width}x{ref.height} image lays out as "
                f"{expected}",
            )
        self.store.resolve(ref.uri)  # trust, for every ref: a cache hit must not bypass it
        return ref

    def _admit_layout(self, ref: ImageRef | VideoRef, layout: OfLayout, kind: str) -> None:
        """Refuse a ref of another family or layout than ``layout`` (the processor's image or
        video half), or whose frame size is over the store's pixel limit."""
        if ref.family != layout.family:
            raise RefRefused(
                "family_mismatch", f"ref family {ref.family!r}, processor {layout.family!r}"
            )
        if ref.layout_fingerprint != layout.fingerprint:
            raise RefRefused(
                "fingerprint_mismatch",
                f"{kind} ref laid out with {ref.layout_fingerprint!r}, this processor's "
                f"{kind} layout is {layout.fingerprint!r}",
            )
        limit = self.store.max_image_pixels
        if ref.width * ref.height > limit:
            raise RefRefused(
                "image_too_large",
                f"{kind} of {ref.width}x{ref.height} exceeds the limit of {limit} pixels",
            )

    def _video(self) -> VideoFamily:
        video = video_half(self.adapter)
        if video is None:
            raise RefRefused(
                "video_unsupported",
                f"this server's processor ({self.adapter.family}) has no video processor: "
                "it resolves image refs only",
            )
        return video

    def _admit_video(self, ref: VideoRef) -> VideoRef:
        video = self._video()
        self._admit_layout(ref, video, "video")
        if ref.num_frames > MAX_CLIP_FRAMES:
            raise RefRefused(
                "image_too_large",
                f"a clip of {ref.num_frames} frames exceeds the limit of {MAX_CLIP_FRAMES}",
            )
        expected = len(video.expansion(ref))
        if ref.length != expected:
            raise RefRefused(
                "span_length_mismatch",
                f"span of {ref.length} tokens, {len(ref.frames)} frames of a "
                f"{ref.width}x{ref.height} video lay out as {expected}",
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

    def _materialize_video(self, ref: VideoRef, index: int) -> Materialized:
        video = self._video()
        key = ("video", video.fingerprint, *ref.clip_key)
        clip = self._cache.get(key, lambda: self._process_video(ref, video))
        video.check_output(clip.tensors, ref, sample_id=None, video_index=index)
        return clip

    def _process_video(self, ref: VideoRef, video: VideoFamily) -> Materialized:
        data = self.store.read_media(ref.uri, ref.hash)
        limit = self.store.max_image_pixels
        info = probe_video(data, max_pixels=limit, max_frames=MAX_CLIP_FRAMES, where=ref.uri)
        if (info.width, info.height) != (ref.width, ref.height):
            raise RefRefused(
                "size_mismatch",
                f"ref says {ref.width}x{ref.height}, the clip is {info.width}x{info.height}",
            )
        if (problem := clip_mismatch(info, ref)) is not None:
            raise RefRefused("clip_mismatch", problem)
        frames = decode_frames(data, ref.frames, max_pixels=limit, where=ref.uri)
        outputs = {**video.process(frames, ref), **video.extras(ref)}
        tensors = {}
        for name, value in outputs.items():
            array = np.ascontiguousarray(np.asarray(value))
            if np.issubdtype(array.dtype, np.floating) and array.dtype != np.float32:
                array = array.astype(np.float32)
            array.flags.writeable = False  # shared by every request that hits this entry
            tensors[name] = array
        return Materialized(tensors, ref.width, ref.height)

    def _inputs(
        self, refs: Sequence[ImageRef | VideoRef], materialized: Sequence[Materialized]
    ) -> dict[str, Any]:
        import torch  # torch, and so the loader's stacking, only once images are served

        from mmstore._loading.stack import batch_images

        images = [m for r, m in zip(refs, materialized, strict=True) if isinstance(r, ImageRef)]
        # Views of the read-only cache entries, no copy: collation concatenates into new
        # memory and never writes its inputs (torch warns about any non-writable array).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            views = [{k: torch.from_numpy(v) for k, v in m.tensors.items()} for m in images]
        batched = batch_images(self.adapter, views)
        out: dict[str, Any] = {
            **{k: v.numpy() for k, v in batched.items()},
            "hashes": [ref.hash for ref in refs if isinstance(ref, ImageRef)],
        }
        video_refs = [r for r in refs if isinstance(r, VideoRef)]
        if video_refs:
            clips = [m for r, m in zip(refs, materialized, strict=True) if isinstance(r, VideoRef)]
            for name in self._video().input_names:  # concatenated: new memory, not the cache's
                out[name] = np.concatenate([clip.tensors[name] for clip in clips])
            out["video_uuids"] = [video_uuid(ref) for ref in video_refs]
        return out


def video_uuid(ref: VideoRef) -> str:
    """vLLM's cache key of one video item: the clip's content hash and the frames taken from
    it (two refs to other frames of one clip are other inputs). ``to_vllm_prompt`` gives a
    video this uuid (``mmstore.integrations.vllm`` exports it)."""
    frames = np.asarray(ref.frames, dtype="<i4").tobytes()
    return f"{ref.hash}-{xxhash.xxh3_64_hexdigest(frames)}"


def _as_error(index: int | None, exc: Exception) -> dict[str, Any]:
    """The error dict a failed check becomes."""
    if isinstance(exc, RefRefused):
        return _error(index, exc.reason, exc.detail)
    for kind, reason in _REASONS:
        if isinstance(exc, kind):
            return _error(index, reason, str(exc) or type(exc).__name__)
    # A bug or an environment failure, not the client's ref: log it, still answer.
    log.exception("resolving media ref %s failed unexpectedly", index)
    return _error(index, "internal_error", f"{type(exc).__name__}: {exc}")


def _error(index: int | None, reason: str, detail: str) -> dict[str, Any]:
    return {"error": ERROR, "index": index, "reason": reason, "detail": detail}


def _cache_bound(cache_bytes: int | None, materialize: Any) -> int:
    """The resolver's cache bound: ``cache_bytes``, or a Materialize object's."""
    if materialize is None:
        return DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes
    # Materialize needs torch, which this module does not: imported only when one is given.
    from mmstore._loading.settings import settings_from

    settings = settings_from(materialize, {}, reader="RefResolver")
    if cache_bytes is not None:
        raise InvalidArgumentError(
            "RefResolver got cache_bytes= and materialize=: give the bound in one of them"
        )
    settings.refuse_all_but({"cache_bytes"}, reader="RefResolver")
    return settings.cache_bytes


def _decoded_bytes(ref: VideoRef) -> int:
    """What decoding a video ref's frames holds at once, at full size: the decoded RGB
    frames and the processor's stacked copy of them (a 24-frame 4K request grew a server by
    1.2 GB: twice its 0.6 GB of frames)."""
    return 2 * len(ref.frames) * ref.width * ref.height * 3


def resolve_wire_refs(
    store: Store,
    wire_refs: Any,
    image_processor: Any,
    *,
    cache_bytes: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    materialize: Any = None,
) -> dict[str, Any]:
    """One-shot :class:`RefResolver`: refs repeated within the request are processed once.

    A server should build one ``RefResolver`` and keep it, so its cache spans requests.
    """
    resolver = RefResolver(
        store,
        image_processor,
        cache_bytes=cache_bytes,
        max_request_bytes=max_request_bytes,
        materialize=materialize,
    )
    return resolver.resolve(wire_refs)
