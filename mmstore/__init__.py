"""mmstore: an Arrow/Parquet rollout store for RL on vision-language models."""

from . import wire
from ._adapters import Layout, QwenVLAdapter, adapter_for
from ._exceptions import (
    DecompressionBombError,
    HashMismatchError,
    ImageDecodeError,
    ImageSizeError,
    InvalidRolloutError,
    LayoutMismatchError,
    MediaError,
    MediaNotFoundError,
    MmstoreError,
    NotAStoreError,
    SchemaVersionError,
    UnsupportedProcessorError,
    UntrustedURIError,
    WireFormatError,
)
from ._invariants import check_rollout, truncate
from ._models import ImageRef, MediaRef, Rollout
from ._schema import ROLLOUT_SCHEMA, SCHEMA_VERSION
from ._store import Store
from ._writer import RolloutWriter

__version__ = "0.1.0"

__all__ = [
    "ROLLOUT_SCHEMA",
    "SCHEMA_VERSION",
    "DecompressionBombError",
    "HashMismatchError",
    "ImageDecodeError",
    "ImageRef",
    "ImageSizeError",
    "InvalidRolloutError",
    "Layout",
    "LayoutMismatchError",
    "MediaError",
    "MediaNotFoundError",
    "MediaRef",
    "MmstoreError",
    "NotAStoreError",
    "QwenVLAdapter",
    "Rollout",
    "RolloutWriter",
    "SchemaVersionError",
    "Store",
    "UnsupportedProcessorError",
    "UntrustedURIError",
    "WireFormatError",
    "adapter_for",
    "check_rollout",
    "truncate",
    "wire",
]
