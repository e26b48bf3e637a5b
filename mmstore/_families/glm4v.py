"""GLM-4.1V and GLM-4.5V: one layout, either transformers backend (PIL or torchvision).

The chat template emits ``<|begin_of_image|><|image|><|end_of_image|>`` per image, and
``Glm4vProcessor`` (like vLLM's ``glm4_1v``) replaces only the ``<|image|>`` between them: by
``<|image|>`` repeated once per merged patch. So the *expansion* is that one token repeated,
and the begin/end-of-image tokens are ordinary text around the span (a row keeps them where
the template put them; they are not image features and may appear outside spans).

GLM's resize is its own ``smart_resize`` (transformers' ``glm4v`` module): images smaller
than ``patch*merge`` on a side are scaled up first, and the pixel budget counts the
``temporal_patch_size`` frames an image is repeated into, so ``max_pixels`` admits half as
many image pixels as Qwen's rule would. The model takes ``pixel_values`` (patch rows),
``image_grid_thw`` and ``mm_token_type_ids``; positions are M-RoPE (the model's own
``get_rope_index``).

Token ids. GLM-4.1V and GLM-4.5V share the image processor but not the image token:
``<|image|>`` is 151343 in GLM-4.1V's tokenizer and 151363 in GLM-4.5V's (transformers'
``Glm4vConfig`` / ``Glm4vMoeConfig`` defaults, as in the checkpoints' config.json). An image
processor alone cannot tell them apart, so the published ids are GLM-4.1V's; for GLM-4.5V
build the adapter from the full processor (its tokenizer supplies the ids) or pass
``image_token_id=151363``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mmstore._families._base import Token
from mmstore._families._grid import PatchVideo, SmartResizeFamily, weightless_rope_index
from mmstore._families._video import Clip, Segment
from mmstore._format.models import MediaRef, VideoRef
from mmstore.errors import InvalidRolloutError

if TYPE_CHECKING:
    import torch


class Glm4v(SmartResizeFamily):
    name = "glm4v"
    title = "GLM-4V"
    # GLM-4.1V-9B's tokenizer (zai-org/GLM-4.1V-9B-Thinking): `<|image|>` 151343 is its config's
    # image_token_id (transformers' Glm4vConfig default); `<|begin_of_image|>` 151339 and
    # `<|end_of_image|>` 151340 are its image_start/end_token_id; `<|endoftext|>` 151329 is the
    # tokenizer's pad token (the first of the GLM-4 tokenizer's added special tokens).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<|image|>", 151343),
        "image_start_token_id": Token("<|begin_of_image|>", 151339),
        "image_end_token_id": Token("<|end_of_image|>", 151340),
        "pad_token_id": Token("<|endoftext|>", 151329),
    }
    # The processor's resize reads exactly these two keys (and refuses a size without them).
    size_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "min_pixels": ("shortest_edge",),
        "max_pixels": ("longest_edge",),
    }

    # -- layout math --------------------------------------------------------------------

    def smart_resize(self, width: int, height: int) -> tuple[int, int]:
        p = self.layout.param
        temporal = p("temporal_patch_size")
        resized: tuple[int, int] = _smart_resize()(
            num_frames=temporal,  # an image is `temporal` identical frames
            height=height,
            width=width,
            temporal_factor=temporal,
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
        """M-RoPE positions ``[3, L]`` of one sample, from the model's own ``get_rope_index``."""
        import torch
        from transformers.models.glm4v.modeling_glm4v import Glm4vModel

        ids = input_ids.reshape(1, -1)
        types_ = (ids == self.feature_token_id).to(torch.int32)
        video_grid = None
        if videos:  # <|image|> inside a video's markers is the video's (type 2)
            self.video.mark_token_types(ids, types_)
            video_grid = torch.cat([v["video_grid_thw"].reshape(-1, 3) for v in videos])
        grids = [image["image_grid_thw"].reshape(-1, 3) for image in images]
        # get_rope_index binds the i-th run of image tokens to the i-th grid: two spans with no
        # text between them (the template's end/begin-of-image tokens) would merge into one.
        runs = sum(1 for key, _ in itertools.groupby(types_[0].tolist()) if key == 1)
        if runs != len(grids):
            raise InvalidRolloutError(
                f"{runs} runs of image tokens for {len(grids)} images: GLM-4V needs text (its "
                "chat template's <|end_of_image|><|begin_of_image|>) between adjacent images"
            )
        rope_index = weightless_rope_index(Glm4vModel, self.layout.param("merge_size"))
        position_ids, _ = rope_index(
            ids,
            types_,
            image_grid_thw=torch.cat(grids) if grids else None,
            video_grid_thw=video_grid,
        )
        return position_ids[:, 0]


def _smart_resize() -> Any:
    """transformers' GLM-4V ``smart_resize``, imported on first use.

    The PIL module's copy ("Copied from" the torchvision module's, so both backends resize
    alike) keeps torchvision out of layout math; ``import mmstore`` imports neither.
    """
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    return smart_resize


