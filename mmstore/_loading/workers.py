"""DataLoader worker processes: their setup (torch threads) and the stream they run
(batches in reusable shared buffers, small tensors inline, typed errors carried whole)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from mmstore._loading.buffers import BatchBuffers
from mmstore.errors import InvalidArgumentError, MmstoreError

RAISED = "_raised"  # a worker's batch stream ended in this error
# Tensors below this travel inside the pickle rather than each in shared memory of its own.
# Measured here per tensor sent (main + worker CPU): 16 KiB 0.4 ms inline against 1.0 ms
# in shared memory, 256 KiB 0.9 against 1.5; at 1 MiB shared memory wins (2.5 against 3.2).
INLINE_BYTES = 256 << 10


def check_worker_threads(threads: int | None, context: Any) -> int:
    """Torch threads per DataLoader worker: 1 unless asked (as DataLoader sets by itself).

    More than one is refused in forked workers: the parent's OpenMP thread pool does not
    survive ``fork`` (libgomp), and a forked worker that starts more threads hangs. With a
    ``spawn`` or ``forkserver`` context, ``threads`` (e.g. cores // num_workers) is safe.
    """
    if threads is None:
        return 1
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
        raise InvalidArgumentError(f"worker_threads must be a positive int, got {threads!r}")
    if threads > 1 and start_method(context) == "fork":
        raise InvalidArgumentError(
            f"worker_threads={threads} needs multiprocessing_context='spawn' or 'forkserver': "
            "forked workers hang when they start OpenMP threads"
        )
    return threads


def check_context(context: Any) -> Any:
    """A DataLoader ``multiprocessing_context``: None, a start method this platform has
    (``"fork"``, ``"spawn"``, ``"forkserver"``), or a :mod:`multiprocessing` context."""
    if context is None or isinstance(context, multiprocessing.context.BaseContext):
        return context
    methods = multiprocessing.get_all_start_methods()
    if not isinstance(context, str) or context not in methods:
        raise InvalidArgumentError(
            f"multiprocessing_context must be one of {methods} or a multiprocessing "
            f"context, got {context!r}"
        )
    return context


def start_method(context: Any) -> str:
    """How a DataLoader with ``multiprocessing_context=context`` starts its workers."""
    if context is None:
        return multiprocessing.get_start_method()
    return context if isinstance(context, str) else str(context.get_start_method())


def init_worker(threads: int, worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: keep torch to ``threads`` threads in this worker, and
    freed memory for the next batch (:func:`keep_freed_memory`)."""
    torch.set_num_threads(threads)
    keep_freed_memory()


# glibc's mallopt parameters, and the most M_MMAP_THRESHOLD may be (64-bit: 32 MiB).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations (glibc only; False
    elsewhere, where nothing changes).

    A worker builds every batch from the same large temporaries (a 1080p image's decoded
    pixels, the processor's float arrays, 12-24 MB each). glibc serves each from fresh pages
    of its own mapping and unmaps them when freed, so every batch faults all of them in
    again, at a cost on the order of the arithmetic in them: measured here, decoding and
    processing distinct 1080p screenshots fell from 54 to 40 ms each (torchvision backend)
    and from 110 to 98 ms (PIL).
    Blocks up to 32 MiB now come from the heap, and the heap is only given back above 1 GiB
    free: a worker holds about its largest batch's temporaries between batches.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (ValueError, OSError):  # not glibc: its mallopt differs, or there is none
        return False
    libc = ctypes.CDLL(None)
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


class WorkerStream(IterableDataset[dict[str, Any]]):
    """A batch stream as DataLoader workers run it: large tensors built in reusable shared
    memory (``buffers``, :mod:`.buffers`), and an mmstore error sent to the main process
    as itself, for :func:`reraise`.

    DataLoader re-raises a worker's exception as ``type(exc)(traceback_text)``, which keeps
    the type and the message but drops the context attributes (``err.sample_id``,
    ``err.image_index``, ``err.file``) a trainer would act on.
    """

    def __init__(
        self, stream: IterableDataset[dict[str, Any]], buffers: BatchBuffers | None
    ) -> None:
        self.stream = stream
        self.buffers = buffers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(self.stream) if self.buffers is None else self.buffers.labelled(self.stream)
        try:
            for batch in batches:
                yield inline_small(batch)
        except MmstoreError as exc:
            yield {RAISED: exc}


def inline_small(value: Any) -> Any:
    """``value`` (a batch) with its small tensors wrapped to travel inline (:class:`Inline`).

    A worker sends each tensor of a batch through shared memory of its own: a segment
    created, filled, and its file descriptor handed to the main process over a socket. For a
    batch's dozen small tensors (token ids, masks, grids, rewards) that handshake costs far
    more than their bytes (about 4 ms of CPU per batch here, against 0.8 ms inline).
    """
    if isinstance(value, torch.Tensor):
        dense_cpu = value.layout == torch.strided and value.device.type == "cpu"
        return Inline(value) if dense_cpu and value.nbytes < INLINE_BYTES else value
    if type(value) is dict:
        return {key: inline_small(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(inline_small(item) for item in value)
    return value


class Inline:
    """A tensor that pickles as its bytes; unpickled, it is a plain tensor again."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, ...]:
        tensor = self.tensor.detach().resolve_conj().resolve_neg().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return (_tensor_from_bytes, (data, tensor.dtype, tuple(tensor.shape)))


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    # A bytearray: a writable copy the tensor owns (the pickle's bytes are read-only).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def reraise(batch: dict[str, Any]) -> None:
    """Raise the error a worker's stream ended in (in the main process), context intact."""
    if RAISED in batch:
        exc = batch[RAISED]
        exc.add_note("(raised in a DataLoader worker)")
        raise exc
