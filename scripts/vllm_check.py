"""End-to-end check of mmstore.integrations.vllm against a real vLLM engine (GPU machine).

Nothing is downloaded. The script builds a tiny random-weight Qwen2-VL locally: a config,
random bf16 weights, a tokenizer built offline with ``tokenizers`` (a word-level vocabulary
``t0..t151642`` followed by Qwen's special tokens at their real ids 151643..151656, so token
ids from mmstore's synthetic rollouts and ``<|image_pad|>`` = 151655 mean what they mean in
Qwen2-VL) and the image processor's ``preprocessor_config.json``. It writes a GRPO group to a
store, reads a rollout back from its Parquet file, then checks:

1. ``hf_forward``: transformers' Qwen2-VL runs on the stored (expanded) tokens with the
   resolver's pixels: spans and pixels agree (runs on CPU too: ``--hf-only``).
2. ``generate``: vLLM generates from the rollout's prompt (``to_vllm_prompt(upto=
   prompt_len)``) and re-expands it to exactly the stored tokens.
3. ``mm_cache``: a second request with the same image (the group's next sample) hits vLLM's
   multimodal processor cache (``vllm:mm_cache_hits`` grows), keyed by our content hash.
4. ``uuid_only``: the image sent as its uuid alone (data ``None``) is served from that cache
   (reported, not required: older vLLMs refuse ``None`` items).
5. ``rollouts``: a sampled group (``n=3``, top-2 logprobs) becomes rows with
   ``mmvllm.rollouts`` (spans located in vLLM's expanded prompt ids), committed, read back.
6. ``prefill``: ``to_vllm_prefill`` scores the whole rollout; vLLM's prompt is the stored
   tokens and its response logprobs are reported beside the HF ones.
7. ``video_generate``: a rollout whose prompt holds a video clip (``store.put_video``, the
   frames its processor sampled at 2 fps): vLLM takes ``to_vllm_prompt``'s pre-sampled clip
   and re-expands its one ``<|video_pad|>`` to exactly the stored span.

Usage: ``python scripts/vllm_check.py [--workdir DIR] [--hf-only]``. Prints a JSON report;
exits 1 if a check fails. Needs vLLM >= 0.19.1 (``pip install 'mmstore[vllm]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

import mmstore
from mmstore._format.models import table_to_rollouts
from mmstore.integrations import vllm as mmvllm
from mmstore.synth import grpo_rollouts, screen_recording

FIRST_SPECIAL = 151643
SPECIALS = [  # Qwen2-VL's special tokens, in id order from 151643
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
VIDEO_PAD = FIRST_SPECIAL + SPECIALS.index("<|video_pad|>")
MAX_PIXELS = 64 * 28 * 28  # at most 64 image tokens: a tiny vision budget for profiling


def build_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(FIRST_SPECIAL)}
    vocab.update({token: FIRST_SPECIAL + i for i, token in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def build_image_processor() -> Any:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

    kwargs = {"min_pixels": 4 * 28 * 28, "max_pixels": MAX_PIXELS}
    try:
        return Qwen2VLImageProcessor(**kwargs)  # torchvision backend, where installed
    except ImportError:
        return Qwen2VLImageProcessorPil(**kwargs)


def build_model_dir(path: Path) -> Any:
    """config.json + model.safetensors + tokenizer files + preprocessor_config.json."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    tokenizer, image_processor = build_tokenizer(), build_image_processor()
    try:  # the full processor (needs torchvision for its video processor), as vLLM loads it
        from transformers.models.qwen2_vl import Qwen2VLVideoProcessor

        Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(),
        ).save_pretrained(path)
    except (ImportError, AttributeError):  # CPU box without torchvision: enough for HF
        tokenizer.save_pretrained(path)
        image_processor.save_pretrained(path)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,  # head_dim 64
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            # M-RoPE: sections sum to head_dim / 2
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [8, 12, 12],
            },
        },
        vision_config={
            "depth": 2,
            "embed_dim": 128,
            "num_heads": 2,  # head_dim 64
            "hidden_size": 256,  # the text hidden size the merger projects to
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    return image_processor


def stored_rollouts(root: Path, image_processor: Any) -> list[mmstore.Rollout]:
    """One GRPO group (shared prompt image) written to a store and read back from Parquet."""
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(image_processor)
    rows = grpo_rollouts(
        store, adapter, groups=1, group_size=3, images_per_sample=1,
        image_size=(200, 150), kind="photo", completion_len=16,
    )  # fmt: skip
    with store.writer(run_id="check", step=0, adapter=adapter) as writer:
        for row in rows:
            writer.write(row)
    (part,) = store.rollout_files()
    return table_to_rollouts(pq.read_table(store.backend.abspath(part.path)))


def hf_forward(model_dir: Path, store: mmstore.Store, rollout: mmstore.Rollout) -> list[float]:
    """Response-token logprobs from transformers, pixels from the wire-ref resolver."""
    import torch
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    processor = AutoImageProcessor.from_pretrained(model_dir)
    inputs = mmvllm.resolve_wire_refs(
        store, [mmstore.wire.encode(ref) for ref in rollout.images], processor
    )
    if "error" in inputs:
        raise AssertionError(f"resolver refused a stored ref: {inputs}")
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    image_tokens = torch.zeros(1, len(rollout.tokens), dtype=torch.int64)  # 1 marks image
    for ref in rollout.images:
        image_tokens[0, ref.offset : ref.offset + ref.length] = 1
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([rollout.tokens]),
            mm_token_type_ids=image_tokens,
            pixel_values=torch.from_numpy(inputs["pixel_values"]),
            image_grid_thw=torch.from_numpy(inputs["image_grid_thw"]),
        ).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    n = len(rollout.tokens)
    return [float(logprobs[k - 1, rollout.tokens[k]]) for k in range(rollout.prompt_len, n)]


