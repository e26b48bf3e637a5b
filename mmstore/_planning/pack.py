"""Packing plan: a pure function of (row facts, seed, epoch, settings) -> micro-batches.

Definitions (the packed loader's contract):

- **Epoch order.** Row groups are permuted by (seed, epoch) as in :mod:`.order`, but *not*
  dealt to ranks: all ranks share one global sequence. It is cut in windows of
  ``window_units`` row groups; inside a window, blocks (runs of one group_id within a row
  group, i.e. a GRPO group written together) are permuted.
- **Step.** Step ``s`` is positions ``[s*B*W, (s+1)*B*W)`` of that sequence (``B`` =
  ``batch_size`` per rank, ``W`` = world size; the last step may be shorter). Every real row
  is in exactly one step, on exactly one rank, in exactly one micro-batch.
- **Micro-batches.** A step's samples, all ranks' together, go into ``W * K`` bins of at
  most ``budget`` tokens (samples never split), ``K`` = micro-batches per rank, starting at
  its lower bound ``ceil(tokens / (budget * W))``, largest sample first into the least-loaded
  bin, so bins come out nearly equal. A step that does not fit so is packed by first-fit
  decreasing (``K = ceil(bins / W)``), and filled evenly again at that ``K`` if it fits.
  When the epoch has any image, ``budget = max_tokens - dummy_tokens``: every micro-batch
  keeps room for the family's dummy image (one token for Qwen-VL at its defaults), so
  filler never breaks ``max_tokens``.
- **Ranks.** Every rank gets exactly ``num_micro = K`` bins (empty ones are filler
  micro-batches): in rounds of ``W`` bins, largest first, each round's heaviest bin to the
  rank with the fewest tokens so far (largest-first greedy with equal counts; measured at
  max/mean rank load 1.02 mean, 1.04 worst, see ``benchmarks/bench_pack.py``).
  The cost balanced is *tokens*: each micro-batch index is one lock-step forward/backward on
  every rank (FSDP all-gathers per layer), so what must match is the work per micro-batch,
  which the even fill equalizes, and the tokens per rank, which the dealing evens out. Image
  patches are left out of the cost: the vision tower is a small part of a VLM's FLOPs, and
  each image's tokens already count its patches / merge**2.
- **Images in lock-step.** Within a rank, micro-batches with images come first. Micro-batch
  ``m`` of a rank gets a zero-loss dummy image iff it has none and some rank's micro-batch
  ``m`` has one, so every rank runs the vision tower on the same micro-batch indices.
- GRPO groups stay adjacent in the epoch order (so a group falls in one step, unless it
  straddles a step boundary), but not on one rank: tokens are balanced first, so a group's
  samples may spread over ranks and micro-batches; each worker's image cache (and the node
  cache, where there is one) then processes the shared image once per worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmstore._planning.order import epoch_units, rng
from mmstore._rows.snapshot import Snapshot


def epoch_order(
    snapshot: Snapshot,
    unit_offsets: np.ndarray,
    block_start: np.ndarray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window_units: int,
) -> np.ndarray:
    """Flat row indices (``unit_offsets`` numbering) in this epoch's global order.

    Vectorized: every block gets a random key from one generator seeded by (seed, epoch);
    blocks are sorted by (window, key), so they move only within their window.
    """
    index = {unit: i for i, unit in enumerate(snapshot.units)}
    ranked = epoch_units(snapshot, seed=seed, epoch=epoch, shuffle=shuffle)
    units = np.fromiter((index[u] for u in ranked), dtype=np.int64, count=len(ranked))
    sizes = unit_offsets[units + 1] - unit_offsets[units]
    rows = _ranges(unit_offsets[units], sizes)
    if not shuffle or not len(rows):
        return rows
    window = np.repeat(np.arange(len(units)) // window_units, sizes)
    starts = np.flatnonzero(block_start[rows] | np.r_[True, window[1:] != window[:-1]])
    keys = rng(seed, epoch, 0xB10C).random(len(starts))
    order = np.lexsort((keys, window[starts]))
    lengths = np.diff(np.append(starts, len(rows)))
    return rows[_ranges(starts[order], lengths[order])]


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, a + n) for a, n in zip(starts, sizes)])``, vectorized."""
    total = int(sizes.sum())
    begin = np.cumsum(sizes) - sizes
    return np.arange(total, dtype=np.int64) - np.repeat(begin - starts, sizes)


