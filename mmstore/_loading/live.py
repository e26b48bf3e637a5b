"""The live loader: a trainer consumes rollouts as they are committed (asynchronous RL),
every sample exactly once across restarts, staleness bounded per group.

The parent process follows the table's log (:mod:`mmstore._rows.follow`: one read of the
next entry per poll, footers and small columns of each new file, never delta-rs in a
worker), cuts the new rows into groups, decides each step from the groups waiting
(:mod:`mmstore._planning.live`) and plans its micro-batches (the packed loader's
:func:`~mmstore._planning.pack.plan_epoch`, one step at a time). Persistent DataLoader workers
build the micro-batches: each task names the rows it packs, so the workers, their image
caches and the node cache live as long as the loader, and a step never re-forks workers
nor re-reads a file the parent already planned from.

A step is consumed when its last micro-batch has been yielded: ``state_dict()`` then
records the position in commit order after it (:class:`~mmstore._rows.follow.Cursor`), and
a loader that loads it gives exactly the steps an uninterrupted one would have given. With
``done_column`` a trajectory's rows are held across commits until a row says it is done;
the position stays at the oldest held row, and the state also lists the groups past it
that steps consumed meanwhile (a resume follows from the position and skips them).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from mmstore._families import Family, adapter_for
from mmstore._format.columns import check_name
from mmstore._loading.buffers import BatchBuffers, batch_buffers
from mmstore._loading.collate import collate
from mmstore._loading.inputs import input_names, model_inputs
from mmstore._loading.layouts import refuse_other_layouts
from mmstore._loading.materialize import Materialized, row_window
from mmstore._loading.microbatch import pack
from mmstore._loading.options import flag, optional_whole, seconds, whole
from mmstore._loading.packed import UnitReader
from mmstore._loading.prefetch import default_requests
from mmstore._loading.settings import FIELDS, Materialize, rank_and_world, settings_from
from mmstore._loading.spec import MaterializerSource
from mmstore._loading.workers import (
    RAISED,
    check_context,
    init_worker,
    inline_small,
    reraise,
    start_method,
)
from mmstore._planning.live import UNKNOWN, StepTake, rank_shares, take_step
from mmstore._planning.pack import budget_for, plan_epoch
from mmstore._rows.check import Sample
from mmstore._rows.follow import Cursor, FollowedFile, LogFollower
from mmstore._rows.lengths import shared_between
from mmstore._rows.snapshot import WorkUnit, read_units
from mmstore._rows.store import Store
from mmstore._rows.versions import table_of
from mmstore.errors import (
    GroupTooLarge,
    InvalidArgumentError,
    LiveFinishedError,
    LiveTimeoutError,
    MmstoreError,
    SampleTooLongError,
    TableVersionError,
    WorkerDiedError,
)

STATE_KIND = "mmstore.LiveLoader"
STATE_VERSION = 1
# Seconds between reads of the next log entry while a step waits. Locally a change of the
# log directory wakes the wait at once (see mmstore._rows.follow): the interval only bounds
# how long a missed notification (a network file system) could delay a commit. On an object
# store a poll is a GET of the next entry (and a HEAD telling "not there" from a failure):
# at most 2 requests a second.
LOCAL_POLL = 0.25
REMOTE_POLL = 1.0
LOG_DIRECTORY = "rollouts/_delta_log"
log = logging.getLogger("mmstore.live")


@dataclass(frozen=True)
class _Part:
    """Rows ``[start, stop)`` of a followed file: one group_id's run."""

    file: FollowedFile
    start: int
    stop: int
    policy: int  # the oldest policy version of its rows, UNKNOWN if none recorded

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def cursor(self) -> Cursor:
        return Cursor(self.file.version, self.file.index, self.start)

    @property
    def key(self) -> tuple[str, str | None]:
        """(run, group_id): the trajectory the part belongs to (a null group_id: none)."""
        return self.file.file.run_id, self.file.facts.columns["group_id"][self.start].as_py()


