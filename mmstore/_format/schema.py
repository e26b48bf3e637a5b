"""The row schema, v1: one Arrow schema, mirrored in ``schemas/rollout.v1.json``.

The Arrow schema here is the source of truth for writers and readers; the JSON file is the
language-neutral description for other engines. ``describe()`` turns the Arrow schema into
that neutral form, and a test keeps the two equal.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from mmstore.errors import SchemaVersionError

SCHEMA_VERSION = 1

# Parquet key-value metadata keys.
META_SCHEMA_VERSION = b"mmstore.schema_version"
META_RUN_ID = b"mmstore.run_id"
META_STEP = b"mmstore.step"
META_LAYOUTS = b"mmstore.layouts"
# Each row's token count, in row order: base64 of little-endian int32. The packed loader plans
# an epoch from these without reading a token list; a file without it (an older mmstore, or
# another Parquet engine) is still read, its lengths taken from the ``tokens`` lists.
META_NUM_TOKENS = b"mmstore.num_tokens"
# "true" in the files of a producer's final commit to its run (``store.writer(final=True)``):
# a live loader that has followed every run's final commit trains the last, short step.
META_FINAL = b"mmstore.final"

IMAGE_REF_TYPE = pa.struct(
    [
        pa.field("uri", pa.string(), nullable=False),
        pa.field("hash", pa.string(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=True),
        pa.field("offset", pa.int32(), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("family", pa.string(), nullable=False),
        pa.field("layout_fingerprint", pa.string(), nullable=False),
        pa.field("payload", pa.string(), nullable=True),
    ]
)

# One video of a rollout: the clip (content-addressed like an image), the frames its tokens
# were laid out for (indices in presentation order, as the processor sampled them), the
# clip's frame size, frame count and rate (timestamps are index / fps), and its token span.
VIDEO_REF_TYPE = pa.struct(
    [
        pa.field("uri", pa.string(), nullable=False),
        pa.field("hash", pa.string(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=True),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("fps", pa.float64(), nullable=False),
        pa.field("frames", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("offset", pa.int32(), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("family", pa.string(), nullable=False),
        pa.field("layout_fingerprint", pa.string(), nullable=False),
    ]
)

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=True),
        pa.field("tokens", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field(
            "loss_mask", pa.list_(pa.field("item", pa.bool_(), nullable=False)), nullable=False
        ),
        pa.field(
            "logprobs", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=True
        ),
        pa.field("reward", pa.float32(), nullable=True),
        pa.field("advantage", pa.float32(), nullable=True),
        pa.field(
            "images", pa.list_(pa.field("item", IMAGE_REF_TYPE, nullable=False)), nullable=False
        ),
        pa.field("metadata", pa.string(), nullable=True),
        # The policy (weights version) that generated the sample; a multi-turn sample carries
        # the oldest. Added after the first release: files without it read as unknown (null).
        pa.field("policy_version", pa.int64(), nullable=True),
        # Video clips of the prompt (refs, like images). Added after the first release: files
        # without it read as null, which is no videos.
        pa.field(
            "videos", pa.list_(pa.field("item", VIDEO_REF_TYPE, nullable=False)), nullable=True
        ),
    ],
    metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode()},
)

# Columns a reader may ask for; run_id and step come from the hive partition directories.
PARTITION_FIELDS = (pa.field("run_id", pa.string()), pa.field("step", pa.int32()))


def file_metadata(
    run_id: str,
    step: int,
    layouts: dict[str, Any],
    num_tokens: Sequence[int] = (),
    *,
    final: bool = False,
) -> dict[bytes, bytes]:
    """Key-value metadata of one rollout Parquet file (``num_tokens``: each row's count;
    ``final``: the run's last commit)."""
    return {
        META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
        META_RUN_ID: run_id.encode(),
        META_STEP: str(step).encode(),
        META_LAYOUTS: json.dumps(layouts, sort_keys=True).encode(),
        META_NUM_TOKENS: encode_num_tokens(num_tokens),
        **({META_FINAL: b"true"} if final else {}),
    }


def encode_num_tokens(num_tokens: Sequence[int]) -> bytes:
    return base64.b64encode(np.asarray(num_tokens, dtype="<i4").tobytes())


def decode_num_tokens(metadata: Mapping[bytes, bytes] | None, num_rows: int) -> np.ndarray | None:
    """The per-row token counts a file's footer records, or None (absent or not ``num_rows``)."""
    raw = (metadata or {}).get(META_NUM_TOKENS)
    if raw is None:
        return None
    try:
        counts = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<i4")
    except ValueError:
        return None
    # A footer that does not describe exactly these rows is ignored, never trusted.
    if len(counts) != num_rows or (counts < 0).any():
        return None
    return counts.astype(np.int64)


def check_schema_version(metadata: Mapping[Any, Any] | None, *, where: str) -> int:
    """Return the schema version recorded in ``metadata``; refuse versions we cannot read.

    ``metadata`` is Parquet key-value metadata as pyarrow (bytes) or polars (str) returns it.
    """
    metadata = metadata or {}
    raw = metadata.get(META_SCHEMA_VERSION, metadata.get(META_SCHEMA_VERSION.decode()))
    if raw is None:
        raise SchemaVersionError("Parquet file carries no mmstore.schema_version", file=where)
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    # Only a plain decimal is a version: int() would also take " 1", "+1" and "1_0".
    if not (text.isascii() and text.isdigit()):
        raise SchemaVersionError(f"unreadable mmstore.schema_version {text!r}", file=where)
    version = int(text)
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"rollout schema version {version} is not supported (this mmstore reads "
            f"{SCHEMA_VERSION})",
            file=where,
        )
    return version


