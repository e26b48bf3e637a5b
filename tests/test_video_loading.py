"""Videos through every way rows reach a model or an engine: packed micro-batches (each
sample's logits equal the sample run alone), distinct batches, the node cache, the live
loader, and vLLM prompts. The layout against the real processor, forged refs and missing
media are tests/test_video_contract.py's; the timestamped families, test_video_timestamped.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

import mmstore
from mmstore import synth
from mmstore._loading import buffers as _buffers
from mmstore.integrations import vllm
from tests.families_common import word_level_tokenizer
from tests.family_cases import QWEN_VL, QWEN_VL_PUBLISHED, WORDS, token_ids

VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
SMALL_VIDEO = {"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}}


def small_video(processor: Any) -> Any:
    """``processor`` with a small video processor (fast), the per-frame cap set explicitly."""
    processor = copy.deepcopy(processor)
    processor.video_processor = Qwen2VLVideoProcessor(
        cap_pixels_per_frame=False, **copy.deepcopy(SMALL_VIDEO)
    )
    return processor


@pytest.fixture(scope="module")
def processor() -> Any:
    return small_video(QWEN_VL.small())


def qwen25_processor() -> Any:
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    ids = {**WORDS, **QWEN_VL.small_ids}
    tokenizer = word_level_tokenizer(ids, QWEN_VL.small_ids, unk="[UNK]", pad="<|endoftext|>")
    return Qwen2_5_VLProcessor(
        image_processor=QWEN_VL.image_processor(),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=False, **SMALL_VIDEO),
    )


def write_rows(
    store: mmstore.Store, processor: Any, rows: list[tuple[str, dict[str, Any]]]
) -> None:
    """One committed step of ``rows``: (prompt text, expand_media keywords) each, a two-token
    completion after it; sample ids s0, s1, ... in order."""
    adapter = mmstore.adapter_for(processor)
    with store.writer("r1", 0, adapter=adapter) as w:
        for i, (text, media) in enumerate(rows):
            expanded = adapter.expand_media(token_ids(processor, f"hello {text} look"), **media)
            n = len(expanded.tokens)
            w.write(
                mmstore.Rollout(
                    sample_id=f"s{i}",
                    group_id=f"g{i // 2}",
                    tokens=[*expanded.tokens, 4, 5],
                    prompt_len=n,
                    loss_mask=[False] * n + [True, True],
                    images=expanded.images,
                    videos=expanded.videos,
                    reward=float(i % 2),
                    advantage=float(i % 2) - 0.5,
                )
            )


@pytest.fixture
def mixed_store(store: mmstore.Store, processor: Any) -> mmstore.Store:
    """Rows with a video, an image and a video, two videos, and text only."""
    clip = store.put_video(synth.screen_recording(1, num_frames=24, width=168, height=112))
    other = store.put_video(synth.screen_recording(2, num_frames=9, width=64, height=96, fps=30))
    image = store.put_image(synth.screenshot(3, 60, 40))
    write_rows(
        store,
        processor,
        [
            (VIDEO_TEXT, {"videos": [clip], "fps": 2.0}),
            (f"{IMAGE_TEXT} {VIDEO_TEXT}", {"images": [image], "videos": [other], "num_frames": 4}),
            (f"{VIDEO_TEXT} {VIDEO_TEXT}", {"videos": [other, clip], "frames": [[0, 8], [3]]}),
            ("", {}),
        ],
    )
    return store


def inputs(loader: mmstore.RolloutLoader, batch: dict[str, Any]) -> dict[str, Any]:
    return {k: batch[k] for k in loader.model_input_names}


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_video_samples_give_the_logits_of_each_sample_alone(mixed_store, processor, attn):
    model = QWEN_VL.tiny_model(torch.float32, attn)
    dataset = mmstore.RolloutDataset(mixed_store, processor, dtype=torch.float32)
    alone = {}
    for batch in mmstore.RolloutLoader(dataset, batch_size=1):
        with torch.no_grad():
            out = model(**inputs(mmstore.RolloutLoader(dataset, batch_size=1), batch))
        alone[batch["sample_ids"][0]] = out.logits[0]
    packed = mmstore.RolloutLoader(dataset, batch_size=4, max_tokens=2048)
    seen = []
    for batch in packed:
        assert batch["video_grid_thw"] is not None
        with torch.no_grad():
            logits = model(**inputs(packed, batch)).logits[0]
        cu = batch["cu_seqlens"].tolist()
        for j, sid in enumerate(batch["sample_ids"]):
            if sid == "<filler>":
                continue
            seen.append(sid)
            torch.testing.assert_close(logits[cu[j] : cu[j + 1]], alone[sid], atol=1e-4, rtol=0)
    assert sorted(seen) == ["s0", "s1", "s2", "s3"]


def test_packed_qwen25_videos_need_the_models_tokens_per_second(store):
    processor = qwen25_processor()
    clip = store.put_video(synth.screen_recording(1, num_frames=12, width=64, height=64))
    write_rows(store, processor, [(VIDEO_TEXT, {"videos": [clip], "fps": 2.0})])
    dataset = mmstore.RolloutDataset(store, processor, dtype=torch.float32)
    padded = next(iter(mmstore.RolloutLoader(dataset, batch_size=1)))
    # Padded batches carry Qwen2.5-VL's temporal spacing: temporal_patch_size / sampled rate.
    assert padded["second_per_grid_ts"].tolist() == [2 / (4 / 12 * 12.0)]
    # Its packed positions step by the model's vision_config.tokens_per_second: without the
    # model's config, refused naming the sample (the packing test gives it).
    with pytest.raises(mmstore.InvalidArgumentError, match=r"model_config=model\.config") as err:
        next(iter(mmstore.RolloutLoader(dataset, batch_size=1, max_tokens=1024)))
    assert err.value.sample_id == "s0" and err.value.run_id == "r1"


def test_a_distinct_batch_carries_a_shared_clip_once_and_expands_to_the_plain_batch(
    store, processor
):
    clip = store.put_video(synth.screen_recording(4, num_frames=20, width=96, height=64))
    write_rows(store, processor, [(VIDEO_TEXT, {"videos": [clip], "fps": 2.0})] * 4)
    dataset = mmstore.RolloutDataset(store, processor, dtype=torch.bfloat16)
    plain = next(iter(mmstore.RolloutLoader(dataset, batch_size=4)))
    shared = next(iter(mmstore.RolloutLoader(dataset, batch_size=4, distinct_images=True)))
    assert shared["video_index"].tolist() == [0, 0, 0, 0]
    assert shared["pixel_values_videos"].shape[0] * 4 == plain["pixel_values_videos"].shape[0]
    expanded = mmstore.expand_images(dict(shared))
    assert "video_index" not in expanded and "video_rows" not in expanded
    for key in ("pixel_values_videos", "video_grid_thw"):
        assert torch.equal(expanded[key], plain[key])
    assert plain["pixel_values_videos"].dtype == torch.bfloat16
    assert plain["video_grid_thw"].dtype == torch.int64


@pytest.mark.slow
def test_the_node_cache_serves_a_clip_equal_to_processing_it(mixed_store, processor, tmp_path):
    def videos(**options: Any) -> list[torch.Tensor]:
        dataset = mmstore.RolloutDataset(mixed_store, processor, dtype=torch.bfloat16, **options)
        return [b["pixel_values_videos"] for b in mmstore.RolloutLoader(dataset, batch_size=2)]

    plain = videos(node_cache_bytes=0)
    cold = videos(node_cache_dir=str(tmp_path / "node"), node_cache_bytes=2**26)
    assert any((tmp_path / "node").iterdir())  # clips were published
    warm = videos(node_cache_dir=str(tmp_path / "node"), node_cache_bytes=2**26)
    for a, b, c in zip(plain, cold, warm, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_live_loader_yields_a_committed_video_step(store, processor):
    clip = store.put_video(synth.screen_recording(5, num_frames=16, width=96, height=64))
    with mmstore.LiveLoader(
        store, processor, runs=["r1"], batch_size=2, dtype="float32", node_cache_bytes=0
    ) as live:
        write_rows(store, processor, [(VIDEO_TEXT, {"videos": [clip], "fps": 2.0})] * 2)
        (batch,) = list(live.next_step(timeout=60))
    assert batch["sample_ids"] == ["s0", "s1"]
    assert batch["video_grid_thw"].tolist() == [[2, 4, 6]] * 2
    model = QWEN_VL.tiny_model(torch.float32, "sdpa")
    with torch.no_grad():
        model(**{k: batch[k] for k in live.model_input_names})


def test_the_live_loader_refuses_videos_its_processor_cannot_lay_out(store, processor):
    clip = store.put_video(synth.screen_recording(5, num_frames=16, width=96, height=64))
    write_rows(store, processor, [(VIDEO_TEXT, {"videos": [clip], "fps": 2.0})] * 2)
    other = small_video(QWEN_VL.small())
    other.video_processor.temporal_patch_size = 4  # other tokens per clip: another layout
    for image_processor in (processor.image_processor, other):  # no video half; another one
        live = mmstore.LiveLoader(store, image_processor, runs=["r1"], batch_size=2)
        for _ in range(2):  # refused on every call, never skipped: nothing is lost
            with pytest.raises(mmstore.LayoutMismatchError, match="videos laid out") as err:
                live.next_step(timeout=5)
            assert err.value.runs == ["r1"]
        assert live.state_dict()["cursor"] == [1, 0, 0]
        live.close()


def test_vllm_prompt_collapses_each_video_span_and_names_its_frames(store):
    processor = small_video(QWEN_VL.published())
    clip = store.put_video(synth.screen_recording(6, num_frames=24, width=168, height=112))
    image = store.put_image(synth.screenshot(7, 60, 40))
    adapter = mmstore.adapter_for(processor)
    video_token, image_token = QWEN_VL_PUBLISHED["<|video_pad|>"], adapter.image_token_id
    prompt = [7, 151652, video_token, 151653, 8, 151652, image_token, 151653, 9, 151652]
    prompt += [video_token, 151653]
    expanded = adapter.expand_media(
        prompt, images=[image], videos=[clip, clip], frames=[[0, 6, 12, 18], [1, 2]]
    )
    rollout = mmstore.Rollout(
        sample_id="v",
        tokens=expanded.tokens,
        prompt_len=len(expanded.tokens),
        loss_mask=[False] * len(expanded.tokens),
        images=expanded.images,
        videos=expanded.videos,
    )
    request = vllm.to_vllm_prompt(store, rollout)
    assert request["prompt_token_ids"] == prompt  # each span back to its one token
    frames, metadata = request["multi_modal_data"]["video"][0]
    assert frames.shape == (4, 112, 168, 3) and frames.dtype == np.uint8
    assert metadata["frames_indices"] == [0, 6, 12, 18] and not metadata["do_sample_frames"]
    assert metadata["fps"] == 12.0 and metadata["total_num_frames"] == 24
    uuids = request["multi_modal_uuids"]["video"]
    assert uuids[0].startswith(clip.hash) and uuids[0] != uuids[1]  # other frames, other item
    assert request["multi_modal_uuids"]["image"] == [image.hash]
    second = expanded.videos[1]
    with pytest.raises(mmstore.InvalidRolloutError, match="cuts video span") as err:
        vllm.to_vllm_prompt(store, rollout, upto=second.offset + 1)
    assert err.value.video_index == 1
    assert (
        vllm.to_vllm_prompt(store, rollout, upto=second.offset)["prompt_token_ids"] == prompt[:10]
    )


def test_a_dataset_refuses_videos_its_processor_did_not_lay_out_before_reading(
    mixed_store, processor
):
    other = copy.deepcopy(processor)
    other.video_processor = Qwen2VLVideoProcessor(
        cap_pixels_per_frame=False, size={"shortest_edge": 56 * 56, "longest_edge": 140 * 140}
    )
    for wrong, says in ((other, "lays videos out as"), (processor.image_processor, "no video")):
        with pytest.raises(mmstore.LayoutMismatchError, match=says) as err:
            mmstore.RolloutDataset(mixed_store, wrong)
        assert err.value.runs == ["r1"] and err.value.num_files == 1


def packable_cases() -> list[Any]:
    from tests.video_cases import TIMESTAMPED_VIDEO_CASES, VIDEO_CASES

    return list({**VIDEO_CASES, **TIMESTAMPED_VIDEO_CASES}.values())


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("case", packable_cases(), ids=str)
def test_every_video_family_packs_samples_as_they_run_alone(store, case, attn):
    """Each family's own positions (Qwen2-VL's and Qwen3-VL's M-RoPE with its per-slab
    timestamps, Qwen2.5-VL's stepping by the model's tokens_per_second, GLM-4.1V's with video
    tokens typed 2 between its markers, Kimi-K2.5's 1-D)."""
    processor = case.small()
    model = case.tiny_model(torch.float32, attn)
    adapter = mmstore.adapter_for(processor, model_config=model.config)
    clip = store.put_video(synth.screen_recording(8, num_frames=24, width=96, height=64))
    other = store.put_video(synth.screen_recording(9, num_frames=12, width=64, height=80, fps=6))
    rows = [(case.text("video"), [clip]), (case.text("video"), [other]), (case.text(), [])]
    with store.writer("r1", 0, adapter=adapter) as w:
        for i, (text, videos) in enumerate(rows):
            expanded = adapter.expand_media(token_ids(processor, text), videos=videos, fps=2.0)
            tail = token_ids(processor, case.completion_text)
            n = len(expanded.tokens)
            w.write(
                mmstore.Rollout(
                    sample_id=f"s{i}",
                    tokens=expanded.tokens + tail,
                    prompt_len=n,
                    loss_mask=[False] * n + [True] * len(tail),
                    videos=expanded.videos,
                )
            )
    dataset = mmstore.RolloutDataset(store, adapter, dtype=torch.float32)
    plain = mmstore.RolloutLoader(dataset, batch_size=1)
    alone = {}
    for batch in plain:
        with torch.no_grad():
            alone[batch["sample_ids"][0]] = model(**inputs(plain, batch)).logits[0]
    packed = mmstore.RolloutLoader(dataset, batch_size=3, max_tokens=4096)
    (batch,) = list(packed)
    with torch.no_grad():
        logits = model(**inputs(packed, batch)).logits[0]
    cu = batch["cu_seqlens"].tolist()
    for j, sid in enumerate(batch["sample_ids"]):
        torch.testing.assert_close(logits[cu[j] : cu[j + 1]], alone[sid], atol=1e-4, rtol=0)
    assert sorted(batch["sample_ids"]) == ["s0", "s1", "s2"]


