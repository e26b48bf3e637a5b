"""Rows -> training samples: verified media reads, decode, the real processor, dtype cast.

Runs inside DataLoader workers. Each worker keeps a byte-bounded cache of processed images
keyed by (hash, fingerprint), so the samples of a GRPO group process their shared image once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import torch

from ._cache import ByteLRU
from ._exceptions import (
    InvalidArgumentError,
    InvalidRolloutError,
    LayoutMismatchError,
    MediaNotFoundError,
    MmstoreError,
)
from ._invariants import truncation_point
from ._models import ImageRef

if TYPE_CHECKING:
    from ._families import Family
    from ._store import Store

MissingPolicy = Literal["error", "placeholder_zero_loss"]
DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass
class Sample:
    """One materialized training sample (tensors of one row, not yet padded)."""

    sample_id: str
    group_id: str | None
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]
    image_mask: torch.Tensor  # bool [L], True on image placeholder tokens
    logprobs: torch.Tensor | None  # float32 [L]
    prompt_len: int
    reward: float
    advantage: float
    # one dict per image: the family's image tensors (floats in the train dtype), each with
    # a leading axis the family's collate concatenates over
    images: list[dict[str, torch.Tensor]] = field(default_factory=list)
    missing_uris: list[str] = field(default_factory=list)


def check_missing_policy(missing: str) -> None:
    if missing not in get_args(MissingPolicy):
        raise InvalidArgumentError(
            f"missing must be one of {get_args(MissingPolicy)}, got {missing!r}"
        )


def cast_floats(outputs: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of a processor output; floating ones cast to ``dtype``, integer ones kept."""
    out = {}
    for key, value in outputs.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def with_context(exc: MmstoreError, **context: Any) -> MmstoreError:
    """The same error, its context extended with where the loader met it."""
    return type(exc)(exc.message, **{**exc.context, **context})


class Materializer:
    """Turns rows (Arrow) into :class:`Sample` s for one adapter and train dtype."""

    def __init__(
        self,
        store: Store,
        adapter: Family,
        *,
        dtype: torch.dtype = torch.bfloat16,
        missing: MissingPolicy = "error",
        max_len: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        check_missing_policy(missing)
        self.store = store
        self.adapter = adapter
        self.dtype = dtype
        self.missing = missing
        self.max_len = max_len
        self.cache: ByteLRU[dict[str, torch.Tensor]] = ByteLRU(cache_bytes)

    def sample(self, row: dict[str, Any]) -> Sample:
        sid = row["sample_id"]
        refs = [ImageRef(**ref) for ref in row["images"]]
        tokens = row["tokens"]
        n = len(tokens)
        kept = len(refs)
        if self.max_len is not None:
            n, kept = truncation_point(
                [r.offset for r in refs], [r.length for r in refs], len(tokens), self.max_len
            )
            if n == 0:
                raise InvalidRolloutError(
                    f"max_len={self.max_len} cuts inside the first image; nothing would remain",
                    sample_id=sid,
                    image_index=0,
                )
        image_mask = torch.zeros(n, dtype=torch.bool)
        sample = Sample(
            sample_id=sid,
            group_id=row["group_id"],
            input_ids=torch.tensor(tokens[:n], dtype=torch.int64),
            loss_mask=torch.tensor(row["loss_mask"][:n], dtype=torch.bool),
            image_mask=image_mask,
            logprobs=None
            if row["logprobs"] is None
            else torch.tensor(row["logprobs"][:n], dtype=torch.float32),
            prompt_len=min(row["prompt_len"], n),
            reward=math.nan if row["reward"] is None else row["reward"],
            advantage=math.nan if row["advantage"] is None else row["advantage"],
        )
        for index, ref in enumerate(refs[:kept]):
            image_mask[ref.offset : ref.offset + ref.length] = True
            sample.images.append(self.image(ref, sid, index, sample))
        if sample.missing_uris:
            sample.loss_mask.zero_()
        return sample

    def image(self, ref: ImageRef, sid: str, index: int, sample: Sample) -> dict[str, torch.Tensor]:
        """One image's tensors (floats in the train dtype), from cache or the processor."""
        where = {"sample_id": sid, "image_index": index}
        if ref.layout_fingerprint != self.adapter.fingerprint:
            raise LayoutMismatchError(
                f"ref laid out by {ref.layout_fingerprint}, processor is "
                f"{self.adapter.fingerprint}",
                uri=ref.uri,
                **where,
            )
        key = (ref.hash, self.adapter.fingerprint)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            image = self.store.open_image(ref.uri, ref.hash)
        except MediaNotFoundError as exc:
            if self.missing == "error":
                raise with_context(exc, **where) from None
            sample.missing_uris.append(ref.uri)
            return self._placeholder(ref)
        except MmstoreError as exc:
            raise with_context(exc, **where) from None
        outputs = cast_floats(self.adapter.process([image]), self.dtype)
        self.adapter.check_output(outputs, ref, sample_id=sid, image_index=index)
        nbytes = sum(t.numel() * t.element_size() for t in outputs.values())
        self.cache.put(key, outputs, nbytes)
        return outputs

    def _placeholder(self, ref: ImageRef) -> dict[str, torch.Tensor]:
        # Never cached: the file may reappear, and a zero tensor is cheap to rebuild.
        return cast_floats(self.adapter.placeholder(ref.width, ref.height), self.dtype)
