"""A GRPO loop on mmstore: write rollouts, train on packed micro-batches, checkpoint, resume.

    python examples/grpo_loop.py --store runs/store --ckpt runs/ckpt.pt   # kill it, run again

Each generation ``g``: the rollout side shows the policy a synthetic UI screenshot and the
task "click <k>" through the family's chat template (``mmstore.chat``: the image stored once
by content, its span located in the processor's ids), samples a GRPO group of completions
with the policy's own ``generate`` (``mmstore.integrations.hf.rollouts``: each completion a
row, with the logprob the sampler drew each token with), scores each token under the
reference policy (the initial weights) into the per-token column ``ref_logprobs``, and
writes run ``gen-<g>``. The trainer then makes one pass over that run, one optimizer step
per loader step, with a PPO/GRPO clipped objective against the stored behaviour logprobs
and a KL penalty to the reference read from the batch (``columns=["ref_logprobs"]``). Every
``--ckpt-every`` steps it saves model, optimizer and ``loader.state_dict()`` in one file
(atomically), pins the rows the rest of the pass needs and releases older generations;
``gc`` runs after every step. A rerun resumes from the file (it prints ``{"resumed": N}``,
N the checkpoint's step) and ends on the same weights, bit for bit (CPU, deterministic). A
rerun of a finished run prints ``{"finished": N}`` and changes nothing. Each optimizer step
prints its loss. ``--replay`` then exports the last checkpoint's window and computes its
first step's loss from both stores.

The model is a tiny random-weight Qwen2-VL (``--family glm4v``: GLM-4.1V) built from a
config, with a processor whose tokenizer is built offline (word-level, the family's
special tokens at their published ids) and a small chat template shaped like the family's:
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from itertools import compress
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
import mmstore.integrations.hf

PIN_PREFIX = "grpo-ckpt-"
KL = 0.01  # the KL penalty's weight
# The per-token column the rollout side writes and the loss reads.
COLUMNS = {"ref_logprobs": mmstore.per_token("float32")}
WORDS = ["[UNK]", "user", "assistant", "click", "0", "1", "2", "3"]


def offline_tokenizer(special: dict[str, int]) -> Any:
    """A word-level tokenizer of :data:`WORDS` and the family's special tokens at their
    published ids (what a real run loads with ``AutoProcessor.from_pretrained``)."""
    backend = Tokenizer(models.WordLevel({**{w: i for i, w in enumerate(WORDS)}, **special},
                                         unk_token="[UNK]"))  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[UNK]")


def chat_template(user: str, end: str, assistant: str, image: str) -> str:
    """A chat template shaped like the family's: each message, its images where they are."""
    return (
        "{% for m in messages %}" + user.replace("ROLE", "{{ m.role }}")
        + "{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% else %}" + image
        + "{% endif %}{% endfor %}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + assistant + "{% endif %}"
    )  # fmt: skip


def qwen2_vl() -> tuple[torch.nn.Module, Any]:
    """A tiny random-weight Qwen2-VL and its processor (small screenshots)."""
    text = dict(vocab_size=151680, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=151655,
                           video_token_id=151656, vision_start_token_id=151652)  # fmt: skip
    special = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
               "<|vision_end|>": 151653, "<|image_pad|>": 151655,
               "<|video_pad|>": 151656}  # fmt: skip
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(max_pixels=160 * 120),  # torchvision: fast
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=offline_tokenizer(special),
        chat_template=chat_template("<|im_start|>ROLE ", "<|im_end|> ", "<|im_start|>assistant ",
                                    "<|vision_start|><|image_pad|><|vision_end|>"),
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(config), processor


