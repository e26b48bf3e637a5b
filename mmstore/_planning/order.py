"""The order of samples, and each rank's share of it: a pure function of (snapshot, seed,
epoch, shuffle, window_units) and (rank, world_size).

1. **Epoch order.** Units (row groups) are permuted by (seed, epoch) (:func:`epoch_units`);
   every rank computes the same sequence (the packed loader, :mod:`.pack`, starts from it
   too). The units are read in windows of ``window_units``; inside a window, *blocks* (runs
   of consecutive rows of one group_id, i.e. a GRPO group written together) are permuted by
   (seed, epoch, window) (:func:`block_permutation`). The shuffle window bounds memory;
   blocks keep a group's samples adjacent, which is what trainers batch and what makes the
   per-worker image cache hit.
2. **Shares.** Rank ``r`` of ``W`` reads one contiguous run of that order (:func:`rank_share`):
   the epoch's ``N`` samples are cut into ``W`` runs whose sizes differ by at most one (the
   first ``N mod W`` ranks hold one more), as the live loader splits a step
   (:func:`.live.rank_shares`). So every sample is read exactly once per epoch, on one rank;
   a rank holds the same number of samples in every epoch (its ``len`` never changes); a
   GRPO group is split over two ranks only where it straddles one of the ``W - 1`` cuts;
   and a rank reads only the windows its run touches (one at each end shared with a
   neighbour). A position is located from footers alone (each unit's row count): seeking
   reads no row before it; the permutation inside a window needs only that window's rows,
   which the rank reads anyway. Fewer samples than ranks is refused
   (:func:`check_shares`): a rank with no sample would train nothing, silently.
3. The rank's sample sequence is cut into batches; DataLoader worker ``w`` of ``n`` builds the
   batches ``start + w, start + w + n, …``. DataLoader's round-robin over workers then yields
   them in sequence, so the stream does not depend on the number of workers, and resuming at
   batch ``k`` only needs ``start = k``.

With one rank the order is the one the previous rule (units dealt round-robin to ranks, each
rank's windows permuted apart) gave: its saved states resume unchanged.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmstore._rows.snapshot import Snapshot, WorkUnit
from mmstore.errors import InvalidArgumentError

DEFAULT_WINDOW_UNITS = 4
# How a padded epoch is shared by ranks (recorded in saved states): contiguous runs of the
# epoch order, balanced by samples. States without it dealt row groups round-robin.
SHARDING = "contiguous-samples"


def rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in keys])


def epoch_units(snapshot: Snapshot, *, seed: int, epoch: int, shuffle: bool) -> list[WorkUnit]:
    """Every unit of the snapshot, in ``epoch``'s order (the same on every rank)."""
    units = sorted(snapshot.units, key=lambda u: (u.file, u.row_group))
    if shuffle:
        order = rng(seed, epoch, 0x5EED).permutation(len(units))
        units = [units[i] for i in order]
    return units


def rank_share(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first epoch position, number of samples) of ``rank``'s share of ``total`` samples:
    contiguous, sizes differing by at most one, the first ``total % world_size`` ranks
    holding one more (``numpy.array_split``'s cut)."""
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def check_shares(total: int, *, rank: int, world_size: int, version: int | None = None) -> None:
    """Refuse an epoch of ``total`` samples that leaves a rank without any (on every rank,
    so no rank goes on to wait for the others in a collective)."""
    if total >= world_size:
        return
    idle = f"rank {total}" if total == world_size - 1 else f"ranks {total}..{world_size - 1}"
    raise InvalidArgumentError(
        f"{world_size} rank(s) would share {total} sample(s): {idle} would read no sample "
        f"and train nothing (this is rank {rank}); every rank needs at least one sample: "
        f"select more runs or steps, or use at most {total} rank(s)"
        if total
        else f"the selection holds no sample: rank {rank} of {world_size} would train "
        "nothing; select runs or steps that hold rows (or wait until they are committed)",
        rank=rank,
        world_size=world_size,
        samples=total,
        version=version,
    )


def block_permutation(
    group_ids: Sequence[str | None],
    *,
    seed: int,
    epoch: int,
    window: int,
    shuffle: bool,
) -> np.ndarray:
    """Row order inside one window: blocks of one group_id permuted, rows kept in a block.

    The same on every rank: two ranks whose shares meet inside a window see one order.
    """
    n = len(group_ids)
    if not shuffle or n == 0:
        return np.arange(n)
    starts = [0]
    for i in range(1, n):
        if group_ids[i] is None or group_ids[i] != group_ids[i - 1]:
            starts.append(i)
    bounds = [*starts, n]
    # The 0 is where the rank went when each rank permuted its own windows: one rank's
    # order (and its saved states) stays what it was.
    order = rng(seed, epoch, 0, window, 0xB10C).permutation(len(starts))
    return np.concatenate([np.arange(bounds[b], bounds[b + 1]) for b in order])


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: the epoch's windows (every rank's), where each starts in the epoch
    order, and this rank's share of that order (``first``, ``num_samples``).

    A rank's *position* ``p`` (0 to ``num_samples - 1``) is epoch position ``first + p``.
    """

    windows: tuple[tuple[WorkUnit, ...], ...]
    starts: tuple[int, ...]  # first epoch position of each window
    total: int  # samples of the epoch, all ranks'
    first: int  # epoch position of this rank's first sample
    num_samples: int  # this rank's samples

    @classmethod
    def build(
        cls,
        snapshot: Snapshot,
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        window_units: int = DEFAULT_WINDOW_UNITS,
    ) -> EpochPlan:
        units = epoch_units(snapshot, seed=seed, epoch=epoch, shuffle=shuffle)
        windows = tuple(
            tuple(units[i : i + window_units]) for i in range(0, len(units), window_units)
        )
        starts, total = [], 0
        for window in windows:
            starts.append(total)
            total += sum(u.num_rows for u in window)
        first, count = rank_share(total, rank, world_size)
        return cls(windows, tuple(starts), total, first, count)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        full, rest = divmod(self.num_samples, batch_size)
        return full if drop_last or not rest else full + 1

    def window_of(self, position: int) -> int:
        """Index of the window holding this rank's sample ``position``."""
        return self.window_at(self.first + position)

    def window_at(self, epoch_position: int) -> int:
        """Index of the window holding epoch position ``epoch_position``."""
        return bisect.bisect_right(self.starts, epoch_position) - 1

    def window_range(self, index: int) -> tuple[int, int]:
        """The epoch positions ``[start, end)`` of window ``index``."""
        end = self.starts[index + 1] if index + 1 < len(self.starts) else self.total
        return self.starts[index], end

    def rank_windows(self) -> range:
        """Indices of the windows this rank's share touches, in order."""
        if not self.num_samples:
            return range(0)
        return range(self.window_of(0), self.window_of(self.num_samples - 1) + 1)


def worker_batches(start_batch: int, num_batches: int, worker: int, num_workers: int) -> range:
    """The batch indices worker ``worker`` of ``num_workers`` builds, from ``start_batch``."""
    return range(start_batch + worker, num_batches, num_workers)