def test_glm_batches_holding_images_and_videos_are_refused_naming_their_samples(store):
    """transformers' GLM-4V model counts <|image|> inside videos as image tokens too: such a
    batch would fail in the model; the loader says why, and batches apart are fine."""
    from tests.video_cases import TIMESTAMPED_VIDEO_CASES

    case = TIMESTAMPED_VIDEO_CASES["glm4.1v"]
    processor = case.small()
    adapter = mmstore.adapter_for(processor)
    clip = store.put_video(synth.screen_recording(8, num_frames=12, width=96, height=64))
    image = store.put_image(synth.screenshot(9, 64, 64))
    with store.writer("r1", 0, adapter=adapter) as w:
        for sid, text, media in (
            ("img", case.text("image"), {"images": [image]}),
            ("vid", case.text("video"), {"videos": [clip]}),
        ):
            expanded = adapter.expand_media(token_ids(processor, text), fps=2.0, **media)
            n = len(expanded.tokens)
            w.write(
                mmstore.Rollout(
                    sample_id=sid,
                    tokens=expanded.tokens,
                    prompt_len=n,
                    loss_mask=[False] * n,
                    images=expanded.images,
                    videos=expanded.videos,
                )
            )
    dataset = mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False)
    for options in ({}, {"max_tokens": 4096}):
        with pytest.raises(mmstore.InvalidArgumentError, match="images and videos") as err:
            list(mmstore.RolloutLoader(dataset, batch_size=2, **options))
        assert "img" in str(err.value) and "vid" in str(err.value)
    apart = list(mmstore.RolloutLoader(dataset, batch_size=1))
    assert [b["sample_ids"] for b in apart] == [["img"], ["vid"]]