def glm4v() -> tuple[torch.nn.Module, Any]:
    """The same for GLM-4.1V (its published token ids)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vProcessor
    from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.5}  # fmt: skip
    text = dict(vocab_size=151352, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, image_size=28)  # fmt: skip
    config = Glm4vConfig(text_config=text, vision_config=vision, image_token_id=151343,
                         video_token_id=151344, image_start_token_id=151339,
                         image_end_token_id=151340, video_start_token_id=151341,
                         video_end_token_id=151342)  # fmt: skip
    size = {"shortest_edge": 112 * 112, "longest_edge": 160 * 120}
    special = {"<|user|>": 151336, "<|assistant|>": 151337, "<|begin_of_image|>": 151339,
               "<|end_of_image|>": 151340, "<|begin_of_video|>": 151341,
               "<|end_of_video|>": 151342, "<|image|>": 151343, "<|video|>": 151344}  # fmt: skip
    processor = Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=size),
        video_processor=Glm4vVideoProcessor(),
        tokenizer=offline_tokenizer(special),
        chat_template=chat_template("<|ROLE|> ", " ", "<|assistant|> ",
                                    "<|begin_of_image|><|image|><|end_of_image|>"),
    )  # fmt: skip
    return Glm4vForConditionalGeneration(config), processor


FAMILIES = {"qwen2-vl": qwen2_vl, "glm4v": glm4v}


def build_model(family: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """The family's tiny model (random weights from ``seed``: the reference policy is the
    model as built) and its processor."""
    torch.manual_seed(seed)
    model, processor = FAMILIES[family]()
    model.set_attn_implementation("eager")
    return model, processor


# ---------------------------------------------------------------- rollout side


def token_logprobs(model: torch.nn.Module, inputs: dict[str, Any], mask: torch.Tensor) -> Any:
    """log p(token t | tokens < t) for every t with ``mask[:, t]`` set (t >= 1), in order.

    Only those positions go through the 151k-wide LM head."""
    hidden = model.model(**inputs).last_hidden_state[:, :-1][mask[:, 1:]]
    logp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
    return logp.gather(-1, inputs["input_ids"][:, 1:][mask[:, 1:]][:, None])[:, 0]


def write_rollouts(store, model, processor, run: str, args: argparse.Namespace) -> None:
    """Generation ``run``: ``--steps-per-gen`` store steps of ``--prompts`` groups of ``-G``.

    A step already committed (by a run that was killed later) is kept, not written twice:
    the policy and the seeds are the same, so it holds what this run would write. The
    generation is the producer and the step its seq: the table commits each step once."""
    done = store.table.producer_seq(run)  # the last step this generation committed
    for step in range(args.steps_per_gen):
        if done is not None and step <= done:
            continue
        with store.writer(run_id=run, step=step, producer=run, seq=step, columns=COLUMNS,
                          adapter=mmstore.adapter_for(processor)) as writer:  # fmt: skip
            write_groups(writer, store, model, processor, f"{run}-{step}", args.prompts,
                         args.group_size, seed=f"{run}/{step}")  # fmt: skip


def write_groups(writer, store, model, processor, name: str, prompts: int, size: int,
                 seed: str, policy_version: int | None = None) -> None:  # fmt: skip
    """``prompts`` GRPO groups of ``size`` completions (sample ids ``<name>-<group>-<k>``),
    their tasks and sampling seeded by ``seed``, into ``writer``."""
    rng = random.Random(seed)
    for p in range(prompts):
        task = rng.randrange(10_000)
        torch.manual_seed(rng.randrange(2**31))  # the sampler's draws: reproducible
        screen = mmstore.synth.screenshot(task, 160, 120)  # a synthetic UI: panels, buttons
        rows = sample_group(store, model, processor, screen, task, size, f"{name}-{p}",
                            policy_version)  # fmt: skip
        rewards = torch.tensor([reward(row, task) for row in rows])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for row, r, a in zip(rows, rewards.tolist(), advantages.tolist(), strict=True):
            ref = reference_logprobs(processor, row, screen)
            writer.write(mmstore.Rollout(**{**row.model_dump(), "reward": r, "advantage": a,
                                            "columns": {"ref_logprobs": ref}}))  # fmt: skip


@torch.no_grad()
def sample_group(store, model, processor, screen, task: int, size: int, group: str,
                 policy_version: int | None) -> list[mmstore.Rollout]:  # fmt: skip
    """The task's screenshot and instruction through the chat template; ``size`` sampled
    completions of it (``generate``), one row each with its behaviour logprobs."""
    content = [{"type": "image", "image": screen}, {"type": "text", "text": f"click {task % 4}"}]
    messages = [{"role": "user", "content": content}]
    prompt = mmstore.chat.prompt(store, processor, messages)  # put, render, process, locate
    inputs = processor(text=[prompt.text], images=[screen], return_tensors="pt")
    adapter = mmstore.adapter_for(processor)
    out = model.eval().generate(
        **inputs, do_sample=True, top_k=0, temperature=1.0,  # the plain softmax: its logprobs
        num_return_sequences=size, max_new_tokens=4, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0,
        suppress_tokens=sorted(adapter.special_token_ids),  # no stray image placeholders
    )  # fmt: skip
    return mmstore.integrations.hf.rollouts(
        out, adapter, prompt.tokens, prompt.images, eos_token_id=None, group_id=group,
        policy_version=policy_version,
    )  # fmt: skip


def reward(row: mmstore.Rollout, task: int) -> float:
    """The toy task's reward: the share of the completion's tokens that "click" button
    ``task % 4`` (token id modulo 4)."""
    completion = row.tokens[row.prompt_len :]
    return sum(t % 4 == task % 4 for t in completion) / len(completion)


REFERENCE: dict[str, torch.nn.Module] = {}


@torch.no_grad()
def reference_logprobs(processor: Any, row: mmstore.Rollout, screen: Any) -> Any:
    """Each token's logprob under the reference policy (the initial weights; 0 on the
    prompt): the per-token column the KL penalty reads."""
    family = "glm4v" if type(processor).__name__.startswith("Glm4v") else "qwen2-vl"
    if family not in REFERENCE:
        REFERENCE[family] = build_model(family)[0].eval()
    model = REFERENCE[family]
    ids = torch.tensor([row.tokens])
    inputs = dict(processor.image_processor(images=[screen], return_tensors="pt"), input_ids=ids,
                  mm_token_type_ids=(ids == model.config.image_token_id).int())  # fmt: skip
    mask = torch.tensor([row.loss_mask])
    scored = iter(token_logprobs(model, inputs, mask).tolist())
    return [next(scored) if m else 0.0 for m in row.loss_mask]


# ---------------------------------------------------------------- trainer side


def micro_loss(model, batch: dict[str, Any], names, batch_size: int, clip: float,
               kl: float = KL) -> Any:  # fmt: skip
    """The clipped GRPO objective of one packed micro-batch with a KL penalty to the
    reference policy (k3, from the batch's ``ref_logprobs``), as its share of the step's loss.

    Each sample's loss is its mean over its completion tokens; the step's loss is the mean
    over the step's ``batch_size`` samples, so micro-batch losses add up to it."""
    mask = batch["loss_mask"]
    logp = token_logprobs(model, {k: batch[k] for k in names}, mask)
    old = batch["logprobs"][:, 1:][mask[:, 1:]]  # the behaviour policy's, as it sampled
    ref = batch["ref_logprobs"][:, 1:][mask[:, 1:]]
    lengths = batch["cu_seqlens"].diff().long()
    sample = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
    sample = sample[:, 1:][mask[:, 1:]]  # the sample each scored token belongs to
    adv = batch["advantage"][sample]
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    per_token = per_token + kl * (torch.exp(ref - logp) - (ref - logp) - 1)
    per_sample = torch.zeros(len(lengths)).index_add(0, sample, per_token)
    counts = torch.bincount(sample, minlength=len(lengths)).clamp(min=1)
    return (per_sample / counts).sum() / batch_size  # filler segments have no scored tokens


def make_loader(store, processor, run: str, args, workers: int | None = None) -> Any:
    fp32 = mmstore.Materialize(dtype=torch.float32)
    ds = mmstore.RolloutDataset(store, processor.image_processor, materialize=fp32, runs=[run],
                                seed=0, columns=list(COLUMNS))  # fmt: skip
    return mmstore.RolloutLoader(
        ds, batch_size=args.batch_size, max_tokens=args.max_tokens,
        num_workers=args.workers if workers is None else workers,
    )  # fmt: skip


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write-then-rename: a kill at any point leaves the previous checkpoint or this one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint(store, path: str, model, opt, loader, gen: int, step: int, trained,
               finished: bool = False) -> None:  # fmt: skip
    """Pin the pass's rows first, then save; then drop older pins and generations.
    ``finished``: the last generation's pass is done; a rerun must not train again."""
    name = f"{PIN_PREFIX}{step}"
    # The rest of this pass reads these rows, of the table version the loader state names.
    version = loader.state_dict()["table_version"]
    mmstore.pin_rows(store, name, runs=[f"gen-{gen}"], version=version)
    save_checkpoint(path, dict(model=model.state_dict(), opt=opt.state_dict(), gen=gen,
                               step=step, loader=loader.state_dict(), trained=trained,
                               finished=finished))  # fmt: skip
    for old in mmstore.list_pins(store):
        if old.startswith(PIN_PREFIX) and old != name:
            mmstore.unpin(store, old)
    if gen > 0 and any(f.run_id == f"gen-{gen - 1}" for f in store.files()):
        mmstore.release_run(store, f"gen-{gen - 1}", grace_seconds=0)  # no resume needs it


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    store = mmstore.Store.open(args.store, create=True)
    model, processor = build_model(args.family)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = torch.load(args.ckpt) if os.path.exists(args.ckpt) else None
    start_gen, step, trained = 0, 0, []
    if ckpt is not None and ckpt.get("finished") and ckpt["gen"] >= args.gens - 1:
        # Done already: another pass would train the last generation twice.
        print(json.dumps({"finished": ckpt["step"], "ckpt": args.ckpt}), flush=True)
        return {"step": ckpt["step"], "trained": ckpt["trained"], "finished": True}
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_gen, step, trained = ckpt["gen"], ckpt["step"], ckpt["trained"]
        print(json.dumps({"resumed": step, "gen": start_gen}), flush=True)
        if ckpt.get("finished"):  # a finished run given more --gens: the next generation
            start_gen, ckpt = start_gen + 1, None
    for gen in range(start_gen, args.gens):
        run = f"gen-{gen}"
        write_rollouts(store, model.eval(), processor, run, args)
        loader = make_loader(store, processor, run, args)
        if ckpt is not None and gen == ckpt["gen"]:
            loader.load_state_dict(ckpt["loader"])  # the rest of this pass, exactly
        model.train()
        ids: list[str] = []
        step_loss = 0.0
        for batch in loader:
            loss = micro_loss(model, batch, loader.model_input_names, args.batch_size, args.clip)
            loss.backward()
            step_loss += float(loss.detach())  # micro-batch losses add up to the step's
            ids += compress(batch["sample_ids"], (~batch["is_filler"]).tolist())
            if batch["micro"] + 1 < batch["num_micro"]:
                continue  # gradient accumulation over the step's micro-batches
            opt.step()
            opt.zero_grad()
            step += 1
            trained.append(ids)
            ids = []
            report = {"step": step, "gen": gen, "samples": len(trained[-1]), "loss": step_loss}
            print(json.dumps(report), flush=True)
            step_loss = 0.0
            if step % args.ckpt_every == 0:
                checkpoint(store, args.ckpt, model, opt, loader, gen, step, trained)
            mmstore.gc(store, grace_seconds=0)  # between steps: nothing a resume needs goes
        ckpt = None
        if gen == args.gens - 1:
            checkpoint(store, args.ckpt, model, opt, loader, gen, step, trained, finished=True)
    return {"step": step, "trained": trained, "finished": False}


# ---------------------------------------------------------------- asynchronous (--async-level)

ASYNC_RUN = "async"


def weights_path(args: argparse.Namespace, version: int) -> str:
    """Where the trainer publishes the weights after ``version`` optimizer steps."""
    return f"{args.ckpt}.weights/{version}.pt"


def rollout_async(args: argparse.Namespace) -> None:
    """The rollout side: step ``n`` (one commit of ``batch_size`` samples) is generated with
    the weights after ``n - K`` optimizer steps, waiting for the trainer to publish them.
    Restarted, it goes on after the last step the table says it committed (exactly once:
    it is producer ``rollout``, the step its seq)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    store = mmstore.Store.open(args.store, create=True)
    model, processor = build_model(args.family)
    done = store.table.producer_seq("rollout")
    last = args.gens * args.steps_per_gen - 1
    for n in range(0 if done is None else done + 1, last + 1):
        policy = max(0, n - args.async_level)
        model.load_state_dict(wait_for_weights(args, policy))
        # The last commit says so: the trainer then trains what waits, never waits for more.
        with store.writer(ASYNC_RUN, n, producer="rollout", seq=n, final=n == last,
                          columns=COLUMNS, adapter=mmstore.adapter_for(processor)) as writer:
            write_groups(writer, store, model.eval(), processor, f"{ASYNC_RUN}-{n}",
                         args.batch_size // args.group_size, args.group_size,
                         seed=f"{ASYNC_RUN}/{n}", policy_version=policy)  # fmt: skip
        print(json.dumps({"rollout": n, "policy": policy}), flush=True)


def kill_with_parent() -> None:
    """In a child before it runs (``Popen(preexec_fn=...)``): on Linux the kernel sends it
    SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; a SIGKILLed parent runs no cleanup)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with_parent(parent: int) -> None:
    """A rollout child started by the trainer dies with it (armed by :func:`kill_with_parent`
    before it started, on Linux; elsewhere this thread notices the parent is gone within a
    second). An orphan would go on committing steps nobody trains, beside the trainer a
    restart starts."""
    if os.getppid() != parent:  # the parent died already
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def wait_for_weights(args: argparse.Namespace, version: int) -> dict[str, Any]:
    path = weights_path(args, version)
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not publish {path} in {args.timeout} s")
        time.sleep(0.05)
    return torch.load(path)


