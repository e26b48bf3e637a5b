"""The contract every model family keeps, run on every family (``tests/family_cases.py``).

Each test takes one family's case and checks what mmstore promises of all of them, against
the family's real transformers processor and a tiny random-weight model of the family:

- the layout: ``expand`` gives the processor's own tokens at every size, placeholders have
  the processor's tensors, ``check_output`` holds the processor's output to the span, token
  ids come from the tokenizer (or are the published ones), each layout setting and nothing
  else moves the fingerprint, sizes the processor refuses are refused, and the torchvision
  backend lays out and processes like the PIL one;
- the store and the loader: rows written, read back and trained on (padded, text only,
  with a dummy image, with missing media, packed: each sample's logits equal its logits
  alone), spans that do not line up refused before any model sees them, a store of one
  layout refused by another, the footer's layout, the wire resolver, vLLM's prompt and
  distinct images.

What only one family does is tested in its own file.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmstore
from mmstore._families import family_for_layout, layout_from_record
from mmstore.integrations import vllm
from tests.families_common import (
    check_distinct_images,
    check_output_fits,
    check_placeholder,
    check_refused_by,
    gradient,
    media_ref,
    model_inputs,
    noise,
    train_loss,
)
from tests.family_cases import CASES, FamilyCase, rollout, store_images, token_ids, write_rows

ALL = list(CASES.values())
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# Settings no family's layout depends on: they change pixel values, never tokens or shapes.
NEUTRAL_CHANGES = (
    {"image_mean": [0.2, 0.2, 0.2], "image_std": [0.3, 0.3, 0.3]},
    {"do_normalize": False},
    {"rescale_factor": 1 / 127.5},
)


def each(cases: list[FamilyCase], name: str, values: Any) -> Any:
    """``parametrize`` over (case, value) pairs, ``values(case)`` for each case."""
    pairs = [(case, value) for case in cases for value in values(case)]
    ids = [f"{case}-{_id(value)}" for case, value in pairs]
    return pytest.mark.parametrize(("case", name), pairs, ids=ids)


def _id(value: Any) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.fixture(scope="module", params=ALL, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


# -- the layout against the real processor -------------------------------------------------


def test_enough_sizes(case):
    assert len(set(case.sizes)) == len(case.sizes) >= 20


@pytest.mark.parametrize(
    ("case", "layout", "width", "height"),
    [
        # 1440p and larger: the real processor takes a second or more here
        pytest.param(c, name, w, h, marks=[pytest.mark.slow] if w * h >= 2560 * 1440 else [])
        for c in ALL
        for name in c.published_layouts
        for w, h in c.sizes
    ],
    ids=[f"{c}-{name}-{w}x{h}" for c in ALL for name in c.published_layouts for w, h in c.sizes],
)
def test_expand_gives_the_real_processors_tokens(case, layout, width, height):
    processor = case.published(layout)
    adapter = mmstore.adapter_for(processor)
    image = gradient(width, height)
    text = case.text(1)
    try:
        expansion = adapter.expansion(width, height)
    except mmstore.ImageSizeError:  # fitted into Pixtral-12B's 1024 px, 1540x1 has 0 rows
        with pytest.raises(ValueError):  # and so does the processor refuse it
            processor(text=[text], images=[image])
        return
    out = processor(text=[text], images=[image], return_tensors="np")
    ids = [int(t) for t in out["input_ids"][0]]

    tokens, [ref] = adapter.expand(token_ids(processor, text), [media_ref(width, height)])
    assert tokens == ids
    assert tokens[ref.offset : ref.offset + ref.length] == expansion
    assert adapter.num_tokens(width, height) == ref.length == len(expansion)
    assert (ref.family, ref.layout_fingerprint) == (case.family, adapter.fingerprint)
    if adapter.token_type_input:  # 1 on the tokens the image features land on
        feature = (np.asarray(ids) == adapter.feature_token_id).astype(np.int64)
        np.testing.assert_array_equal(out[adapter.token_type_input][0], feature)
    check_placeholder(adapter, out, width, height)
    assert adapter.pixel_shape(width, height) == out["pixel_values"].shape
    check_output_fits(adapter, {key: out[key] for key in adapter.image_inputs}, ref)


def test_two_images_expand_and_process_as_the_processor_does(case):
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    sizes = [case.sizes[3], case.sizes[-1]]  # an odd small size and a screen
    images = [gradient(*sizes[0]), noise(*sizes[1])]
    text = case.text(2)
    out = processor(text=[text], images=[images], return_tensors="np")
    media = [media_ref(w, h, n) for n, (w, h) in enumerate(sizes)]
    tokens, refs = adapter.expand(token_ids(processor, text), media)
    assert tokens == [int(t) for t in out["input_ids"][0]]
    assert refs[0].offset + refs[0].length <= refs[1].offset
    ours = adapter.process(images)
    assert set(ours) == set(adapter.image_inputs)
    for key, value in ours.items():
        np.testing.assert_array_equal(value, out[key], err_msg=key)
        assert value.dtype in (np.float32, np.int64), key
    # The loader hands the model what the processor hands it (less what a batch names anyway).
    assert set(case.model_input_names) <= set(processor.model_input_names)


def test_token_ids_come_from_the_tokenizer_or_are_published(case):
    small = case.small()
    from_tokenizer = mmstore.adapter_for(small)
    alone = mmstore.adapter_for(small.image_processor)
    published = mmstore.adapter_for(case.full(case.image_processor(), case.published_ids))
    for adapter, ids in (
        (from_tokenizer, case.small_ids),
        (alone, case.published_ids),
        (published, case.published_ids),
    ):
        assert adapter.family == case.family
        assert adapter.image_token_id == ids[case.image_token]
        assert adapter.feature_token_id == ids[case.feature_token]
        assert adapter.layout.token_id("pad_token_id") == ids[case.pad_token]
        assert adapter.special_token_ids == {ids[token] for token in case.special_tokens}
    assert published.layout == alone.layout
    # Token ids are tokenizer facts, not layout: they never move the fingerprint (Gemma 3's
    # full processor also sets a layout parameter, its soft tokens per image).
    parameters = {**dict(alone.layout.parameters), **case.small_full_parameters}
    assert dict(from_tokenizer.layout.parameters) == parameters
    assert (from_tokenizer.fingerprint == alone.fingerprint) == (not case.small_full_parameters)


def test_the_flagship_layout_and_the_fingerprint_stores_record(case):
    flagship = case.published()
    adapter = mmstore.adapter_for(flagship)
    assert dict(adapter.layout.parameters) == case.layout_parameters
    # Stores record this value: changing how it is computed orphans every stored layout.
    assert adapter.fingerprint == case.fingerprint
    # The image processor alone lays out as the full processor, or is refused until it is
    # given what only the full processor says (never a guess: Pixtral's merge).
    alone = copy.deepcopy(flagship.image_processor)
    if case.alone_needs:
        with pytest.raises(mmstore.UnsupportedProcessorError, match="full") as refusal:
            mmstore.adapter_for(alone)
        assert all(name in str(refusal.value) for name in case.alone_needs)
        for name, value in case.alone_needs.items():
            setattr(alone, name, value)
    assert mmstore.adapter_for(alone).fingerprint == case.fingerprint


def test_the_footer_record_rebuilds_the_layout(case):
    """A reader without the processor redoes the layout math from the footer's record."""
    adapter = mmstore.adapter_for(case.small())
    layout = layout_from_record(adapter.layout.params())
    assert layout == adapter.layout and layout.fingerprint == adapter.fingerprint
    footer = family_for_layout(layout)
    for width, height in case.sizes[:12]:
        assert footer.expansion(width, height) == adapter.expansion(width, height)
        assert footer.pixel_shape(width, height) == adapter.pixel_shape(width, height)