# Language-neutral names of the Arrow types the schema uses (Arrow's own str() of float32 is
# "float", which other languages read as a different width).
_TYPE_NAMES = {
    pa.string(): "string",
    pa.bool_(): "bool",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.float32(): "float32",
    pa.float64(): "float64",
}


def _describe_type(t: pa.DataType) -> Any:
    if pa.types.is_list(t):
        item = t.value_field
        return {"list": _describe_type(item.type), "item_nullable": item.nullable}
    if pa.types.is_struct(t):
        return {"struct": [_describe_field(t.field(i)) for i in range(t.num_fields)]}
    if t not in _TYPE_NAMES:
        raise TypeError(f"no language-neutral name for Arrow type {t}: add it to _TYPE_NAMES")
    return _TYPE_NAMES[t]


def _describe_field(f: pa.Field) -> dict[str, Any]:
    return {"name": f.name, "type": _describe_type(f.type), "nullable": f.nullable}


def describe(schema: pa.Schema = ROLLOUT_SCHEMA) -> dict[str, Any]:
    """The language-neutral description stored in ``schemas/rollout.v1.json``."""
    return {
        "name": "mmstore.rollout",
        "version": SCHEMA_VERSION,
        "partitioning": {
            "style": "hive",
            "fields": [_describe_field(f) for f in PARTITION_FIELDS],
        },
        "key_value_metadata": [
            k.decode()
            for k in (META_SCHEMA_VERSION, META_RUN_ID, META_STEP, META_LAYOUTS, META_NUM_TOKENS)
        ],
        "fields": [_describe_field(f) for f in schema],
    }


# The row columns the loader reads and checks; `metadata` stays on disk.
ROW_COLUMNS = [
    "sample_id",
    "group_id",
    "tokens",
    "prompt_len",
    "loss_mask",
    "logprobs",
    "reward",
    "advantage",
    "images",
    "videos",
    "policy_version",
]
# Columns added to the v1 schema since files were first written: a file may lack them, and a
# reader of such a file sees nulls (never an error).
OPTIONAL_COLUMNS = ("policy_version", "videos")
FILE_COLUMN = "_file"  # the committed file each row came from, added by the loader's scan
