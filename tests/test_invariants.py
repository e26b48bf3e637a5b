"""Property tests of the row invariants and of span-safe truncation.

Valid rows are built the way rollout code builds them (text tokens, one placeholder per image,
``adapter.expand``); each kind of corruption is then applied to a valid row and must be refused
by ``check_rollout`` naming the sample and, where it concerns one image, its index.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._format.models import MediaRef, Rollout, rollouts_to_table, table_to_rollouts
from mmstore._rows.invariants import check_rollout, truncate

# A small pixel budget keeps spans short (4..64 tokens) with the real Qwen2-VL resize rule.
ADAPTER = mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=64 * 28 * 28))
IMG = ADAPTER.image_token_id
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text_tokens = st.integers(0, 151_000).filter(lambda t: t != IMG)
hashes = st.text("0123456789abcdef", min_size=32, max_size=32)


@st.composite
def image_sizes(draw: st.DrawFn) -> tuple[int, int]:
    width = draw(st.integers(1, 900))
    # Keep the aspect ratio within the 1:200 the layout allows.
    height = draw(st.integers(max(1, -(-width // 200)), min(900, width * 200)))
    return width, height


@st.composite
def valid_rows(draw: st.DrawFn, min_images: int = 0, min_text: int = 0) -> Rollout:
    n_images = draw(st.integers(min_images, 4))
    # Text between every two images: Qwen-VL images that touch read as one (refused).
    chunks = [
        draw(st.lists(text_tokens, min_size=int(0 < i < n_images), max_size=6))
        for i in range(n_images + 1)
    ]
    while sum(map(len, chunks)) < min_text:
        chunks[-1].append(draw(text_tokens))
    ids = list(chunks[0])
    for chunk in chunks[1:]:
        ids += [IMG, *chunk]
    media = [
        MediaRef(hash=h, uri=f"media/{h[:2]}/{h[2:4]}/{h}.png", width=w, height=h_)
        for h, (w, h_) in ((draw(hashes), draw(image_sizes())) for _ in range(n_images))
    ]
    tokens, refs = ADAPTER.expand(ids, media)
    refs = [
        ref.model_copy(update={"payload": draw(st.none() | st.text(max_size=8))}) for ref in refs
    ]
    n = len(tokens)
    floats = st.floats(-1e6, 1e6, width=32)
    # Per-token columns come from one drawn generator: drawing hundreds of elements one by one
    # costs most of the test time and finds nothing the invariants care about.
    rng = random.Random(draw(st.integers(0, 2**32)))
    return Rollout(
        sample_id=draw(st.text(min_size=1, max_size=10)),
        group_id=draw(st.none() | st.text(max_size=6)),
        tokens=tokens,
        prompt_len=draw(st.integers(0, n)),
        loss_mask=[rng.random() < 0.5 for _ in range(n)],
        logprobs=None if draw(st.booleans()) else [-50 * rng.random() for _ in range(n)],
        reward=draw(st.none() | floats),
        advantage=draw(st.none() | floats),
        images=refs,
        metadata=draw(
            st.none() | st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4))
        ),
    )


# --- valid rows ---------------------------------------------------------------------------


@pytest.mark.slow  # hypothesis
@SETTINGS
@given(valid_rows())
def test_valid_rows_pass_and_round_trip_through_arrow(row):
    check_rollout(row)
    check_rollout(row, image_token_ids=[IMG])
    table = rollouts_to_table([row])
    assert table.schema.equals(mmstore.ROLLOUT_SCHEMA)
    assert table_to_rollouts(table) == [row]
    for batch in table.to_batches():
        assert table_to_rollouts(batch) == [row]


@pytest.mark.slow  # hypothesis
@SETTINGS
@given(st.lists(valid_rows(), min_size=1, max_size=4))
def test_many_rows_round_trip_in_order(rows):
    assert table_to_rollouts(rollouts_to_table(rows)) == rows


# --- corruptions --------------------------------------------------------------------------


def _with_image(row: Rollout, index: int, **update: object) -> Rollout:
    images = list(row.images)
    images[index] = images[index].model_copy(update=update)
    return row.model_copy(update={"images": images})


def _refused(
    row: Rollout,
    match: str,
    image_index: int | None,
    check: Callable[[Rollout], None] = check_rollout,
) -> None:
    with pytest.raises(mmstore.InvalidRolloutError, match=match) as info:
        check(row)
    assert info.value.sample_id == row.sample_id
    if image_index is None:
        assert "image_index" not in info.value.context
    else:
        assert info.value.image_index == image_index


@SETTINGS
@given(valid_rows(min_images=2), st.data())
def test_overlapping_spans_are_refused(row, data):
    i = data.draw(st.integers(1, len(row.images) - 1))
    prev = row.images[i - 1]
    back = data.draw(st.integers(1, prev.length))
    bad = _with_image(row, i, offset=prev.offset + prev.length - back)
    _refused(bad, "overlaps the previous image", i)


@SETTINGS
@given(valid_rows(min_images=2), st.data())
def test_unsorted_spans_are_refused(row, data):
    i = data.draw(st.integers(1, len(row.images) - 1))
    images = list(row.images)
    images[i - 1], images[i] = images[i], images[i - 1]
    _refused(row.model_copy(update={"images": images}), "not sorted", i)


@SETTINGS
@given(valid_rows(min_images=1), st.integers(1, 50))
def test_spans_outside_the_tokens_are_refused(row, beyond):
    last = len(row.images) - 1
    ref = row.images[last]
    bad = _with_image(row, last, offset=len(row.tokens) - ref.length + beyond)
    _refused(bad, "outside the", last)


@SETTINGS
@given(valid_rows(min_images=1), st.data())
def test_wrong_token_inside_a_span_is_refused(row, data):
    i = data.draw(st.integers(0, len(row.images) - 1))
    ref = row.images[i]
    pos = data.draw(st.integers(ref.offset, ref.offset + ref.length - 1))
    tokens = list(row.tokens)
    tokens[pos] = data.draw(text_tokens)
    _refused(row.model_copy(update={"tokens": tokens}), f"position {pos} inside the span", i)


@SETTINGS
@given(valid_rows(min_images=1), st.data())
def test_wrong_span_length_is_refused(row, data):
    i = data.draw(st.integers(0, len(row.images) - 1))
    ref = row.images[i]
    shorter = data.draw(st.integers(1, ref.length - 1))
    _refused(_with_image(row, i, length=shorter), "span length", i)
    # The same span claimed for an image of another size is just as wrong.
    other = data.draw(image_sizes().filter(lambda s: ADAPTER.num_tokens(*s) != ref.length))
    _refused(_with_image(row, i, width=other[0], height=other[1]), "span length", i)


@SETTINGS
@given(valid_rows(min_text=1), st.data())
def test_stray_placeholder_outside_spans_is_refused(row, data):
    in_span = {p for ref in row.images for p in range(ref.offset, ref.offset + ref.length)}
    text_positions = [p for p in range(len(row.tokens)) if p not in in_span]
    pos = data.draw(st.sampled_from(text_positions))
    tokens = list(row.tokens)
    tokens[pos] = IMG
    bad = row.model_copy(update={"tokens": tokens})
    _refused(bad, f"at position {pos} lies outside every image span", None, check_known_token)
    if row.images:  # the images' own layout already names the placeholder token
        _refused(bad, f"at position {pos} lies outside", None)


def check_known_token(row: Rollout) -> None:
    check_rollout(row, image_token_ids=[IMG])


@SETTINGS
@given(valid_rows(), st.integers(-3, 3).filter(bool))
def test_loss_mask_length_mismatch_is_refused(row, delta):
    mask = row.loss_mask + [True] * delta if delta > 0 else row.loss_mask[:delta]
    if len(mask) == len(row.tokens):  # empty row, nothing to drop
        return
    _refused(row.model_copy(update={"loss_mask": mask}), "loss_mask has", None)


@SETTINGS
@given(valid_rows(min_text=1), st.integers(-3, 3).filter(bool))
def test_logprobs_length_mismatch_is_refused(row, delta):
    logprobs = list(row.logprobs or [0.0] * len(row.tokens))
    logprobs = logprobs + [-1.0] * delta if delta > 0 else logprobs[:delta]
    _refused(row.model_copy(update={"logprobs": logprobs}), "logprobs has", None)


@SETTINGS
@given(valid_rows(), st.integers(1, 100))
def test_prompt_len_beyond_the_tokens_is_refused(row, beyond):
    bad = row.model_copy(update={"prompt_len": len(row.tokens) + beyond})
    _refused(bad, "prompt_len", None)


@SETTINGS
@given(valid_rows(min_images=1), st.data())
def test_unknown_fingerprint_is_refused(row, data):
    i = data.draw(st.integers(0, len(row.images) - 1))
    fingerprint = data.draw(st.text("0123456789abcdef", min_size=16, max_size=16))
    if fingerprint == ADAPTER.fingerprint:
        return
    _refused(_with_image(row, i, layout_fingerprint=fingerprint), "unknown layout fingerprint", i)


@SETTINGS
@given(valid_rows(min_images=1), st.data())
def test_family_mismatch_is_refused(row, data):
    i = data.draw(st.integers(0, len(row.images) - 1))
    family = data.draw(st.text(min_size=1, max_size=8).filter(lambda f: f != ADAPTER.family))
    _refused(_with_image(row, i, family=family), "family", i)


def test_first_violation_is_reported_with_its_image_index():
    media = [MediaRef(hash=f"{i:032x}", uri=f"m{i}.png", width=56, height=56) for i in range(3)]
    tokens, refs = ADAPTER.expand([1, IMG, 2, IMG, 3, IMG], media)
    row = Rollout(
        sample_id="s-42", tokens=tokens, prompt_len=0, loss_mask=[1] * len(tokens), images=refs
    )
    check_rollout(row)
    _refused(_with_image(row, 2, family="other"), "family", 2)


# --- truncation ---------------------------------------------------------------------------


@SETTINGS
@given(valid_rows(), st.integers(1, 400))
def test_truncation_keeps_a_prefix_of_whole_images(row, max_len):
    n = len(row.tokens)
    first = row.images[0] if row.images else None
    straddles_at_zero = (
        first is not None and first.offset == 0 and first.length > max_len and n > max_len
    )
    if straddles_at_zero:
        with pytest.raises(mmstore.InvalidRolloutError, match="leaves nothing") as info:
            truncate(row, max_len)
        assert (info.value.sample_id, info.value.image_index) == (row.sample_id, 0)
        return

    out = truncate(row, max_len)
    cut = len(out.tokens)
    assert cut <= max_len
    assert cut > 0 or n == 0
    # A prefix of every per-token column.
    assert out.tokens == row.tokens[:cut]
    assert out.loss_mask == row.loss_mask[:cut]
    assert out.logprobs == (None if row.logprobs is None else row.logprobs[:cut])
    assert out.prompt_len == min(row.prompt_len, cut)
    # Only whole images, and as many of them as fit.
    kept = len(out.images)
    assert out.images == row.images[:kept]
    assert all(ref.offset + ref.length <= cut for ref in out.images)
    assert not any(ref.offset < cut < ref.offset + ref.length for ref in row.images)
    if kept < len(row.images):
        nxt = row.images[kept]
        assert nxt.offset + nxt.length > max_len
        assert cut == min(nxt.offset, max_len)  # the cut moves back only to spare a span
    else:
        assert cut == min(n, max_len)
    # The other columns are untouched and the result is a valid row.
    assert (out.sample_id, out.reward, out.metadata) == (row.sample_id, row.reward, row.metadata)
    check_rollout(out)
    if n <= max_len:
        assert out == row


def test_truncation_moves_the_cut_before_a_straddling_image():
    media = [MediaRef(hash=f"{i:032x}", uri=f"m{i}.png", width=56, height=56) for i in range(2)]
    tokens, refs = ADAPTER.expand([7, IMG, 8, 9, IMG, 10], media)  # spans [1,5) and [7,11)
    row = Rollout(
        sample_id="t",
        tokens=tokens,
        prompt_len=6,
        loss_mask=[1] * 12,
        logprobs=[-0.5] * 12,
        images=refs,
    )
    out = truncate(row, 9)
    assert out.tokens == [7, IMG, IMG, IMG, IMG, 8, 9]
    assert out.images == refs[:1]
    assert out.prompt_len == 6
    assert truncate(row, 11).images == refs
    assert truncate(row, 12) == row


def test_truncation_to_nothing_is_an_error():
    media = [MediaRef(hash="0" * 32, uri="m.png", width=56, height=56)]
    tokens, refs = ADAPTER.expand([IMG, 1, 2], media)
    row = Rollout(sample_id="z", tokens=tokens, prompt_len=0, loss_mask=[1] * 6, images=refs)
    with pytest.raises(mmstore.InvalidRolloutError, match="leaves nothing") as info:
        truncate(row, 3)
    assert (info.value.sample_id, info.value.image_index) == ("z", 0)
    with pytest.raises(ValueError, match="positive"):
        truncate(row, 0)