def test_layout_settings_move_the_fingerprint_and_others_do_not(case):
    fingerprint = mmstore.adapter_for(case.image_processor()).fingerprint
    for change in case.layout_changes:
        other = mmstore.adapter_for(case.image_processor(**change))
        assert other.fingerprint != fingerprint, change
    for change in (*NEUTRAL_CHANGES, *case.neutral_changes):
        same = mmstore.adapter_for(case.image_processor(**change))
        assert same.fingerprint == fingerprint, change


def test_fingerprints_differ_across_layouts_and_families():
    adapters = [mmstore.adapter_for(c.published(name)) for c in ALL for name in c.published_layouts]
    adapters += [mmstore.adapter_for(c.small()) for c in ALL]
    assert len({a.fingerprint for a in adapters}) == len(adapters)


@each(ALL, "backend", lambda case: list(case.backends))
def test_a_processor_that_does_not_resize_is_refused(case, backend):
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_resize"):
        mmstore.adapter_for(case.image_processor(backend, do_resize=False))


@each(ALL, "size", lambda case: [(0, 5), (5, 0), (-1, 3)])
def test_empty_sizes_are_refused(case, size):
    adapter = mmstore.adapter_for(case.small())
    with pytest.raises(mmstore.ImageSizeError):
        adapter.expansion(*size)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.num_tokens(*size)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.placeholder(*size)


