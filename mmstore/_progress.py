"""Progress bars (tqdm) for anything that can take more than a second.

Off when ``MMSTORE_PROGRESS=0`` or when stderr is not a terminal, unless asked for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled(progress: bool | None = None) -> bool:
    if progress is not None:
        return progress
    if os.environ.get("MMSTORE_PROGRESS", "").strip() in ("0", "false", "no", "off"):
        return False
    return sys.stderr.isatty() or os.environ.get("MMSTORE_PROGRESS", "") in ("1", "true")


def bar(
    items: Iterable[T],
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    progress: bool | None = None,
) -> Iterator[T]:
    """``items`` with a progress bar on stderr when enabled."""
    if not enabled(progress):
        yield from items
        return
    # Plain (std) tqdm: tqdm.auto warns in kernels without ipywidgets; stderr works anywhere.
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
