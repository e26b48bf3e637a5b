"""Scaffolding the family tests share (tests/family_cases.py, tests/test_family_*.py,
tests/test_adapter.py).

Offline tokenizers, test images and media refs, tiny random-weight models and their loss, and
the checks every family's layout must pass against the output of its real processor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmstore


def sized(sizes: Sequence[tuple[int, int]]) -> Any:
    """``parametrize`` over (width, height) pairs, each test id ``WxH``."""
    return pytest.mark.parametrize(("width", "height"), sizes, ids=[f"{w}x{h}" for w, h in sizes])


# -- tokenizers, images, media ----------------------------------------------------------------


def word_level_tokenizer(
    vocab: Mapping[str, int],
    specials: Iterable[str] = (),
    *,
    unk: str,
    pad: str | None = None,
    **kwargs: Any,
) -> Any:
    """A WordLevel tokenizer over ``vocab``, split on white space, built offline.

    ``specials`` become added special tokens at their vocab ids, so the processor's
    "<|image|><|image|>" (no spaces) splits into tokens.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(dict(vocab), unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    added = [AddedToken(t, special=True, normalized=False) for t in specials]
    if added:
        backend.add_special_tokens(added)
    if pad is not None:
        kwargs["pad_token"] = pad
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, **kwargs)


def gradient(width: int, height: int) -> Image.Image:
    """A diagonal gradient: ordinary pixels, so the processor's resize has something to do."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.broadcast_to((x + y) / 2, (height, width, 3)).astype(np.uint8))


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Uniform noise: other content per seed, and a resampling that rounds."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def media_ref(width: int, height: int, n: int = 0) -> mmstore.MediaRef:
    """A media ref of that size (no bytes behind it): for layout math and ``expand``."""
    digest = f"{n:032x}"
    return mmstore.MediaRef(hash=digest, uri=f"media/{digest}.png", width=width, height=height)


# -- tiny models --------------------------------------------------------------------------------


def tiny_qwen2_vl_config(
    *,
    num_hidden_layers: int,
    vocab_size: int = 151680,
    image_token_id: int = 151655,
    video_token_id: int = 151656,
    vision_start_token_id: int = 151652,
) -> Any:
    """A random-weight-sized Qwen2-VL config (patch 14, merge 2), with the published token ids
    and vocabulary unless given others (a small vocabulary keeps the model fast)."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id,
    )


def tiny_model(model_cls: Any, config: Any, dtype: torch.dtype, *, attn: str = "eager") -> Any:
    """A random-weight ``model_cls`` (seeded: the same weights every call), cast, in eval mode."""
    torch.manual_seed(0)
    config._attn_implementation = attn
    return model_cls(config).to(dtype).eval()


def model_inputs(loader: Any, batch: Mapping[str, Any], model: Any = None) -> dict[str, Any]:
    """What the loader says its model takes, from one of its batches (``model``: where the
    batch needs an attention mask built for it)."""
    return loader.model_inputs(batch, model)


def model_output(model: Any, loader: Any, batch: Mapping[str, Any], *, labels_on: str) -> Any:
    """The model's output on ``batch``, labelled on the tokens where ``batch[labels_on]``."""
    labels = batch["input_ids"].masked_fill(~batch[labels_on].bool(), -100)
    return model(**model_inputs(loader, batch, model), labels=labels)


def train_loss(model: Any, loader: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """The training loss of ``batch``: labels on the loss mask."""
    return model_output(model, loader, batch, labels_on="loss_mask").loss


def check_distinct_images(
    store: mmstore.Store,
    processor: Any,
    *,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    num_workers: int = 0,
    max_tokens: int | None = None,
    preprocess_device: str | None = None,
    **dataset_kwargs: Any,
) -> int:
    """Load ``store`` plainly and with ``distinct_images``: every distinct batch, expanded,
    equals its plain batch key for key, tensor for tensor. The leading rows of the first
    image input the distinct batches left out (0 where no batch shows an image twice)."""
    ds = mmstore.RolloutDataset(store, processor, dtype=dtype, **dataset_kwargs)
    options: dict[str, Any] = dict(
        num_workers=num_workers, max_tokens=max_tokens, preprocess_device=preprocess_device
    )
    plain = list(mmstore.RolloutLoader(ds, batch_size=batch_size, **options))
    distinct = list(
        mmstore.RolloutLoader(ds, batch_size=batch_size, distinct_images=True, **options)
    )
    assert len(plain) == len(distinct) > 0
    first = next(iter(ds.adapter.image_inputs))
    saved = 0
    for want, batch in zip(plain, distinct, strict=True):
        if isinstance(batch[first], torch.Tensor):
            images = len(batch["image_index"])
            assert len(batch["image_rows"][first]) == int(batch["image_index"].max()) + 1
            saved += want[first].shape[0] - batch[first].shape[0]
            assert want[first].shape[0] >= batch[first].shape[0] and images > 0
        got = mmstore.expand_images(dict(batch))
        assert got.keys() == want.keys()
        for key, value in want.items():
            if "cache_" in key:  # counters: the second loader finds the node cache filled
                continue
            if isinstance(value, torch.Tensor):
                assert value.dtype == got[key].dtype and torch.equal(value, got[key]), key
            else:
                assert value == got[key], key
    return saved


# -- checks against the real processor -----------------------------------------------------------


def check_placeholder(
    adapter: Any, outputs: Mapping[str, Any], width: int, height: int
) -> dict[str, np.ndarray]:
    """The family's placeholder for a ``width`` x ``height`` image has the processor's
    tensors: each of its image inputs in the same shape and dtype, floats all zero, integer
    tensors (grids, sizes) equal. Returns the placeholder."""
    placeholder = adapter.placeholder(width, height)
    for key in adapter.image_inputs:
        ours, theirs = placeholder[key], np.asarray(outputs[key])
        assert ours.shape == theirs.shape, key
        assert ours.dtype == theirs.dtype, key
        if np.issubdtype(ours.dtype, np.floating):
            assert not ours.any(), key
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=key)
    return placeholder


def check_output_fits(adapter: Any, outputs: Mapping[str, Any], ref: Any) -> None:
    """``check_output`` accepts the processor's real output for ``ref`` and refuses it for a
    ref whose span is one token longer."""
    adapter.check_output(outputs, ref, sample_id="s", image_index=0)
    longer = ref.model_copy(update={"length": ref.length + 1})
    with pytest.raises(mmstore.LayoutMismatchError):
        adapter.check_output(outputs, longer, sample_id="s", image_index=0)


def check_refused_by(store: mmstore.Store, other_processor: Any) -> None:
    """A store laid out by one family cannot be read with another family's processor: the
    dataset refuses it when it is built, before any batch."""
    with pytest.raises(mmstore.LayoutMismatchError):
        mmstore.RolloutDataset(store, other_processor)