@each(ALL, "size", lambda case: case.unrepresentable)
def test_sizes_the_processor_refuses_are_refused(case, size):
    processor = case.published()
    adapter = mmstore.adapter_for(processor)
    with pytest.raises(mmstore.ImageSizeError, match=case.unrepresentable_match):
        adapter.expansion(*size)
    with pytest.raises(mmstore.ImageSizeError):
        adapter.expand([adapter.image_token_id], [media_ref(*size)])
    # The real processor refuses them too: the adapter is not stricter than the model.
    with pytest.raises(ValueError):
        processor(text=[case.text(1)], images=[gradient(*size)])


@pytest.mark.parametrize("case", [c for c in ALL if len(c.backends) == 2], ids=str)
def test_the_torchvision_backend_matches_the_pil_backend(case):
    pil, fast = case.image_processor("pil"), case.image_processor("torchvision")
    a, b = mmstore.adapter_for(pil), mmstore.adapter_for(fast)
    assert a.fingerprint == b.fingerprint
    level = 1 / 255 / min(pil.image_std)  # one 8-bit gray level after normalization
    for seed, (width, height) in enumerate(case.backend_sizes):
        images = [gradient(width, height)]
        if case.backend_noise:
            images.append(noise(width, height, seed))
        for image in images:
            ours, theirs = a.process([image]), b.process([image])
            for key, zeros in a.placeholder(width, height).items():
                assert ours[key].shape == theirs[key].shape == zeros.shape, (key, width, height)
                if zeros.dtype.kind != "f":
                    np.testing.assert_array_equal(ours[key], theirs[key])
                    continue
                # The backends' resampling rounds to 8-bit levels apart: a level or two.
                diff = np.abs(ours[key] - theirs[key])
                assert diff.max() <= case.backend_levels * level + 1e-4, (width, height)
                assert diff.mean() < 2e-3, (width, height)


# -- the store, the loader and the tiny model ----------------------------------------------


@dataclass(frozen=True)
class Filled:
    """A store of one family's rows: run "r" holds two images, one, none and the first image
    again; run "t" two text-only rows."""

    store: mmstore.Store
    rows: Mapping[str, mmstore.Rollout]
    images: Mapping[str, list[Image.Image]]


@pytest.fixture(scope="module")
def filled(case, tmp_path_factory) -> Filled:
    store = mmstore.Store.open(tmp_path_factory.mktemp(case.family) / "store", create=True)
    a, b, c = store_images(case)
    run_r = [("two", [a, b]), ("one", [c]), ("text", []), ("again", [a])]
    run_t: list[tuple[str, list[Image.Image]]] = [("t0", []), ("t1", [])]
    rows = write_rows(store, case, case.small(), run_r)
    rows += write_rows(store, case, case.small(), run_t, run_id="t")
    return Filled(store, {row.sample_id: row for row in rows}, dict(run_r + run_t))


def _check_image_inputs(
    batch: Mapping[str, Any], expected: Mapping[str, Any], dtype: torch.dtype
) -> None:
    """The batch's image tensors are exactly ``expected`` (the processor's, cast): floats in
    the train dtype, integers (grids, sizes) int64."""
    for key, value in expected.items():
        assert batch[key].dtype == (dtype if value.is_floating_point() else torch.int64), key
        assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key