@dataclass(frozen=True)
class _Group:
    """What a step takes whole: a group's run of rows in one file, or (``done_column``) a
    trajectory's parts over the commits that added them, in commit order."""

    parts: tuple[_Part, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def policy(self) -> int:
        known = [p.policy for p in self.parts if p.policy != UNKNOWN]
        return min(known) if known else UNKNOWN

    @property
    def cursor(self) -> Cursor:
        return self.parts[0].cursor

    @property
    def rows(self) -> list[tuple[FollowedFile, int]]:
        return [(p.file, r) for p in self.parts for r in range(p.start, p.stop)]

    def loss_tokens(self) -> int:
        return sum(p.file.loss_tokens(p.start, p.stop) for p in self.parts)

    def describe(self) -> str:
        last = self.parts[-1].file.file
        (run, group_id), commits = self.parts[0].key, len(self.parts)
        where = f"step {last.step}"
        if commits > 1:
            where = f"{commits} commits, up to step {last.step}"
        return (
            f"run {run!r} {where} group {group_id!r} ({self.size} samples, policy version "
            f"{self.policy})"
        )


@dataclass(frozen=True)
class MicroTask:
    """One micro-batch for a worker to build: which rows, packed how."""

    step: int
    micro: int
    num_micro: int
    dummy: bool  # add the family's dummy image (another rank's micro-batch has images)
    rows: tuple[tuple[WorkUnit, int, int], ...]  # (unit, row within it, tokens expected)


class _Tasks:
    """The DataLoader's sampler: the current step's tasks (set before each iteration)."""

    def __init__(self) -> None:
        self.tasks: list[MicroTask] = []

    def __iter__(self) -> Iterator[MicroTask]:
        return iter(list(self.tasks))

    def __len__(self) -> int:
        return len(self.tasks)


class _MicroBatches(Dataset[dict[str, Any]]):
    """What a worker runs: a task in, a micro-batch out (errors sent whole, see
    :func:`~mmstore._loading.workers.reraise`). Its reader and materializer are built in
    each worker on first use and kept as long as the worker lives."""

    def __init__(
        self,
        store: Store,
        source: MaterializerSource,
        *,
        packed: bool,
        pad_token_id: int | None,
        distinct_images: bool,
        dummy_image: bool,
        prefix_sharing: bool = False,
    ) -> None:
        self.store = store
        self.source = source
        self.packed = packed
        self.prefix_sharing = prefix_sharing
        self.pad_token_id = pad_token_id
        self.distinct_images = distinct_images
        self.dummy_image = dummy_image
        self._reader: UnitReader | None = None
        # Forked workers' reusable shared memory (set as the DataLoader is made).
        self.buffers: BatchBuffers | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None, "buffers": None}

    def __getitem__(self, task: MicroTask) -> dict[str, Any]:
        try:
            if get_worker_info() is None:
                return self._build(task)
            if self.buffers is None:
                return inline_small(self._build(task))
            # Large tensors into buffers the trainer let go, small ones inside the pickle.
            with self.buffers.building():
                batch = self._build(task)
            return inline_small(self.buffers.label(batch))
        except MmstoreError as exc:
            return {RAISED: exc}

    def _build(self, task: MicroTask) -> dict[str, Any]:
        if self._reader is None:
            self._reader = UnitReader(self.store, self.source)
        samples = [self._reader.sample(unit, i, n) for unit, i, n in task.rows]
        family, dtype = self.source.adapter, self.source.dtype
        if self.packed:
            batch = pack(
                samples,
                family,
                add_dummy=task.dummy,
                dtype=dtype,
                pad_token_id=self.pad_token_id,
                distinct_images=self.distinct_images,
                prefix_sharing=self.prefix_sharing,
            )
        else:
            batch = collate(
                samples or [_filler(family, self.pad_token_id)],
                family,
                pad_token_id=self.pad_token_id,
                dummy_image=self.dummy_image,
                dtype=dtype,
                distinct_images=self.distinct_images,
            )
            batch["is_filler"] = torch.tensor([False] * len(samples) or [True])
        batch.update(step=task.step, micro=task.micro, num_micro=task.num_micro)
        return batch


def _filler(family: Family, pad_token_id: int | None) -> Materialized:
    """A one-token, zero-loss row: a rank whose share of a padded step is empty still runs
    its forward and backward passes in lock-step."""
    pad = family.layout.pad_token_id if pad_token_id is None else pad_token_id
    return Sample(
        sample_id="",
        group_id=None,
        input_ids=torch.tensor([pad]),
        loss_mask=torch.zeros(1, dtype=torch.bool),
        logprobs=None,
        prompt_len=0,
        reward=0.0,
        advantage=0.0,
        images=[],
    )


