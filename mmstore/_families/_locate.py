"""Spans in token ids whose media are expanded already: :meth:`.Family.locate`.

:meth:`.Family.expand_media` writes each medium's expansion in place of its one placeholder
token. Rollout code often holds ids expanded already (a processor's ``input_ids`` from its
chat template, an inference engine's prompt ids); :func:`locate` finds the spans there and
gives the refs ``expand_media`` gives for the unexpanded prompt, field for field, with the
tokens unchanged.

How a span is found. Left to right, the next medium (images in order among themselves, videos
among themselves; the two kinds interleave as the ids say) is the one whose kind's *feature
token* (the token its features land on: Qwen's ``<|image_pad|>``, Gemma 3's soft token, a
video's pad) comes next: every expansion holds it and no text does, while the tokens an
expansion may start with are ordinary text (Gemma 3's ``"\\n\\n"``, a Qwen3-VL or Kimi-K2.5
video's timestamp) or markers a chat template also writes outside spans (a GLM-4.1V video
slab's ``<|begin_of_image|>``). The span starts as many tokens before that feature token as the
expansion has before its first one, and must equal the expansion exactly. Feature or
placeholder tokens left outside every span mean more media in the ids than given: refused.
GLM-4.1V's images and videos share one feature token: a video's are those the model's token
types make a video's (between ``<|begin_of_video|>`` and ``<|end_of_video|>``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmstore._families._layout import Expanded
from mmstore._families._video import Clip, VideoFamily
from mmstore._format.models import ImageRef, MediaRef, VideoRef
from mmstore.errors import InvalidArgumentError, InvalidRolloutError, UnsupportedProcessorError


class Family(Protocol):
    """What locating reads of an image family (:class:`._base.Family`, which imports this
    module: so named by what it offers)."""

    @property
    def feature_token_id(self) -> int: ...
    @property
    def special_token_ids(self) -> frozenset[int]: ...
    @property
    def video(self) -> VideoFamily: ...
    def expansion(self, width: int, height: int) -> list[int]: ...
    def _image_ref(self, item: MediaRef | ImageRef, offset: int) -> ImageRef: ...


@dataclass(frozen=True)
class _Wanted:
    """One medium to locate: its expansion, and its ref once its span's offset is known."""

    kind: str  # "image" or "video"
    index: int  # among the media of its kind
    what: str  # the medium in messages ("a 640x480 image")
    uri: str
    expansion: np.ndarray
    lead: int  # tokens of the expansion before its first feature token
    ref: Callable[[int], ImageRef | VideoRef]

    @property
    def context(self) -> dict[str, Any]:
        return {f"{self.kind}_index": self.index, "uri": self.uri}


def locate(
    family: Family,
    token_ids: Sequence[int],
    *,
    images: Sequence[MediaRef | ImageRef] = (),
    videos: Sequence[MediaRef] = (),
    fps: float | None = None,
    num_frames: int | None = None,
    frames: Sequence[Sequence[int]] | None = None,
) -> Expanded:
    """The spans of ``images`` and ``videos`` in ``token_ids``, whose spans are expanded
    already: the tokens unchanged, and the refs :meth:`.Family.expand_media` gives for the
    same prompt with one placeholder per medium (a video's frames sampled as it samples)."""
    tokens = [int(t) for t in token_ids]
    _check_arguments(images, videos, frames)
    video = family.video if videos else _video_half(family)
    ids = np.asarray(tokens, dtype=np.int64)
    on_video = _video_features(family, video, ids)
    features = {
        "image": np.flatnonzero((ids == family.feature_token_id) & ~on_video),
        "video": np.flatnonzero(on_video),
    }
    pending = {
        "image": deque(_wanted_images(family, images)),
        "video": deque(_wanted_videos(video, videos, fps, num_frames, frames)),
    }
    found: list[tuple[_Wanted, int]] = []
    cursor = 0
    while any(pending.values()):
        item, at = _next(pending, features, cursor)
        start = at - item.lead
        problem = _mismatch(ids, item, start, cursor)
        if problem is not None:
            raise _run_on(ids, found, at) or InvalidRolloutError(problem, **item.context)
        found.append((item, start))
        cursor = start + len(item.expansion)
    _check_no_stray(ids, found, _special(family, video, ids, on_video), on_video, video)
    refs: dict[str, list[Any]] = {"image": [], "video": []}
    for item, start in found:
        refs[item.kind].append(item.ref(start))
    return Expanded(tokens, refs["image"], refs["video"])