def stored_video_rollout(root: Path, image_processor: Any) -> mmstore.Rollout:
    """A rollout with a video clip in its prompt, laid out by the video processor the model
    directory saves (Qwen2VLVideoProcessor's defaults), written and read back."""
    from transformers.models.qwen2_vl import Qwen2VLVideoProcessor

    store = mmstore.Store.open(root)
    adapter = mmstore.adapter_for(image_processor, video_processor=Qwen2VLVideoProcessor())
    clip = store.put_video(screen_recording(seed=1, num_frames=24, width=160, height=96, fps=12))
    video = adapter.video.video_token_id
    start, end = (FIRST_SPECIAL + SPECIALS.index(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    prompt = [5, 6, start, video, end, 7, 8]
    expanded = adapter.expand_media(prompt, videos=[clip], fps=2.0)
    n = len(expanded.tokens)
    with store.writer(run_id="check-video", step=0, adapter=adapter) as writer:
        writer.write(
            mmstore.Rollout(
                sample_id="video-0",
                tokens=[*expanded.tokens, 11, 12],
                prompt_len=n,
                loss_mask=[False] * n + [True, True],
                videos=expanded.videos,
            )
        )
    (rollout,) = store.rollouts("check-video")
    return rollout


def mm_cache_counters(llm: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:mm_cache_hits", "vllm:mm_cache_queries"):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals


def vllm_checks(
    model_dir: Path, store: mmstore.Store, rollouts: list[mmstore.Rollout], report: dict[str, Any]
) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    report["vllm_version"] = vllm.__version__
    llm = LLM(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 2, "video": 1},
        disable_log_stats=False,  # the mm cache counters are stats
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first, second = rollouts[0], rollouts[1]

    before = mm_cache_counters(llm)
    prompt = mmvllm.to_vllm_prompt(store, first, upto=first.prompt_len)
    (out,) = llm.generate(prompt, greedy)
    report["generate"] = {
        "ok": list(out.prompt_token_ids) == first.tokens[: first.prompt_len],
        "prompt_tokens_sent": len(prompt["prompt_token_ids"]),
        "prompt_tokens_engine": len(out.prompt_token_ids),
        "stored_prompt_tokens": first.prompt_len,
        "generated": list(out.outputs[0].token_ids),
    }

    middle = mm_cache_counters(llm)
    assert second.images[0].hash == first.images[0].hash, "the group shares its image"
    (out2,) = llm.generate(mmvllm.to_vllm_prompt(store, second, upto=second.prompt_len), greedy)
    after = mm_cache_counters(llm)
    hits = after.get("vllm:mm_cache_hits", 0.0) - middle.get("vllm:mm_cache_hits", 0.0)
    report["mm_cache"] = {
        "ok": hits >= len(second.images)
        and list(out2.prompt_token_ids) == second.tokens[: second.prompt_len],
        "hits_on_second_request": hits,
        "counters": {"before": before, "after_first": middle, "after_second": after},
    }

    uuid_only = dict(prompt, multi_modal_data={"image": [None] * len(first.images)})
    try:
        (out3,) = llm.generate(uuid_only, greedy)
        report["uuid_only"] = {"served": list(out3.prompt_token_ids) == list(out.prompt_token_ids)}
    except Exception as exc:  # older vLLMs require the data itself
        report["uuid_only"] = {"served": False, "why": f"{type(exc).__name__}: {exc}"[:300]}

    video = report.pop("_video_rollout")
    (out4,) = llm.generate(mmvllm.to_vllm_prompt(store, video, upto=video.prompt_len), greedy)
    report["video_generate"] = {
        "ok": list(out4.prompt_token_ids) == video.tokens[: video.prompt_len],
        "prompt_tokens_engine": len(out4.prompt_token_ids),
        "stored_prompt_tokens": video.prompt_len,
        "video_span": (video.videos[0].offset, video.videos[0].length),
    }

    # The engine's own output -> rows: a group of 3 sampled completions with top-2 logprobs,
    # located in vLLM's (expanded) prompt ids, committed and read back.
    media = list(first.images)  # refs name their media as put_image's MediaRef does
    sampled = SamplingParams(max_tokens=8, temperature=1.0, n=3, logprobs=2, seed=0)
    (group,) = llm.generate(prompt, sampled)
    try:
        adapter = mmstore.adapter_for(build_image_processor())
        rows = mmvllm.rollouts(group, adapter, media, group_id="vllm-g", topk=2)
        with store.writer("vllm-rollouts", 0, columns=mmvllm.topk_columns(2)) as w:
            w.write_many(rows)
        back = store.rollouts(run_id="vllm-rollouts")
        report["rollouts"] = {
            "ok": len(back) == 3
            and all(r.tokens[: r.prompt_len] == list(group.prompt_token_ids) for r in back),
            "completion_tokens": [len(r.tokens) - r.prompt_len for r in back],
        }
    except Exception as exc:
        report["rollouts"] = {"ok": False, "why": f"{type(exc).__name__}: {exc}"[:500]}

    request = mmvllm.to_vllm_prefill(store, first)
    (scored,) = llm.generate(request["prompt"], SamplingParams(**request["sampling_params"]))
    tokens = first.tokens
    logprobs = [
        scored.prompt_logprobs[k][tokens[k]].logprob for k in range(first.prompt_len, len(tokens))
    ]
    hf = report["hf_forward"]["response_logprobs"]
    report["prefill"] = {
        "ok": list(scored.prompt_token_ids) == tokens and len(logprobs) == len(hf),
        "max_abs_diff_vs_hf_fp32": max(abs(a - b) for a, b in zip(logprobs, hf, strict=True)),
    }


def run(workdir: Path, hf_only: bool) -> dict[str, Any]:
    report: dict[str, Any] = {}
    model_dir = workdir / "tiny-qwen2-vl"
    image_processor = build_model_dir(model_dir)
    report["model_dir"] = sorted(p.name for p in model_dir.iterdir())
    rollouts = stored_rollouts(workdir / "store", image_processor)
    store = mmstore.Store.open(workdir / "store")
    first = rollouts[0]
    report["rollout"] = {
        "tokens": len(first.tokens), "prompt_len": first.prompt_len,
        "image_spans": [(r.offset, r.length) for r in first.images],
    }  # fmt: skip
    response = hf_forward(model_dir, store, first)
    report["hf_forward"] = {"ok": len(response) == len(first.tokens) - first.prompt_len,
                            "response_logprobs": response}  # fmt: skip
    video = stored_video_rollout(workdir / "store", image_processor)
    # The prompt vLLM gets, built here too: a CPU run checks everything up to the engine.
    sent = mmvllm.to_vllm_prompt(store, video, upto=video.prompt_len)
    report["video_prompt"] = {
        "ok": sent["prompt_token_ids"].count(VIDEO_PAD) == 1,  # the span, collapsed
        "frames": list(video.videos[0].frames),
        "uuid": sent["multi_modal_uuids"]["video"][0],
    }
    if not hf_only:
        report["_video_rollout"] = video
        vllm_checks(model_dir, store, rollouts, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="default: a fresh temporary directory")
    parser.add_argument("--hf-only", action="store_true", help="skip vLLM (CPU is enough)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm_check-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            report = run(workdir, args.hf_only)
        except Exception:
            traceback.print_exc()
            return 1
    failed = [
        name for name, part in report.items() if isinstance(part, dict) and part.get("ok") is False
    ]
    report["failed"] = failed
    print(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
