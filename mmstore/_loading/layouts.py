"""The layout check every reader runs before any worker starts: files whose images (or
videos) were laid out by another processor are refused, naming the runs and the parameters
that differ, so drift between the processor that wrote the spans and the one that rebuilds
the pixels fails at start-up, not after a whole rollout round."""

from __future__ import annotations

from typing import Any

from mmstore._families import Family, video_half
from mmstore._format.paths import partition_of
from mmstore._rows.snapshot import (
    Snapshot,
    fingerprints_by_file,
    recorded_layouts,
    video_fingerprints_by_file,
)
from mmstore._rows.store import Store
from mmstore.errors import LayoutMismatchError

# Differences and files a layout mismatch names (the count says how many there are).
SHOWN = 3


def check_layouts(store: Store, adapter: Family, snapshot: Snapshot) -> None:
    """Refuse a snapshot whose files were laid out for another processor, naming the runs."""
    refuse_other_layouts(
        store,
        adapter,
        fingerprints_by_file(store, snapshot),
        video_fingerprints_by_file(store, snapshot),
    )


def refuse_other_layouts(
    store: Store,
    adapter: Family,
    images: dict[str, set[str]],
    videos: dict[str, set[str]],
) -> None:
    """Refuse, before any worker starts, files whose images (``images``: fingerprint ->
    files) or videos were laid out by another processor, naming the runs and first files."""
    _refuse_video_layouts(adapter, videos)
    wrong = {fp: files for fp, files in images.items() if fp != adapter.fingerprint}
    if not wrong:
        return
    runs = {fp: {partition_of(f)[0] for f in files} for fp, files in wrong.items()}
    files = sorted({f for files in wrong.values() for f in files})
    stored = recorded_layouts(store, files)
    mine = adapter.layout.params()
    listing = "; ".join(
        f"runs {sorted(runs[fp])}: {_layout_diff(stored.get(fp), mine)}"
        for fp in sorted(wrong, key=str)
    )
    raise LayoutMismatchError(
        f"the processor lays images out differently from how they were stored "
        f"(stored vs processor) in {listing}. Build the image processor with the stored "
        "parameters, or select other runs (runs=...)",
        runs=sorted({r for rs in runs.values() for r in rs}),
        # the first few files: a long run would fill a screen with paths
        files=files[:SHOWN],
        num_files=len(files),
    )


def _refuse_video_layouts(adapter: Family, found: dict[str, set[str]]) -> None:
    """Refuse videos laid out by another video processor (or videos where the processor
    has none)."""
    video = video_half(adapter) if found else None
    wrong = {fp: files for fp, files in found.items() if video is None or fp != video.fingerprint}
    if not wrong:
        return
    files = sorted({f for fs in wrong.values() for f in fs})
    runs = sorted({partition_of(f)[0] for f in files})
    mine = "has no video processor" if video is None else f"lays videos out as {video.fingerprint}"
    raise LayoutMismatchError(
        f"rows hold videos laid out as {sorted(wrong)}; the processor {mine}. Pass the full "
        "processor (with its video_processor) the rollouts were written with, or select "
        "other runs (runs=...)",
        runs=runs,
        files=files[:SHOWN],
        num_files=len(files),
    )


def _layout_diff(stored: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    """``family differs (a vs b)``, or ``2 parameters differ: patch_size 14 vs 16, …`` (the
    first few): what tells a user which processor to build, not every field."""
    if stored is None:
        return "a layout their footers do not record"
    if stored.get("family") != mine.get("family"):
        return f"family differs ({stored.get('family')} vs {mine.get('family')})"
    keys = sorted(stored.keys() | mine.keys())
    differ = [f"{k} {stored.get(k)} vs {mine.get(k)}" for k in keys if stored.get(k) != mine.get(k)]
    if not differ:
        return "the same parameters under another fingerprint"
    more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
    return f"{len(differ)} parameter(s) differ: {', '.join(differ[:SHOWN])}{more}"