def _check_arguments(
    images: Sequence[MediaRef | ImageRef],
    videos: Sequence[MediaRef],
    frames: Sequence[Sequence[int]] | None,
) -> None:
    """The argument checks of :meth:`.Family.expand_media`, refused alike."""
    for item in images:
        if getattr(item, "kind", "image") != "image":
            raise InvalidArgumentError(f"{item.uri} is a video: pass it in videos=")
    if frames and not videos:
        raise InvalidArgumentError("frames= given without videos")
    if frames is not None and len(frames) != len(videos):
        raise InvalidArgumentError(f"{len(frames)} frame lists for {len(videos)} videos")


def _video_half(family: Family) -> VideoFamily | None:
    # Without videos to locate, the video half (where there is one) still tells a video's
    # tokens left in the ids from an image's, and refuses them as strays.
    try:
        return family.video
    except UnsupportedProcessorError:
        return None


def _video_features(family: Family, video: VideoFamily | None, ids: np.ndarray) -> np.ndarray:
    """Where the ids hold a video's feature tokens (a bool mask)."""
    if video is None:
        return np.zeros(len(ids), dtype=bool)
    if video.feature_token_id != family.feature_token_id:
        return ids == video.feature_token_id
    # One token feeds images and videos (GLM-4.1V's <|image|>): which are a video's is what
    # the model's token types say (inside <|begin_of_video|>..<|end_of_video|>), so ask the
    # video half's own marking rather than guess from the span's shape.
    import torch

    types = torch.zeros(len(ids), dtype=torch.int64)
    video.mark_token_types(torch.from_numpy(ids), types)
    marked: np.ndarray = types.numpy() == video.token_type
    return marked


def _wanted_images(family: Family, images: Sequence[MediaRef | ImageRef]) -> list[_Wanted]:
    out = []
    for index, item in enumerate(images):
        expansion = np.asarray(family.expansion(item.width, item.height), dtype=np.int64)
        out.append(
            _Wanted(
                kind="image",
                index=index,
                what=f"a {item.width}x{item.height} image",
                uri=item.uri,
                expansion=expansion,
                lead=_lead(expansion, family.feature_token_id),
                ref=functools.partial(family._image_ref, item),
            )
        )
    return out


def _wanted_videos(
    video: VideoFamily | None,
    videos: Sequence[MediaRef],
    fps: float | None,
    num_frames: int | None,
    frames: Sequence[Sequence[int]] | None,
) -> list[_Wanted]:
    out = []
    for index, media in enumerate(videos):
        assert video is not None  # bound (or refused) when videos are given
        # Sampled as expand_media samples: the ref records these frames.
        picked = frames[index] if frames is not None else None
        if picked is None:
            picked = video.sample(media, fps=fps, num_frames=num_frames)
        expansion = np.asarray(video.expansion(Clip.of(media, picked)), dtype=np.int64)
        out.append(
            _Wanted(
                kind="video",
                index=index,
                what=f"{len(picked)} frames of a {media.width}x{media.height} video",
                uri=media.uri,
                expansion=expansion,
                lead=_lead(expansion, video.feature_token_id),
                ref=functools.partial(video.ref, media, picked),
            )
        )
    return out


def _lead(expansion: np.ndarray, feature: int) -> int:
    """Tokens of ``expansion`` before its first ``feature`` token."""
    at = np.flatnonzero(expansion == feature)
    if not at.size:  # a family whose expansion holds no feature token cannot be located
        raise UnsupportedProcessorError(f"an expansion without its feature token {feature}")
    return int(at[0])


def _next(
    pending: Mapping[str, deque[_Wanted]], features: Mapping[str, np.ndarray], cursor: int
) -> tuple[_Wanted, int]:
    """The medium whose span comes next (its kind's next feature token at or after
    ``cursor`` is the nearer), and that token's position; taken from ``pending``."""
    best: tuple[_Wanted, int] | None = None
    for kind, queue in pending.items():
        if not queue:
            continue
        at = features[kind]
        k = int(np.searchsorted(at, cursor))
        if k == len(at):
            item = queue[0]
            raise InvalidRolloutError(
                f"{kind} {item.index} ({item.what}): no {kind} span at or after position "
                f"{cursor}: the ids hold fewer {kind}s than the {item.index + len(queue)} given",
                **item.context,
            )
        if best is None or at[k] < best[1]:
            best = (queue[0], int(at[k]))
    assert best is not None  # called while some medium is pending
    pending[best[0].kind].popleft()
    return best