def first_fit_decreasing(ranked: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bins of many independent problems at once: one per row of ``ranked`` ([S, n], each
    row sorted largest first, 0 = no item). Returns (bin of each item, -1 for none; number of
    bins of each row).

    Exact first-fit decreasing, vectorized over rows: one numpy pass over the open bins of
    every row per item rank, so an epoch of steps packs together. (A per-row max-tree of free
    room was slower in numpy: its gathers miss the cache, the linear scan streams.)
    """
    steps, n = ranked.shape
    ranked = ranked.astype(np.int32)
    room = np.full((steps, max(n, 1)), capacity, dtype=np.int32)
    bins_ranked = np.full((steps, n), -1, dtype=np.int64)
    rows = np.arange(steps)
    fits = np.empty((steps, max(n, 1)), dtype=bool)
    used = 0
    for j in range(n):
        size = ranked[:, j]
        if not size.any():
            break  # sorted: only empty slots follow
        width = used + 1  # bin `used` is empty in every row, so one always fits
        np.greater_equal(room[:, :width], size[:, None], out=fits[:, :width])
        chosen = fits[:, :width].argmax(axis=1)
        room[rows, chosen] -= size
        bins_ranked[:, j] = np.where(size > 0, chosen, -1)
        used = max(used, int(chosen.max()) + 1)
    return bins_ranked, (bins_ranked.max(axis=1, initial=-1) + 1)


def least_loaded(
    ranked: np.ndarray, capacity: int, num_bins: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's items (sorted largest first) into the least-loaded of its ``num_bins`` bins.

    Gives near-equal bins (within about the smallest item). Returns (bin of each item, -1 for
    none; whether every item of the row fitted within ``capacity``).
    """
    steps, n = ranked.shape
    width = int(num_bins.max(initial=1))
    load = np.zeros((steps, width), dtype=np.int64)
    load[np.arange(width)[None, :] >= num_bins[:, None]] = np.iinfo(np.int64).max // 2
    rows = np.arange(steps)
    ok = np.ones(steps, dtype=bool)
    bins_ranked = np.full((steps, n), -1, dtype=np.int64)
    for j in range(n):
        size = ranked[:, j]
        if not size.any():
            break
        chosen = load.argmin(axis=1)
        load[rows, chosen] += size
        ok &= load[rows, chosen] <= capacity
        bins_ranked[:, j] = np.where(size > 0, chosen, -1)
    return bins_ranked, ok


def pack_steps(
    lengths: np.ndarray, capacity: int, world_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches of each step (a row of ``lengths``): (bin of each item, micro-batches per
    rank ``K``). Bins are numbered below ``world_size * K``.

    ``K`` starts at its lower bound, ``ceil(tokens / (capacity * world_size))``, with bins
    filled evenly (least-loaded first). A step that does not fit so is packed by first-fit
    decreasing; if that needs no more micro-batches per rank, its packing is kept, else the
    even fill is tried once more with the larger ``K`` before first-fit is kept.
    """
    order = np.argsort(-lengths, axis=1, kind="stable")
    ranked = np.take_along_axis(lengths, order, axis=1)
    lower = np.maximum(1, -(-lengths.sum(axis=1) // (capacity * world_size)))
    bins_ranked, ok = least_loaded(ranked, capacity, lower * world_size)
    per_rank = lower.copy()
    bad = np.flatnonzero(~ok)
    if len(bad):
        ffd, used = first_fit_decreasing(ranked[bad], capacity)
        per_rank[bad] = np.maximum(1, -(-used // world_size))
        bins_ranked[bad] = ffd
        retry = bad[per_rank[bad] > lower[bad]]
        if len(retry):
            again, fitted = least_loaded(ranked[retry], capacity, per_rank[retry] * world_size)
            bins_ranked[retry[fitted]] = again[fitted]
    bins = np.empty_like(bins_ranked)
    np.put_along_axis(bins, order, bins_ranked, axis=1)
    return bins, per_rank


def deal_bins(bin_loads: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Deal each row's bins ([S, nb] loads, 0 = no bin) to ranks, equal counts per rank.

    In rounds of ``world_size`` bins, largest first, the round's k-th heaviest bin goes to
    the k-th lightest rank so far. Returns (rank of each bin, tokens per rank [S, W]).
    """
    steps, nb = bin_loads.shape
    rounds = -(-nb // world_size)
    width = rounds * world_size
    padded = np.zeros((steps, width), dtype=np.int64)
    padded[:, :nb] = bin_loads
    order = np.argsort(-padded, axis=1, kind="stable")
    rank_load = np.zeros((steps, world_size), dtype=np.int64)
    rank_ranked = np.empty((steps, width), dtype=np.int64)
    rows = np.arange(steps)[:, None]
    for k in range(rounds):
        cols = order[:, k * world_size : (k + 1) * world_size]
        lightest = np.argsort(rank_load, axis=1, kind="stable")
        rank_ranked[:, k * world_size : (k + 1) * world_size] = lightest
        rank_load[rows, lightest] += padded[rows, cols]
    ranks = np.empty_like(rank_ranked)
    np.put_along_axis(ranks, order, rank_ranked, axis=1)
    return ranks[:, :nb], rank_load


@dataclass(frozen=True)
class RankPlan:
    """One rank's micro-batches of an epoch, in the order it yields them."""

    step: np.ndarray  # [M] step of each micro-batch
    micro: np.ndarray  # [M] its index within the step
    num_micro: np.ndarray  # [M] micro-batches of that step (equal on every rank)
    dummy: np.ndarray  # [M] bool: add a dummy image (another rank's micro m has images)
    ptr: np.ndarray  # [M + 1] into positions
    positions: np.ndarray  # epoch positions of the samples, ascending within a micro-batch

    def __len__(self) -> int:
        return len(self.step)

    def samples(self, index: int) -> np.ndarray:
        return self.positions[self.ptr[index] : self.ptr[index + 1]]


@dataclass(frozen=True)
class PackPlan:
    """Every rank's packing of one epoch: where each position goes, and per-step totals."""

    world_size: int
    rank_of: np.ndarray  # [N] rank of each epoch position
    micro_of: np.ndarray  # [N] micro-batch index (within its step and rank)
    step_of: np.ndarray  # [N]
    num_micro: np.ndarray  # [S]
    image_micros: np.ndarray  # [S, W] micro-batches with images on each rank (they come first)
    rank_tokens: np.ndarray  # [S, W] real tokens per rank per step (after sharing)
    #: prefix sharing: the first position of each tree too large to share (packed unshared)
    unshared_trees: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def for_rank(self, rank: int) -> RankPlan:
        mine = np.flatnonzero(self.rank_of == rank)
        mine = mine[np.lexsort((mine, self.micro_of[mine], self.step_of[mine]))]
        steps = np.repeat(np.arange(len(self.num_micro)), self.num_micro)
        first = np.cumsum(self.num_micro) - self.num_micro
        micro = np.arange(len(steps)) - np.repeat(first, self.num_micro)
        flat = first[self.step_of[mine]] + self.micro_of[mine]  # flat micro of each sample
        ptr = np.zeros(len(steps) + 1, dtype=np.int64)
        np.cumsum(np.bincount(flat, minlength=len(steps)), out=ptr[1:])
        most = self.image_micros.max(axis=1)[steps]
        dummy = (micro >= self.image_micros[steps, rank]) & (micro < most)
        return RankPlan(steps, micro, self.num_micro[steps], dummy, ptr, mine)


def plan_epoch(
    lengths: np.ndarray,
    has_images: np.ndarray,
    *,
    batch_size: int,
    world_size: int,
    budget: int,
    shared: np.ndarray | None = None,
) -> PackPlan:
    """Pack epoch positions (``lengths[p]`` tokens, ``has_images[p]``) into micro-batches.

    Every length must be at most ``budget`` (the caller refuses longer samples by name).

    ``shared`` (prefix sharing): for each position, the leading tokens it shares with the
    position before it (0: it starts a tree). A tree's positions within one step go into
    one micro-batch and cost their tokens after sharing, unless that exceeds ``budget``:
    then its samples are packed as unshared ones. The forest of a micro-batch never has
    more tokens than its cost (it may share more: across trees).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    has_images = np.asarray(has_images, dtype=bool)
    n = len(lengths)
    per_step = batch_size * world_size
    steps = -(-n // per_step)
    cost, head, unshared = lengths, np.arange(n), np.zeros(0, np.int64)
    if shared is not None:
        cost, head, unshared = _trees(lengths, np.asarray(shared, np.int64), per_step, budget)
    grid = np.zeros((steps, per_step), dtype=np.int64)
    grid.flat[:n] = np.bincount(head, weights=cost, minlength=n).astype(np.int64)
    bins, num_micro = pack_steps(grid, budget, world_size)
    nb = int(bins.max(initial=-1)) + 1
    rows = np.repeat(np.arange(steps), per_step)[:n]
    flat_bins = bins.reshape(-1)[:n][head]  # a tree's positions go where its head goes
    width = max(nb, 1)
    cell = rows * width + flat_bins
    loads = np.bincount(cell, weights=cost, minlength=steps * width).astype(np.int64)
    loads = loads.reshape(steps, width)
    filled = (np.bincount(cell, minlength=steps * width) > 0).reshape(steps, width)
    imaged = (np.bincount(cell[has_images], minlength=steps * width) > 0).reshape(steps, width)
    ranks, rank_tokens = deal_bins(loads[:, :nb], world_size)
    micro_of_bin, image_micros = _order_micros(ranks, loads[:, :nb], filled, imaged, world_size)
    return PackPlan(
        world_size,
        ranks[rows, flat_bins],
        micro_of_bin[rows, flat_bins],
        rows,
        num_micro,
        image_micros,
        rank_tokens,
        unshared,
    )


def _trees(
    lengths: np.ndarray, shared: np.ndarray, per_step: int, budget: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cost, head) of each position: its tokens after sharing with the one before it, and
    the first position of its tree (trees cut at step boundaries; a tree whose cost exceeds
    ``budget`` is undone: each of its positions costs its length and heads itself); and the
    first position of each tree undone."""
    n = len(lengths)
    starts = (shared <= 0) | (np.arange(n) % per_step == 0)
    tree = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    cost = np.where(starts, lengths, lengths - np.minimum(shared, lengths))
    too_big = np.bincount(tree, weights=cost)[tree] > budget
    head = np.where(too_big, np.arange(n), first[tree])
    undone = np.flatnonzero(too_big & starts)  # (a sample alone always fits)
    return np.where(too_big, lengths, cost), head, undone


def _order_micros(
    ranks: np.ndarray, loads: np.ndarray, filled: np.ndarray, imaged: np.ndarray, world: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each bin's micro-batch index on its rank: bins with images first, then heaviest first,
    empty bins (fillers) last. Also the number of micro-batches with images per rank."""
    steps, nb = ranks.shape
    # One flat sort over (step, rank, key, -load): the bins of a rank end up consecutive.
    key = np.where(filled[:, :nb], 1, 3) - imaged[:, :nb]  # 0: images, 1: text, 3: empty
    step = np.repeat(np.arange(steps), nb)
    flat_rank = ranks.reshape(-1)
    group = step * world + flat_rank
    heaviest = int(loads.max(initial=0)) + 1
    composite = (group * 4 + key.reshape(-1)) * heaviest + (heaviest - 1 - loads.reshape(-1))
    order = np.argsort(composite, kind="stable")
    sorted_group = group[order]
    first = np.searchsorted(sorted_group, sorted_group, side="left")
    micro = np.empty(steps * nb, dtype=np.int64)
    micro[order] = np.arange(steps * nb) - first
    image_micros = np.bincount(
        group, weights=imaged[:, :nb].reshape(-1), minlength=steps * world
    ).astype(np.int64)
    image_micros = image_micros.reshape(steps, world)
    return micro.reshape(steps, nb), image_micros


def budget_for(max_tokens: int, dummy_tokens: int, any_images: bool) -> int:
    """Tokens a micro-batch may give real samples (room kept for a dummy image)."""
    return max_tokens - dummy_tokens if any_images else max_tokens
