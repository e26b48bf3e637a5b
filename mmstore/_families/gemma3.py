"""Gemma 3 (4B, 12B, 27B): a fixed number of soft tokens per image, wrapped in text.

Every image is resized to one fixed size (896x896 published), so its expansion does not
depend on its size. ``Gemma3Processor`` replaces the ``<start_of_image>`` its chat template
emits (the ``image_token_id`` here) by ``full_image_sequence``::

    "\\n\\n" <start_of_image> <image_soft_token> * image_seq_length <end_of_image> "\\n\\n"

and tokenizes the result, so the expansion is ``[nl2, boi, soft * n, eoi, nl2]`` where
``nl2`` is the tokenizer's one token for "\\n\\n" (an ordinary text token: it may appear
anywhere in text). The image features land on the soft tokens (``token_type_ids`` is 1
there: the model attends bidirectionally within each image). Positions are 1-D RoPE.

The two "\\n\\n" and BPE merges. The processor substitutes *text* and then tokenizes the whole
prompt, so in Gemma's BPE vocabulary (which has single tokens for "\\n\\n\\n" and "\\n\\n\\n\\n")
a newline right before or after the image, or a second image right after the first, merges
with the wrapper: "x\\n" + "\\n\\n<start_of_image>" tokenizes as [x, "\\n\\n\\n", boi, ...],
not [x, "\\n", "\\n\\n", boi, ...]. mmstore never re-tokenizes text: ``expand`` substitutes
*token ids* for the one ``<start_of_image>`` id, so the tokens around a span stay exactly
as the caller tokenized them and every span holds exactly ``[nl2, boi, soft*n, eoi, nl2]``
(which the writer checks token for token). The model sees the same image
features either way (only the soft tokens carry them, and their count is fixed); what can
differ is one text token next to a span, compared with a text-level tokenization of the
same prompt. vLLM works at token level too (``Gemma3MultiModalProcessor``'s
``PromptReplacement`` of ``<start_of_image>``) but then re-merges "\\n" + "\\n\\n" and
"\\n\\n" + "\\n\\n" (``_apply_token_matches``), so where a newline token touches a span,
or two images touch, its ``prompt_token_ids`` differ from the stored tokens there.

Pan-and-scan (``do_pan_and_scan=True``: extra crops, each with its own wrapped sequence,
inside a text sentence) is refused: off by default, and its layout is not built here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from mmstore._families._base import Collation, Family, Token, size_value
from mmstore._format.models import ImageRef
from mmstore.errors import ImageSizeError, LayoutMismatchError, UnsupportedProcessorError

# Soft tokens per image of the published models: `mm_tokens_per_image` in their config.json
# and `Gemma3Processor(image_seq_length=256)`'s default.
PUBLISHED_IMAGE_SEQ_LENGTH = 256

# Size keys that take precedence over height/width in transformers' resize (they keep the
# aspect ratio, so pixels would vary in shape from image to image).
_VARIABLE_SIZE_KEYS = ("shortest_edge", "longest_edge", "max_height", "max_width")


class Gemma3(Family):
    name = "gemma3"
    # The soft token count decides the tokens; the fixed size every image is resized to
    # decides the pixels' shape (so a footer alone gives placeholders and dense sizes).
    parameter_names = ("image_seq_length", "resized_height", "resized_width")
    # The published Gemma 3 tokenizer (google/gemma-3-4b-it and siblings): `<start_of_image>`
    # 255999 and `<end_of_image>` 256000 are config.json's boi_token_index / eoi_token_index,
    # `<image_soft_token>` 262144 its image_token_index (also transformers' Gemma3Config
    # defaults); "\n\n" is 108 and `<pad>` 0 in tokenizer.json (google-deepmind/gemma's
    # gm/vision/_token_utils_test.py expands an image to [108, 255999, soft..., 256000, 108]).
    token_table: ClassVar[Mapping[str, Token]] = {
        "image_token_id": Token("<start_of_image>", 255_999),
        "end_of_image_token_id": Token("<end_of_image>", 256_000),
        "image_soft_token_id": Token("<image_soft_token>", 262_144),
        "double_newline_token_id": Token("\n\n", 108),
        "pad_token_id": Token("<pad>", 0),
    }
    image_inputs: ClassVar[Mapping[str, Collation]] = {"pixel_values": "cat"}
    token_type_input = "token_type_ids"
    position_rows = 1
    images_attend_both_ways = True  # transformers' bidirectional mask over each image

    # -- construction -------------------------------------------------------------------

    @classmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        kind = type(image_processor).__name__
        if getattr(image_processor, "do_pan_and_scan", None):
            raise UnsupportedProcessorError(
                f"{kind} has do_pan_and_scan=True: its crops add a sentence and one wrapped "
                "image sequence per crop, a layout mmstore does not build; turn it off"
            )
        if not getattr(image_processor, "do_resize", True):
            raise UnsupportedProcessorError(
                f"{kind} has do_resize=False: Gemma 3's vision tower takes one fixed size"
            )
        size = image_processor.size
        variable = [k for k in _VARIABLE_SIZE_KEYS if _size_get(size, k)]
        if variable:
            raise UnsupportedProcessorError(
                f"{kind} size sets {variable}: images would not all become one fixed size"
            )
        # The full processor, not the image processor, knows the soft token count.
        seq_length = PUBLISHED_IMAGE_SEQ_LENGTH
        if processor is not image_processor:
            seq_length = getattr(processor, "image_seq_length", PUBLISHED_IMAGE_SEQ_LENGTH)
        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length <= 0:
            raise UnsupportedProcessorError(f"image_seq_length must be positive: {seq_length!r}")
        _check_image_sequence(processor, seq_length)
        return {
            "image_seq_length": seq_length,
            "resized_height": size_value(size, "height"),
            "resized_width": size_value(size, "width"),
        }

    @classmethod
    def read_token_ids(cls, tokenizer: Any) -> dict[str, int]:
        ids = super().read_token_ids(tokenizer)
        # Gemma3Processor reads these tokenizer attributes itself: prefer them to the strings.
        for key, attr in (
            ("image_token_id", "boi_token_id"),
            ("end_of_image_token_id", "eoi_token_id"),
            ("image_soft_token_id", "image_token_id"),
        ):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                ids[key] = value
        # "\n\n" is text the processor tokenizes: ask the tokenizer, not its vocabulary.
        newline = list(tokenizer.encode("\n\n", add_special_tokens=False))
        if len(newline) != 1:
            raise UnsupportedProcessorError(
                f"the tokenizer encodes '\\n\\n' as {newline}, not one token: the Gemma 3 "
                "image wrapper would not be the layout mmstore builds"
            )
        ids["double_newline_token_id"] = int(newline[0])
        return ids

    # -- identity -----------------------------------------------------------------------

    @property
    def feature_token_id(self) -> int:
        return self.layout.token_id("image_soft_token_id")

    @property
    def special_token_ids(self) -> frozenset[int]:
        # Not the "\n\n": it is ordinary text.
        ids = ("image_token_id", "end_of_image_token_id", "image_soft_token_id")
        return frozenset(self.layout.token_id(k) for k in ids)

    # -- layout math --------------------------------------------------------------------

    def expansion(self, width: int, height: int) -> list[int]:
        _check_size(width, height)
        t = self.layout.token_id
        newline = t("double_newline_token_id")
        soft = [t("image_soft_token_id")] * self.layout.param("image_seq_length")
        return [newline, t("image_token_id"), *soft, t("end_of_image_token_id"), newline]

    def num_tokens(self, width: int, height: int) -> int:
        _check_size(width, height)
        return self.layout.param("image_seq_length") + 4

    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        _check_size(width, height)
        shape = (1, 3, self.layout.param("resized_height"), self.layout.param("resized_width"))
        return {"pixel_values": np.zeros(shape, dtype=np.float32)}

    def integer_tensors(self, width: int, height: int) -> dict[str, np.ndarray]:
        _check_size(width, height)
        return {}  # pixel_values only

    @property
    def dummy_size(self) -> tuple[int, int]:
        return 1, 1  # every size lays out alike

    # -- the processor ------------------------------------------------------------------

    def select_outputs(self, out: Mapping[str, Any]) -> dict[str, Any]:
        # Pan-and-scan was refused when the adapter was built; a processor switched to it
        # since would add crops the spans do not hold.
        crops = np.asarray(out.get("num_crops", [0]))
        if crops.any():
            raise LayoutMismatchError(
                f"{type(self.image_processor).__name__} produced pan-and-scan crops "
                f"{crops.tolist()}: the stored spans hold one image sequence each"
            )
        return {"pixel_values": out["pixel_values"]}

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        return int(outputs["pixel_values"].shape[0]) * (self.layout.param("image_seq_length") + 4)

    def check_output(
        self, outputs: Mapping[str, Any], ref: ImageRef, *, sample_id: str | None, image_index: int
    ) -> None:
        super().check_output(outputs, ref, sample_id=sample_id, image_index=image_index)
        expected = self.placeholder(ref.width, ref.height)["pixel_values"].shape
        if tuple(outputs["pixel_values"].shape) != expected:
            raise LayoutMismatchError(
                f"processor output has pixel_values of shape "
                f"{tuple(outputs['pixel_values'].shape)}, the layout says {expected}",
                sample_id=sample_id,
                image_index=image_index,
                uri=ref.uri,
            )


def _check_size(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageSizeError(f"image size must be positive, got {width}x{height}")


def _size_get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _check_image_sequence(processor: Any, seq_length: int) -> None:
    """Refuse a full processor whose image wrapper is not the one :meth:`Gemma3.expansion`
    lays out (a future transformers, a customized processor)."""
    full = getattr(processor, "full_image_sequence", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if full is None or tokenizer is None:
        return
    boi, soft, eoi = (
        getattr(tokenizer, a, None) for a in ("boi_token", "image_token", "eoi_token")
    )
    if not (isinstance(boi, str) and isinstance(soft, str) and isinstance(eoi, str)):
        return
    if full != f"\n\n{boi}{soft * seq_length}{eoi}\n\n":
        raise UnsupportedProcessorError(
            f"{type(processor).__name__}.full_image_sequence is not '\\n\\n' + {boi} + "
            f"{seq_length} x {soft} + {eoi} + '\\n\\n': not the layout mmstore builds"
        )
