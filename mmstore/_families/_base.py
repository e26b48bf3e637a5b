"""The family protocol: what mmstore must know of one model family's images.

A :class:`Layout` is pure data: the family's name, the processor parameters that decide how
an image becomes tokens (hashed into the fingerprint) and the tokenizer's ids of the family's
image tokens (not hashed: they are tokenizer facts, not layout math). It is also the record
each rollout file's footer keeps, so a reader can redo the layout math without the processor.

A :class:`Family` is that layout plus behaviour. Bound to a live transformers image processor
it is the *adapter* (``mmstore.adapter_for``): it expands image tokens, runs the processor,
builds zero placeholders and says which tensors the family's model takes. Built from a layout
alone (a footer, a fingerprint seen in this process) it still answers every question of layout
math: the expansion of an image, its token count, the shape of its pixels.

What no family does its own way lives beside the class, not on it: the cached expansion
arrays the checks read (:func:`expansion_array`, per layout), running the processor
(:func:`run_processor`, :func:`takes_tensors`); the batch's model inputs and token types live
with collate (:mod:`mmstore._loading.collate`).

Nothing outside the family modules names a family's tensors or token ids: the store, writer,
loader, collate and the vLLM integration ask the family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mmstore._families._layout import (
    Collation,
    Expanded,
    Layout,
    OfLayout,
    Token,
    published_token_ids,
    tokenizer_ids,
)
from mmstore._families._locate import locate
from mmstore._families._video import VideoFamily
from mmstore._format.models import ImageRef, MediaRef, VideoRef
from mmstore.errors import (
    InvalidArgumentError,
    InvalidRolloutError,
    LayoutMismatchError,
    UnsupportedProcessorError,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image


class Family(OfLayout, ABC):
    """One model family's image layout, processor call and model inputs.

    A new family (one module, or a third party's class given to
    :func:`mmstore.register_family`) sets the class attributes ``name``,
    ``parameter_names``, ``token_table`` (at least ``image_token_id`` and ``pad_token_id``)
    and ``image_inputs``, and implements:

    - :meth:`read_parameters`: the layout parameters of a live processor;
    - :meth:`expansion`, :meth:`placeholder`, :attr:`dummy_size`: layout math;
    - :meth:`output_tokens`: how many span tokens a processor output fills.

    It may override what its family does differently: the class attributes
    ``token_type_input``, ``position_rows`` and ``vllm_modality``; token ids
    (:meth:`read_token_ids`, :meth:`from_processor`, :attr:`feature_token_id`,
    :attr:`special_token_ids`); layout math with a faster or finer form (:meth:`num_tokens`,
    :meth:`integer_tensors`, :meth:`pixel_shape`); the processor call and its checks
    (:meth:`processor_kwargs`, :meth:`select_outputs`, :meth:`check_output`); position ids
    (:meth:`position_ids`) and vLLM's item (:meth:`vllm_item`).

    The rest is the adapter's public face and is not overridden: :attr:`family`,
    :attr:`fingerprint`, :attr:`image_token_id`, :meth:`expand`, :meth:`expand_media`,
    :meth:`locate`, :meth:`process`, and :attr:`video`, the family's video half (a
    :class:`._video.VideoFamily` registered beside it in :mod:`._registry`, bound to the full
    processor's video processor).

    Layout math reads ``self.layout`` only, never the processor: a family built from a layout
    alone (a footer) answers it, and expansions are cached per layout (:func:`expansion_array`).
    """

    #: the family's name, as rows record it in ``ImageRef.family``
    name: ClassVar[str]
    #: processor attributes that decide the layout (the fingerprint hashes exactly these)
    parameter_names: ClassVar[tuple[str, ...]]
    #: the family's special tokens, by the layout's name for their id: ``image_token_id`` is
    #: the one token a chat template emits per image, ``pad_token_id`` pads batches
    token_table: ClassVar[Mapping[str, Token]]
    #: the image tensors the family's model takes, and how each is batched
    image_inputs: ClassVar[Mapping[str, Collation]]
    #: name of the per-token type tensor the model takes (1 on image features), if any
    token_type_input: ClassVar[str | None] = None
    #: rows of position ids: 1 for 1-D RoPE, 3 for M-RoPE (packing adds the text row)
    position_rows: ClassVar[int] = 1
    #: whether the model's image tokens attend to each other both ways (Gemma 3), which a
    #: prefix forest's attention mask must keep (``attention_blocks``)
    images_attend_both_ways: ClassVar[bool] = False
    #: the ``multi_modal_data`` key vLLM's processor for this family takes its images under
    vllm_modality: ClassVar[str] = "image"

    #: the processor :meth:`mmstore.adapter_for` was given, and how the registry binds the
    #: video half to its ``video_processor`` on first use of :attr:`video`
    video_source: Any = None
    video_binder: Callable[[Family], VideoFamily] | None = None
    #: the model's config, where a family's position ids read it (Qwen2.5-VL videos'
    #: ``vision_config.tokens_per_second``); ``mmstore.adapter_for(..., model_config=)``
    model_config: Any = None

    def __init__(self, layout: Layout, image_processor: Any = None) -> None:
        if layout.family != self.name:
            raise UnsupportedProcessorError(
                f"layout of family {layout.family!r} given to the {self.name!r} family"
            )
        self.layout = layout
        self.image_processor = image_processor

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_processor(cls, processor: Any, *, image_token_id: int | None = None) -> Family:
        """Bind to a live image processor, or a full processor (image processor + tokenizer).

        Token ids come from the full processor's tokenizer when there is one, else from the
        family's published tokenizer (:attr:`token_table`).
        """
        image_processor = getattr(processor, "image_processor", processor)
        tokenizer = getattr(processor, "tokenizer", None)
        token_ids = published_token_ids(cls)
        if tokenizer is not None:
            token_ids.update(cls.read_token_ids(tokenizer))
        if image_token_id is None and processor is not image_processor:
            image_token_id = getattr(processor, "image_token_id", None)
        if image_token_id is not None:
            token_ids["image_token_id"] = int(image_token_id)
        parameters = cls.read_parameters(image_processor, processor)
        return cls(Layout.make(cls.name, parameters, token_ids), image_processor)

    @classmethod
    @abstractmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        """The layout parameters of a live image processor (refuse settings we cannot lay out).

        ``processor`` is the full processor when one was given, else the image processor
        itself: some families keep layout parameters there (Gemma 3's image_seq_length).
        """

    @classmethod
    def read_token_ids(cls, tokenizer: Any) -> dict[str, int]:
        """This family's token ids in ``tokenizer`` (those it has; published ids fill the rest)."""
        return tokenizer_ids(cls.token_table, tokenizer)

    def __repr__(self) -> str:
        backend = type(self.image_processor).__name__ if self.image_processor else "layout only"
        return f"{type(self).__name__}({backend}, fingerprint={self.fingerprint!r})"

    # -- identity ---------------------------------------------------------------------

    @property
    def image_token_id(self) -> int:
        """The one token a chat template emits per image (what vLLM expands)."""
        return self.layout.image_token_id

    @property
    def feature_token_id(self) -> int:
        """The token whose positions receive the image's features (its token type is 1)."""
        return self.image_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Tokens that occur only inside image spans: one outside a span is a stray image."""
        return frozenset({self.image_token_id, self.feature_token_id})

    # -- layout math (no processor needed) --------------------------------------------

    @abstractmethod
    def expansion(self, width: int, height: int) -> list[int]:
        """The exact tokens one image of this size becomes in the model's input."""

    def num_tokens(self, width: int, height: int) -> int:
        return len(self.expansion(width, height))

    @abstractmethod
    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        """Zero tensors of exactly the shapes the processor gives one image of this size."""

    def integer_tensors(self, width: int, height: int) -> dict[str, np.ndarray]:
        """The integer tensors of :meth:`placeholder` (grids, sizes), without its pixels:
        what position ids read before the pixels exist (preprocessing on a device)."""
        zeros = self.placeholder(width, height)
        return {key: value for key, value in zeros.items() if value.dtype.kind != "f"}

    def pixel_shape(self, width: int, height: int) -> tuple[int, ...]:
        """Shape of one image's float ``pixel_values`` (for dense-size estimates)."""
        return tuple(self.placeholder(width, height)["pixel_values"].shape)

    @property
    @abstractmethod
    def dummy_size(self) -> tuple[int, int]:
        """(width, height) of the smallest image the family lays out (the FSDP dummy)."""

    # -- the processor ----------------------------------------------------------------

    def process(self, images: Sequence[Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Run the real image processor on ``images``: the model's image tensors, numpy; with
        ``dtype``, torch tensors whose floats are in ``dtype`` (integers kept as they are)."""
        out = self.select_outputs(run_processor(self, images, cast_to=dtype))
        if dtype is None:
            return {key: np.asarray(value) for key, value in out.items()}
        from mmstore._tensors import cast_floats  # torch: only when a dtype asks for tensors

        return cast_floats(out, dtype)

    def select_outputs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        """The model's image tensors of one processor output, as the processor made them;
        families fix integer dtypes here, or refuse an output they cannot lay out."""
        return {key: out[key] for key in self.image_inputs}

    def processor_kwargs(self) -> dict[str, Any]:
        """The processor's call arguments besides the images.

        ``return_tensors``: a torchvision backend's own torch tensors (asked for numpy, it
        copies its float32 output: about 2 ms of a 1080p image's 26 here), a PIL backend's own
        numpy arrays. :meth:`process` views either as numpy, uncopied.
        """
        return {"return_tensors": "pt" if takes_tensors(self.image_processor) else "np"}

    @abstractmethod
    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        """How many span tokens one image's processor output fills."""

    def check_output(
        self, outputs: Mapping[str, Any], ref: ImageRef, *, sample_id: str | None, image_index: int
    ) -> None:
        """Refuse processor output that does not fill the stored span exactly, or whose
        integer tensors (grids, sizes) are not those of the ref's size: a count alone passes
        a transposed grid (an image turned a quarter against its ref: other pixels)."""
        produced = self.output_tokens(outputs)
        if produced != ref.length:
            raise LayoutMismatchError(
                f"processor output fills {produced} image tokens, the span holds {ref.length}",
                sample_id=sample_id,
                image_index=image_index,
                uri=ref.uri,
            )
        for key, expected in self.integer_tensors(ref.width, ref.height).items():
            got = np.asarray(outputs[key])
            if got.shape != expected.shape or (got != expected).any():
                raise LayoutMismatchError(
                    f"processor output has {key} {got.tolist()}, a {ref.width}x{ref.height} "
                    f"image lays out as {expected.tolist()}",
                    sample_id=sample_id,
                    image_index=image_index,
                    uri=ref.uri,
                )

    # -- the model's inputs -----------------------------------------------------------

    def position_ids(
        self,
        input_ids: torch.Tensor,
        images: Sequence[Mapping[str, torch.Tensor]],
        videos: Sequence[Mapping[str, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """Position ids of one sample run alone, ``[position_rows, L]`` (1-D RoPE: 0..L-1);
        ``videos``: each video's tensors (the video half's inputs), in span order."""
        import torch

        return torch.arange(input_ids.shape[-1], dtype=torch.int64)[None]

    def vllm_item(self, image: Image.Image, uuid: str) -> Any:
        """One image as an item of vLLM's ``multi_modal_data[vllm_modality]`` (the image)."""
        return image

    # -- video ------------------------------------------------------------------------

    @property
    def video(self) -> VideoFamily:
        """The family's video half, bound to the full processor's video processor; raises
        :class:`UnsupportedProcessorError` for a family without video (Gemma 3, Pixtral) or
        an adapter built without a video processor.

        Bound once, refusal included: collate and the writer ask for it every batch and row,
        and an image-only adapter must not pay a failed binding each time."""
        bound = self.__dict__.get("_video")
        if bound is None:
            try:
                if self.video_binder is None:
                    raise UnsupportedProcessorError(
                        f"{self!r} has no video processor: build it with "
                        "mmstore.adapter_for(full processor)"
                    )
                bound = self.video_binder(self)
            except UnsupportedProcessorError as exc:
                bound = exc  # the refusal, raised afresh (its own traceback) on every ask
            self.__dict__["_video"] = bound
        if isinstance(bound, UnsupportedProcessorError):
            raise UnsupportedProcessorError(bound.message, **bound.context)
        return bound

    # -- the rollout side -------------------------------------------------------------

    def expand(
        self, token_ids: Sequence[int], media: Sequence[MediaRef | ImageRef]
    ) -> tuple[list[int], list[ImageRef]]:
        """Replace the i-th image token by the expansion of ``media[i]``; tokens and refs.

        The returned refs carry their spans, this family's name and fingerprint.
        """
        tokens, images, _ = self.expand_media(token_ids, images=media)
        return tokens, images

    def expand_media(
        self,
        token_ids: Sequence[int],
        *,
        images: Sequence[MediaRef | ImageRef] = (),
        videos: Sequence[MediaRef] = (),
        fps: float | None = None,
        num_frames: int | None = None,
        frames: Sequence[Sequence[int]] | None = None,
    ) -> Expanded:
        """Replace the i-th image token by the expansion of ``images[i]`` and the i-th video
        token by that of ``videos[i]``: the tokens and both kinds of refs, spans in place.

        A video's frames are what the video processor samples (its own ``sample_frames``,
        with its configured or the given ``fps``/``num_frames``), or ``frames[i]``
        explicitly; the ref records them, so readers decode and lay out exactly those.
        """
        token_list = [int(t) for t in token_ids]
        for item in images:
            if getattr(item, "kind", "image") != "image":
                raise InvalidArgumentError(f"{item.uri} is a video: pass it in videos=")
        video = self.video if videos else None
        if video is None and frames:
            raise InvalidArgumentError("frames= given without videos")
        if frames is not None and len(frames) != len(videos):
            raise InvalidArgumentError(f"{len(frames)} frame lists for {len(videos)} videos")
        ids = {self.image_token_id: "image"}
        if video is not None:
            ids[video.video_token_id] = "video"
        at = [(i, ids[t]) for i, t in enumerate(token_list) if t in ids]
        for kind, given in (("image", images), ("video", videos)):
            found = sum(1 for _, k in at if k == kind)
            if found != len(given) and (given or kind == "image"):
                token = self.image_token_id if kind == "image" else video.video_token_id  # type: ignore[union-attr]
                raise InvalidRolloutError(
                    f"{found} {kind} placeholder tokens ({token}) but {len(given)} {kind}s to "
                    f"expand: put one {kind} token in the prompt per {kind}"
                )
        pending_images, pending_videos = iter(images), iter(enumerate(videos))
        out: list[int] = []
        image_refs: list[ImageRef] = []
        video_refs: list[VideoRef] = []
        start = 0
        for pos, kind in at:
            out.extend(token_list[start:pos])
            if kind == "image":
                image_refs.append(self._image_ref(next(pending_images), offset=len(out)))
                out.extend(self.expansion(image_refs[-1].width, image_refs[-1].height))
                start = pos + 1
            else:
                assert video is not None
                wrapped = _wrapped(video.wrapper, token_list, pos, start)
                if wrapped:  # the processor replaces the wrapper with the token: so do we
                    out.pop()
                index, media = next(pending_videos)
                picked = frames[index] if frames is not None else None
                if picked is None:
                    picked = video.sample(media, fps=fps, num_frames=num_frames)
                video_refs.append(video.ref(media, picked, offset=len(out)))
                out.extend(video.expansion(video_refs[-1]))
                start = pos + 2 if wrapped else pos + 1
        out.extend(token_list[start:])
        return Expanded(out, image_refs, video_refs)

    def locate(
        self,
        token_ids: Sequence[int],
        *,
        images: Sequence[MediaRef | ImageRef] = (),
        videos: Sequence[MediaRef] = (),
        fps: float | None = None,
        num_frames: int | None = None,
        frames: Sequence[Sequence[int]] | None = None,
    ) -> Expanded:
        """:meth:`expand_media` for ids whose spans are expanded already (a processor's
        ``input_ids``, an inference engine's prompt ids): the tokens unchanged, and the refs
        ``expand_media`` gives for the same prompt with one placeholder per medium.

        Media are in prompt order (images among themselves, videos among themselves); a
        video's frames are sampled as ``expand_media`` samples them, or ``frames[i]``. Each
        span must be exactly its medium's expansion, and no image or video token may lie
        outside the spans: else :class:`~mmstore.errors.InvalidRolloutError` naming the
        ``image_index``/``video_index`` (or the stray token's position).
        See :mod:`._locate` for how spans are found.
        """
        return locate(
            self,
            token_ids,
            images=images,
            videos=videos,
            fps=fps,
            num_frames=num_frames,
            frames=frames,
        )

    def _image_ref(self, item: MediaRef | ImageRef, offset: int) -> ImageRef:
        return ImageRef(
            uri=item.uri,
            hash=item.hash,
            width=item.width,
            height=item.height,
            nbytes=item.nbytes,
            offset=offset,
            length=self.num_tokens(item.width, item.height),
            family=self.family,
            layout_fingerprint=self.fingerprint,
            payload=getattr(item, "payload", None),
        )


def _wrapped(wrapper: tuple[int, int] | None, tokens: Sequence[int], pos: int, start: int) -> bool:
    """Whether the video token at ``pos`` sits inside ``wrapper`` (its start token not yet
    consumed: at or after ``start``)."""
    if wrapper is None:
        return False
    before, after = wrapper
    return (
        pos - 1 >= start
        and tokens[pos - 1] == before
        and list(tokens[pos + 1 : pos + 2]) == [after]
    )


def expansion_array(family: Family, width: int, height: int) -> np.ndarray:
    """``family.expansion(width, height)`` as a read-only int64 array (checked on every read).

    Cached per layout, not per adapter: every adapter of one layout shares the entries, and
    the cache keeps no adapter (and so no processor) alive.
    """
    return _cached_expansion(type(family), family.layout, width, height)


@lru_cache(maxsize=4096)
def _cached_expansion(cls: type[Family], layout: Layout, width: int, height: int) -> np.ndarray:
    array = np.asarray(cls(layout).expansion(width, height), dtype=np.int64)
    array.flags.writeable = False
    return array


def takes_tensors(image_processor: Any) -> bool:
    """Whether ``image_processor`` is a torchvision backend: it takes decoded uint8 tensors
    (channels first) as they come from torchvision's decoder, with no PIL round trip."""
    return getattr(image_processor, "backend", None) == "torchvision"


def run_processor(
    family: Family, images: Sequence[Any], *, cast_to: torch.dtype | None = None, **overrides: Any
) -> Mapping[str, Any]:
    """``family``'s processor's whole output for ``images`` (PIL images or uint8 CHW tensors).

    ``overrides`` replace call arguments of :meth:`Family.processor_kwargs` (the device stage
    passes ``device=`` and ``return_tensors="pt"`` to a torchvision backend).
    ``cast_to``: a torchvision backend casts its floats to this dtype as soon as it has
    normalized them (:func:`mmstore._tensors.casting_after_normalize`); other backends ignore it.
    """
    processor = family.image_processor
    if processor is None:
        raise UnsupportedProcessorError(f"{family!r} has no image processor to run")
    kwargs = {**family.processor_kwargs(), **overrides}
    if images and all(type(im).__module__.startswith("torch") for im in images):
        # Our tensors are channels first; transformers would guess, and a 3- or
        # 4-pixel-wide image looks like channels last to it.
        kwargs["input_data_format"] = "channels_first"
    if cast_to is not None and takes_tensors(processor):
        from mmstore._tensors import casting_after_normalize  # torch: with a dtype only

        processor = casting_after_normalize(processor, cast_to)
    return processor(images=list(images), **kwargs)


def size_value(size: Any, *keys: str) -> int:
    """The first of ``keys`` set in a processor's ``size`` (a dict or a SizeDict)."""
    for key in keys:
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if value is not None:
            return int(value)
    raise UnsupportedProcessorError(f"image processor size has none of {keys}: {size!r}")