def test_video_batches_from_workers_reuse_the_shared_memory_of_dropped_ones(store, processor):
    """A worker concatenates a batch's clips straight into a shared buffer the trainer has
    let go of (as images): no second copy into fresh shared memory when it sends them."""
    clips = [
        store.put_video(synth.screen_recording(10 + i, num_frames=24, width=112, height=112))
        for i in range(4)
    ]
    write_rows(store, processor, [(VIDEO_TEXT, {"videos": [c], "fps": 4.0}) for c in clips] * 4)
    settings = mmstore.Materialize(dtype=torch.float32, node_cache_bytes=0, cache_bytes=0)
    dataset = mmstore.RolloutDataset(store, processor, seed=0, materialize=settings)
    alone = [b["pixel_values_videos"].clone() for b in mmstore.RolloutLoader(dataset, batch_size=2)]
    assert all(t.numel() * t.element_size() >= _buffers.MIN_BYTES for t in alone)
    files = []
    for i, batch in enumerate(mmstore.RolloutLoader(dataset, batch_size=2, num_workers=2)):
        pixels = batch["pixel_values_videos"]
        assert torch.equal(pixels, alone[i])
        fd, _ = pixels.untyped_storage()._share_fd_cpu_()
        files.append(os.fstat(fd).st_ino)
        del batch, pixels  # the trainer is done with it
    assert len(files) == 8 and len(set(files)) < len(files)
