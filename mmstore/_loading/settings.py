"""How committed rows become tensors: :class:`Materialize`, one frozen settings object.

Every reader that materializes (``RolloutDataset`` and the loaders over it, ``LiveLoader``,
the Ray reader, the wire-ref resolver) takes ``materialize=Materialize(...)``. The object
checks each setting, and the combinations that cannot work together, once, when it is
built; a reader then only applies it. A new materialization option is added in two places:
a field here (with its check), and the stage that applies it.

For one release the readers still take the same settings as flat keywords
(``RolloutDataset(store, p, dtype="bf16")``): :func:`settings_from` builds the object from
them, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmstore._format.columns import check_name
from mmstore._loading.materialize import DEFAULT_CACHE_BYTES, MissingPolicy, check_missing_policy
from mmstore._loading.node_cache import DEFAULT_NODE_CACHE_BYTES, default_directory
from mmstore._loading.options import flag, optional_whole, whole
from mmstore._loading.prefetch import DEFAULT_PREFETCH_BYTES, default_requests
from mmstore._rows.store import Store
from mmstore.errors import InvalidArgumentError

# Short names people write for the training dtype, beside torch's own attribute names.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


@dataclass(frozen=True, kw_only=True)
class Materialize:
    """How a committed row becomes the tensors a trainer gets. Frozen; every field is
    checked when the object is built (:class:`InvalidArgumentError` naming the field, or
    both fields of a combination that cannot work); ``replace(**changes)`` makes a checked
    copy.

    Per sample:
        dtype: the train dtype the processor's floating outputs are cast to
            (``torch.bfloat16``, or a name such as ``"bf16"``); integer outputs
            (``image_grid_thw``) are never cast.
        missing: ``"error"`` (missing media raises :class:`MediaNotFoundError`) or
            ``"placeholder_zero_loss"`` (a zero image of the stored size, the sample kept
            out of the loss and counted in ``images_missing``).
        max_len: truncate samples to this many tokens (>= 1), whole images kept.
        columns: extra columns the rows' runs declared (``store.writer(columns=...)``)
            that each sample carries into the batch, by name (per token cut with the
            tokens); no other column is read. Also taken as ``columns=`` by every reader.

    Per batch:
        pad_token_id: the token padding is filled with (>= 0); ``None``: the family's.
        dummy_image: a padded batch without images gets one tiny zero image out of the loss,
            so every FSDP rank runs the vision tower (packed micro-batches get theirs from
            the packing plan, so packed loaders refuse it).
        distinct_images: each distinct image once per batch, plus ``image_index``
            (:func:`mmstore.expand_images` gives the plain batch back).

    Caches (processed images):
        cache_bytes: each process's cache, in bytes (0: none).
        node_cache_bytes: the node-wide cache shared by every worker and rank of the
            machine. ``None``: 2 GiB where a directory is usable, else off; ``0``: off.
        node_cache_dir: where the node cache lives; ``None``: ``$MMSTORE_NODE_CACHE``, else
            a per-user folder on ``/dev/shm``.

    Read-ahead (object stores):
        prefetch_requests: media reads in flight per worker. ``None``: 16 on a remote
            store, none on a local one; ``0``: off.
        prefetch_bytes: no new read starts while this many bytes wait (>= 1); ``None``:
            64 MiB. Refused on a local store without ``prefetch_requests`` (it would bound
            nothing).

    Device stage:
        preprocess_device: run the (torchvision) image processor on this device in the main
            process; workers only verify and decode. The node cache does not apply then, so
            ``node_cache_bytes``/``node_cache_dir`` given with it are refused.
    """

    dtype: torch.dtype | str = torch.bfloat16
    missing: MissingPolicy = "error"
    max_len: int | None = None
    columns: tuple[str, ...] = ()
    pad_token_id: int | None = None
    dummy_image: bool = False
    distinct_images: bool = False
    cache_bytes: int = DEFAULT_CACHE_BYTES
    node_cache_bytes: int | None = None
    node_cache_dir: str | None = None
    prefetch_requests: int | None = None
    prefetch_bytes: int | None = None
    preprocess_device: str | torch.device | None = None

    def __post_init__(self) -> None:
        check_missing_policy(self.missing)
        checked = {
            "dtype": training_dtype(self.dtype),
            "max_len": optional_whole("max_len", self.max_len, minimum=1),
            "columns": _column_names(self.columns),
            "pad_token_id": optional_whole("pad_token_id", self.pad_token_id, minimum=0),
            "dummy_image": flag("dummy_image", self.dummy_image),
            "distinct_images": flag("distinct_images", self.distinct_images),
            "cache_bytes": whole("cache_bytes", self.cache_bytes, minimum=0),
            "node_cache_bytes": optional_whole(
                "node_cache_bytes", self.node_cache_bytes, minimum=0
            ),
            "node_cache_dir": _directory("node_cache_dir", self.node_cache_dir),
            "prefetch_requests": optional_whole(
                "prefetch_requests", self.prefetch_requests, minimum=0
            ),
            "prefetch_bytes": optional_whole("prefetch_bytes", self.prefetch_bytes, minimum=1),
            "preprocess_device": _device(self.preprocess_device),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.preprocess_device is not None and self.node_cache_asked:
            raise InvalidArgumentError(
                "node_cache_bytes/node_cache_dir do not apply with "
                f"preprocess_device={str(self.preprocess_device)!r}: workers only decode "
                "images, so nothing is processed for the node cache to share; set "
                "node_cache_bytes=0, or drop preprocess_device"
            )

    @property
    def node_cache_asked(self) -> bool:
        """A node cache asked for by a setting (not merely the default)."""
        if self.node_cache_bytes == 0:
            return False
        return self.node_cache_bytes is not None or self.node_cache_dir is not None

    def replace(self, **changes: Any) -> Materialize:
        """A copy with ``changes``, checked as a new object is."""
        return dataclasses.replace(self, **changes)

    def node_cache_place(self) -> tuple[str | None, int]:
        """Where the node cache lives here and its bound in bytes (0: off)."""
        where = self.node_cache_dir or default_directory()
        if self.node_cache_bytes is None:
            return where, DEFAULT_NODE_CACHE_BYTES if where else 0
        if self.node_cache_bytes and not where:
            raise InvalidArgumentError(
                f"node_cache_bytes={self.node_cache_bytes} needs a directory: pass "
                "node_cache_dir (there is no writable /dev/shm here and $MMSTORE_NODE_CACHE "
                "is unset)"
            )
        return where, self.node_cache_bytes

    def read_ahead_bound(self, store: Store) -> int:
        """The read-ahead's byte bound on ``store``, refused where it would bound nothing."""
        if self.prefetch_bytes is None:
            return DEFAULT_PREFETCH_BYTES
        if self.prefetch_requests is None and default_requests(store) == 0:
            raise InvalidArgumentError(
                f"prefetch_bytes={self.prefetch_bytes} bounds nothing: a local store reads "
                "without read-ahead; pass prefetch_requests (reads in flight) to read ahead "
                "here, or drop prefetch_bytes"
            )
        return self.prefetch_bytes

    def refuse_all_but(self, applied: Collection[str], *, reader: str) -> None:
        """Refuse settings ``reader`` does not apply (those moved from their defaults)."""
        unused = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in applied and getattr(self, f.name) != getattr(_DEFAULTS, f.name)
        ]
        if unused:
            raise InvalidArgumentError(
                f"{reader} does not apply the materialize settings {unused}: it applies only "
                f"{sorted(applied)}; drop the others"
            )


