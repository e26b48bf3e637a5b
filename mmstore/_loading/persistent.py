"""Workers that outlive a pass: ``RolloutLoader(..., persistent_workers=True)``.

One DataLoader with persistent workers serves every pass of the loader (as the live
loader's does). Its sampler, in this process, names the batches of the current pass,
``(epoch, total, index)`` for ``index`` from the pass's first batch; DataLoader sends the
k-th name to worker ``k % n`` and yields the results in the sampler's order, so the order is
the planned one by construction, whatever a worker does.

Each worker serves the names it gets from a generator over the stream's batches ``index,
index + n, …`` (:meth:`.dataset._BatchStream.batches` or :meth:`.packed.PackedStream.batches`: the
code a worker of a loader without persistent workers runs, window by window, media read
ahead), so a pass costs what it costs there minus the start-up. A name it does not expect
next (a new pass, a resume, another epoch) starts a new generator at that batch: a batch is
always the one named. The workers' materializers (image caches, node cache handle) and the
packed plan of the last epoch stay with them for the loader's life.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data._utils import signal_handling

from mmstore._format.media import warm_decoder
from mmstore._loading.buffers import BatchBuffers
from mmstore._loading.workers import RAISED, init_worker, inline_small, reraise
from mmstore.errors import InvalidArgumentError, MmstoreError, WorkerDiedError

Task = tuple[int, int, int]  # (epoch, total, batch index): one batch of a pass


class Stream(Protocol):
    """What the persistent workers build batches from (both batch streams)."""

    def batches(self, epoch: int, indices: range) -> Generator[dict[str, Any], None, None]: ...


class _Passes:
    """The DataLoader's sampler: the batches of the current pass. Beginning a pass ends the
    previous one's iterator, so DataLoader sends none of its batches from then on."""

    def __init__(self) -> None:
        self.number = 0
        self.current = (0, 0, 0)  # (epoch, start, total)

    def begin(self, epoch: int, start: int, total: int) -> int:
        self.number += 1
        self.current = (epoch, start, total)
        return self.number

    def __iter__(self) -> Iterator[Task]:
        number, (epoch, start, total) = self.number, self.current
        for index in range(start, total):
            if self.number != number:
                return
            yield (epoch, total, index)


