"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one layout, either transformers backend.

An image is resized to multiples of ``patch_size * merge_size`` within [min_pixels,
max_pixels] (transformers' own ``smart_resize``), cut into ``temporal_patch_size`` x patch x
patch patches, and each ``merge_size**2`` patches become one ``<|image_pad|>`` token: the
expansion is that one token repeated. The model takes ``pixel_values`` (patch rows),
``image_grid_thw`` and ``mm_token_type_ids``; positions are M-RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from mmstore._families._base import Token
from mmstore._families._grid import PatchVideo, SmartResizeFamily, weightless_rope_index
from mmstore._families._video import Clip, Segment, VideoFamily, sampled_fps
from mmstore._format.models import VideoRef
from mmstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch


class QwenVL(SmartResizeFamily):
    name = "qwen-vl"
    title = "Qwen-VL"
    # Qwen2-VL / 2.5-VL / 3-VL tokenizers: `<|image_pad|>` and `<|endoftext|>` (the pad token).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<|image_pad|>", 151655),
        "pad_token_id": Token("<|endoftext|>", 151643),
    }
    # Either key of each bound: the processor's resize accepts both spellings.
    size_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "min_pixels": ("shortest_edge", "min_pixels"),
        "max_pixels": ("longest_edge", "max_pixels"),
    }

    # -- layout math --------------------------------------------------------------------

    def smart_resize(self, width: int, height: int) -> tuple[int, int]:
        p = self.layout.param
        resized: tuple[int, int] = _smart_resize()(
            height,
            width,
            factor=p("patch_size") * p("merge_size"),
            min_pixels=p("min_pixels"),
            max_pixels=p("max_pixels"),
        )
        return resized

    # -- positions ----------------------------------------------------------------------

    def position_ids(
        self,
        input_ids: torch.Tensor,
        images: Sequence[Mapping[str, torch.Tensor]],
        videos: Sequence[Mapping[str, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """M-RoPE positions of one sample run alone, ``[3, L]``, by transformers' own
        ``Qwen2VLModel.get_rope_index`` (run on a stand-in holding only the merge size, which
        is all that function reads of the model; see :func:`weightless_rope_index`). Qwen2.5-VL
        and Qwen3-VL lay images out the same way; their functions differ only for videos:
        Qwen2-VL's and Qwen3-VL's are laid out here, Qwen2.5-VL's refused (its temporal
        positions read the model's ``tokens_per_second``, which a loader does not have)."""
        import torch

        ids = input_ids.reshape(1, -1).to(torch.int64)
        types = (ids == self.feature_token_id).to(torch.int32)
        grid = _grids(images, "image_grid_thw")
        video_grid = _grids(videos, "video_grid_thw")
        if video_grid is not None:
            self.video.mark_token_types(ids, types)
        if grid is None and video_grid is None:  # text only: get_rope_index expects vision
            return torch.arange(ids.shape[1], dtype=torch.int64)[None].expand(3, -1).clone()
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

        merge = self.layout.param("merge_size")
        if video_grid is not None and isinstance(self.video, Qwen3VLVideo):
            # Qwen3-VL's function splits each video's grid per frame slab (its timestamps
            # separate them); for images it agrees with Qwen2-VL's.
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

            positions, _ = weightless_rope_index(Qwen3VLModel, merge)(ids, types, grid, video_grid)
        elif video_grid is not None and self.video.layout.param("grid_seconds"):
            positions = self._qwen25_positions(ids, types, grid, video_grid, videos)
        else:
            positions, _ = weightless_rope_index(Qwen2VLModel, merge)(ids, types, grid, video_grid)
        return positions[:, 0]

    def _qwen25_positions(
        self,
        ids: torch.Tensor,
        types: torch.Tensor,
        grid: torch.Tensor | None,
        video_grid: torch.Tensor,
        videos: Sequence[Mapping[str, torch.Tensor]],
    ) -> torch.Tensor:
        """Qwen2.5-VL's function, whose video positions step by the model's
        ``vision_config.tokens_per_second`` times each video's ``second_per_grid_ts``."""
        import torch
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        vision = getattr(self.model_config, "vision_config", None)
        per_second = getattr(vision, "tokens_per_second", None)
        if per_second is None:
            raise InvalidArgumentError(
                "packing Qwen2.5-VL videos needs the model's vision_config.tokens_per_second "
                "(their positions step by it): build the adapter with "
                "mmstore.adapter_for(processor, model_config=model.config) and give the "
                "dataset that adapter, or read them padded (max_tokens=None)"
            )
        seconds = torch.cat([video["second_per_grid_ts"].reshape(-1) for video in videos])
        rope_index = weightless_rope_index(
            Qwen2_5_VLModel, self.layout.param("merge_size"), tokens_per_second=per_second
        )
        positions, _ = rope_index(ids, types, grid, video_grid, second_per_grid_ts=seconds)
        return positions


def _grids(media: Sequence[Mapping[str, torch.Tensor]], key: str) -> torch.Tensor | None:
    import torch

    grids = [m[key].reshape(-1, 3) for m in media]
    return torch.cat(grids).to(torch.int64) if grids else None


def _smart_resize() -> Any:
    """transformers' own ``smart_resize``, imported on first use.

    Importing it pulls in transformers' image stack (and torch, ~4 s): the CLI, polars
    notebooks and the rollout side's ``import mmstore`` should not pay that up front.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize


class QwenVLVideo(PatchVideo):
    """Qwen2-VL and Qwen2.5-VL videos: the frames are resized alike (``smart_resize`` into the
    video processor's pixel budget, optionally capped per frame by the clip's frame count),
    and each ``merge_size**2`` patches of a slab become one ``<|video_pad|>``: the expansion
    is that token repeated (the chat template's ``<|vision_start|>``/``<|vision_end|>`` stay
    outside the span). Qwen2.5-VL's model also takes ``second_per_grid_ts``
    (``temporal_patch_size`` over the sampled rate), so its full processor's layout records
    ``grid_seconds``. Qwen3-VL writes timestamps as text between frame slabs:
    :class:`Qwen3VLVideo` lays it out (``from_processor`` and the registry pick it by its
    video processor, or its layout's ``timestamps`` parameter).
    """

    name = "qwen-vl"
    title = "Qwen-VL"
    processor_name = "Qwen2VLVideoProcessor"
    parameter_names = (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "min_pixels",
        "max_pixels",
        "cap_pixels_per_frame",
        "max_video_tokens",
        "grid_seconds",
    )
    token_table: ClassVar[Mapping[str, Token]] = {
        "video_token_id": Token("<|video_pad|>", 151656),
        "pad_token_id": Token("<|endoftext|>", 151643),
    }

    @classmethod
    def class_for_processor(cls, video_processor: Any) -> type[VideoFamily]:
        if type(video_processor).__name__ == Qwen3VLVideo.processor_name:
            return Qwen3VLVideo
        return cls

    @classmethod
    def class_for_parameters(cls, parameters: Mapping[str, Any]) -> type[VideoFamily]:
        return Qwen3VLVideo if "timestamps" in parameters else cls

    @classmethod
    def read_parameters(cls, video_processor: Any, processor: Any) -> dict[str, Any]:
        return {
            **cls.grid_parameters(video_processor),
            **_pixel_cap(video_processor),
            "grid_seconds": type(processor).__name__ == "Qwen2_5_VLProcessor",
        }

    def resized(self, ref: VideoRef | Clip) -> tuple[int, int]:
        p = self.layout.param
        factor = p("patch_size") * p("merge_size")
        max_pixels = p("max_pixels")
        if p("cap_pixels_per_frame"):  # the video processor's resize, line for line
            total_pixels = int(p("max_video_tokens") * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * p("temporal_patch_size") // len(ref.frames)),
                int(p("min_pixels") * 1.05),
            )
        try:
            resized: tuple[int, int] = _video_smart_resize()(
                ref.height,
                ref.width,
                factor=factor,
                min_pixels=p("min_pixels"),
                max_pixels=max_pixels,
            )
        except ValueError as exc:  # an aspect ratio beyond 200:1
            raise self.resize_error(ref, exc) from None
        return resized

    def expansion(self, ref: VideoRef | Clip) -> list[int]:
        return [self.video_token_id] * (self.grid(ref)[0] * self.slab_tokens(ref))

    @property
    def input_names(self) -> tuple[str, ...]:
        extra = ("second_per_grid_ts",) if self.layout.param("grid_seconds") else ()
        return (*self.video_inputs, *extra)

    def extras(self, ref: VideoRef) -> dict[str, Any]:
        if not self.layout.param("grid_seconds"):
            return {}
        import torch

        seconds = self.layout.param("temporal_patch_size") / sampled_fps(ref)
        return {"second_per_grid_ts": torch.tensor([seconds], dtype=torch.float32)}


def _pixel_cap(video_processor: Any) -> dict[str, Any]:
    """Qwen's per-frame pixel cap: None (today's default) resizes as False, with a warning;
    the default is to change, so the layout records what was applied."""
    return {
        "cap_pixels_per_frame": bool(video_processor.cap_pixels_per_frame),
        "max_video_tokens": int(video_processor.max_video_tokens),
    }


def _video_smart_resize() -> Any:
    """The video processor's own ``smart_resize`` (it pulls in torchvision)."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

    return smart_resize


class Qwen3VLVideo(PatchVideo):
    """Qwen3-VL videos (``Qwen3VLVideoProcessor`` inside ``Qwen3VLProcessor``).

    The frames are resized alike (the video module's ``smart_resize``, which counts the
    frames, into the pixel budget, optionally capped per frame: ``cap_pixels_per_frame``,
    line for line as the processor's ``resize``), padded to a multiple of
    ``temporal_patch_size`` by repeating the last. The processor replaces the prompt's
    ``<|video_pad|>`` (the span) by, per slab, ``<{t:.1f} seconds>`` as text (``t`` the mean
    of the slab's first and last frame times, ``frame / fps``, the last frame repeated to
    fill the slab: ``Qwen3VLProcessor._calculate_timestamps``), then ``<|vision_start|>``,
    ``<|video_pad|>`` per merged patch of the slab, ``<|vision_end|>``. The model takes
    ``pixel_values_videos``, one ``video_grid_thw`` row per video and ``mm_token_type_ids``
    (2 on ``<|video_pad|>``). Its layout records ``timestamps="qwen3"``, which is how a
    layout record is told from a Qwen2-VL one.
    """

    name = "qwen-vl"
    title = "Qwen3-VL"
    has_text = True
    processor_name = "Qwen3VLVideoProcessor"
    # What the processor's resize and patchify read (`max_video_tokens` only under the cap);
    # fps, num_frames, min/max_frames only sample, and a ref's frames are explicit.
    parameter_names = (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "min_pixels",
        "max_pixels",
        "cap_pixels_per_frame",
        "max_video_tokens",
        "timestamps",
    )
    token_table: ClassVar[Mapping[str, Token]] = {
        "video_token_id": Token("<|video_pad|>", 151656),
        "vision_start_token_id": Token("<|vision_start|>", 151652),
        "vision_end_token_id": Token("<|vision_end|>", 151653),
        "pad_token_id": Token("<|endoftext|>", 151643),
    }

    @classmethod
    def read_parameters(cls, video_processor: Any, processor: Any) -> dict[str, Any]:
        return {
            **cls.grid_parameters(video_processor),
            **_pixel_cap(video_processor),
            "timestamps": "qwen3",
        }

    @classmethod
    def read_wrapper(cls, processor: Any, token_ids: Mapping[str, int]) -> tuple[int, int] | None:
        # transformers 5.25 collapses the chat template's
        # <|vision_start|><|video_pad|><|vision_end|> into the video's replacement (each slab
        # is bracketed already); 5.24 and earlier keep the outer pair. Asked of the
        # processor's own text step, so whichever version is installed is followed.
        replace = getattr(processor, "get_text_with_replacements", None)
        names = ("vision_start_token", "video_token", "vision_end_token")
        texts = [t for name in names if isinstance(t := getattr(processor, name, None), str)]
        if replace is None or len(texts) != len(names):
            return None
        try:
            (text,), _ = replace(["".join(texts)], [], ["X"], [])
        except Exception:  # a text step of another shape: it keeps the pair, as before 5.25
            return None
        if text != "X":
            return None
        return token_ids["vision_start_token_id"], token_ids["vision_end_token_id"]

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset({self.video_token_id})

    def resized(self, ref: VideoRef | Clip) -> tuple[int, int]:
        p = self.layout.param
        factor = p("patch_size") * p("merge_size")
        frames = len(ref.frames)
        max_pixels = p("max_pixels")
        if p("cap_pixels_per_frame"):  # the video processor's resize, line for line
            frame_cap = p("max_video_tokens") * factor * factor
            per_frame = max(min(frame_cap, max_pixels // frames), int(p("min_pixels") * 1.05))
            max_pixels = per_frame * frames
        try:
            resized: tuple[int, int] = _qwen3_video_smart_resize()(
                num_frames=frames,
                height=ref.height,
                width=ref.width,
                temporal_factor=p("temporal_patch_size"),
                factor=factor,
                min_pixels=p("min_pixels"),
                max_pixels=max_pixels,
            )
        except ValueError as exc:  # fewer frames than a slab, or an aspect ratio beyond 200:1
            raise self.resize_error(ref, exc) from None
        return resized

    def timestamps(self, ref: VideoRef | Clip) -> list[str]:
        """Each slab's text (``Qwen3VLProcessor._calculate_timestamps``, then its format)."""
        size = self.layout.param("temporal_patch_size")
        indices = list(ref.frames)
        if len(indices) % size:
            indices.extend(indices[-1] for _ in range(size - len(indices) % size))
        seconds = [index / ref.fps for index in indices]
        means = [(seconds[i] + seconds[i + size - 1]) / 2 for i in range(0, len(seconds), size)]
        return [f"<{t:.1f} seconds>" for t in means]

    def segments(self, ref: VideoRef | Clip) -> list[Segment]:
        slab = self.bracketed_slab(ref, "vision_start_token_id", "vision_end_token_id")
        out: list[Segment] = []
        for text in self.timestamps(ref)[: self.grid(ref)[0]]:
            out += [text, slab]
        return out


def _qwen3_video_smart_resize() -> Any:
    """Qwen3-VL's video ``smart_resize`` (it counts frames; the module pulls in torchvision)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    return smart_resize
