"""Every key of a batch, declared once: its name, dtype, shape and what it holds.

A padded batch (:func:`.collate.collate`: ``RolloutLoader`` without ``max_tokens``) and a
packed micro-batch (:func:`.microbatch.pack`: with ``max_tokens``) share most keys; the
family decides its model inputs (:data:`FAMILY`), ``distinct_images`` adds four
(:data:`DISTINCT`), and each loader adds its own (:data:`ROLLOUT_LOADER`,
:data:`LIVE_LOADER`). The per-sample keys of both kinds are built by one function,
:func:`sample_fields`.

``docs/training.md``'s table of batch keys is generated from this module (``python -m
mmstore._loading.batch_keys`` prints it); ``tests/test_batch_keys.py`` fails when the page
differs, and when collate, pack or a loader makes a key that is not declared here, or one
whose dtype is not the declared one.

**A new key** is declared here first, in its group, then built where its group is built: a
per-sample field in :func:`sample_fields` (collate and pack both call it), a per-token one in
collate and pack, a loader's own in that loader; then regenerate the page's table.

Shapes are written in words (:data:`LEGEND` says what the letters mean): ``"[B, T]"`` in a
padded batch, ``"[1, T]"`` in a packed one, ``"[S]"`` per segment, ``"scalar"`` for a Python
value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmstore._families import Family, video_half
from mmstore._rows.check import Sample

#: The padded or packed form of a batch.
Form = Literal["padded", "packed"]


@dataclass(frozen=True)
class BatchKey:
    """One key of a batch.

    ``padded`` and ``packed`` are its shape in a padded batch and in a packed micro-batch
    (``None``: not in that form). A key whose name the family decides has ``of_family``,
    giving its names for a family (none where the family has no such input); ``name`` then
    says what they are.
    """

    name: str
    dtype: str
    holds: str
    padded: str | None = None
    packed: str | None = None
    of_family: Callable[[Family], tuple[str, ...]] | None = None

    def names(self, family: Family) -> tuple[str, ...]:
        return (self.name,) if self.of_family is None else self.of_family(family)

    def shape(self, form: Form) -> str | None:
        return self.padded if form == "padded" else self.packed


def _token_types(family: Family) -> tuple[str, ...]:
    return (family.token_type_input,) if family.token_type_input else ()


def _image_inputs(family: Family) -> tuple[str, ...]:
    return tuple(family.image_inputs)


def _video_inputs(family: Family) -> tuple[str, ...]:
    video = video_half(family)
    return tuple(video.input_names) if video is not None else ()


def _video_distinct(name: str) -> Callable[[Family], tuple[str, ...]]:
    return lambda family: (name,) if video_half(family) is not None else ()


# -- the keys of collate and pack ----------------------------------------------------------

INPUT_IDS = BatchKey(
    "input_ids",
    "int64",
    "the samples' token ids; padded: `pad_token_id` after each; packed: one segment after "
    "another (with `prefix_sharing`: the forest's tokens, each shared prefix once)",
    padded="[B, T]",
    packed="[1, N]",
)
ATTENTION_MASK = BatchKey(
    "attention_mask",
    "int64",
    "1 on a sample's tokens (and a dummy image), 0 on padding",
    padded="[B, T]",
)
POSITION_IDS = BatchKey(
    "position_ids",
    "int64",
    "each segment's own position ids from 0, the family's; M-RoPE: a text row (0..len-1 per "
    "segment), then its 3 rows (a forest token: its position in each sample through it)",
    packed="[1, N] or [4, 1, N]",
)
LOSS_MASK = BatchKey(
    "loss_mask",
    "bool",
    "the rows' loss masks (true: the token is trained on); false on padding, filler and where "
    "media was missing",
    padded="[B, T]",
    packed="[1, T]",
)
LOGPROBS = BatchKey(
    "logprobs",
    "float32",
    "the sampler's per-token log-probabilities; padded: 0 where a sample has none; packed: "
    "only when every sample has them",
    padded="[B, T]",
    packed="[1, T]",
)

#: Per token: what the model reads and the loss weighs.
TOKENS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOSS_MASK, LOGPROBS)

CU_SEQLENS = BatchKey(
    "cu_seqlens", "int32", "segment boundaries: 0, then each segment's end", packed="[S + 1]"
)
MAX_SEQLEN = BatchKey("max_seqlen", "int", "the longest segment's length", packed="scalar")
USE_CACHE = BatchKey(
    "use_cache",
    "bool",
    "`False`: without a KV cache transformers derives the per-sample mask from the position ids",
    packed="scalar",
)
NUM_REAL_TOKENS = BatchKey(
    "num_real_tokens",
    "int",
    "the samples' tokens (the filler segment's not counted)",
    packed="scalar",
)
DUMMY_IMAGE = BatchKey(
    "dummy_image",
    "bool",
    "whether the batch holds the family's zero dummy image (padded: after the first sample's "
    "tokens, `dummy_image=True`; packed: a filler segment of its own)",
    padded="scalar",
    packed="scalar",
)

#: Per batch: its segments (packed) and its filler.
LAYOUT = (CU_SEQLENS, MAX_SEQLEN, USE_CACHE, NUM_REAL_TOKENS, DUMMY_IMAGE)

FOREST_INDEX = BatchKey(
    "forest_index",
    "int64",
    "for each token slot of the segments laid end to end, the model token it is: "
    "`logits[:, forest_index]` lines up with `loss_mask` (without `prefix_sharing`: 0..T-1)",
    packed="[T]",
)
VISIBLE_UNTIL = BatchKey(
    "visible_until",
    "int64",
    "model token `j` is seen by tokens `j .. visible_until[j] - 1` (its own segment's, or in a "
    "forest its branches'): the attention structure, compact (`mmstore.forest_attention_mask`)",
    packed="[N]",
)
ATTENTION_BLOCKS = BatchKey(
    "attention_blocks",
    "int64",
    "tokens with the same number above 0 see each other both ways (Gemma 3: one image's); 0 "
    "elsewhere",
    packed="[N]",
)

#: Per packed micro-batch: how its model tokens attend (:mod:`.forest`).
FOREST = (FOREST_INDEX, VISIBLE_UNTIL, ATTENTION_BLOCKS)

TOKEN_TYPES = BatchKey(
    "token types (`mm_token_type_ids`, `token_type_ids`)",
    "int32",
    "the family's per-token types: 1 on image features, the video half's type on video "
    "features (families that take them)",
    padded="[B, T]",
    packed="[1, N]",
    of_family=_token_types,
)
IMAGE_INPUTS = BatchKey(
    "image inputs (`pixel_values`, `image_grid_thw`, `image_sizes`, ...)",
    "the family's",
    "the family's image tensors, its images in model order, concatenated or padded as the "
    "family says; floats in the train dtype (with `preprocess_device`, on that device); `None` "
    "without images",
    padded="the family's",
    packed="the family's",
    of_family=_image_inputs,
)
VIDEO_INPUTS = BatchKey(
    "video inputs (`pixel_values_videos`, `video_grid_thw`, ...)",
    "the family's",
    "the video half's tensors, the batch's clips in order; `None` without videos (families "
    "with a video processor)",
    padded="the family's",
    packed="the family's",
    of_family=_video_inputs,
)

#: The family's model inputs besides the tokens: their names depend on the family.
FAMILY = (TOKEN_TYPES, IMAGE_INPUTS, VIDEO_INPUTS)

IMAGE_INDEX = BatchKey(
    "image_index",
    "int64",
    "for each image of the batch, in model order, its distinct image",
    padded="[I]",
    packed="[I]",
)
IMAGE_ROWS = BatchKey(
    "image_rows",
    "dict of int64",
    "per image input, the leading rows each distinct image fills (a grid: 1)",
    padded="{input: [D]}",
    packed="{input: [D]}",
)
VIDEO_INDEX = BatchKey(
    "video_index",
    "int64",
    "`image_index` for the batch's videos (families with a video processor)",
    padded="[V]",
    packed="[V]",
    of_family=_video_distinct("video_index"),
)
VIDEO_ROWS = BatchKey(
    "video_rows",
    "dict of int64",
    "`image_rows` for the batch's videos (families with a video processor)",
    padded="{input: [D]}",
    packed="{input: [D]}",
    of_family=_video_distinct("video_rows"),
)

#: With ``distinct_images=True`` (:mod:`.distinct`): each image once, and where it goes.
DISTINCT = (IMAGE_INDEX, IMAGE_ROWS, VIDEO_INDEX, VIDEO_ROWS)

SAMPLE_IDS = BatchKey(
    "sample_ids",
    "list[str]",
    'each sample\'s id; packed: `"<filler>"` for the filler segment',
    padded="[B]",
    packed="[S]",
)
GROUP_IDS = BatchKey(
    "group_ids",
    "list[str | None]",
    "each sample's GRPO group id; packed: `None` for the filler segment",
    padded="[B]",
    packed="[S]",
)
IS_FILLER = BatchKey(
    "is_filler", "bool", "whether a segment is the filler segment (zero loss)", packed="[S]"
)
ADVANTAGE = BatchKey(
    "advantage", "float32", "each sample's advantage; filler: 0", padded="[B]", packed="[S]"
)
REWARD = BatchKey(
    "reward", "float32", "each sample's reward; filler: 0", padded="[B]", packed="[S]"
)
PROMPT_LENS = BatchKey(
    "prompt_lens",
    "int64",
    "each sample's prompt length in tokens; filler: 0",
    padded="[B]",
    packed="[S]",
)
IMAGES_MISSING = BatchKey(
    "images_missing",
    "int",
    "samples with missing media, replaced by zero-loss placeholders "
    '(`missing="placeholder_zero_loss"`)',
    padded="scalar",
    packed="scalar",
)
MISSING_URIS = BatchKey(
    "missing_uris",
    "list[str]",
    "the URIs of those missing media, sample by sample",
    padded="list",
    packed="list",
)

POLICY_VERSIONS = BatchKey(
    "policy_versions",
    "int64",
    "the policy version that generated each sample (its row's `policy_version`; -1 unknown); "
    "packed: per token, -1 on filler",
    padded="[B]",
    packed="[1, T]",
)
RUN_IDS = BatchKey(
    "run_ids",
    "list[str | None]",
    "the run each sample was written to; packed: `None` for the filler segment",
    padded="[B]",
    packed="[S]",
)
STORE_STEPS = BatchKey(
    "store_steps",
    "int64",
    "the store step each sample was written at (`store.writer(run_id, step)`: the "
    "producer's step, not the trainer's); packed: -1 for the filler segment",
    padded="[B]",
    packed="[S]",
)
COLUMNS = BatchKey(
    "<column>",
    "its declared dtype",
    "each extra column asked for with `columns=[...]`, under its own name. Per token: "
    "laid out like `input_ids` (zeros after each sample; packed: zeros on filler). Per "
    'sample: one entry per sample (packed: per segment, 0 or `""` for filler); strings a '
    "list",
    padded="[B, T, *shape] or [B, *shape]",
    packed="[1, T, *shape] or [S, *shape]",
    of_family=lambda family: (),  # named by the reader's columns=, not the family
)

#: Per sample, from the rows (built by :func:`sample_fields` for collate and pack alike;
#: ``policy_versions`` and the columns by :mod:`.extra`).
SAMPLES = (
    SAMPLE_IDS,
    GROUP_IDS,
    IS_FILLER,
    ADVANTAGE,
    REWARD,
    PROMPT_LENS,
    IMAGES_MISSING,
    MISSING_URIS,
    POLICY_VERSIONS,
    RUN_IDS,
    STORE_STEPS,
    COLUMNS,
)

# -- the keys the loaders add --------------------------------------------------------------

#: What ``RolloutLoader`` adds to each batch it yields (in its workers).
ROLLOUT_LOADER = (
    BatchKey("batch_index", "int", "the batch's index in the rank's epoch", padded="scalar"),
    BatchKey("epoch", "int", "the epoch the micro-batch belongs to", packed="scalar"),
    BatchKey("step", "int", "the step (`batch_size` samples per rank)", packed="scalar"),
    BatchKey("micro", "int", "the micro-batch's index in its step", packed="scalar"),
    BatchKey(
        "num_micro", "int", "micro-batches in the step, the same on every rank", packed="scalar"
    ),
    BatchKey("micro_index", "int", "the micro-batch's index in the rank's epoch", packed="scalar"),
    BatchKey(
        "cache_hits",
        "int",
        "images the worker's cache served for this batch",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "cache_misses",
        "int",
        "images the worker materialized for this batch",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "node_cache_hits", "int", "images the node cache served (0 without one)", padded="scalar"
    ),
    BatchKey(
        "node_cache_misses",
        "int",
        "images the worker processed itself (without a node cache: `cache_misses`)",
        padded="scalar",
    ),
)

#: What ``LiveLoader`` adds to each micro-batch of ``next_step``.
LIVE_LOADER = (
    BatchKey("step", "int", "the live loader's step", padded="scalar", packed="scalar"),
    BatchKey(
        "micro", "int", "the micro-batch's index in its step", padded="scalar", packed="scalar"
    ),
    BatchKey(
        "num_micro",
        "int",
        "micro-batches in the step, the same on every rank (padded: 1)",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "is_filler",
        "bool",
        "padded: `[True]` for a rank's empty share of a step (one zero-loss pad token)",
        padded="[B]",
    ),
    BatchKey(
        "policy_version",
        "int | None",
        "the `policy_version` given to `next_step`",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "stale_groups",
        "int",
        "groups of this step dropped as too stale",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "stale_samples", "int", "the samples of those groups", padded="scalar", packed="scalar"
    ),
    BatchKey(
        "step_samples",
        "int",
        "the samples the whole step trains, on all ranks (normalise the loss by it)",
        padded="scalar",
        packed="scalar",
    ),
    BatchKey(
        "step_loss_tokens",
        "int",
        "the loss tokens the whole step trains, on all ranks",
        padded="scalar",
        packed="scalar",
    ),
)

#: What collate and pack build, every group of them.
BUILT = (*TOKENS, *LAYOUT, *FOREST, *FAMILY, *DISTINCT, *SAMPLES)

#: Keys that travel from a worker to the main process and are gone before the trainer sees
#: the batch: pending images for the device stage (``device.PENDING_KEY``), the shared
#: buffers a batch sits in (``buffers.KEY``), a worker's error (``workers.RAISED``).
INTERNAL = ("_pending_images", "_shared_buffers", "_raised")


def built_keys(
    family: Family, form: Form, *, distinct_images: bool = False, columns: Sequence[str] = ()
) -> tuple[str, ...]:
    """The keys collate (``"padded"``) or pack (``"packed"``) give a batch of ``family``'s
    samples (with the extra ``columns`` asked for): packed ``logprobs`` only where every
    sample has them."""
    groups = BUILT if distinct_images else tuple(k for k in BUILT if k not in DISTINCT)
    names = tuple(name for key in groups if key.shape(form) for name in key.names(family))
    return (*names, *columns)


def loader_keys(loader: Literal["RolloutLoader", "LiveLoader"], form: Form) -> tuple[str, ...]:
    """The keys ``loader`` adds to what collate or pack built."""
    keys = ROLLOUT_LOADER if loader == "RolloutLoader" else LIVE_LOADER
    return tuple(key.name for key in keys if key.shape(form))


#: The ``sample_ids`` entry of a packed micro-batch's filler segment.
FILLER_ID = "<filler>"


def sample_fields(
    samples: Sequence[Sample[Any, Any]], *, fillers: int | None = None
) -> dict[str, Any]:
    """The per-sample keys (:data:`SAMPLES`) of ``samples``.

    ``fillers``: packed, the number of filler segments after them (0 or 1): each gets its
    entry (:data:`FILLER_ID`, no group, zero advantage, reward and prompt) and ``is_filler``
    says which. ``None``: padded, no ``is_filler``.
    """
    fill = 0 if fillers is None else fillers
    out: dict[str, Any] = {
        SAMPLE_IDS.name: [s.sample_id for s in samples] + [FILLER_ID] * fill,
        GROUP_IDS.name: [s.group_id for s in samples] + [None] * fill,
    }
    if fillers is not None:
        is_filler = [False] * len(samples) + [True] * fill
        out[IS_FILLER.name] = torch.tensor(is_filler, dtype=torch.bool)
    advantage = [s.advantage for s in samples] + [0.0] * fill
    reward = [s.reward for s in samples] + [0.0] * fill
    prompt_lens = [s.prompt_len for s in samples] + [0] * fill
    return out | {
        ADVANTAGE.name: torch.tensor(advantage, dtype=torch.float32),
        REWARD.name: torch.tensor(reward, dtype=torch.float32),
        PROMPT_LENS.name: torch.tensor(prompt_lens, dtype=torch.int64),
        IMAGES_MISSING.name: sum(1 for s in samples if s.missing_uris),
        MISSING_URIS.name: [uri for s in samples for uri in s.missing_uris],
    }


# -- the page's table -----------------------------------------------------------------------

TABLES: tuple[tuple[str, tuple[BatchKey, ...]], ...] = (
    ("Per token", TOKENS),
    ("The family's model inputs (names depend on the family)", FAMILY),
    ("Per sample (packed: per segment)", SAMPLES),
    ("The batch's layout and filler", LAYOUT),
    ("How a packed micro-batch's tokens attend", FOREST),
    ("With `distinct_images=True`", DISTINCT),
    ("Added by `RolloutLoader`", ROLLOUT_LOADER),
    ("Added by `LiveLoader`", LIVE_LOADER),
)


def _cell(text: str | None) -> str:
    return "no" if text is None else text.replace("|", "\\|")


LEGEND = (
    "Shapes: `B` samples of a padded batch, `T` token positions (padded: the longest "
    "sample's; packed: all segments'), `N` the model's tokens of a packed micro-batch (`T`, "
    "or fewer with `prefix_sharing`), `S` segments of a micro-batch (its samples, then the "
    "filler segment where it has one), `I` images of the batch in model order, `V` videos, "
    "`D` distinct images (or videos); `scalar` and `list`: a Python value, not a tensor; "
    "`no`: not in that form."
)


def markdown() -> str:
    """The tables ``docs/training.md`` shows, one per group, after the legend."""
    parts = [LEGEND]
    for title, keys in TABLES:
        rows = [
            f"**{title}**",
            "",
            "| key | dtype | padded | packed | holds |",
            "|---|---|---|---|---|",
        ]
        for key in keys:
            name = f"`{key.name}`" if key.name.isidentifier() else key.name
            cells = (name, key.dtype, key.padded, key.packed, key.holds)
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
