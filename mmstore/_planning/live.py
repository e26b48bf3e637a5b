"""What the live loader's next step takes: a pure function of the groups waiting, in commit
order, and the step's settings.

Definitions (the live loader's contract):

- **Groups.** The rows a commit added are cut into groups: runs of rows of one ``group_id``
  in a file (a null ``group_id`` is a group of one). Groups wait in commit order (table
  version, then file order within the commit, then row order). (With the loader's
  ``done_column``, a trajectory's runs over several commits are one group, waiting from
  the commit that ends it.)
- **Stale.** With a bound, a group whose policy version (the oldest of its rows'; unknown
  when none of them records one) is below ``oldest`` is stale: it is consumed by the step
  that meets it, never trained. Unknown versions are never stale.
- **A step** takes waiting groups in order, whole, up to ``target`` samples
  (``batch_size x world_size``). It is complete when it holds ``target`` samples, or when the
  next fresh group would overflow it (that group waits for the next step, which is then
  this one's complement: smaller than ``target``). A step that reaches the end of the
  waiting groups before either is not complete: it waits for more commits, and consumes
  nothing meanwhile; unless every followed run's final commit has been followed: then the
  waiting groups are the last, short step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmstore.errors import GroupTooLarge

UNKNOWN = -1  # a policy version nothing recorded


@dataclass(frozen=True)
class StepTake:
    """A complete step: the first ``consumed`` waiting groups go, of which ``trained`` (in
    order) are trained and ``stale`` dropped."""

    consumed: int
    trained: tuple[int, ...]
    stale: tuple[int, ...]


def take_step(
    sizes: np.ndarray,
    policies: np.ndarray,
    *,
    target: int,
    oldest: int | None,
    final: bool = False,
) -> StepTake | None:
    """The next step over waiting groups of ``sizes`` samples and ``policies`` versions
    (:data:`UNKNOWN` where unknown); None when it is not complete yet. ``final``: nothing
    more will be committed, so the waiting groups are the last step even if they fall short
    of ``target``. Raises :class:`GroupTooLarge` for a fresh group of more than ``target``
    samples."""
    total = 0
    trained: list[int] = []
    stale: list[int] = []
    for index, (size, policy) in enumerate(zip(sizes.tolist(), policies.tolist(), strict=True)):
        if oldest is not None and policy != UNKNOWN and policy < oldest:
            stale.append(index)
            continue
        if size > target:
            raise GroupTooLarge(index, size)
        if total + size > target:
            return StepTake(index, tuple(trained), tuple(stale))
        total += size
        trained.append(index)
        if total == target:
            return StepTake(index + 1, tuple(trained), tuple(stale))
    if final and (trained or stale):
        return StepTake(len(sizes), tuple(trained), tuple(stale))
    return None


def rank_shares(num_samples: int, world_size: int) -> list[np.ndarray]:
    """Contiguous shares of a padded step's samples, one per rank (sizes differ by at most
    one; a rank's share is empty only when the step has fewer samples than ranks)."""
    return np.array_split(np.arange(num_samples), world_size)