FIELDS = frozenset(f.name for f in dataclasses.fields(Materialize))


def settings_from(
    materialize: Any,
    flat: Mapping[str, Any],
    *,
    reader: str,
    base: Materialize | None = None,
    accepted: Collection[str] = FIELDS,
) -> Materialize:
    """The settings a reader uses: ``materialize``, or ``base`` (default: ``Materialize()``)
    with the flat keywords of an older call (one release, with a DeprecationWarning).

    A flat keyword that is no setting is a TypeError, as for any unknown keyword; one given
    beside ``materialize`` is refused, since which should win would be a guess."""
    unknown = sorted(set(flat) - set(accepted))
    if unknown:
        raise TypeError(f"{reader} got unexpected keyword argument(s) {unknown}")
    flat = dict(flat)
    columns = flat.pop("columns", None)  # a keyword of every reader, not a deprecated one
    settings = _settings(materialize, flat, reader=reader, base=base)
    if columns is None:
        return settings
    if settings.columns:
        raise InvalidArgumentError(
            f"{reader} got columns= and materialize=Materialize(columns=...): give one"
        )
    return settings.replace(columns=columns)


def _settings(
    materialize: Any, flat: Mapping[str, Any], *, reader: str, base: Materialize | None
) -> Materialize:
    if materialize is not None and not isinstance(materialize, Materialize):
        raise InvalidArgumentError(
            f"materialize must be an mmstore.Materialize, got {type(materialize).__name__}"
        )
    if not flat:
        return materialize or base or _DEFAULTS
    if materialize is not None:
        raise InvalidArgumentError(
            f"{reader} got materialize= and the flat keyword(s) {sorted(flat)}: put them in "
            "the Materialize object"
        )
    warnings.warn(
        f"{reader}({', '.join(f'{k}=' for k in flat)}...) is deprecated: pass "
        f"materialize=mmstore.Materialize({', '.join(f'{k}=...' for k in flat)})",
        DeprecationWarning,
        stacklevel=3,
    )
    return (base or _DEFAULTS).replace(**flat)


def training_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.float16"``,
    ``"bf16"``); anything else raises :class:`InvalidArgumentError`."""
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        found = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
        if not isinstance(found, torch.dtype):
            raise InvalidArgumentError(
                f"dtype {dtype!r} names no torch dtype; pass torch.bfloat16 or a name such as "
                "'bfloat16', 'float16', 'float32' (or 'bf16', 'fp16', 'fp32')"
            )
        dtype = found
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgumentError(
            f"dtype must be a floating torch dtype (pixel_values are cast to it), got {dtype!r}"
        )
    return dtype


def rank_and_world(rank: Any, world_size: Any) -> tuple[int, int]:
    """This process's shard: as given, or from ``torch.distributed`` when both are None."""
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = whole("world_size", 1 if world_size is None else world_size, minimum=1)
    if rank is None and world > 1:
        raise InvalidArgumentError(
            f"world_size={world} without rank: every process would read rank 0's share; "
            "pass rank too, or neither (to take both from torch.distributed)"
        )
    shard = whole("rank", 0 if rank is None else rank, minimum=0)
    if shard >= world:
        raise InvalidArgumentError(f"rank {shard} is outside world_size {world}")
    return shard, world


def _column_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"columns must be a list of column names, got {value!r}")
    names = tuple(dict.fromkeys(value))
    for name in names:
        check_name(name)
    return names


def _directory(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise InvalidArgumentError(f"{name} must be a path, got {value!r}")
    return os.fspath(value)


def _device(value: Any) -> str | torch.device | None:
    # Whether torch and the processor can use it is checked where the processor is known
    # (mmstore._loading.device.check_device); here only what kind of value it is.
    if value is None or isinstance(value, str | torch.device):
        return value
    raise InvalidArgumentError(f"preprocess_device must be a device or its name, got {value!r}")


# Built last: its checks call the functions above.
_DEFAULTS = Materialize()
