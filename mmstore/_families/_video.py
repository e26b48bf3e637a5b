"""The video half of a family: how one clip's sampled frames become tokens and tensors.

A :class:`VideoFamily` is to a video processor what :class:`~._base.Family` is to an image
processor: pure layout math over a :class:`~._base.Layout` (whose parameters carry
``media="video"``, so a video layout never shares a fingerprint with an image one), and,
bound to a live transformers video processor, the processor call. A ref's frames are
explicit indices (sampled once, on the rollout side, by the processor's own
``sample_frames``), so the layout and the reader never sample again: they lay out and
process exactly the frames the rollout's tokens were made for.

A family without a video processor has no :class:`VideoFamily`: its adapter's
:attr:`~._base.Family.video` raises, and the writer and reader refuse its video refs.

Span segments. Some processors write text inside a video span (timestamps: GLM-4.1V's
integer seconds, Qwen3-VL's ``<1.5 seconds>``, Kimi-K2.5's ``00:00:01.500``), which only the
tokenizer turns into ids. A family describes a ref's span as :meth:`VideoFamily.segments`:
fixed token ids (markers, runs of feature tokens) or text. :meth:`VideoFamily.expansion`
tokenizes the text with the bound tokenizer (the full processor's); a layout-only family
(footers, verify, debug) checks a span structurally (:meth:`VideoFamily.check_span`).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mmstore._families._layout import (
    Collation,
    Layout,
    OfLayout,
    Token,
    published_token_ids,
    tokenizer_ids,
)
from mmstore._format.models import MAX_REF_FRAMES, MediaRef, VideoRef
from mmstore.errors import (
    ImageSizeError,
    InvalidArgumentError,
    LayoutMismatchError,
    UnsupportedProcessorError,
)

if TYPE_CHECKING:
    import torch

MEDIA_VIDEO = "video"  # the layout parameter that marks a video layout

#: One piece of a video span: fixed token ids, or text the tokenizer turns into ids.
Segment = tuple[int, ...] | str


def is_video_layout(layout: Layout) -> bool:
    return dict(layout.parameters).get("media") == MEDIA_VIDEO


class VideoFamily(OfLayout, ABC):
    """One family's video layout and video processor call.

    A family sets ``name`` (its image family's), ``parameter_names`` (the video processor's
    layout parameters, hashed into the fingerprint), ``token_table`` (at least
    ``video_token_id``, the one token a chat template emits per video, and
    ``pad_token_id``), ``video_inputs`` (the model's video tensors and how each is batched)
    and ``token_type`` (the value the model's per-token type tensor takes on video
    features), and implements :meth:`read_parameters`, :meth:`integer_tensors` and either
    :meth:`expansion` (a span of fixed tokens) or :meth:`segments` (a span with text in it:
    set ``has_text``; the expansion is then the segments, text tokenized).
    """

    name: ClassVar[str]
    parameter_names: ClassVar[tuple[str, ...]]
    token_table: ClassVar[Mapping[str, Token]]
    video_inputs: ClassVar[Mapping[str, Collation]]
    token_type: ClassVar[int]
    #: whether :meth:`segments` holds text (then :meth:`expansion` needs a tokenizer)
    has_text: ClassVar[bool] = False
    #: whether the family's model takes one batch (or packed micro-batch) holding images and
    #: videos; a family whose model cannot gets a typed refusal from collate instead
    batches_with_images: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # (a base still abstract, as PatchVideo, leaves it to its subclasses)
        abstract = any(
            getattr(getattr(cls, n, None), "__isabstractmethod__", False) for n in dir(cls)
        )
        if abstract:
            return
        if cls.expansion is VideoFamily.expansion and cls.segments is VideoFamily.segments:
            raise TypeError(f"{cls.__name__} must implement expansion or segments")

    def __init__(self, layout: Layout, video_processor: Any = None, tokenizer: Any = None) -> None:
        if layout.family != self.name or not is_video_layout(layout):
            raise UnsupportedProcessorError(
                f"layout {layout.family!r} ({dict(layout.parameters).get('media', 'image')}) "
                f"given to the {self.name!r} video family"
            )
        self.layout = layout
        self.video_processor = video_processor
        self.tokenizer = tokenizer
        self._text_ids: dict[str, tuple[int, ...]] = {}
        #: the tokens around the video token that the bound processor replaces with it (see
        #: :meth:`read_wrapper`); None where it replaces the video token alone
        self.wrapper: tuple[int, int] | None = None

    @classmethod
    def class_for_processor(cls, video_processor: Any) -> type[VideoFamily]:
        """The class that lays out ``video_processor``'s videos (a family whose processors
        differ in layout, as Qwen2-VL's and Qwen3-VL's, picks one here)."""
        return cls

    @classmethod
    def class_for_parameters(cls, parameters: Mapping[str, Any]) -> type[VideoFamily]:
        """The class whose layout has these parameters (see :meth:`class_for_processor`)."""
        return cls

    @classmethod
    def from_processor(cls, processor: Any, token_ids: Mapping[str, int]) -> VideoFamily:
        """Bind to a full processor's (or a bare) video processor; ``token_ids``: the image
        adapter's, which hold the tokenizer's ids of this family's tokens. A full
        processor's tokenizer is kept: it tokenizes the text of spans (:meth:`segments`)."""
        video_processor = getattr(processor, "video_processor", processor)
        chosen = cls.class_for_processor(video_processor)
        if chosen is not cls:
            return chosen.from_processor(processor, token_ids)
        ids = {**published_token_ids(cls), **token_ids}
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None:
            ids.update(tokenizer_ids(cls.token_table, tokenizer))
        ids = {k: v for k, v in ids.items() if k in cls.token_table}
        parameters = {"media": MEDIA_VIDEO, **cls.read_parameters(video_processor, processor)}
        family = cls(Layout.make(cls.name, parameters, ids), video_processor, tokenizer)
        family.wrapper = cls.read_wrapper(processor, ids)
        return family

    @classmethod
    def read_wrapper(cls, processor: Any, token_ids: Mapping[str, int]) -> tuple[int, int] | None:
        """The (start, end) tokens a chat template puts around the video token that the full
        ``processor`` replaces together with it, or None (it replaces the video token alone).

        Not a layout parameter: the span (and so every reader) is the same either way; only
        the tokens around it differ, which is what :meth:`.Family.expand_media` must do as
        the processor does.
        """
        return None

    @classmethod
    @abstractmethod
    def read_parameters(cls, video_processor: Any, processor: Any) -> dict[str, Any]:
        """The layout parameters of a live video processor (refusing what we cannot lay out)."""

    def __repr__(self) -> str:
        backend = type(self.video_processor).__name__ if self.video_processor else "layout only"
        if self.has_text and self.tokenizer is None:
            backend += ", no tokenizer"
        return f"{type(self).__name__}({backend}, fingerprint={self.fingerprint!r})"

    # -- identity -------------------------------------------------------------------------

    @property
    def video_token_id(self) -> int:
        """The one token a chat template emits per video (what
        :meth:`.Family.expand_media` replaces)."""
        return self.layout.token_id("video_token_id")

    @property
    def feature_token_id(self) -> int:
        """The token whose positions receive the video's features."""
        return self.video_token_id

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Tokens only video spans hold: one outside every span is a stray video."""
        return frozenset({self.video_token_id, self.feature_token_id})

    @cached_property
    def family_token_ids(self) -> frozenset[int]:
        """Every token of the family's table: none may occur in a span's text."""
        return frozenset(int(v) for _, v in self.layout.token_ids)

    def mark_token_types(self, input_ids: torch.Tensor, types: torch.Tensor) -> None:
        """Set the per-token types (``mm_token_type_ids``) of video features in ``types``
        (in place; ``input_ids`` ``[L]`` or ``[B, L]``, rows whole samples or packed ones):
        :attr:`token_type` on :attr:`feature_token_id` by default."""
        types[input_ids == self.feature_token_id] = self.token_type

    # -- layout math ----------------------------------------------------------------------

    def segments(self, ref: VideoRef | Clip) -> list[Segment]:
        """The ref's span in order: fixed token ids (tuples) and text (str) the tokenizer
        tokenizes. A span without text is one fixed segment, its :meth:`expansion`."""
        return [tuple(self.expansion(ref))]

    def expansion(self, ref: VideoRef | Clip) -> list[int]:
        """The exact tokens the ref's frames become in the model's input (text segments
        tokenized by the bound tokenizer, as the full processor tokenizes them)."""
        out: list[int] = []
        for segment in self.segments(ref):
            out.extend(self.text_ids(segment) if isinstance(segment, str) else segment)
        return out

    def text_ids(self, text: str) -> tuple[int, ...]:
        """``text`` tokenized as the full processor's tokenizer does inside a span: the
        text between two special tokens is tokenized on its own, no special tokens added."""
        ids = self._text_ids.get(text)
        if ids is None:
            if self.tokenizer is None:
                raise UnsupportedProcessorError(
                    f"{self!r}: its video spans hold text ({text!r}) that only the full "
                    "processor's tokenizer tokenizes: build the adapter with "
                    "mmstore.adapter_for(full processor)"
                )
            encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = self._text_ids[text] = tuple(int(t) for t in encoded)
        return ids

    def check_span(self, tokens: Sequence[int] | np.ndarray, ref: VideoRef) -> str | None:
        """What is wrong with ``tokens`` as the span of ``ref`` (None: nothing).

        Exact (the tokens equal :meth:`expansion`) where the span holds no text or a
        tokenizer is bound. Otherwise structural: fixed segments must match exactly; a text
        segment takes the tokens up to the next of the family's tokens (or the span's end):
        at least one, at most a few more than its text has bytes, none of the family's; the
        segments must take the whole span.
        """
        span = np.asarray(tokens, dtype=np.int64)
        try:
            exact = not self.has_text or self.tokenizer is not None
            expected = np.asarray(self.expansion(ref), dtype=np.int64) if exact else None
            segments = None if exact else self.segments(ref)
        except ImageSizeError as exc:
            return exc.message
        if expected is not None:
            if len(span) != len(expected):
                return (
                    f"holds {len(span)} tokens; {self.family} lays out {len(expected)} for "
                    f"{len(ref.frames)} frames of a {ref.width}x{ref.height} video"
                )
            wrong = np.flatnonzero(span != expected)
            if wrong.size:
                at = int(wrong[0])
                return (
                    f"holds token {int(span[at])} at span position {at}, not the "
                    f"{self.family} expansion's {int(expected[at])}"
                )
            return None
        assert segments is not None
        return self._check_structure(span, segments, ref)

    def _check_structure(
        self, span: np.ndarray, segments: Sequence[Segment], ref: VideoRef
    ) -> str | None:
        n = len(span)
        family_at = np.flatnonzero(np.isin(span, sorted(self.family_token_ids)))
        pos = 0
        for segment in segments:
            if isinstance(segment, str):
                k = int(np.searchsorted(family_at, pos))
                stop = int(family_at[k]) if k < len(family_at) else n
                taken = stop - pos
                if taken == 0:
                    what = f"token {int(span[pos])}" if pos < n else "the span's end"
                    return f"has no tokens for the text {segment!r}: {what} at span position {pos}"
                if taken > len(segment.encode()) + 2:
                    return (
                        f"holds {taken} tokens at span positions {pos}..{stop - 1} for the "
                        f"text {segment!r}"
                    )
                pos = stop
                continue
            fixed = np.asarray(segment, dtype=np.int64)
            got = span[pos : pos + len(fixed)]
            if len(got) < len(fixed):
                return (
                    f"ends at {n} tokens inside the {self.family} layout of "
                    f"{len(ref.frames)} frames of a {ref.width}x{ref.height} video"
                )
            wrong = np.flatnonzero(got != fixed)
            if wrong.size:
                at = pos + int(wrong[0])
                return (
                    f"holds token {int(span[at])} at span position {at}, not the "
                    f"{self.family} layout's {int(fixed[wrong[0]])}"
                )
            pos += len(fixed)
        if pos != n:
            return (
                f"holds {n} tokens; the {self.family} layout of {len(ref.frames)} frames of a "
                f"{ref.width}x{ref.height} video ends at {pos}"
            )
        return None

    @abstractmethod
    def integer_tensors(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        """The integer tensors (grids) the processor gives the ref's frames."""

    @abstractmethod
    def placeholder(self, ref: VideoRef | Clip) -> dict[str, np.ndarray]:
        """Zero tensors of exactly the shapes the processor gives the ref's frames."""

    @abstractmethod
    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        """How many feature tokens one clip's processor output fills."""

    @property
    def input_names(self) -> tuple[str, ...]:
        """The batch keys one video feeds the model: its tensors, then :meth:`extras`'."""
        return tuple(self.video_inputs)

    def extras(self, ref: VideoRef) -> dict[str, Any]:
        """Per-video model inputs besides the processor's tensors (a leading axis of one
        video, concatenated over the batch's videos); none by default."""
        return {}

    # -- the processor --------------------------------------------------------------------

    def sample(
        self, media: MediaRef, *, fps: float | None = None, num_frames: int | None = None
    ) -> list[int]:
        """The frame indices the video processor samples from ``media`` (its own
        ``sample_frames``, with its configured or these ``fps``/``num_frames``)."""
        if media.kind != "video" or media.num_frames is None or media.fps is None:
            raise InvalidArgumentError(f"{media.uri} is not a video (put_video returns one)")
        if self.video_processor is None:
            raise UnsupportedProcessorError(f"{self!r} has no video processor to sample with")
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(
            total_num_frames=media.num_frames,
            fps=media.fps,
            width=media.width,
            height=media.height,
            duration=media.num_frames / media.fps,
        )
        kwargs = {k: v for k, v in (("fps", fps), ("num_frames", num_frames)) if v is not None}
        if (
            not kwargs
            and getattr(self.video_processor, "fps", None) is None
            and getattr(self.video_processor, "num_frames", None) is None
        ):
            return list(range(media.num_frames))  # the processor would take every frame
        try:
            indices = self.video_processor.sample_frames(metadata, **kwargs)
        except ValueError as exc:  # e.g. more frames asked than the clip has (Kimi-K2.5)
            raise InvalidArgumentError(
                f"{type(self.video_processor).__name__} cannot sample {media.uri} "
                f"({media.num_frames} frames at {media.fps:g} fps): {exc}"
            ) from None
        return [int(i) for i in np.asarray(indices).tolist()]

    def process(
        self, frames: np.ndarray, ref: VideoRef, dtype: torch.dtype | None = None
    ) -> dict[str, Any]:
        """Run the real video processor on ``frames`` (uint8 ``[T, H, W, 3]``, the ref's
        frames): the model's video tensors, their floats in ``dtype`` (torch) or numpy."""
        import torch

        if self.video_processor is None:
            raise UnsupportedProcessorError(f"{self!r} has no video processor to run")
        from mmstore._tensors import cast_floats, casting_after_normalize

        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        processor = self.video_processor
        if dtype is not None:  # patchify and concatenate move half the bytes, same bits
            processor = casting_after_normalize(processor, dtype)
        out = processor(videos=[video], return_tensors="pt", **self.processor_kwargs(ref))
        selected = {key: out[key] for key in self.video_inputs}
        if dtype is None:
            return {key: np.asarray(value) for key, value in selected.items()}
        return cast_floats(selected, dtype)

    def processor_kwargs(self, ref: VideoRef) -> dict[str, Any]:
        """The processor's call arguments besides the frames: never sample again."""
        return {"do_sample_frames": False}

    def check_output(
        self, outputs: Mapping[str, Any], ref: VideoRef, *, sample_id: str | None, video_index: int
    ) -> None:
        """Refuse processor output that does not fill the ref's span or grid exactly."""
        produced = self.output_tokens(outputs)
        expected_tokens = self.output_tokens(self.integer_tensors(ref))
        if produced != expected_tokens:
            raise LayoutMismatchError(
                f"video processor output fills {produced} video tokens, the span holds "
                f"{expected_tokens}",
                sample_id=sample_id,
                video_index=video_index,
                uri=ref.uri,
            )
        for key, expected in self.integer_tensors(ref).items():
            got = np.asarray(outputs[key])
            if got.shape != expected.shape or (got != expected).any():
                raise LayoutMismatchError(
                    f"video processor output has {key} {got.tolist()}, the ref's "
                    f"{len(ref.frames)} frames of {ref.width}x{ref.height} lay out as "
                    f"{expected.tolist()}",
                    sample_id=sample_id,
                    video_index=video_index,
                    uri=ref.uri,
                )

    # -- the rollout side -----------------------------------------------------------------

    def ref(self, media: MediaRef, frames: Sequence[int], offset: int) -> VideoRef:
        """A ref to ``frames`` of ``media`` whose span starts at ``offset``."""
        clip = Clip.of(media, frames)
        return VideoRef(
            uri=media.uri,
            hash=media.hash,
            width=media.width,
            height=media.height,
            nbytes=media.nbytes,
            num_frames=clip.num_frames,
            fps=clip.fps,
            frames=clip.frames,
            offset=offset,
            length=len(self.expansion(clip)),
            family=self.family,
            layout_fingerprint=self.fingerprint,
        )