def _check_token_types(adapter: Any, batch: Mapping[str, Any]) -> None:
    if adapter.token_type_input:
        features = (batch["input_ids"] == adapter.feature_token_id).int()
        assert batch[adapter.token_type_input].tolist() == features.tolist()


def _check_zero_image(adapter: Any, tensors: Mapping[str, torch.Tensor], size: tuple[int, int]):
    """``tensors`` are the family's placeholder for an image of ``size``: zeros, its shapes."""
    for key, zeros in adapter.placeholder(*size).items():
        assert tuple(tensors[key].shape) == zeros.shape, key
        if zeros.dtype.kind == "f":
            assert not tensors[key].any(), key
        else:
            assert tensors[key].tolist() == zeros.tolist(), key


@DTYPES
def test_the_tiny_model_trains_on_every_padded_batch(case, filled, dtype):
    model = case.tiny_model(dtype)
    ds = mmstore.RolloutDataset(filled.store, case.small(), dtype=dtype, runs=["r"], shuffle=False)
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    assert loader.model_input_names == case.model_input_names
    batches = list(loader)
    assert [b["sample_ids"] for b in batches] == [["two", "one"], ["text", "again"]]
    for batch in batches:
        images = [image for sid in batch["sample_ids"] for image in filled.images[sid]]
        _check_image_inputs(batch, ds.adapter.process(images, dtype), dtype)
        _check_token_types(ds.adapter, batch)
        assert torch.isfinite(train_loss(model, loader, batch)), batch["sample_ids"]
    # The model itself refuses image tokens that do not line up with the pixels: the finite
    # losses above mean that spans, tensors and pixels agree.
    broken = batch["input_ids"].clone()
    row, column = (broken == ds.adapter.feature_token_id).nonzero()[0].tolist()
    broken[row, column] = token_ids(case.small(), case.words[0])[0]
    with pytest.raises((ValueError, RuntimeError)):
        model(**{**model_inputs(loader, batch), "input_ids": broken})


@DTYPES
def test_text_only_batches_with_and_without_a_dummy_image(case, filled, dtype):
    model = case.tiny_model(dtype)
    ds = mmstore.RolloutDataset(filled.store, case.small(), dtype=dtype, runs=["t"], shuffle=False)
    adapter = ds.adapter
    plain = mmstore.RolloutLoader(ds, batch_size=2)
    (batch,) = list(plain)
    # No image inputs at all: a vision tower cannot run on zero images.
    assert all(batch[key] is None for key in adapter.image_inputs)
    assert torch.isfinite(train_loss(model, plain, batch))

    padded = mmstore.RolloutLoader(ds, batch_size=2, dummy_image=True)
    (batch,) = list(padded)
    assert batch["dummy_image"]
    _check_zero_image(adapter, batch, adapter.dummy_size)
    floats = [key for key, zeros in adapter.placeholder(1, 1).items() if zeros.dtype.kind == "f"]
    assert all(batch[key].dtype == dtype for key in floats)
    # The dummy's tokens end the first row, attended but never in the loss.
    expansion = adapter.expansion(*adapter.dummy_size)
    end = int(batch["attention_mask"][0].sum())
    assert batch["input_ids"][0, end - len(expansion) : end].tolist() == expansion
    assert not batch["loss_mask"][0, end - len(expansion) : end].any()
    _check_token_types(adapter, batch)
    assert torch.isfinite(train_loss(model, padded, batch))


