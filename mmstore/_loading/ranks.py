"""The ranks of a job agree on the table version they read.

Two ranks that open the latest version a moment apart, while a writer commits, would plan
different epochs (different lengths, different micro-batch counts: lock-step broken, samples
never trained) without an error. So under ``torch.distributed`` a dataset sharded over the
job's ranks takes the smallest latest version any rank sees (one all-reduce), and a version
given explicitly (an argument, a saved state) must be the same on every rank, else every
rank raises :class:`VersionMismatchError` before any batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmstore._rows.store import Store
from mmstore._rows.versions import latest_version
from mmstore.errors import VersionMismatchError


def agreed_version(store: Store, version: int | None, *, world_size: int, what: str) -> int:
    """The version this rank reads: ``version``, or the latest when None; agreed with the
    other ranks when the dataset is sharded over the whole ``torch.distributed`` job
    (``world_size`` equal to its world size, above 1)."""
    mine = latest_version(store) if version is None else version
    if not _sharded_over_job(world_size):
        return mine
    explicit = 0 if version is None else 1
    # One all-reduce of MIN over (v, -v, e, -e): the smallest and largest version, and
    # whether every rank, no rank or only some gave one. Every rank decides alike.
    values = torch.tensor([mine, -mine, explicit, -explicit], dtype=torch.int64)
    values = values.to(_collective_device())
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    low, high, all_explicit, any_explicit = (int(v) for v in values.cpu().tolist())
    high, any_explicit = -high, -any_explicit
    if all_explicit != any_explicit:
        raise VersionMismatchError(
            f"{what}: some ranks name a table version and others take the latest (versions "
            f"{low}..{high} across ranks); give every rank the same version, or none",
            table=store.table.uri,
            rank=dist.get_rank(),
        )
    if any_explicit and low != high:
        raise VersionMismatchError(
            f"{what}: the ranks name different table versions (this rank {mine}, across "
            f"ranks {low}..{high}); they would plan different epochs. Load the same state "
            "on every rank",
            table=store.table.uri,
            rank=dist.get_rank(),
            version=mine,
        )
    return low


def _sharded_over_job(world_size: int) -> bool:
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(dist.get_world_size() == world_size)


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo (and the CPU half of a mixed backend) CPU ones."""
    backend = str(dist.get_backend())
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
