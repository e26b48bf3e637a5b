"""Prefix forests (issue 41): what ``prefix_sharing=True`` saves a GRPO step and a
multi-turn screenshot agent, against unshared packing of the same rows, in one run.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_forest --scale 1 [--reps 3] [--out DIR]

Rows (Qwen2-VL's published layout, real PNG screenshots drawn by ``mmstore.synth``):

- **grpo**: ``groups`` GRPO-8 groups; a prompt of 300 text tokens, one 1920x1080 screenshot
  (2,691 tokens) and 40 more, then 8 responses of 100-600 tokens (loss on the response).
- **agent**: ``trajectories`` 10-turn agents stored one sample per turn with the whole
  history (how trainers store them today): turn ``t`` holds a 200-token system prompt, then
  per turn a 1280x720 screenshot (1,196 tokens), 30 tokens of observation text and a 40-120
  token action; the loss on its last action. **agent-window**: the same turns with a
  sliding window of the last 4 screenshots + the current one (older screenshots dropped
  from the history): the prefix property breaks at every turn past the window, so little
  is shared; its screenshots dedupe in storage by content, as today.

Each data set is read by two ``RolloutLoader``s (``max_tokens`` 16,384 for grpo, 65,536 for
the agents; ``batch_size`` one step's samples; ``num_workers=0``; a fresh dataset each, so
no image cache is shared between contenders) over one epoch:

1. **Tokens forwarded** per step: the model tokens of every micro-batch (``input_ids``'
   length, dummy images and filler included), forest / ideal, where ideal is the distinct
   tokens of the step (grpo: ``P + 8R``; agents: each trajectory's last turn). Goal for
   grpo <= 1.05 (unshared: ``8(P + R)``). ``flat_over_forest``: unshared / forest (higher =
   mmstore better).
2. **Vision-tower images** per step: the images of every micro-batch (``image_grid_thw``
   rows) / the step's distinct images (goal <= 1.02; unshared: one per sample showing it).
3. **Loader throughput**: samples per second of a whole pass, start-up included (the
   forest's planning reads each row's token list once), ``reps`` repetitions alternating
   which loader goes first; ``forest_over_flat`` = forest / unshared samples per second,
   the median of the ratio within each repetition (higher = mmstore better; goal >= 1: no
   slower per sample).

4. **Storage** of the rows as written (whole: one sample per turn, each with its history):
   ``rows_bytes_over_distinct_tokens`` = the Parquet files' bytes (zstd; tokens, masks and
   refs) / 4 bytes per distinct token of the data set; ``store_over_distinct`` adds the
   screenshots (content-addressed: each once) to both (issue 41's goal for trees: <= 1.1;
   lower = better); for the agents, ``rows_over_last_turn_rows`` = those bytes / the bytes
   of a store holding each trajectory once (its last turn), same encoding: what storing
   continuations (``Rollout(parent_id=, prefix_len=)``) whole costs against segments
   stored once. The GPU step (issue 41 (e)) needs a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import mmstore
from benchmarks._common import interleaved, paired_ratio, processor
from mmstore.synth import screenshot

GROUP = 8
TURNS = 10
WINDOW = 4  # past screenshots kept by agent-window, besides the current one
MAX_TOKENS = {"grpo": 16_384, "agent": 65_536, "agent-window": 65_536}


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.zipf(1.2, n) % 150_000]


def _image(store: mmstore.Store, size: tuple[int, int], seed: int) -> Any:
    return store.put_image(screenshot(seed, *size))


def _span(adapter: Any, media: Any, at: int) -> tuple[list[int], Any]:
    """A screenshot's expanded span placed at token ``at``: its tokens and its ref."""
    tokens, refs = adapter.expand([adapter.image_token_id], [media])
    return tokens, refs[0].model_copy(update={"offset": refs[0].offset + at})


def _row(sample_id: str, group: str, parts: list[tuple[list[int], Any]], answer: list[int]):
    tokens: list[int] = []
    refs = []
    for part, ref in parts:
        if ref is not None:
            refs.append(ref.model_copy(update={"offset": ref.offset + len(tokens)}))
        tokens += part
    prompt = len(tokens)
    return mmstore.Rollout(
        sample_id=sample_id, group_id=group, tokens=tokens + answer, prompt_len=prompt,
        loss_mask=[False] * prompt + [True] * len(answer), images=refs, reward=1.0,
        advantage=0.5,
    )  # fmt: skip