def train_async(args: argparse.Namespace, other_side: Any = None) -> dict[str, Any]:
    """The trainer: optimizer step ``s`` trains the next ``batch_size`` samples the rollout
    side committed (a LiveLoader: waits for them, exactly once across restarts), then
    publishes its weights for the rollout side and checkpoints model, optimizer and loader
    state in one file."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    store = mmstore.Store.open(args.store, create=True)
    model, processor = build_model(args.family)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.gens * args.steps_per_gen
    live = mmstore.LiveLoader(
        store, processor.image_processor, runs=[ASYNC_RUN], batch_size=args.batch_size,
        columns=list(COLUMNS),
        materialize=mmstore.Materialize(dtype=torch.float32),
        max_tokens=args.max_tokens, max_staleness=args.async_level, num_workers=args.workers,
    )  # fmt: skip
    trained: list[list[str]] = []
    ckpt = torch.load(args.ckpt) if os.path.exists(args.ckpt) else None
    if ckpt is not None and ckpt["finished"]:
        print(json.dumps({"finished": ckpt["step"], "ckpt": args.ckpt}), flush=True)
        return {"step": ckpt["step"], "trained": ckpt["trained"], "finished": True}
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        live.load_state_dict(ckpt["loader"])
        trained = ckpt["trained"]
        print(json.dumps({"resumed": ckpt["step"]}), flush=True)
    else:
        publish(args, model, 0)
    model.train()
    with live:
        for step in range(live.step, total):
            ids: list[str] = []
            step_loss, stale, started = 0.0, 0, time.monotonic()
            for batch in next_step(live, step, args.timeout, other_side):
                # The step's own sample count (all ranks; one here): a step cut short by
                # stale groups, or the run's last step, is still a mean over its samples.
                loss = micro_loss(model, batch, live.model_input_names, batch["step_samples"],
                                  args.clip)  # fmt: skip
                loss.backward()
                step_loss += float(loss.detach())
                stale = batch["stale_samples"]
                ids += compress(batch["sample_ids"], (~batch["is_filler"]).tolist())
            opt.step()
            opt.zero_grad()
            trained.append(ids)
            publish(args, model, step + 1)  # again after a restart: the same bytes
            state = dict(model=model.state_dict(), opt=opt.state_dict(), step=step + 1,
                         loader=live.state_dict(), trained=trained)  # fmt: skip
            save_checkpoint(args.ckpt, {**state, "finished": step + 1 == total})
            prune_weights(args, step + 1)
            report = {"step": step + 1, "loss": step_loss, "samples": len(ids),
                      "stale_samples": stale,
                      "seconds": round(time.monotonic() - started, 3)}  # fmt: skip
            print(json.dumps(report), flush=True)
    return {"step": total, "trained": trained, "finished": False}


def next_step(live: Any, step: int, timeout: float, other_side: Any) -> Any:
    """The step's micro-batches; waiting a second at a time, so that a rollout side that
    died (``other_side``, its process) is noticed within a second instead of ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return live.next_step(policy_version=step, timeout=1 if other_side else timeout)
        except mmstore.LiveTimeoutError:
            if other_side is not None and other_side.poll() is not None:
                raise SystemExit(
                    f"the rollout process (pid {other_side.pid}) exited with "
                    f"{other_side.returncode} before committing step {step}'s samples"
                ) from None
            if time.monotonic() > deadline:
                raise