class Glm4vVideo(PatchVideo):
    """GLM-4.1V videos (``Glm4vVideoProcessor`` inside ``Glm4vProcessor``).

    The chat template emits ``<|begin_of_video|><|video|><|end_of_video|>``; the processor
    replaces the ``<|video|>`` (the span) by, per ``temporal_patch_size``-frame slab,
    ``<|begin_of_image|>`` + ``<|image|>`` per merged patch + ``<|end_of_image|>`` + the
    slab's timestamp as text: ``int(seconds)`` of every other sampled frame (``frame /
    fps``; the processor's ``timestamps[::2]``). The features go to the *image* token; the
    model's ``mm_token_type_ids`` are 2 on ``<|image|>`` between ``<|begin_of_video|>`` and
    ``<|end_of_video|>`` (:meth:`mark_token_types`), 1 on other ``<|image|>``.

    Frames. ``Glm4vVideoProcessor.sample_frames`` returns an even count, repeating the last
    index when it sampled an odd one; a ref keeps its frames strictly increasing, so a ref's
    frames are that list without the repeat, and the layout and :meth:`process` put the
    repeat back (the processor's resize counts it, and a 1-frame ref becomes 2 frames).
    The model takes ``pixel_values_videos`` and one ``video_grid_thw`` row per video.
    """

    name = "glm4v"
    title = "GLM-4V"
    processor_name = "Glm4vVideoProcessor"
    has_text = True
    # transformers' Glm4vModel.get_placeholder_mask counts every <|image|> as an image token
    # and as a video token: a batch holding both fails in the model (the processor's own
    # inputs too).
    batches_with_images = False
    # What the video processor's resize and patchify read; its fps/num_frames/max_duration
    # only sample, and a ref's frames are explicit.
    parameter_names = (
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "min_pixels",
        "max_pixels",
    )
    # GLM-4.1V's published ids (transformers' Glm4vConfig defaults, the checkpoint's config).
    token_table: ClassVar[Mapping[str, Token]] = {
        "video_token_id": Token("<|video|>", 151344),
        "image_token_id": Token("<|image|>", 151343),
        "image_start_token_id": Token("<|begin_of_image|>", 151339),
        "image_end_token_id": Token("<|end_of_image|>", 151340),
        "video_start_token_id": Token("<|begin_of_video|>", 151341),
        "video_end_token_id": Token("<|end_of_video|>", 151342),
        "pad_token_id": Token("<|endoftext|>", 151329),
    }

    @classmethod
    def read_parameters(cls, video_processor: Any, processor: Any) -> dict[str, Any]:
        return cls.grid_parameters(video_processor)

    @property
    def feature_token_id(self) -> int:
        return self.layout.token_id("image_token_id")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        # `<|image|>` is the image family's token too (image spans hold it): only `<|video|>`
        # is the video's own.
        return frozenset({self.video_token_id})

    def mark_token_types(self, input_ids: torch.Tensor, types: torch.Tensor) -> None:
        """2 on ``<|image|>`` inside ``<|begin_of_video|>`` .. ``<|end_of_video|>`` (the
        processor's ``create_mm_token_type_ids``, over each row)."""
        import torch

        starts = torch.cumsum(input_ids == self.layout.token_id("video_start_token_id"), dim=-1)
        ends = torch.cumsum(input_ids == self.layout.token_id("video_end_token_id"), dim=-1)
        types[(input_ids == self.feature_token_id) & (starts > ends)] = self.token_type

    # -- layout math ----------------------------------------------------------------------

    @staticmethod
    def frames(ref: VideoRef | Clip) -> list[int]:
        """The frame indices the processor sees: the ref's, made even by repeating the last
        (as ``sample_frames`` does)."""
        frames = list(ref.frames)
        return frames + frames[-1:] if len(frames) % 2 else frames

    def num_frames(self, ref: VideoRef | Clip) -> int:
        return len(self.frames(ref))

    def resized(self, ref: VideoRef | Clip) -> tuple[int, int]:
        p = self.layout.param
        try:
            resized: tuple[int, int] = _smart_resize()(
                num_frames=self.num_frames(ref),
                height=ref.height,
                width=ref.width,
                temporal_factor=p("temporal_patch_size"),
                factor=p("patch_size") * p("merge_size"),
                min_pixels=p("min_pixels"),
                max_pixels=p("max_pixels"),
            )
        except ValueError as exc:  # an aspect ratio beyond 200:1
            raise self.resize_error(ref, exc) from None
        return resized

    def timestamps(self, ref: VideoRef | Clip) -> list[str]:
        """Each slab's timestamp text (``Glm4vProcessor.replace_video_token``)."""
        t = self.grid(ref)[0]
        seconds = [index / ref.fps for index in self.frames(ref)][::2][:t]
        while len(seconds) < t:
            seconds.append(seconds[-1] if seconds else 0)
        return [str(int(s)) for s in seconds]

    def segments(self, ref: VideoRef | Clip) -> list[Segment]:
        frame = self.bracketed_slab(ref, "image_start_token_id", "image_end_token_id")
        out: list[Segment] = []
        for text in self.timestamps(ref):
            out += [frame, text]
        return out

    # -- the processor --------------------------------------------------------------------

    def sample(
        self, media: MediaRef, *, fps: float | None = None, num_frames: int | None = None
    ) -> list[int]:
        """``sample_frames``' indices without the repeated last one (see the class)."""
        indices = super().sample(media, fps=fps, num_frames=num_frames)
        return [i for k, i in enumerate(indices) if k == 0 or i != indices[k - 1]]

    def process(
        self, frames: np.ndarray, ref: VideoRef, dtype: torch.dtype | None = None
    ) -> dict[str, Any]:
        if len(frames) % 2:  # the repeated last frame sample_frames would have given
            frames = np.concatenate([frames, frames[-1:]])
        return super().process(frames, ref, dtype)