def grpo_step(store: mmstore.Store, adapter: Any, groups: int, seed: int) -> list[Any]:
    """One step: ``groups`` GRPO-8 groups, each a screenshot prompt and 8 responses."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        image, ref = _span(adapter, _image(store, (1920, 1080), seed * 1000 + g), 0)
        prompt = [(_text(rng, 300), None), (image, ref), (_text(rng, 40), None)]
        answers = [_text(rng, int(rng.integers(100, 601))) for _ in range(GROUP)]
        rows += [_row(f"s{seed}g{g}-{k}", f"s{seed}g{g}", prompt, a) for k, a in enumerate(answers)]
    return rows


def agent_step(
    store: mmstore.Store, adapter: Any, trajectories: int, seed: int, window: int | None
) -> list[Any]:
    """One step: ``trajectories`` agents of :data:`TURNS` turns, one sample per turn."""
    rng = np.random.default_rng(seed)
    rows = []
    for a in range(trajectories):
        system = (_text(rng, 200), None)
        turns = []
        for t in range(TURNS):
            shot = _span(adapter, _image(store, (1280, 720), seed * 1000 + a * TURNS + t), 0)
            action = _text(rng, int(rng.integers(40, 121)))
            turns.append((shot, (_text(rng, 30), None), action))
        for t in range(TURNS):
            parts = [system]
            for k, (shot, obs, action) in enumerate(turns[: t + 1]):
                kept = window is None or k >= t - window
                parts += [shot, obs] if kept else [obs]
                if k < t:
                    parts.append((action, None))
            rows.append(_row(f"s{seed}a{a}-t{t}", f"s{seed}a{a}", parts, turns[t][2]))
    return rows


def distinct_tokens(rows: list[Any]) -> int:
    """The step's distinct tokens: nodes of the trie of its rows, an image span's tokens
    keyed by the image's hash (what an ideal forest of the whole step forwards)."""
    nodes: set[int] = set()
    for row in rows:
        keys: list[Any] = list(row.tokens)
        for ref in row.images:
            keys[ref.offset : ref.offset + ref.length] = [ref.hash] * ref.length
        node = 0
        for key in keys:
            node = hash((node, key))
            nodes.add(node)
    return len(nodes)


def write(root: str, kind: str, steps: int, per_step: int) -> tuple[mmstore.Store, dict[str, int]]:
    """A store of ``steps`` steps of ``kind`` rows, one commit each; the ideal figures."""
    store = mmstore.Store.open(root, create=True)
    adapter = mmstore.adapter_for(processor())
    ideal = {"tokens": 0, "images": 0, "samples": 0}
    # The agents' trajectories once each (their last turns only): what the rows hold that
    # the per-turn rows repeat, in the same encoding.
    last_turns = mmstore.Store.open(f"{root}-last", create=True) if kind != "grpo" else None
    for step in range(steps):
        if kind == "grpo":
            rows = grpo_step(store, adapter, per_step, seed=step)
        else:
            window = WINDOW if kind == "agent-window" else None
            rows = agent_step(store, adapter, per_step, seed=step, window=window)
        with store.writer(run_id=kind, step=step, adapter=adapter) as writer:
            writer.write_many(rows)
        if last_turns is not None:  # the same screenshots, in its media
            shutil.copytree(f"{root}/media", f"{root}-last/media", dirs_exist_ok=True)
            with last_turns.writer(run_id=kind, step=step, adapter=adapter) as writer:
                writer.write_many([r for r in rows if r.sample_id.endswith(f"-t{TURNS - 1}")])
        ideal["tokens"] += distinct_tokens(rows)
        ideal["images"] += len({ref.hash for row in rows for ref in row.images})
        ideal["samples"] += len(rows)
    ideal["per_step"] = ideal["samples"] // steps
    ideal["rows_bytes"] = _bytes(os.path.join(root, "rollouts"), skip="_delta_log")
    ideal["media_bytes"] = _bytes(os.path.join(root, "media"))
    if last_turns is not None:
        ideal["last_turn_rows_bytes"] = _bytes(f"{root}-last/rollouts", skip="_delta_log")
    return store, ideal


def _bytes(folder: str, skip: str = "") -> int:
    total = 0
    for parent, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != skip]
        total += sum(os.path.getsize(os.path.join(parent, f)) for f in files)
    return total