@pytest.mark.slow  # a tiny model per case
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("max_tokens", [None, 8192], ids=["padded", "packed"])
def test_the_tiny_model_trains_on_every_live_micro_batch_of_two_ranks(case, filled, max_tokens):
    """LiveLoader over both runs (commit order: r, then t), two ranks computing their shares
    alone: every micro-batch of either rank (images, text only, packed or padded) is
    accepted by the tiny model, the ranks' shares are disjoint and cover each step, and
    they run the same number of micro-batches."""
    dtype = torch.float32
    model = case.tiny_model(dtype)
    shares = []
    for rank in (0, 1):
        live = mmstore.LiveLoader(filled.store, case.small(), runs=["r", "t"], batch_size=1,
                                  max_tokens=max_tokens, rank=rank, world_size=2, dtype=dtype,
                                  node_cache_bytes=0)  # fmt: skip
        steps = []
        for _ in range(3):
            batches = list(live.next_step(timeout=5))
            for batch in batches:
                assert torch.isfinite(train_loss(model, live, batch)), batch["sample_ids"]
            ids = [
                s
                for b in batches
                for s, f in zip(b["sample_ids"], b["is_filler"].tolist(), strict=True)
                if not f
            ]
            steps.append((len(batches), ids))
        shares.append(steps)
    expected = [["two", "one"], ["text", "again"], ["t0", "t1"]]
    for (n0, ids0), (n1, ids1), step in zip(*shares, expected, strict=True):
        assert n0 == n1 and sorted(ids0 + ids1) == sorted(step)


def assert_logits_of_each_sample_alone(model, packed, batch, one_by_one, alone) -> None:
    """Each sample's logits in packed micro-batch ``batch`` equal its logits run alone
    (``alone[sample_id]``: its batch from the one-by-one loader)."""
    with torch.no_grad():
        logits = model(**model_inputs(packed, batch, model)).logits[0]
        cu = batch["cu_seqlens"].tolist()
        for i, sample_id in enumerate(batch["sample_ids"]):
            expected = model(**model_inputs(one_by_one, alone[sample_id])).logits[0]
            torch.testing.assert_close(logits[cu[i] : cu[i + 1]], expected, atol=1e-4, rtol=0)


def test_packed_text_only_micro_batches_train(case, filled):
    """A packed micro-batch without images (a text-only step, an agent turn without a
    screenshot) passes None for the image inputs, as a padded batch does (a vision tower
    cannot run on zero images); the tiny model trains on it, and each sample's logits equal
    its logits alone."""
    dtype = torch.float32
    model = case.tiny_model(dtype)
    small = case.small()
    ds = mmstore.RolloutDataset(filled.store, small, dtype=dtype, runs=["t"], shuffle=False)
    dummy = ds.adapter.num_tokens(*ds.adapter.dummy_size)  # every budget has room for one
    max_tokens = sum(len(filled.rows[sid].tokens) for sid in ("t0", "t1")) + dummy
    packed = mmstore.RolloutLoader(ds, batch_size=2, max_tokens=max_tokens)
    one_by_one = mmstore.RolloutLoader(ds, batch_size=1)
    alone = {batch["sample_ids"][0]: batch for batch in one_by_one}
    (batch,) = list(packed)
    assert batch["sample_ids"] == ["t0", "t1"] and not batch["dummy_image"]
    assert all(batch[key] is None for key in ds.adapter.image_inputs)
    assert torch.isfinite(train_loss(model, packed, batch))
    assert_logits_of_each_sample_alone(model, packed, batch, one_by_one, alone)
    # The same with each image once (distinct_images): no image, no index.
    (distinct,) = list(
        mmstore.RolloutLoader(ds, batch_size=2, max_tokens=max_tokens, distinct_images=True)
    )
    assert all(distinct[key] is None for key in ds.adapter.image_inputs)
    assert distinct["image_index"].numel() == 0