def _mismatch(ids: np.ndarray, item: _Wanted, start: int, cursor: int) -> str | None:
    """What is wrong with the span at ``start`` as the medium's expansion (None: nothing)."""
    n = len(item.expansion)
    name = f"{item.kind} {item.index} ({item.what})"
    if start < cursor:
        return (
            f"{name}: its {n}-token span would start at {start}, before position {cursor} "
            f"(its first feature token is at {start + item.lead}, {item.lead} into the span)"
        )
    got = ids[start : start + n]
    m = min(len(got), n)
    wrong = np.flatnonzero(got[:m] != item.expansion[:m])
    if not wrong.size and len(got) == n:
        return None
    at = int(wrong[0]) if wrong.size else m
    found = f"token {int(got[at])}" if at < len(got) else "the ids' end"
    return (
        f"{name}: expected a span of {n} tokens at position {start}, found "
        f"{_run(ids, start, item.expansion)} of its layout's tokens there; span position "
        f"{at} holds {found}, not {int(item.expansion[at])}"
    )


def _run_on(
    ids: np.ndarray, found: Sequence[tuple[_Wanted, int]], at: int
) -> InvalidRolloutError | None:
    """The previous medium's error where its span runs on into the next one's feature token
    at ``at``: a span of repeated feature tokens (Qwen's, GLM's) longer than its medium's
    layout matches that layout as a prefix, and its remainder would be blamed on the next
    medium, whose media are fine."""
    if not found:
        return None
    item, start = found[-1]
    end = start + len(item.expansion)
    if at != end or int(ids[at]) != int(item.expansion[-1]):
        return None
    return InvalidRolloutError(
        f"{item.kind} {item.index} ({item.what}): expected a span of {len(item.expansion)} "
        f"tokens at position {start}, found {_run(ids, start, item.expansion)} of its "
        "layout's tokens there: the span runs on past its end",
        **item.context,
    )


def _run(ids: np.ndarray, start: int, expansion: np.ndarray) -> int:
    """How many tokens from ``start`` on are tokens of ``expansion`` (what the ids hold
    where the span was expected: its length, where it ends at other tokens)."""
    inside = np.isin(ids[start:], np.unique(expansion))
    return int(np.argmin(inside)) if not inside.all() else len(inside)


def _special(
    family: Family, video: VideoFamily | None, ids: np.ndarray, on_video: np.ndarray
) -> np.ndarray:
    """Where the ids hold tokens only spans hold: feature and placeholder tokens."""
    special = set(family.special_token_ids) | {family.feature_token_id}
    if video is not None:
        special |= set(video.special_token_ids) | {video.feature_token_id}
    mask: np.ndarray = np.isin(ids, sorted(special)) | on_video
    return mask


def _check_no_stray(
    ids: np.ndarray,
    found: Sequence[tuple[_Wanted, int]],
    special: np.ndarray,
    on_video: np.ndarray,
    video: VideoFamily | None,
) -> None:
    """Refuse feature or placeholder tokens outside every located span."""
    outside = special.copy()
    for item, start in found:
        outside[start : start + len(item.expansion)] = False
    if not outside.any():
        return
    pos = int(np.flatnonzero(outside)[0])
    video_ids = video.special_token_ids if video is not None else frozenset()
    kind = "video" if on_video[pos] or int(ids[pos]) in video_ids else "image"
    before = [(item, start) for item, start in found if start + len(item.expansion) <= pos]
    raise _stray(f"{_a(kind)} token ({int(ids[pos])}) at position {pos}", kind, pos, before)


def _stray(
    token: str, kind: str, pos: int, before: Sequence[tuple[_Wanted, int]]
) -> InvalidRolloutError:
    """The error for ``token``, a ``kind`` token at ``pos`` outside every span; ``before``:
    the spans located before it."""
    item, start = before[-1] if before else (None, 0)
    end = start + len(item.expansion) if item is not None else 0
    if item is not None and end == pos:
        # Right after a span: that span runs on, or another medium follows it unexpanded.
        return InvalidRolloutError(
            f"{item.kind} {item.index} ({item.what}): its {len(item.expansion)}-token span "
            f"is followed by {token}: the span is longer than its layout, or the ids hold "
            f"more {kind}s than given",
            **item.context,
        )
    after = ""
    if item is not None and item.kind == kind == "video":
        # A video span of more slabs than its frames lay out leaves such strays too (its
        # layout matches the span's first slabs; text separates slabs): name that span.
        after = (
            f" (after video {item.index}'s span, {start}..{end - 1}, or its frames are not "
            "those the span was laid out for)"
        )
    return InvalidRolloutError(
        f"{token} lies outside every located span: the ids hold more {kind}s than given{after}",
        position=pos,
    )


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"