def one_pass(store: mmstore.Store, kind: str, batch_size: int, sharing: bool) -> dict[str, Any]:
    """One epoch through a fresh dataset and loader: figures, and its seconds (start-up in)."""
    start = time.perf_counter()
    ds = mmstore.RolloutDataset(store, processor(), shuffle=False)
    loader = mmstore.RolloutLoader(
        ds, batch_size=batch_size, max_tokens=MAX_TOKENS[kind], prefix_sharing=sharing
    )
    tokens = images = samples = micro = 0
    for batch in loader:
        tokens += int(batch["input_ids"].shape[1])
        grid = batch["image_grid_thw"]
        images += 0 if grid is None else int(grid.shape[0])
        samples += int((~batch["is_filler"]).sum())
        micro += 1
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "images": images, "samples": samples, "micro_batches": micro,
            "seconds": seconds, "samples_per_s": samples / seconds}  # fmt: skip


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    """Every data set: write it, count one pass of each loader, then time ``reps`` passes."""
    sizes = {"grpo": (4, 4), "agent": (2, 2), "agent-window": (2, 2)}  # steps, per step
    out: dict[str, Any] = {"direction": "every ratio: higher = mmstore better, unless named "
                           "*_over_ideal (lower = better, 1 = nothing repeated)"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for kind, (steps, per_step) in sizes.items():
            steps = max(1, round(steps * scale))
            store, ideal = write(os.path.join(tmp, kind), kind, steps, per_step)
            batch_size = ideal["per_step"]
            forest = one_pass(store, kind, batch_size, True)
            flat = one_pass(store, kind, batch_size, False)
            assert forest["samples"] == flat["samples"] == ideal["samples"], kind
            timed = interleaved(
                {
                    "forest": lambda s=store, k=kind, b=batch_size: one_pass(s, k, b, True)[
                        "samples_per_s"
                    ],
                    "flat": lambda s=store, k=kind, b=batch_size: one_pass(s, k, b, False)[
                        "samples_per_s"
                    ],
                },
                reps,
            )
            out[kind] = {
                "steps": steps,
                "samples_per_step": batch_size,
                "ideal": ideal,
                "forest": forest,
                "flat": flat,
                "forest_tokens_over_ideal": forest["tokens"] / ideal["tokens"],
                "flat_tokens_over_ideal": flat["tokens"] / ideal["tokens"],
                "flat_over_forest_tokens": flat["tokens"] / forest["tokens"],
                "forest_images_over_distinct": forest["images"] / ideal["images"],
                "flat_images_over_distinct": flat["images"] / ideal["images"],
                # Stored one sample per turn (whole rows): the Parquet rows over the distinct
                # tokens as int32, and the store over those plus the distinct screenshots.
                "rows_bytes_over_distinct_tokens": ideal["rows_bytes"] / (4 * ideal["tokens"]),
                "store_over_distinct": (ideal["rows_bytes"] + ideal["media_bytes"])
                / (4 * ideal["tokens"] + ideal["media_bytes"]),
                "rows_over_last_turn_rows": ideal["rows_bytes"] / ideal["last_turn_rows_bytes"]
                if "last_turn_rows_bytes" in ideal
                else None,
                "samples_per_s": timed,
                "forest_over_flat_samples_per_s": paired_ratio(timed, "forest", "flat"),
            }
    return out


# Headline rows for benchmarks/run.py: (label, path in the result, start-up: "in",
# "excluded" or "n/a", as run.py defines them).
HEADLINE = [
    ("forest / flat tokens forwarded, GRPO-8", "grpo.flat_over_forest_tokens", "n/a"),
    ("forest tokens / ideal, GRPO-8 (goal <= 1.05)", "grpo.forest_tokens_over_ideal", "n/a"),
    ("forest / flat tokens forwarded, 10-turn agent", "agent.flat_over_forest_tokens", "n/a"),
    ("forest images / distinct, 10-turn agent", "agent.forest_images_over_distinct", "n/a"),
    ("forest / flat samples/s, GRPO-8", "grpo.forest_over_flat_samples_per_s.median", "in"),
]


def table(result: dict[str, Any]) -> str:
    lines = [
        "| data | tokens: forest / ideal | flat / ideal | flat / forest | images: forest / "
        "distinct | flat / distinct | samples/s forest / flat (median, min-max) | rows bytes / "
        "distinct tokens x 4 B | store / distinct | rows / last turns' rows |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("grpo", "agent", "agent-window"):
        r = result[kind]
        speed = r["forest_over_flat_samples_per_s"]
        lines.append(
            f"| {kind} | {r['forest_tokens_over_ideal']:.3f} | {r['flat_tokens_over_ideal']:.2f} "
            f"| {r['flat_over_forest_tokens']:.2f} | {r['forest_images_over_distinct']:.3f} | "
            f"{r['flat_images_over_distinct']:.2f} | {speed['median']:.2f} "
            f"({speed['min']:.2f}-{speed['max']:.2f}) | "
            f"{r['rows_bytes_over_distinct_tokens']:.2f} | {r['store_over_distinct']:.2f} | "
            + (
                "-"
                if r["rows_over_last_turn_rows"] is None
                else f"{r['rows_over_last_turn_rows']:.2f}"
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args.scale, args.reps)
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d")
        with open(os.path.join(args.out, f"{stamp}-forest.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, f"{stamp}-forest.md"), "w") as f:
            f.write(table(result) + "\n")
    return result


if __name__ == "__main__":
    main()