def _touching_images(case: FamilyCase, processor: Any, adapter: Any, media: list) -> Any:
    """A row whose two images have no token between them: the image token twice."""
    first, last, _, _ = case.words
    prompt = [
        *token_ids(processor, first),
        adapter.image_token_id,
        adapter.image_token_id,
        *token_ids(processor, last),
    ]
    tokens, refs = adapter.expand(prompt, media)
    completion = token_ids(processor, case.completion_text)
    return mmstore.Rollout(
        sample_id="touching",
        tokens=tokens + completion,
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * len(completion),
        images=refs,
    )


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_touching_images_are_refused_where_the_model_would_merge_them(case, tmp_path):
    """One rule for every family, at write time (and again at read time): two images whose
    feature tokens would touch are refused, for the model reads a run of them as one image
    (Qwen-VL's and GLM-4V's get_rope_index fail on it; Kimi-K2.5's spans are one repeated
    token too). A family whose expansion closes on another token (Pixtral's [IMG_END], Gemma
    3's "\n\n"), as its chat template writes two images in a row, keeps them apart: such a
    row is written and trains packed with each sample's logits equal to its logits alone."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    small = case.small()
    adapter = mmstore.adapter_for(small)
    a, b, c = store_images(case)
    media = [store.put_image(a), store.put_image(b)]
    touching = _touching_images(case, small, adapter, media)
    first, second = touching.images
    assert first.offset + first.length == second.offset
    feature = adapter.feature_token_id
    merge = touching.tokens[second.offset - 1] == feature == touching.tokens[second.offset]
    assert merge == (case.family in ("qwen-vl", "glm4v", "kimi-k25"))
    if merge:
        writer = store.writer(run_id="r", step=0, adapter=adapter)
        with pytest.raises(mmstore.InvalidRolloutError, match="as one image") as err, writer as w:
            w.write(touching)
        assert (err.value.sample_id, err.value.image_index) == ("touching", 1)
        assert store.rollout_files() == []
        return
    other = rollout(case, small, "other", [store.put_image(c)], adapter=adapter)
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(touching)
        w.write(other)
    model = case.tiny_model(torch.float32, "eager")
    ds = mmstore.RolloutDataset(store, small, dtype=torch.float32, shuffle=False)
    one_by_one = mmstore.RolloutLoader(ds, batch_size=1)
    alone = {batch["sample_ids"][0]: batch for batch in one_by_one}
    dummy = adapter.num_tokens(*adapter.dummy_size)  # kept free for a rank without images
    max_tokens = len(touching.tokens) + len(other.tokens) + dummy
    packed = mmstore.RolloutLoader(ds, batch_size=2, max_tokens=max_tokens)
    (batch,) = list(packed)
    assert sorted(batch["sample_ids"]) == ["other", "touching"]
    assert_logits_of_each_sample_alone(model, packed, batch, one_by_one, alone)


def test_missing_media_gives_placeholders_the_model_accepts(case, tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    small = case.small()
    a, b, _ = store_images(case)
    lost, _ = write_rows(store, case, small, [("lost", [a]), ("kept", [b])])
    gone = lost.images[0]
    os.remove(os.path.join(store.root, gone.uri))
    with pytest.raises(mmstore.MediaNotFoundError):
        list(mmstore.RolloutLoader(mmstore.RolloutDataset(store, small), batch_size=2))

    dtype = torch.bfloat16
    ds = mmstore.RolloutDataset(
        store, small, dtype=dtype, shuffle=False, missing="placeholder_zero_loss"
    )
    loader = mmstore.RolloutLoader(ds, batch_size=2)
    with pytest.warns(UserWarning, match="missing media"):
        (batch,) = list(loader)
    assert batch["sample_ids"] == ["lost", "kept"] and batch["images_missing"] == 1
    assert batch["missing_uris"] == [gone.uri]
    assert not batch["loss_mask"][0].any() and batch["loss_mask"][1].any()
    # The lost image's rows are its placeholder (zeros, its shapes); the kept image's follow.
    kept = ds.adapter.process([b], dtype)
    for key, zeros in ds.adapter.placeholder(gone.width, gone.height).items():
        rows = zeros.shape[0]
        if zeros.dtype.kind == "f":
            assert not batch[key][:rows].any() and batch[key][rows:].any(), key
        else:
            assert batch[key].tolist() == [*zeros.tolist(), *kept[key].tolist()], key
    assert torch.isfinite(train_loss(case.tiny_model(dtype), loader, batch))


def _with_tokens(row: mmstore.Rollout, sample_id: str, tokens: list[int]) -> mmstore.Rollout:
    return row.model_copy(
        update={"sample_id": sample_id, "tokens": tokens, "loss_mask": [True] * len(tokens)}
    )


def _altered(span: list[int], text_token: int) -> list[int]:
    """The span's tokens, its count kept, no longer the expansion: two neighbours that differ
    swapped (a Pixtral row break moved, Gemma's wrapper out of order), or, where every token
    is the same, one of them a text token."""
    out = list(span)
    for i in range(len(out) - 1):
        if out[i] != out[i + 1]:
            out[i], out[i + 1] = out[i + 1], out[i]
            return out
    out[0] = text_token
    return out


def test_a_bad_span_or_a_stray_image_token_is_refused_by_the_writer(case, tmp_path):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    small = case.small()
    adapter = mmstore.adapter_for(small)
    good = rollout(case, small, "good", [store.put_image(store_images(case)[0])])
    ref = good.images[0]
    span = slice(ref.offset, ref.offset + ref.length)
    text_token = token_ids(small, case.words[0])[0]
    tokens = list(good.tokens)
    tokens[span] = _altered(tokens[span], text_token)
    shifted = ref.model_copy(update={"offset": ref.offset + 1})
    spans = [
        good.model_copy(update={"sample_id": "shifted", "images": [shifted]}),
        _with_tokens(good, "altered", tokens),
    ]
    # An image-only token outside every span: an image whose pixels no span holds.
    text_only = rollout(case, small, "text", [])
    strays = [
        _with_tokens(text_only, f"stray-{token}", [*text_only.tokens, token])
        for token in sorted(adapter.special_token_ids)
    ]
    for row, match in [(r, "span") for r in spans] + [
        (r, "outside every image span") for r in strays
    ]:
        writer = store.writer(run_id="r", step=0, adapter=adapter)
        with pytest.raises(mmstore.InvalidRolloutError, match=match) as err, writer as w:
            w.write(row)
        assert err.value.sample_id == row.sample_id
    assert store.rollout_files() == []  # a refused row commits nothing
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        w.write(good)
    assert len(store.rollout_files()) == 1


def test_another_layout_cannot_read_the_store(case, filled):
    """Refused when the dataset is built, before any batch: a processor of another family, or
    of another layout of the same family."""
    other_family = CASES["glm4v" if case.family == "qwen-vl" else "qwen-vl"]
    check_refused_by(filled.store, other_family.image_processor())
    check_refused_by(filled.store, case.image_processor(**case.layout_changes[0]))
    # The image processor alone reads it whenever its layout is the full processor's.
    alone = case.small().image_processor
    if case.small_full_parameters:
        check_refused_by(filled.store, alone)
    else:
        assert len(mmstore.RolloutDataset(filled.store, alone)) == len(filled.rows)


def test_the_footer_layouts_give_the_dense_sizes(case, filled):
    """``debug.summary`` sizes the pixels a dense pipeline would ship from each file's footer."""
    adapter = mmstore.adapter_for(case.small())
    refs = [ref for row in filled.rows.values() for ref in row.images]
    pixels = sum(math.prod(adapter.pixel_shape(r.width, r.height)) for r in refs)
    total = mmstore.debug.summary(filled.store, by=()).row(0, named=True)
    assert total["images"] == len(refs) == 4 and total["unique_images"] == 3
    assert total["dense_fp32_bytes"] == 4 * pixels


def test_the_wire_resolver_gives_the_processors_tensors(case, filled):
    small = case.small()
    rows = [filled.rows["two"], filled.rows["one"]]
    refs = [ref for row in rows for ref in row.images]
    out = vllm.resolve_wire_refs(filled.store, [mmstore.wire.encode(r) for r in refs], small)
    assert out["hashes"] == [ref.hash for ref in refs]
    expected = mmstore.adapter_for(small).process(filled.images["two"] + filled.images["one"])
    for key, value in expected.items():
        np.testing.assert_array_equal(out[key], value, err_msg=key)


def test_vllm_prompt_holds_one_image_token_per_image(case, tmp_path):
    # vLLM's processors expand each image token of a token prompt themselves (their
    # PromptReplacement of the chat template's one image token), as the family's processor
    # does; so the prompt holds one per image, and the published ids, as vLLM's tokenizer.
    store = mmstore.Store.open(tmp_path / "s", create=True)
    processor = case.published()
    adapter = mmstore.adapter_for(processor)
    originals = store_images(case)[:2]
    media = [store.put_image(image) for image in originals]
    row = rollout(case, processor, "v", media, adapter=adapter)
    with store.writer(run_id="v", step=0) as w:
        w.write(row)
    request = vllm.to_vllm_prompt(store, row)
    template = token_ids(processor, f"{case.text(2)} {case.completion_text}")
    assert request["prompt_token_ids"] == template
    assert template.count(adapter.image_token_id) == 2
    modality = adapter.vllm_modality
    assert set(request["multi_modal_data"]) == set(request["multi_modal_uuids"]) == {modality}
    items = request["multi_modal_data"][modality]
    images = [item["image"] if isinstance(item, dict) else item for item in items]
    for image, original in zip(images, originals, strict=True):
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(original))
    assert request["multi_modal_uuids"][modality] == [m.hash for m in media]
    # Collapsing inverts the expansion: an engine of the same layout gets the stored tokens.
    again, _ = adapter.expand(request["prompt_token_ids"], media)
    assert again == row.tokens