def publish(args: argparse.Namespace, model: torch.nn.Module, version: int) -> None:
    os.makedirs(os.path.dirname(weights_path(args, version)), exist_ok=True)
    save_checkpoint(weights_path(args, version), model.state_dict())


def prune_weights(args: argparse.Namespace, newest: int) -> None:
    """Delete published weights the rollout side can no longer ask for: it generates step
    ``n >= newest`` from the weights of ``n - K``, so versions below ``newest - K`` go."""
    for version in range(max(0, newest - args.async_level - 1), -1, -1):
        path = weights_path(args, version)
        if not os.path.exists(path):
            break  # pruned before, with everything older
        os.remove(path)


def run_async(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides: the rollout side in its own process, the trainer in this one."""
    if args.role == "rollout":
        rollout_async(args)
        return {"finished": True}
    if args.role == "train":
        return train_async(args)
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--role", "rollout",
               "--parent-pid", str(os.getpid())]  # fmt: skip
    rollout = subprocess.Popen(command, preexec_fn=kill_with_parent)
    try:
        result = train_async(args, other_side=rollout)
        # Trained to the end: the rollout side committed its final step, so it exits too.
        if rollout.wait(timeout=args.timeout):
            raise SystemExit(f"the rollout process failed ({rollout.returncode})")
    finally:
        if rollout.poll() is None:  # the trainer failed: never leave the other side behind
            rollout.kill()
            rollout.wait()
    return result


def replay(args: argparse.Namespace, dest: str) -> tuple[float, float]:
    """The last checkpoint's first step, from the store and from an export of its window."""
    store = mmstore.Store.open(args.store)
    model, processor = build_model(args.family)
    ckpt = torch.load(args.ckpt)
    model.load_state_dict(ckpt["model"])
    run = f"gen-{ckpt['gen']}"
    dump = mmstore.export(store, dest, runs=[run])
    losses = []
    for source in (store, dump):
        total = 0.0
        loader = make_loader(source, processor, run, args, workers=0)
        names = loader.model_input_names
        for batch in loader:
            if batch["step"] > 0:
                break
            with torch.no_grad():
                total += float(micro_loss(model, batch, names, args.batch_size, args.clip))
        losses.append(total)
    return losses[0], losses[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", default="runs/grpo-store")
    p.add_argument("--ckpt", default="runs/grpo-ckpt.pt")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen2-vl")
    p.add_argument("--gens", type=int, default=3, help="rollout generations")
    p.add_argument("--steps-per-gen", type=int, default=2, help="store steps per generation")
    p.add_argument("--prompts", type=int, default=2, help="GRPO groups per store step")
    p.add_argument("-G", "--group-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="samples per optimizer step")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per micro-batch")
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--replay", metavar="DEST", help="then export the last window to DEST (new)")
    p.add_argument(
        "--async-level",
        type=int,
        metavar="K",
        help="asynchronous: the rollout side, in its own process, generates step n "
        "with the weights of step n-K; the trainer follows it with a LiveLoader",
    )
    p.add_argument(
        "--role",
        choices=["rollout", "train"],
        help="with --async-level: run only this side (default: both)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the other side")
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # the trainer's child
    return p.parse_args(argv)


def header(args: argparse.Namespace) -> dict[str, Any]:
    """The first JSON line: what this process is."""
    mode = "sync" if args.async_level is None else f"async (K={args.async_level})"
    return {
        "store": args.store,
        "ckpt": args.ckpt,
        "family": args.family,
        "mode": mode,
        "role": args.role or ("both" if args.async_level is not None else "both, in turn"),
    }


if __name__ == "__main__":
    args = parse()
    print(json.dumps({"header": header(args)}), flush=True)
    result = train(args) if args.async_level is None else run_async(args)
    if not result["finished"]:
        print(json.dumps({"done": result["step"]}), flush=True)
    if args.replay and os.path.exists(args.replay):
        print(json.dumps({"replay_exists": args.replay}), flush=True)  # exported before
    elif args.replay:
        store_loss, export_loss = replay(args, args.replay)
        print(json.dumps({"store_loss": store_loss, "export_loss": export_loss}))
