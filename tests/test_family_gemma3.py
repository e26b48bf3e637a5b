"""What only Gemma 3 does; the contract every family keeps is ``tests/test_family_contract.py``.

Gemma 3 squashes every image to one fixed size and wraps a fixed count of soft tokens in
text: ``"\\n\\n" <start_of_image> <image_soft_token> * n <end_of_image> "\\n\\n"``. Its
processors are transformers' own (``Gemma3Processor`` over ``Gemma3ImageProcessorPil`` or
the torchvision ``Gemma3ImageProcessor``), with the offline tokenizer of
``tests/family_cases.py``.
"""

from __future__ import annotations

import pytest
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

import mmstore
from tests.families_common import gradient, media_ref
from tests.family_cases import (
    GEMMA3,
    GEMMA3_PUBLISHED,
    GEMMA3_PUBLISHED_SEQ,
    GEMMA3_SEQ,
    GEMMA3_SIDE,
    GEMMA3_SMALL,
    gemma3_expansion,
    gemma3_processor,
    rollout,
)

PUBLISHED_SPAN = gemma3_expansion(GEMMA3_PUBLISHED, GEMMA3_PUBLISHED_SEQ)


def test_every_size_becomes_the_same_wrapped_soft_tokens():
    adapter = mmstore.adapter_for(GEMMA3.published())  # 896x896, 256 soft tokens
    for width, height in [(1, 1), (640, 480), (8000, 40)]:
        assert adapter.expansion(width, height) == PUBLISHED_SPAN
        assert adapter.num_tokens(width, height) == 260
        assert adapter.placeholder(width, height)["pixel_values"].shape == (1, 3, 896, 896)
    assert adapter.feature_token_id == GEMMA3_PUBLISHED["soft"]
    # The wrapper's "\n\n" is ordinary text: only boi, eoi and the soft tokens are image-only.
    assert GEMMA3_PUBLISHED["nl2"] not in adapter.special_token_ids


def test_two_images_each_get_the_whole_wrapper():
    processor = GEMMA3.published()
    adapter = mmstore.adapter_for(processor)
    boi = GEMMA3_PUBLISHED["boi"]
    out = processor(
        text=["hi <start_of_image> ok <start_of_image> there"],
        images=[[gradient(30, 20), gradient(5, 900)]],
        return_tensors="np",
    )
    assert [int(t) for t in out["input_ids"][0]] == [3, *PUBLISHED_SPAN, 5, *PUBLISHED_SPAN, 4]
    tokens, refs = adapter.expand([3, boi, 5, boi, 4], [media_ref(30, 20), media_ref(5, 900, 1)])
    assert tokens == [int(t) for t in out["input_ids"][0]]
    assert [(r.offset, r.length) for r in refs] == [(1, 260), (262, 260)]


def test_the_full_processors_soft_token_count_is_a_layout_parameter():
    small = GEMMA3.small()
    adapter = mmstore.adapter_for(small)
    assert adapter.expansion(10, 10) == gemma3_expansion(GEMMA3_SMALL, GEMMA3_SEQ)
    # image_seq_length is the processor's, not the image processor's: it moves the fingerprint.
    assert adapter.layout.param("image_seq_length") == GEMMA3_SEQ
    image_only = mmstore.adapter_for(small.image_processor)
    assert image_only.layout.param("image_seq_length") == GEMMA3_PUBLISHED_SEQ
    assert adapter.fingerprint != image_only.fingerprint
    full_published_count = gemma3_processor(small.image_processor, GEMMA3_SMALL, 256)
    assert mmstore.adapter_for(full_published_count).fingerprint == image_only.fingerprint


# --- settings the family refuses ---------------------------------------------------------


@pytest.mark.parametrize("backend", [Gemma3ImageProcessorPil, Gemma3ImageProcessor])
def test_pan_and_scan_is_refused(backend):
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_pan_and_scan"):
        mmstore.adapter_for(backend(do_pan_and_scan=True))
    with pytest.raises(mmstore.UnsupportedProcessorError, match="do_pan_and_scan"):
        mmstore.adapter_for(gemma3_processor(backend(do_pan_and_scan=True)))


def test_a_processor_switched_to_pan_and_scan_later_is_refused_at_processing():
    processor = Gemma3ImageProcessorPil(size={"height": GEMMA3_SIDE, "width": GEMMA3_SIDE})
    adapter = mmstore.adapter_for(processor)
    processor.do_pan_and_scan = True
    processor.pan_and_scan_min_crop_size = 8
    processor.pan_and_scan_max_num_crops = 4
    processor.pan_and_scan_min_ratio_to_activate = 1.2
    with pytest.raises(mmstore.LayoutMismatchError, match="pan-and-scan"):
        adapter.process([gradient(90, 30)])


def test_a_size_that_keeps_the_aspect_ratio_is_refused():
    # Pixels would vary in shape from image to image; every Gemma 3 image has one size.
    with pytest.raises(mmstore.UnsupportedProcessorError, match="shortest_edge"):
        mmstore.adapter_for(Gemma3ImageProcessorPil(size={"shortest_edge": 224}))


def test_a_tokenizer_without_one_double_newline_token_is_refused():
    with pytest.raises(mmstore.UnsupportedProcessorError, match="not one token"):
        mmstore.adapter_for(gemma3_processor(Gemma3ImageProcessorPil(), with_nl2=False))


def test_a_processor_with_another_image_wrapper_is_refused():
    changed = gemma3_processor(GEMMA3.image_processor(), GEMMA3_SMALL)
    changed.full_image_sequence = changed.full_image_sequence.strip("\n")
    with pytest.raises(mmstore.UnsupportedProcessorError, match="full_image_sequence"):
        mmstore.adapter_for(changed)


# --- spans in the writer -----------------------------------------------------------------


def test_soft_tokens_without_their_wrapper_are_refused(store):
    small = GEMMA3.small()
    adapter = mmstore.adapter_for(small)
    good = rollout(GEMMA3, small, "s", [store.put_image(gradient(20, 20))])
    soft = [GEMMA3_SMALL["soft"]] * GEMMA3_SEQ
    bare = good.model_copy(update={"tokens": [2, 3, 3, *soft, 3, 3, 5, 4]})
    with store.writer(run_id="r", step=0, adapter=adapter) as w:
        with pytest.raises(mmstore.InvalidRolloutError):
            w.write(bare)
        w.write(good)


def test_double_newlines_next_to_a_span_are_ordinary_text(store):
    # Token-level expansion never merges the wrapper's "\n\n" with the prompt's (a text-level
    # BPE tokenization would): the neighbours stay as given and the span stays exact.
    adapter = mmstore.adapter_for(GEMMA3.small())
    nl2, boi = GEMMA3_SMALL["nl2"], adapter.image_token_id
    media = store.put_image(gradient(20, 20))
    tokens, refs = adapter.expand([2, nl2, boi, nl2, nl2, 4], [media])
    assert tokens == [2, nl2, *gemma3_expansion(GEMMA3_SMALL, GEMMA3_SEQ), nl2, nl2, 4]
    row = mmstore.Rollout(
        sample_id="nl", tokens=tokens, prompt_len=4, loss_mask=[0] * len(tokens), images=refs
    )
    with store.writer(run_id="n", step=0, adapter=adapter) as w:
        w.write(row)