def test_distinct_images_expand_to_the_plain_batches(case, filled):
    # "again" shows the first image of "two": one batch of 4 carries it once.
    small = case.small()
    saved = check_distinct_images(filled.store, small, batch_size=4, runs=["r"], shuffle=False)
    assert saved > 0


def _own_positions(model: Any, adapter: Any, alone: Mapping[str, Any]) -> torch.Tensor:
    """The position ids the model computes for one sample run alone: ``[rows, L]``."""
    ids = alone["input_ids"]
    if adapter.position_rows == 1:  # 1-D RoPE
        return torch.arange(ids.shape[1])[None]
    positions, _ = model.model.get_rope_index(
        ids, alone[adapter.token_type_input], image_grid_thw=alone["image_grid_thw"]
    )
    return positions[:, 0]


@pytest.mark.slow  # a tiny model per case
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_equal_each_sample_alone(case, filled, attn):
    """Each sample's logits in a packed micro-batch equal its logits run alone (fp32, atol
    1e-4): alone, the model computes its own position ids; packed, it takes the micro-batch's
    (M-RoPE: a text row first, which transformers reads sample boundaries from) and they are
    the model's own, restarting at each sample."""
    small = case.small()
    model = case.tiny_model(torch.float32, attn)
    one_by_one = mmstore.RolloutLoader(
        mmstore.RolloutDataset(filled.store, small, dtype=torch.float32, shuffle=False),
        batch_size=1,
    )
    alone = {batch["sample_ids"][0]: batch for batch in one_by_one}
    # Room for the longest and the shortest sample, and the dummy image a micro-batch keeps
    # free for a rank whose share has no image.
    lengths = sorted(len(row.tokens) for row in filled.rows.values())
    dummy = mmstore.adapter_for(small).num_tokens(*mmstore.adapter_for(small).dummy_size)
    checked, packed_many = [], 0
    with torch.no_grad():
        for rank in (0, 1):  # two ranks: token-balanced shares and their filler
            ds = mmstore.RolloutDataset(
                filled.store, small, dtype=torch.float32, rank=rank, world_size=2, seed=1
            )
            loader = mmstore.RolloutLoader(
                ds, batch_size=6, max_tokens=lengths[-1] + lengths[0] + dummy
            )
            for batch in loader:
                logits = model(**model_inputs(loader, batch, model)).logits[0]
                cu = batch["cu_seqlens"].tolist()
                packed_many += len(cu) > 2
                for i, sample_id in enumerate(batch["sample_ids"]):
                    if batch["is_filler"][i]:
                        continue
                    segment = slice(cu[i], cu[i + 1])
                    own = alone[sample_id]
                    assert batch["input_ids"][0, segment].tolist() == own["input_ids"][0].tolist()
                    positions = batch["position_ids"].reshape(-1, cu[-1])[:, segment]
                    if ds.adapter.position_rows > 1:
                        assert positions[0].tolist() == list(range(segment.stop - segment.start))
                        positions = positions[1:]
                    assert torch.equal(positions, _own_positions(model, ds.adapter, own))
                    expected = model(**model_inputs(one_by_one, own)).logits[0]
                    torch.testing.assert_close(logits[segment], expected, atol=1e-4, rtol=0)
                    checked.append(sample_id)
    assert sorted(checked) == sorted(filled.rows)
    assert packed_many > 0, "the store must pack several samples into one micro-batch"
