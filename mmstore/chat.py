"""Chat messages -> rows: the family's own chat template and processor, the spans located.

``prompt(store, processor, messages)`` takes a conversation in the OpenAI / Hugging Face chat
format (``{"role": ..., "content": ...}``, the content a string or a list of blocks), puts
each image of it into the store, renders the processor's chat template
(``processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``),
runs the processor on that text and the stored images (its ``input_ids``: every image span
expanded, as the model is given them) and locates the spans (:meth:`mmstore.Family.locate`:
each must be exactly its image's layout). :meth:`ChatPrompt.rollout` then makes the row of
a completion: the prompt, then the completion, trained on the completion only.

Image blocks, in the order the template writes them: ``{"type": "image", "image": ...}`` (a
PIL image, a uint8 array or tensor, or a file path), ``{"type": "image", "path" | "url" |
"base64": ...}`` and OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``. A URL is
a ``data:`` URL or a local file (``file://`` or a path): nothing is downloaded. The
processor is given the images as the store holds them (upright RGB), as the loader gives
them to the trainer.

Multi-turn: the conversation so far is the prompt (earlier assistant turns included, not
trained on); a later user turn may add images. Videos are not taken here (locate a video's
span with ``adapter.locate(ids, videos=...)``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from mmstore._families import Family, adapter_for
from mmstore._format.media import FORMAT_EXTENSIONS, probe
from mmstore._format.models import ImageRef, MediaRef, Rollout
from mmstore._rows.store import Store
from mmstore.errors import ImageDecodeError, InvalidArgumentError

__all__ = ["ChatPrompt", "prompt"]

_IMAGE_KEYS = ("image", "url", "path", "base64")  # what transformers reads an image from
_VIDEO_TYPES = ("video", "video_url")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered, processed prompt: its ids (image spans expanded), the refs of its images
    (``offset``/``length``: their spans), the family adapter and the rendered text."""

    tokens: list[int]
    images: list[ImageRef]
    adapter: Family
    text: str

    def rollout(
        self,
        sample_id: str,
        completion: Sequence[int],
        *,
        logprobs: Sequence[float] | None = None,
        **fields: Any,
    ) -> Rollout:
        """The row of ``completion`` (token ids) sampled from this prompt: ``prompt_len`` is
        the prompt's length and ``loss_mask`` is True on the completion only. ``logprobs``:
        the sampler's, one per completion token (stored 0 on the prompt). ``fields``: any
        other :class:`mmstore.Rollout` field (``group_id``, ``reward``, ``advantage``,
        ``policy_version``, ``columns``...)."""
        sampled = [int(t) for t in completion]
        n, m = len(self.tokens), len(sampled)
        full = None
        if logprobs is not None:
            if len(logprobs) != m:
                raise InvalidArgumentError(
                    f"{len(logprobs)} logprobs for a {m}-token completion: give one per "
                    "completion token",
                    sample_id=sample_id,
                )
            full = [0.0] * n + [float(x) for x in logprobs]
        return Rollout(
            sample_id=sample_id,
            tokens=[*self.tokens, *sampled],
            prompt_len=n,
            loss_mask=[False] * n + [True] * m,
            logprobs=full,
            images=list(self.images),
            **fields,
        )


def prompt(
    store: Store,
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> ChatPrompt:
    """``messages`` as the model is prompted with them: each image put into ``store``, the
    chat template rendered (``chat_template``, else the processor's own; ``template_kwargs``
    go to the template, e.g. ``enable_thinking``), the text and images run through
    ``processor`` (a full processor: tokenizer, image processor and chat template) and the
    image spans located in its ``input_ids``. See the module docstring."""
    if not hasattr(processor, "apply_chat_template") or not hasattr(processor, "tokenizer"):
        raise InvalidArgumentError(
            f"mmstore.chat.prompt takes a full processor (tokenizer, image processor, chat "
            f"template), got {type(processor).__name__}"
        )
    adapter = adapter_for(processor)
    media = [_put(store, source) for source in _image_sources(messages)]
    text = processor.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    kwargs: dict[str, Any] = {}
    bos = getattr(processor.tokenizer, "bos_token", None)
    if bos and text.startswith(bos):  # the template wrote it: not twice (as transformers)
        kwargs["add_special_tokens"] = False
    images = [store.open_image(ref.uri, ref.hash) for ref in media]
    out = processor(text=text, images=images or None, **kwargs)
    ids = np.asarray(out["input_ids"]).reshape(-1).tolist()
    found = adapter.locate(ids, images=media)
    return ChatPrompt(found.tokens, found.images, adapter, text)


def _image_sources(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each image block's image, in message and block order (the template's order)."""
    sources = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        for block in content:
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "image":
                given = [k for k in _IMAGE_KEYS if block.get(k) is not None]
                if len(given) != 1:
                    raise InvalidArgumentError(
                        f"message {index}: an image block needs one of {', '.join(_IMAGE_KEYS)}"
                    )
                image = block[given[0]]
                sources.append(_b64decode(image) if given[0] == "base64" else image)
            elif kind == "image_url":
                url = block.get("image_url")
                sources.append(url.get("url") if isinstance(url, Mapping) else url)
            elif kind in _VIDEO_TYPES:
                raise InvalidArgumentError(
                    f"message {index}: mmstore.chat takes images, not videos; locate a video's "
                    "span with adapter.locate(ids, videos=[...])"
                )
    return sources


def _put(store: Store, source: Any) -> MediaRef:
    """Store one image: in-memory pixels and paths by ``put_image``, bytes as they are."""
    if isinstance(source, bytes):
        fmt, _, _ = probe(source, max_pixels=store.max_image_pixels)
        if fmt not in FORMAT_EXTENSIONS:
            raise ImageDecodeError(f"{fmt} images are not stored: {sorted(FORMAT_EXTENSIONS)}")
        return store.put_media(source, ext=FORMAT_EXTENSIONS[fmt][0])
    if isinstance(source, str):
        if source.startswith("data:"):
            header, _, payload = source.partition(",")
            if not header.endswith(";base64"):
                raise InvalidArgumentError("a data: URL of an image must be base64")
            return _put(store, _b64decode(payload))
        if source.startswith("file://"):
            return store.put_image(unquote(urlparse(source).path))
        if "://" in source:
            raise InvalidArgumentError(
                f"mmstore.chat downloads nothing: fetch {source[:80]!r} and pass the image "
                "(or a data: URL)"
            )
    return store.put_image(source)


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError("an image's base64 does not decode") from None
