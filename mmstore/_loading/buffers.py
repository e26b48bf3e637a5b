"""Shared-memory batch buffers that DataLoader workers reuse once the trainer lets go.

A batch leaves its worker in shared memory, and fresh shared memory is page-faulted in, page
by page, by the worker that fills it. On this project's machines that costs several times
the copy itself (a 1080p image's bf16 pixels, 11.5 MB: about 7 ms into fresh pages, 1.2 ms
into pages already in), so for a GRPO batch, whose images are mostly cache hits, it is most
of the batch's cost. A worker therefore keeps the shared storages of the batches it sent and
fills one again as soon as the main process has dropped every tensor on it.

The handshake is one byte per buffer in a table both sides map (anonymous shared memory,
created before the workers fork): the worker sets it when it fills the buffer; in the main
process a finalizer on the received storage clears it once the trainer holds no view of
it. A buffer still referenced anywhere in the main process is never written. Batches that
find no free buffer (the trainer keeps many, or they outgrew the pool) take fresh shared
memory, as torch's DataLoader does.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import get_worker_info

# Smaller tensors (token ids, grids, masks) take fresh memory: cheap, and not worth a buffer.
MIN_BYTES = 1 << 20
KEY = "_shared_buffers"  # the batch entry naming the buffers a batch's tensors sit in
_HEADROOM = 1.5  # a new buffer's size over the batch's: the next batches vary in size


class BatchBuffers:
    """The reusable shared storages of ``workers`` DataLoader workers, ``per_worker`` each."""

    def __init__(self, workers: int, per_worker: int) -> None:
        self.per_worker = per_worker
        self._busy = mmap.mmap(-1, workers * per_worker)  # MAP_SHARED: survives fork
        self._pool: list[torch.UntypedStorage] = []  # this worker's (filled after fork)
        self._filled: list[tuple[int, int]] = []  # (data_ptr, flag) since the last batch

    # -- in a worker -------------------------------------------------------------------

    def empty(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """An uninitialised tensor of ``like``'s dtype and ``shape`` in a free buffer of this
        worker (its pages already faulted in); None where no buffer fits."""
        info = get_worker_info()
        nbytes = like.element_size() * _numel(shape)
        if info is None or nbytes < MIN_BYTES:
            return None
        slot = self._free_slot(nbytes)
        if slot is None:
            return None
        flag = info.id * self.per_worker + slot
        self._busy[flag] = 1
        storage = self._pool[slot]
        self._filled.append((storage.data_ptr(), flag))
        return like.new_empty(0).set_(storage)[: _numel(shape)].view(shape)

    def _free_slot(self, nbytes: int) -> int | None:
        info = get_worker_info()
        assert info is not None
        free = [i for i in range(len(self._pool)) if not self._busy[info.id * self.per_worker + i]]
        fitting = [i for i in free if self._pool[i].nbytes() >= nbytes]
        if fitting:
            return fitting[0]
        # A free buffer too small for this batch gives its place to a larger one.
        slot = free[0] if free else len(self._pool) if len(self._pool) < self.per_worker else None
        if slot is None:
            return None
        storage = torch.UntypedStorage._new_shared(-(-int(nbytes * _HEADROOM) // 64) * 64)
        if slot == len(self._pool):
            self._pool.append(storage)
        else:
            self._pool[slot] = storage
        return slot

    def label(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with the flags of the buffers its tensors sit in, by key."""
        flags = dict(self._filled)
        self._filled.clear()
        batch[KEY] = {
            key: flags[value.untyped_storage().data_ptr()]
            for key, value in batch.items()
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in flags
        }
        return batch

    def labelled(self, batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """``batches`` built with these buffers at hand, each labelled for :meth:`track`."""
        with self.building():
            for batch in batches:
                yield self.label(batch)

    @contextmanager
    def building(self) -> Iterator[None]:
        """Batches built inside take free buffers (:func:`.stack.concat`); one that fails
        gives back the buffers it took (no trainer will ever hold, nor free, them)."""
        global active
        active = self
        try:
            yield
        except BaseException:
            for _, flag in self._filled:
                self._busy[flag] = 0
            self._filled.clear()
            raise
        finally:
            active = None

    # -- in the main process -----------------------------------------------------------

    def track(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Free each of ``batch``'s buffers for its worker once nothing here holds it."""
        for key, flag in batch.pop(KEY, {}).items():
            weakref.finalize(batch[key].untyped_storage(), _release, self._busy, flag)
        return batch


def batch_buffers(workers: int, start: str, prefetch_factor: int | None) -> BatchBuffers | None:
    """Reusable shared memory for the batches of ``workers`` DataLoader workers started by
    ``start``: forked workers only (they inherit the table of flags it shares)."""
    if not workers or start != "fork":
        return None
    # In flight (prefetch_factor each), being built, and held by the trainer.
    return BatchBuffers(workers, per_worker=(prefetch_factor or 2) + 2)


def _release(busy: mmap.mmap, flag: int) -> None:
    if not busy.closed:
        busy[flag] = 0


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# The buffers of the batch stream running in this worker: set by BatchBuffers.labelled, read
# by :func:`.stack.concat`, deep under each family's collate, which cannot pass them on.
active: BatchBuffers | None = None