class Clip:
    """What layout math reads of a video ref, before the ref (and its span) exists."""

    __slots__ = ("fps", "frames", "height", "num_frames", "width")

    def __init__(
        self, width: int, height: int, num_frames: int, fps: float, frames: Sequence[int]
    ) -> None:
        self.width, self.height, self.num_frames, self.fps = width, height, num_frames, fps
        self.frames = tuple(int(f) for f in frames)

    @classmethod
    def of(cls, media: MediaRef, frames: Sequence[int]) -> Clip:
        if media.kind != "video" or media.num_frames is None or media.fps is None:
            raise InvalidArgumentError(f"{media.uri} is not a video (put_video returns one)")
        frames = [int(f) for f in frames]
        if not frames or len(frames) > MAX_REF_FRAMES:
            raise InvalidArgumentError(
                f"a video ref names 1 to {MAX_REF_FRAMES} frames, got {len(frames)}"
            )
        if any(b <= a for a, b in itertools.pairwise(frames)):
            raise InvalidArgumentError("frames must be strictly increasing")
        if frames[0] < 0 or frames[-1] >= media.num_frames:
            raise InvalidArgumentError(
                f"frames {frames[0]}..{frames[-1]} are not within the clip's "
                f"{media.num_frames} frames"
            )
        return cls(media.width, media.height, media.num_frames, media.fps, frames)


def sampled_fps(ref: VideoRef | Clip) -> float:
    """The rate a ref's frames were sampled at (transformers' ``VideoMetadata.sampled_fps``)."""
    return len(ref.frames) / ref.num_frames * ref.fps