class LiveLoader:
    """Follows runs of a store as they are written and yields each training step's
    micro-batches once its rollouts are committed: every sample exactly once, in commit
    order, across restarts of either side; groups never split; staleness bounded.

    ``for mb in live.next_step(policy_version=step, timeout=600): ...``, then save
    ``live.state_dict()`` with the checkpoint. See ``docs/live.md``.

    Args:
        store: the :class:`Store` to follow.
        image_processor: as for :class:`RolloutDataset`.

    What a step holds:
        runs: the run id(s) to follow; they need not exist yet.
        batch_size: samples per rank per step; a step is the next ``batch_size x
            world_size`` samples in commit order that no earlier step took, whole groups
            only (a group that would overflow waits, and the step is smaller).
        max_tokens: pack each step into micro-batches of at most this many tokens (the same
            number of micro-batches on every rank); ``None``: one padded batch per rank.
        prefix_sharing: with ``max_tokens``, each micro-batch a prefix forest (as for
            :class:`RolloutLoader`): a group's samples in one micro-batch, each shared
            prefix run once; call the model with :meth:`model_inputs`.
        max_staleness: a group generated by a policy older than ``policy_version -
            max_staleness`` is not trained (counted in :meth:`stats`, on each batch, and
            named in the ``mmstore.live`` debug log). ``None``: no bound.
        done_column: a ``per_sample("bool")`` column the runs declare, for trajectories
            committed turn by turn: the rows of one ``group_id`` of a run are held, over
            any number of commits, while the last of them says False, and join the steps
            whole (as one group, at the commit that ends them) once a row of the group
            says True or nothing (null, or a file without the column). A run's final
            commit ends its groups still held. ``None``: every commit's groups are whole.
        rank, world_size: as for :class:`RolloutDataset` (from ``torch.distributed`` when
            initialized). Ranks compute each step from the log alone, without talking.

    How rows become tensors: ``materialize``, a :class:`Materialize` as for
    :class:`RolloutDataset` (``dummy_image`` applies to padded steps only; for one release
    its fields are also taken as flat keywords, with a DeprecationWarning).

    Workers: ``num_workers`` persistent DataLoader workers (0: build in this process),
    ``prefetch_factor``, ``multiprocessing_context``. ``poll_interval``: seconds between
    reads of the next log entry while waiting (default: 0.25 s locally, where a new entry
    also wakes the wait at once; 1 s on S3, at most 2 requests a second).
    """

    def __init__(
        self,
        store: Store,
        image_processor: Any,
        *,
        # what a step holds
        runs: str | Iterable[str],
        batch_size: int,
        max_tokens: int | None = None,
        prefix_sharing: bool = False,
        max_staleness: int | None = None,
        done_column: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        # how rows become tensors
        materialize: Materialize | None = None,
        # workers and waiting
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        poll_interval: float | None = None,
        **flat_settings: Any,
    ) -> None:
        settings = settings_from(materialize, flat_settings, reader="LiveLoader")
        self.materialize = settings
        self.store = store
        self.batch_size = whole("batch_size", batch_size, minimum=1)
        self.max_tokens = optional_whole("max_tokens", max_tokens, minimum=1)
        self.prefix_sharing = flag("prefix_sharing", prefix_sharing)
        if self.prefix_sharing and self.max_tokens is None:
            raise InvalidArgumentError(
                "prefix_sharing=True builds packed micro-batches: set max_tokens too"
            )
        self.max_staleness = optional_whole("max_staleness", max_staleness, minimum=0)
        if done_column is not None:
            check_name(done_column)
        self.done_column = done_column
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.max_len = settings.max_len
        self.num_workers = whole("num_workers", num_workers, minimum=0)
        if not self.num_workers and (prefetch_factor is not None or multiprocessing_context):
            raise InvalidArgumentError(
                "prefetch_factor and multiprocessing_context apply to workers: set num_workers"
            )
        self.prefetch_factor = optional_whole("prefetch_factor", prefetch_factor, minimum=1)
        self.multiprocessing_context = check_context(multiprocessing_context)
        if settings.dummy_image and self.max_tokens is not None:
            raise InvalidArgumentError(
                "dummy_image applies to padded batches; packed micro-batches add the dummy "
                "image where another rank's micro-batch has images"
            )
        self.adapter = adapter_for(image_processor)
        # Its workers build whole micro-batches: no device stage in this process (yet).
        settings.refuse_all_but(FIELDS - {"preprocess_device"}, reader="LiveLoader")
        self._work = _MicroBatches(
            store,
            MaterializerSource.of(store, self.adapter, settings),
            packed=self.max_tokens is not None,
            pad_token_id=settings.pad_token_id,
            distinct_images=settings.distinct_images,
            dummy_image=settings.dummy_image,
            prefix_sharing=self.prefix_sharing,
        )
        self._local = not default_requests(store)  # object stores read ahead by default
        if poll_interval is None:
            poll_interval = LOCAL_POLL if self._local else REMOTE_POLL
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float):
            raise InvalidArgumentError(f"poll_interval must be seconds, got {poll_interval!r}")
        if not 0 < poll_interval <= 60:
            raise InvalidArgumentError(f"poll_interval must be in (0, 60], got {poll_interval}")
        self.poll_interval = float(poll_interval)
        self._runs = [runs] if isinstance(runs, str) else list(runs)
        self._budget = None
        if self.max_tokens is not None:
            dummy = self.adapter.num_tokens(*self.adapter.dummy_size)
            if self.max_tokens <= dummy:
                raise InvalidArgumentError(
                    f"max_tokens={self.max_tokens} leaves no room beside the {dummy}-token "
                    "dummy image"
                )
            # Room for the dummy image kept in every micro-batch: a step's images are not
            # known before it is planned, and the budget must not change from step to step.
            self._budget = budget_for(self.max_tokens, dummy, any_images=True)
        self._tasks = _Tasks()
        self._loader: DataLoader[dict[str, Any]] | None = None
        self._id: str | None = None  # the table's, read when a state is first taken or loaded
        self._start(Cursor(0, 0, 0), step=0, stats=_new_stats())

    @property
    def model_input_names(self) -> tuple[str, ...]:
        """The batch keys the model's ``forward`` takes (as ``RolloutLoader``'s; refused
        where :meth:`model_inputs` must build a mask)."""
        return input_names(self.adapter, **self._form())

    def model_inputs(self, batch: Mapping[str, Any], model: Any = None) -> dict[str, Any]:
        """What to call the model with (as :meth:`RolloutLoader.model_inputs`)."""
        return model_inputs(batch, self.adapter, model, **self._form())

    def _form(self) -> dict[str, bool]:
        return {"packed": self.max_tokens is not None, "prefix_sharing": self.prefix_sharing}

    # -- position ------------------------------------------------------------------------

    def _start(
        self,
        cursor: Cursor,
        *,
        step: int,
        stats: dict[str, int],
        finished: Iterable[str] = (),
        consumed: Iterable[Cursor] = (),
    ) -> None:
        self._follower = LogFollower(
            self.store,
            self._runs,
            start=cursor,
            max_len=self.max_len,
            prefixes=self.prefix_sharing,
            done_column=self.done_column,
        )
        self._finished = set(finished)  # runs whose final commit has been followed
        self._waiting: list[_Group] = []
        # Trajectories whose last row said done=False, by (run, group_id), oldest first.
        self._held: dict[tuple[str, str | None], list[_Part]] = {}
        # Parts past the cursor that steps consumed (a held trajectory keeps the cursor
        # back while later groups are trained): a resume follows from the cursor again and
        # skips these.
        self._consumed = set(consumed)
        self._unchecked: deque[FollowedFile] = deque()  # read from the log, not yet checked
        self.step = step
        self._stats = stats

    @property
    def cursor(self) -> Cursor:
        """The first position in commit order no step has consumed (parts past it that
        steps consumed are in the state's ``consumed``)."""
        firsts = [g.cursor for g in self._waiting] + [p[0].cursor for p in self._held.values()]
        if self._unchecked:
            first = self._unchecked[0]
            firsts.append(Cursor(first.version, first.index, first.first_row))
        return min(firsts, default=Cursor(self._follower.version + 1, 0, 0))

    def stats(self) -> dict[str, int]:
        """Counts since the run began (restored from a state): steps, samples trained (all
        ranks), stale groups and samples not trained, samples removed from the table (a
        released run) before they were trained, groups waiting now, trajectories held now
        (``done_column``)."""
        return {
            **self._stats,
            "waiting_groups": len(self._waiting),
            "held_trajectories": len(self._held),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands after the last completed step: load it into a new loader to
        continue exactly there. The same on every rank (any rank's state resumes any)."""
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "step": self.step,
            "cursor": self.cursor.as_list(),
            "table": self._table_id(),
            "finished_runs": sorted(self._finished),
            "consumed": sorted(c.as_list() for c in self._consumed),
            **self._settings(),
            "stats": dict(self._stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken (any ``num_workers``; the same settings)."""
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            raise InvalidArgumentError("not a LiveLoader state (RolloutLoader states differ)")
        if state.get("version") != STATE_VERSION:
            raise InvalidArgumentError(
                f"LiveLoader state version {state.get('version')!r} is not supported"
            )
        self._check_settings(state)
        stats = state.get("stats")
        # removed_samples came later: a state from before it has counted none.
        if not isinstance(stats, dict) or not set(_new_stats()) - {"removed_samples"} <= set(
            stats
        ) <= set(_new_stats()):
            raise InvalidArgumentError("LiveLoader state has no valid stats")
        step = whole("step", state.get("step"), minimum=0)
        cursor = Cursor.from_state(state.get("cursor"))
        self._check_same_table(state.get("table"), cursor)
        stats = {**_new_stats(), **stats}
        finished = state.get("finished_runs", [])
        if not isinstance(finished, list) or not set(finished) <= set(self._runs):
            raise InvalidArgumentError(f"LiveLoader state has invalid finished_runs {finished!r}")
        consumed = state.get("consumed", [])  # (a state from before done_column: none)
        if not isinstance(consumed, list):
            raise InvalidArgumentError(f"LiveLoader state has invalid consumed {consumed!r}")
        past = [Cursor.from_state(c) for c in consumed]
        if any(c < cursor for c in past):
            raise InvalidArgumentError("LiveLoader state has consumed parts before its cursor")
        self._follower.close()
        self._start(cursor, step=step, stats=dict(stats), finished=finished, consumed=past)

    def _table_id(self) -> str | None:
        if self._id is None:
            self._id = table_of(self.store).table_id()
        return self._id

    def _check_same_table(self, saved: Any, cursor: Cursor) -> None:
        """Refuse a state of another table (its cursor would skip or repeat this table's
        rows) or one whose position lies beyond this table's log."""
        mine = self._table_id()
        if saved is not None and mine is not None and saved != mine:
            raise InvalidArgumentError(
                f"LiveLoader state was taken from another table (id {saved}); this store's "
                f"table is {mine}: load a state of this store, or start afresh"
            )
        if cursor.version == 0:
            return
        table = table_of(self.store)
        try:
            before = table.log_entry(cursor.version - 1)
        except TableVersionError:  # cleaned up below a checkpoint: it was committed
            return
        if before is None:
            raise InvalidArgumentError(
                f"LiveLoader state's position (table version {cursor.version}) lies beyond "
                "this table's log: it was taken from another store"
            )

    def _check_settings(self, state: dict[str, Any]) -> None:
        """Refuse a state of other runs: rows of a run added since were passed by its cursor
        (they would never be trained). Everything else only shapes the steps still to come,
        so it may change at a resume: the remedy an error names (``max_len``, a larger
        ``batch_size``) must be usable on the run that raised it."""
        if state.get("runs") != sorted(self._runs):
            raise InvalidArgumentError(
                f"LiveLoader state follows runs {state.get('runs')!r}, this loader "
                f"{sorted(self._runs)!r}: the state's position passed rows of the others; "
                "follow the same runs (another set starts afresh)"
            )
        changed = {k: (state.get(k), v) for k, v in self._settings().items() if state.get(k) != v}
        if changed:
            log.info(
                "resuming with settings changed for the steps to come (saved -> now): %s",
                ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
            )

    def _settings(self) -> dict[str, Any]:
        """What decides each step's samples and micro-batches (a state must agree)."""
        return {
            "runs": sorted(self._runs),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "max_tokens": self.max_tokens,
            "max_staleness": self.max_staleness,
            "max_len": self.max_len,
            "done_column": self.done_column,
        }

    # -- steps ---------------------------------------------------------------------------

    def next_step(
        self, policy_version: int | None = None, *, timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Wait until step :attr:`step` is complete (or raise :class:`LiveTimeoutError`
        after ``timeout`` seconds, consuming nothing), then return its micro-batches for
        this rank. The step counts as consumed once the last one has been yielded.

        ``policy_version``: the policy this step trains (bounds staleness with
        ``max_staleness``; None: no group is stale). ``timeout``: a finite number of
        seconds >= 0 (None: wait without a limit).
        """
        if policy_version is not None:
            policy_version = whole("policy_version", policy_version, minimum=0)
        if timeout is not None:
            timeout = seconds("timeout", timeout)
        oldest = None
        if self.max_staleness is not None and policy_version is not None:
            oldest = policy_version - self.max_staleness
        take = self._wait(oldest, timeout)
        return self._yield_step(take, policy_version)

    def _wait(self, oldest: int | None, timeout: float | None) -> StepTake:
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        if self._local:  # (again after close)
            self._follower.watch(self.store.backend.abspath(LOG_DIRECTORY))
        while True:
            self._follow()
            take = self._take(oldest)
            if take is not None:
                return take
            if self._all_finished and not self._waiting and not self._unchecked:
                raise LiveFinishedError(
                    f"every followed run is finished (runs {sorted(self._runs)}) and every "
                    f"sample consumed: no step {self.step}",
                    runs=sorted(self._runs),
                    step=self.step,
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                waiting = sum(g.size for g in self._waiting)
                held = sum(p.size for parts in self._held.values() for p in parts)
                holding = f", {held} held in {len(self._held)} open trajectories" if held else ""
                raise LiveTimeoutError(
                    f"step {self.step} not complete after {timeout} s: {waiting} sample(s) "
                    f"waiting{holding}, a step takes {self._target} (runs "
                    f"{sorted(self._runs)}, read up to table version {self._follower.version})",
                    runs=sorted(self._runs),
                    step=self.step,
                )
            self._follower.wait(
                self.poll_interval if left is None else min(self.poll_interval, left)
            )

    @property
    def _all_finished(self) -> bool:
        """Every followed run's final commit followed: nothing more will come."""
        return self._finished >= set(self._runs)

    @property
    def finished(self) -> bool:
        """Every followed run's final commit has been followed and every sample consumed:
        :meth:`next_step` then raises :class:`LiveFinishedError`."""
        self._follow()
        return self._all_finished and not self._waiting and not self._unchecked

    @property
    def _target(self) -> int:
        return self.batch_size * self.world_size

    def _follow(self) -> None:
        """Add the groups of every file committed to the followed runs since last time."""
        polled = self._follower.poll()
        self._finished |= polled.finished
        self._stats["removed_samples"] += polled.removed_rows
        if polled.removed:
            self._drop_removed(polled.removed)
        self._unchecked.extend(polled.files)
        while self._unchecked:
            # A file laid out for another processor raises here, and again on every call:
            # it stays first in line, never skipped (its rows would be lost to a resume).
            followed = self._unchecked[0]
            path, facts = followed.file.path, followed.facts
            assert facts.layouts is not None and facts.video_layouts is not None
            refuse_other_layouts(
                self.store,
                self.adapter,
                {fp: {path} for fp in facts.layouts},
                {fp: {path} for fp in facts.video_layouts},
            )
            self._check_rows(followed)
            # A part is open where its last row says done=False: more of it is to come.
            open_rows = followed.open_rows(self.done_column) if self.done_column else None
            for part in _parts_of(followed):
                if part.cursor not in self._consumed:
                    self._add(part, open_rows is not None and bool(open_rows[part.stop - 1]))
            if followed.final:
                self._finished.add(followed.file.run_id)
            self._unchecked.popleft()
        for key in [k for k in self._held if k[0] in self._finished]:
            # Nothing more will come for it: its rows are trained as they are.
            self._waiting.append(_Group(tuple(self._held.pop(key))))

    def _add(self, part: _Part, is_open: bool) -> None:
        """A new part waits as a group, or (``done_column``) joins its trajectory: held
        while the trajectory's last row says done=False, waiting whole once it ends."""
        if self.done_column is None or part.key[1] is None:
            self._waiting.append(_Group((part,)))
            return
        parts = [*self._held.pop(part.key, []), part]
        if is_open:
            self._held[part.key] = parts
        else:
            self._waiting.append(_Group(tuple(parts)))

    def _check_rows(self, followed: FollowedFile) -> None:
        """Every row of a followed file through the workers' checks, here, on every rank,
        before any of its rows is planned. A worker checks only its rank's share: one rank
        would train a step while another raised on it, and a lock-step job would hang in
        its next collective. Read in the parent, every rank raises the same error at the
        same step (again on every call, until the file leaves the table: a released run)."""
        table = read_units(self.store, followed.units, self.materialize.columns)
        window = row_window(self.store, self.adapter, self.max_len, table)
        for row in range(followed.first_row, window.num_rows):
            window.check(row)

    def _drop_removed(self, removed: frozenset[str]) -> None:
        """Forget waiting and held rows of files the table no longer holds (a released
        run): they are never trained, and counted."""
        parts = [p for g in self._waiting for p in g.parts]
        parts += [p for held in self._held.values() for p in held]
        gone = [p for p in parts if p.file.file.path in removed]
        gone_files = [f for f in self._unchecked if f.file.path in removed]
        if not gone and not gone_files:
            return
        kept = [tuple(p for p in g.parts if p.file.file.path not in removed) for g in self._waiting]
        self._waiting = [_Group(k) for k in kept if k]
        for key, held in list(self._held.items()):
            self._held[key] = [p for p in held if p.file.file.path not in removed]
            if not self._held[key]:
                del self._held[key]
        self._unchecked = deque(f for f in self._unchecked if f.file.path not in removed)
        samples = sum(p.size for p in gone) + sum(
            len(f.facts.lengths) - f.first_row for f in gone_files
        )
        self._stats["removed_samples"] += samples
        log.debug("%d waiting sample(s) removed from the table before training", samples)

    def _take(self, oldest: int | None) -> StepTake | None:
        sizes = np.fromiter((g.size for g in self._waiting), np.int64, len(self._waiting))
        policies = np.fromiter((g.policy for g in self._waiting), np.int64, len(self._waiting))
        try:
            return take_step(
                sizes, policies, target=self._target, oldest=oldest, final=self._all_finished
            )
        except GroupTooLarge as exc:
            group = self._waiting[exc.index]
            raise InvalidArgumentError(
                f"{group.describe()} holds more samples than a step takes ({self._target} = "
                "batch_size x world_size): groups are never split; raise batch_size",
                file=group.parts[-1].file.file.path,
                run_id=group.parts[-1].file.file.run_id,
                step=group.parts[-1].file.file.step,
            ) from None

    def _yield_step(self, take: StepTake, policy_version: int | None) -> Iterator[dict[str, Any]]:
        groups = [self._waiting[i] for i in take.trained]
        stale = [self._waiting[i] for i in take.stale]
        stale_samples = sum(g.size for g in stale)
        for group in stale:
            log.debug("step %d: not trained, stale: %s", self.step, group.describe())
        self._tasks.tasks = self._plan(groups)
        totals = {
            "step_samples": sum(g.size for g in groups),
            "step_loss_tokens": sum(g.loss_tokens() for g in groups),
        }
        for built in self._built(self._dataloader()):
            reraise(built)
            if self._work.buffers is not None:
                self._work.buffers.track(built)
            if built["images_missing"]:
                warnings.warn(
                    f"{built['images_missing']} sample(s) had missing media, replaced by "
                    f"zero-loss placeholders: {built['missing_uris']}",
                    stacklevel=2,
                )
            built.update(
                policy_version=policy_version,
                stale_groups=len(stale),
                stale_samples=stale_samples,
                **totals,
            )
            yield built
        # Every micro-batch of the step was handed over: it is consumed.
        self._consumed.update(p.cursor for g in self._waiting[: take.consumed] for p in g.parts)
        del self._waiting[: take.consumed]
        cursor = self.cursor
        self._consumed = {c for c in self._consumed if c > cursor}
        self.step += 1
        self._stats["steps"] += 1
        self._stats["samples"] += sum(g.size for g in groups)
        self._stats["stale_groups"] += len(stale)
        self._stats["stale_samples"] += stale_samples

    def _built(self, loader: DataLoader[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The workers' micro-batches; a dead worker lets every worker go and raises
        :class:`WorkerDiedError` (the step is not consumed: the next call replays it)."""
        try:
            yield from loader
        except RuntimeError as exc:
            if "exited unexpectedly" not in str(exc):
                raise
            self.close()
            raise WorkerDiedError(
                f"a worker of the live loader died while building step {self.step} ({exc}); "
                "the step was not consumed: call next_step again to start new workers and "
                "get the step again from its first micro-batch",
                step=self.step,
            ) from exc

    def _plan(self, groups: list[_Group]) -> list[MicroTask]:
        """This rank's micro-batches of a step of ``groups``."""
        rows = [row for g in groups for row in g.rows]
        lengths = np.array([f.facts.lengths[r] for f, r in rows], dtype=np.int64)
        located = [(*f.locate(r), int(n)) for (f, r), n in zip(rows, lengths, strict=True)]
        if self._budget is None:
            share = rank_shares(len(rows), self.world_size)[self.rank]
            return [MicroTask(self.step, 0, 1, False, tuple(located[i] for i in share))]
        self._refuse_too_long(rows, lengths)
        images = np.array([f.facts.images[r] > 0 for f, r in rows], dtype=bool)
        packing = plan_epoch(
            lengths,
            images,
            batch_size=self.batch_size,
            world_size=self.world_size,
            budget=self._budget,
            shared=_shared(groups) if self.prefix_sharing else None,
        )
        if len(packing.unshared_trees):
            followed, row = rows[int(packing.unshared_trees[0])]
            log.debug(
                "step %d: %d group(s) hold more than max_tokens after sharing and are packed "
                "unshared, the first starting at sample %r (run %r, step %d)",
                self.step, len(packing.unshared_trees), followed.sample_ids[row].as_py(),
                followed.file.run_id, followed.file.step,
            )  # fmt: skip
        plan = packing.for_rank(self.rank)
        return [
            MicroTask(
                self.step,
                int(plan.micro[i]),
                int(plan.num_micro[i]),
                bool(plan.dummy[i]),
                tuple(located[int(p)] for p in plan.samples(i)),
            )
            for i in range(len(plan))
        ]

    def _refuse_too_long(self, rows: list[tuple[FollowedFile, int]], lengths: np.ndarray) -> None:
        assert self._budget is not None
        too_long = np.flatnonzero(lengths > self._budget)
        if not len(too_long):
            return
        followed, row = rows[int(too_long[0])]
        reserve = self.max_tokens - self._budget if self.max_tokens else 0
        raise SampleTooLongError(
            f"sample of {int(lengths[too_long[0]])} tokens exceeds max_tokens={self.max_tokens}"
            + (f" less the {reserve}-token dummy image" if reserve else "")
            + f"; set max_len <= {self._budget} to truncate (whole images kept) or raise "
            "max_tokens",
            file=followed.file.path,
            run_id=followed.file.run_id,
            step=followed.file.step,
            sample_id=followed.sample_ids[row].as_py(),
        )

    # -- workers -------------------------------------------------------------------------

    def _dataloader(self) -> DataLoader[dict[str, Any]]:
        """One DataLoader for the loader's life: its workers persist across steps."""
        if self._loader is None:
            workers = self.num_workers
            start = start_method(self.multiprocessing_context) if workers else ""
            self._work.buffers = batch_buffers(workers, start, self.prefetch_factor)
            self._loader = DataLoader(
                self._work,
                batch_size=None,
                sampler=self._tasks,
                num_workers=workers,
                persistent_workers=workers > 0,
                prefetch_factor=self.prefetch_factor if workers else None,
                multiprocessing_context=self.multiprocessing_context if workers else None,
                worker_init_fn=functools.partial(init_worker, 1),
            )
        return self._loader

    def close(self) -> None:
        """Stop the workers (a later step starts new ones) and the log watch."""
        self._follower.close()
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def __enter__(self) -> LiveLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - at interpreter exit even contextlib may be gone
            self.close()
        except Exception:
            pass


def _shared(groups: list[_Group]) -> np.ndarray:
    """What each of a step's rows shares with the row before it in its group (0 for a
    group's first row): read at follow time for a row after its file's row before, compared
    here for a trajectory's row after a row of an earlier commit."""
    shared = []
    for group in groups:
        rows = group.rows
        shared.append(0)
        for (before, row_before), (file, row) in itertools.pairwise(rows):
            if file is before and row_before == row - 1:
                assert file.facts.shared is not None
                shared.append(int(file.facts.shared[row]))
            else:
                keys, keys_before = file.facts.prefix_keys, before.facts.prefix_keys
                assert keys is not None and keys_before is not None
                shared.append(shared_between(keys_before, row_before, keys, row))
    return np.asarray(shared, dtype=np.int64)


def _parts_of(followed: FollowedFile) -> list[_Part]:
    """``followed``'s rows from its first row on, cut into runs of one group_id."""
    facts = followed.facts
    n = len(facts.lengths)
    starts = np.flatnonzero(facts.block_start)
    starts = np.union1d(starts[starts >= followed.first_row], [followed.first_row])
    bounds = np.append(starts[starts < n], n)
    policies = followed.policy_versions(UNKNOWN)
    groups = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        known = policies[lo:hi][policies[lo:hi] != UNKNOWN]
        groups.append(_Part(followed, lo, hi, int(known.min()) if len(known) else UNKNOWN))
    return groups


def _new_stats() -> dict[str, int]:
    return {
        "steps": 0,
        "samples": 0,
        "stale_groups": 0,
        "stale_samples": 0,
        "removed_samples": 0,
    }
