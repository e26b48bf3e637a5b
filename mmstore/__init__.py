"""mmstore: an Arrow/Parquet rollout store for RL on vision-language models."""

from typing import TYPE_CHECKING, Any

from mmstore import errors
from mmstore._families import Family, Layout, Token, adapter_for, known_families, register_family
from mmstore._families.qwen_vl import QwenVL
from mmstore._format.columns import Column, per_sample, per_token
from mmstore._format.models import ImageRef, MediaRef, Rollout, VideoRef
from mmstore._format.schema import ROLLOUT_SCHEMA, SCHEMA_VERSION
from mmstore._lifecycle.export import export
from mmstore._lifecycle.gc import GcReport, ReleaseReport, gc, release_run
from mmstore._lifecycle.pins import list_pins, pin, pin_rows, readable_versions, unpin
from mmstore._lifecycle.upgrade import UpgradeReport, upgrade
from mmstore._lifecycle.verify import Problem, VerifyReport, verify
from mmstore._rows.invariants import check_rollout, truncate
from mmstore._rows.store import Store
from mmstore._rows.writer import RolloutWriter
from mmstore.errors import (
    CorruptFileError,
    DecompressionBombError,
    DeleteFailedError,
    DestinationExistsError,
    HashMismatchError,
    ImageDecodeError,
    ImageSizeError,
    InvalidArgumentError,
    InvalidRolloutError,
    LayoutMismatchError,
    LiveFinishedError,
    LiveTimeoutError,
    MediaError,
    MediaNotFoundError,
    MediaPermissionError,
    MmstoreError,
    NetworkError,
    NoMatchError,
    NotAStoreError,
    PinnedRowsError,
    ProducerConflictError,
    RunNotFoundError,
    SampleTooLongError,
    SchemaVersionError,
    StepNotCommittedError,
    TableConflictError,
    TableError,
    TableForkError,
    TableNotFoundError,
    TableVersionError,
    UnknownLayoutError,
    UnsupportedProcessorError,
    UntrustedURIError,
    UpgradeRequiredError,
    VersionMismatchError,
    VideoBombError,
    VideoDecodeError,
    WireFormatError,
    WorkerDiedError,
)

# The first release's name for the Qwen-VL adapter.
QwenVLAdapter = QwenVL

if TYPE_CHECKING:
    from mmstore import chat, debug, synth, wire
    from mmstore._loading.dataset import RolloutDataset, RolloutLoader
    from mmstore._loading.distinct import expand_images
    from mmstore._loading.forest import forest_attention_mask
    from mmstore._loading.live import LiveLoader
    from mmstore._loading.settings import Materialize

__version__ = "0.1.0"

# The loader needs torch (the `torch` extra); the rollout side and debugging do not, so
# these names import it only when first used.
_TORCH_NAMES = {
    "RolloutDataset": "._loading.dataset",
    "RolloutLoader": "._loading.dataset",
    "expand_images": "._loading.distinct",
    "forest_attention_mask": "._loading.forest",
    "LiveLoader": "._loading.live",
    "Materialize": "._loading.settings",
}
# Submodules imported on first use too: `debug` brings polars, `chat` jinja2, `synth` and
# `wire` their own stacks, and neither a writer nor the CLI's read-only commands need them
# all (`mmstore stats` answers in under a second on a small store).
_SUBMODULES = {"chat", "debug", "synth", "wire"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module(_TORCH_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mmstore' has no attribute {name!r}")


__all__ = [
    "CorruptFileError",
    "DeleteFailedError",
    "DestinationExistsError",
    "InvalidArgumentError",
    "NoMatchError",
    "RunNotFoundError",
    "StepNotCommittedError",
    "ROLLOUT_SCHEMA",
    "SCHEMA_VERSION",
    "DecompressionBombError",
    "GcReport",
    "HashMismatchError",
    "ImageDecodeError",
    "VideoBombError",
    "VideoDecodeError",
    "ImageRef",
    "ImageSizeError",
    "InvalidRolloutError",
    "Family",
    "Layout",
    "LayoutMismatchError",
    "LiveLoader",
    "LiveFinishedError",
    "LiveTimeoutError",
    "WorkerDiedError",
    "Token",
    "SampleTooLongError",
    "MediaError",
    "MediaNotFoundError",
    "MediaPermissionError",
    "MediaRef",
    "VideoRef",
    "MmstoreError",
    "NetworkError",
    "NotAStoreError",
    "Problem",
    "ProducerConflictError",
    "QwenVL",
    "QwenVLAdapter",
    "ReleaseReport",
    "Rollout",
    "Column",
    "per_token",
    "per_sample",
    "RolloutDataset",
    "RolloutLoader",
    "RolloutWriter",
    "SchemaVersionError",
    "Store",
    "TableConflictError",
    "TableError",
    "TableForkError",
    "TableNotFoundError",
    "TableVersionError",
    "UnknownLayoutError",
    "UnsupportedProcessorError",
    "UntrustedURIError",
    "UpgradeRequiredError",
    "VersionMismatchError",
    "PinnedRowsError",
    "VerifyReport",
    "WireFormatError",
    "adapter_for",
    "forest_attention_mask",
    "known_families",
    "register_family",
    "chat",
    "check_rollout",
    "debug",
    "errors",
    "synth",
    "expand_images",
    "Materialize",
    "export",
    "gc",
    "list_pins",
    "pin",
    "pin_rows",
    "readable_versions",
    "release_run",
    "truncate",
    "unpin",
    "upgrade",
    "UpgradeReport",
    "verify",
    "wire",
]
