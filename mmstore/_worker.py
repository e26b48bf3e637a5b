"""DataLoader worker processes: their setup (torch threads, how they keep memory) and the
stream they run (batches in reusable shared buffers, typed errors carried whole).

A worker's hot loop allocates and frees the same large buffers for every image: the decoded
image, the processor's float temporaries (tens of MB for a 1080p screenshot), the cast
pixels, the batch. glibc serves blocks that large with a fresh ``mmap`` and returns them with
``munmap``, so every one of them is page-faulted in again, page by page: on this project's
machines that costs as much as the copy itself (a 46 MB ``torch.cat``: 28 ms fresh, 5 ms into
reused memory). A worker therefore keeps what it frees (``mallopt``): its resident memory
stays at its peak (a few batches' worth) instead of going back to the system between images.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import multiprocessing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset

from ._exceptions import InvalidArgumentError, MmstoreError

if TYPE_CHECKING:
    from ._buffers import BatchBuffers

RAISED = "_raised"  # a worker's batch stream ended in this error

# glibc's mallopt parameters (malloc.h): blocks below the mmap threshold come from the heap,
# and the heap's free top is returned to the system only beyond the trim threshold.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # the largest block glibc still takes from its heap
_TRIM_THRESHOLD = 2**31 - 1  # the most mallopt takes (an int): in effect, never trim


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


def start_method(context: Any) -> str:
    """How a DataLoader with ``multiprocessing_context=context`` starts its workers."""
    if context is None:
        return multiprocessing.get_start_method()
    return context if isinstance(context, str) else str(context.get_start_method())


def init_worker(threads: int, worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: torch to ``threads`` threads; freed memory kept."""
    torch.set_num_threads(threads)
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """Make glibc keep large freed blocks for reuse (see the module docstring); False where
    the C library is not glibc (musl, macOS), which is left as it is."""
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    # The trim threshold first: raising the mmap threshold alone lets glibc trim the heap.
    return bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    )


@functools.cache
def _libc_function(name: str, argtypes: tuple[Any, ...]) -> Any:
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = list(argtypes)
    return function


class WorkerStream(IterableDataset[dict[str, Any]]):
    """A batch stream as DataLoader workers run it: large tensors built in reusable shared
    memory (``buffers``, :mod:`._buffers`), and an mmstore error sent to the main process
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
            yield from batches
        except MmstoreError as exc:
            yield {RAISED: exc}


def reraise(batch: dict[str, Any]) -> None:
    """Raise the error a worker's stream ended in (in the main process), context intact."""
    if RAISED in batch:
        exc = batch[RAISED]
        exc.add_note("(raised in a DataLoader worker)")
        raise exc