class _PassWork(Dataset[dict[str, Any]]):
    """What a persistent worker runs: a batch's name in, the batch out (large tensors in
    reusable shared memory, mmstore errors sent whole, see :mod:`.workers`)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.buffers: BatchBuffers | None = None  # forked workers' (set per DataLoader)
        self._run: Generator[dict[str, Any], None, None] | None = None
        self._next: Task | None = None  # the name self._run builds next

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_run": None, "_next": None, "buffers": None}

    def __getitem__(self, task: Task) -> dict[str, Any]:
        try:
            if self.buffers is None:
                return inline_small(self._build(task))
            with self.buffers.building():
                batch = self._build(task)
            return inline_small(self.buffers.label(batch))
        except MmstoreError as exc:
            return {RAISED: exc}

    def _build(self, task: Task) -> dict[str, Any]:
        epoch, total, index = task
        info = get_worker_info()
        step = info.num_workers if info else 1
        if self._next != task:
            self._stop()
            self._run = self.stream.batches(epoch, range(index, total, step))
        assert self._run is not None
        try:
            batch = next(self._run)
        except BaseException:
            self._stop()  # a generator that raised is finished: the next name starts anew
            raise
        self._next = (epoch, total, index + step)
        return batch

    def _stop(self) -> None:
        run, self._run, self._next = self._run, None, None
        if run is not None:
            run.close()  # lets its read-ahead go


class PersistentWorkers:
    """The workers of one loader's passes over one spec (a resumed snapshot needs new
    ones), started on the first pass, stopped by :meth:`close` or a dead worker."""

    def __init__(
        self,
        stream: Stream,
        spec: object,
        options: dict[str, Any],
        buffers: Callable[[], BatchBuffers | None],
        *,
        warm: bool,
    ) -> None:
        self.spec = spec
        self._work = _PassWork(stream)
        self._options = options  # DataLoader's worker settings
        self._new_buffers = buffers
        self._warm = warm
        self._passes = _Passes()
        self._loader: DataLoader[dict[str, Any]] | None = None
        self._it: Any = None  # the DataLoader's one iterator (private torch type)

    def batches(self, epoch: int, start: int, total: int) -> Iterator[dict[str, Any]]:
        """Batches ``start..total-1`` of ``epoch`` as the workers send them, errors raised,
        shared buffers tracked. An older pass's iterator raises once this one has begun."""
        number = self._passes.begin(epoch, start, total)
        it = self._resume(epoch)
        while True:
            if self._passes.number != number or self._it is not it:
                raise InvalidArgumentError(
                    "this iterator of a RolloutLoader with persistent_workers=True was ended "
                    "by a newer one or by close() (its workers serve one pass at a time): "
                    "iterate the loader again"
                )
            with self._deaths(f"while building epoch {epoch}", epoch):
                built = next(it, None)
            if built is None:
                return
            reraise(built)
            self._track(built)
            yield built

    def _resume(self, epoch: int) -> Any:
        """The DataLoader's iterator at the pass just begun: the living workers (checked
        alive, the pass left early received), or new ones."""
        if self._it is not None:
            self._refuse_the_dead(epoch)
            with self._deaths("as a pass began", epoch):
                self._receive_left()
        if self._it is None:
            return self._start()
        assert self._loader is not None
        with self._deaths("as a pass began", epoch):
            return iter(self._loader)  # torch's reset: the workers start the new pass

    def _start(self) -> Any:
        if self._warm:
            warm_decoder()  # imported once here, not once in each worker it forks (~50 ms)
        self._work.buffers = self._new_buffers()
        self._loader = DataLoader(
            self._work,
            batch_size=None,
            sampler=self._passes,
            persistent_workers=True,
            **self._options,
        )
        self._it = iter(self._loader)  # forks the workers
        # Unwatched by torch's SIGCHLD handler, which would raise RuntimeError in whatever
        # this process runs when a worker dies (the trainer's step, a checkpoint being
        # saved): a death comes out of the loader as WorkerDiedError instead, at the next
        # batch asked for (DataLoader checks its workers every 5 s while it waits) or as
        # the next pass begins.
        signal_handling._remove_worker_pids(id(self._it))
        self._it._worker_pids_set = False
        return self._it

    def _refuse_the_dead(self, epoch: int) -> None:
        dead = [w.pid for w in self._it._workers if not w.is_alive()]
        if dead:
            self.close()
            raise WorkerDiedError(
                f"DataLoader worker(s) {dead} of a RolloutLoader with persistent_workers=True "
                "died between passes (killed: the OOM killer's usual victim); its workers "
                "were let go: iterate again to start new ones",
                epoch=epoch,
            )

    def _receive_left(self) -> None:
        """Receive what the workers still build for a pass left early (a peek, a break) and
        drop it here, tracked: DataLoader's reset would drop those batches untracked, and
        their workers would never reuse the shared buffers they sit in."""
        try:
            for built in self._it:
                self._track(built)
        except Exception as exc:
            if _died(exc):
                raise
            # That pass's error is no one's now; its iterator may be stuck (a timeout).
            self.close()

    def _track(self, built: dict[str, Any]) -> None:
        if self._work.buffers is not None:
            self._work.buffers.track(built)

    @contextmanager
    def _deaths(self, when: str, epoch: int) -> Iterator[None]:
        """A dead worker as :class:`WorkerDiedError`, every worker let go."""
        try:
            yield
        except RuntimeError as exc:
            if not _died(exc):
                raise
            self.close()
            raise WorkerDiedError(
                f"a worker of a RolloutLoader with persistent_workers=True died {when} "
                f"({exc}); its workers were let go: iterate again to start new ones "
                "(load_state_dict first to continue after the batches handed out)",
                epoch=epoch,
            ) from exc

    def close(self) -> None:
        """Stop the workers; the next pass starts new ones."""
        it, self._it, self._loader = self._it, None, None
        if it is not None:
            it._shutdown_workers()


def _died(exc: BaseException) -> bool:
    """Whether ``exc`` is DataLoader's news of a dead worker (its own check's or its
    SIGCHLD handler's: both say "DataLoader worker (pid")."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker (pid")


def worker_options(
    num_workers: int,
    *,
    prefetch_factor: int | None,
    pin_memory: bool,
    timeout: float,
    multiprocessing_context: Any,
    worker_threads: int,
) -> dict[str, Any]:
    """DataLoader's worker settings as a RolloutLoader passes them (0 workers: none)."""
    return {
        "num_workers": num_workers,
        "prefetch_factor": prefetch_factor if num_workers else None,
        "pin_memory": pin_memory,
        "multiprocessing_context": multiprocessing_context if num_workers else None,
        "timeout": timeout,
        "worker_init_fn": functools.partial(init_worker, worker_threads),
    }
