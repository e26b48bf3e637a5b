"""The order of samples: a pure function of (snapshot, seed, epoch, shuffle, rank, world).

1. Units (row groups) are permuted by (seed, epoch) and dealt round-robin to ranks, so ranks
   are disjoint and together cover every sample exactly once.
2. A rank's units are read in windows of a few units; inside a window, *blocks* (runs of
   consecutive rows of one group_id, i.e. a GRPO group written together) are permuted. The
   shuffle window bounds memory; blocks keep a group's samples adjacent, which is what
   trainers batch and what makes the per-worker image cache hit.
3. The rank's sample sequence is cut into batches; DataLoader worker ``w`` of ``n`` builds the
   batches ``start + w, start + w + n, …``. DataLoader's round-robin over workers then yields
   them in sequence, so the stream does not depend on the number of workers, and resuming at
   batch ``k`` only needs ``start = k``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmstore._rows.snapshot import Snapshot, WorkUnit

DEFAULT_WINDOW_UNITS = 4


def rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in keys])


def rank_units(
    snapshot: Snapshot, *, seed: int, epoch: int, shuffle: bool, rank: int, world_size: int
) -> list[WorkUnit]:
    """This rank's units, in epoch order."""
    units = sorted(snapshot.units, key=lambda u: (u.file, u.row_group))
    if shuffle:
        order = rng(seed, epoch, 0x5EED).permutation(len(units))
        units = [units[i] for i in order]
    return units[rank::world_size]


def block_permutation(
    group_ids: Sequence[str | None],
    *,
    seed: int,
    epoch: int,
    rank: int,
    window: int,
    shuffle: bool,
) -> np.ndarray:
    """Row order inside one window: blocks of one group_id permuted, rows kept in a block."""
    n = len(group_ids)
    if not shuffle or n == 0:
        return np.arange(n)
    starts = [0]
    for i in range(1, n):
        if group_ids[i] is None or group_ids[i] != group_ids[i - 1]:
            starts.append(i)
    bounds = [*starts, n]
    order = rng(seed, epoch, rank, window, 0xB10C).permutation(len(starts))
    return np.concatenate([np.arange(bounds[b], bounds[b + 1]) for b in order])


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: its units grouped into windows, and where each window starts."""

    windows: tuple[tuple[WorkUnit, ...], ...]
    starts: tuple[int, ...]  # first sample position of each window
    num_samples: int

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
        units = rank_units(
            snapshot, seed=seed, epoch=epoch, shuffle=shuffle, rank=rank, world_size=world_size
        )
        windows = tuple(
            tuple(units[i : i + window_units]) for i in range(0, len(units), window_units)
        )
        starts, total = [], 0
        for window in windows:
            starts.append(total)
            total += sum(u.num_rows for u in window)
        return cls(windows, tuple(starts), total)

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        full, rest = divmod(self.num_samples, batch_size)
        return full if drop_last or not rest else full + 1

    def window_of(self, position: int) -> int:
        """Index of the window holding sample ``position``."""
        return bisect.bisect_right(self.starts, position) - 1

    def window_range(self, index: int) -> tuple[int, int]:
        end = self.starts[index + 1] if index + 1 < len(self.starts) else self.num_samples
        return self.starts[index], end


def worker_batches(start_batch: int, num_batches: int, worker: int, num_workers: int) -> range:
    """The batch indices worker ``worker`` of ``num_workers`` builds, from ``start_batch``."""
    return range(start_batch + worker, num_batches, num_workers)
