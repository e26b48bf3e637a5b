"""What a family's layout is, as data: shared by image (:mod:`._base`) and video
(:mod:`._video`) families, and the footer records readers rebuild them from."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, NamedTuple

import xxhash

from mmstore._format.models import ImageRef, VideoRef

# How one image tensor of a family is batched: "cat" concatenates the images' tensors along
# their first axis (patch rows, or one row per image); "pad" zero-pads the trailing (spatial)
# axes to the largest image of the batch first (Pixtral's native-resolution images).
Collation = Literal["cat", "pad"]


class Expanded(NamedTuple):
    """A prompt with its media expanded: the tokens, and the refs of its images and videos."""

    tokens: list[int]
    images: list[ImageRef]
    videos: list[VideoRef]


@dataclass(frozen=True)
class Layout:
    """How one family, with one set of processor parameters, lays images out as tokens."""

    family: str
    parameters: tuple[tuple[str, Any], ...]
    token_ids: tuple[tuple[str, int], ...]

    @classmethod
    def make(
        cls, family: str, parameters: Mapping[str, Any], token_ids: Mapping[str, int]
    ) -> Layout:
        return cls(
            family,
            tuple(sorted(parameters.items())),
            tuple(sorted((k, int(v)) for k, v in token_ids.items())),
        )

    @cached_property  # asked for several times per image read; the layout is frozen
    def fingerprint(self) -> str:
        # family + layout parameters only. For Qwen-VL this is byte for byte the canonical
        # JSON of the first release, so stored fingerprints never change.
        canonical = json.dumps(
            {"family": self.family, **dict(self.parameters)}, sort_keys=True, separators=(",", ":")
        )
        return xxhash.xxh3_64_hexdigest(canonical.encode())

    def param(self, name: str) -> Any:
        return dict(self.parameters)[name]

    def token_id(self, name: str) -> int:
        return dict(self.token_ids)[name]

    @property
    def image_token_id(self) -> int:
        return self.token_id("image_token_id")

    @property
    def pad_token_id(self) -> int:
        """The token that pads a batch (the tokenizer's pad token)."""
        return self.token_id("pad_token_id")

    def params(self) -> dict[str, Any]:
        """The footer record: family, layout parameters and token ids, flat."""
        return {"family": self.family, **dict(self.parameters), **dict(self.token_ids)}


@dataclass(frozen=True)
class Token:
    """One of a family's special tokens: its text in the tokenizer, and its id in the family's
    published tokenizer (used when the adapter is built without a tokenizer)."""

    text: str
    published_id: int


def published_token_ids(family: Any) -> dict[str, int]:
    """The ids of ``family``'s special tokens in its published tokenizer, by name."""
    return {key: token.published_id for key, token in family.token_table.items()}


def tokenizer_ids(token_table: Mapping[str, Token], tokenizer: Any) -> dict[str, int]:
    """The ids ``tokenizer`` gives the tokens of ``token_table`` (those it has), and its pad
    token's id."""
    ids: dict[str, int] = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for key, token in token_table.items():
        token_id = tokenizer.convert_tokens_to_ids(token.text)
        if isinstance(token_id, int) and token_id != unk:
            ids[key] = token_id
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int):
        ids["pad_token_id"] = pad
    return ids


class OfLayout:
    """What an image or a video family knows of itself from its layout alone."""

    layout: Layout

    @property
    def family(self) -> str:
        return self.layout.family

    @property
    def fingerprint(self) -> str:
        return self.layout.fingerprint
