"""Reachability gc and run release.

Media is deleted because nothing reaches it, never because of where it sits: roots are the
committed rollout files (only their ``images[].hash`` leaf column is read) and the pins.

Why concurrent writers never end up with a dangling ref
-------------------------------------------------------
The writer's contract: ``put_media`` writes a file, or renews the timestamp (mtime) of the
one already there, before any row referencing it is written, and the row's file is committed
within ``grace_seconds`` of that put. gc, with ``cutoff = start - grace_seconds``:

1. lists media with their mtimes (the candidates),
2. lists and reads the committed rollout files, then the pins (the marks),
3. sweeps each unmarked candidate listed older than the cutoff, re-checking its mtime at the
   moment it is claimed: locally by renaming it into ``_staging/`` first (atomic), so a touch
   lands either before the claim, and is seen, or after it, and finds no file, so the put
   writes the file anew; on S3 by a HEAD just before the DELETE.

Suppose gc deletes media M that a committed row R references. M's mtime was older than the
cutoff when claimed, so every put of M came before ``start - grace`` or after the claim. A
put after the claim re-creates M (M is not deleted after all). A put before
``start - grace`` means R was committed before ``start`` by the contract, so R was listed in
step 2 and M was marked: no such M. The mtime read in step 1 alone would not do: a writer
can touch M after step 1 and commit after step 2; the re-check at the claim catches that.

A gc killed between a claim and its decision leaves the only name of that media in
``_staging/``; the next gc links every such claim back first (the claim keeps the media's
name), so a file touched meanwhile is referenced again; until then it reads as missing.

What is left: S3 has no atomic claim, so a put that lands between the HEAD and the DELETE
(one round trip) of an unreferenced image older than the grace period can still lose it;
keep the grace period far above any write's duration and clock skew between machines.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from mmstore._exceptions import DeleteFailedError, InvalidArgumentError
from mmstore._format.media import media_path
from mmstore._lifecycle.pins import pinned_hashes
from mmstore._rows.files import media_hash, referenced_hashes, select_files
from mmstore._rows.store import Store
from mmstore._rows.writer import check_partition
from mmstore._storage.backends import STAGING, Backend, FileStat, LocalBackend
from mmstore._storage.store import MEDIA, ROLLOUTS

# Deletes are I/O bound (one or two S3 round trips each); a few threads hide the latency.
SWEEP_THREADS = 16
CLAIM_PREFIX = "gc-claim-"


@dataclass(frozen=True)
class GcReport:
    """What a gc deleted (or, on a dry run, would delete) and what it kept."""

    deleted: list[str]  # store-relative media paths
    kept: int  # media files kept (marked, or younger than the grace period)
    bytes_freed: int
    bytes_kept: int
    staging_cleared: list[str]
    dry_run: bool
    referenced: int  # distinct hashes marked by rollout files and pins
    files_scanned: int = 0  # committed rollout files read
    pinned: int = 0  # distinct hashes the pins hold
    grace_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReleaseReport:
    run_id: str
    removed_files: list[str]  # committed rollout files removed (or that would be)
    gc: GcReport
    dry_run: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    store: Store,
    grace_seconds: float = 3600,
    dry_run: bool = False,
    progress: bool | None = None,
) -> GcReport:
    """Delete media that no committed rollout file or pin references and that is older than
    ``grace_seconds``, and ``_staging/`` leftovers older than that. See the module docstring
    for why this is safe next to running writers."""
    return _collect(store, grace_seconds, dry_run, progress, ignore_files=frozenset())


def release_run(
    store: Store, run_id: str, grace_seconds: float = 3600, dry_run: bool = False
) -> ReleaseReport:
    """Remove run ``run_id``'s rollout partitions, then gc: media still referenced by other
    runs or pins stays. A dry run removes nothing and reports what a real one would.

    A run the store does not hold raises :class:`NoMatchError` naming the runs it does.
    Raises :class:`DeleteFailedError` naming the files that survived their delete
    (permissions, immutable, busy), before any gc: they stay committed and visible, and
    their media is never swept. Removing what blocks them and calling it again finishes.
    """
    check_partition(run_id, 0)
    run_dir = f"{ROLLOUTS}/run_id={run_id}"
    # Raises NoMatchError naming the runs there are: releasing a typo must not look done.
    files = [f.path for f in select_files(store, runs=[run_id])]
    if dry_run:
        report = _collect(store, grace_seconds, True, None, ignore_files=frozenset(files))
        return ReleaseReport(run_id=run_id, removed_files=files, gc=report, dry_run=True)
    for path in files:
        with contextlib.suppress(OSError):  # what survives is found by listing again
            store.backend.delete(path)
    with contextlib.suppress(OSError):  # empty partition directories, staging debris
        store.backend.delete_tree(run_dir)
    # Trust the listing, not the deletes: a file still listed is still committed.
    survivors = _run_files(store, run_dir)
    if survivors:
        raise DeleteFailedError(
            f"{len(survivors)} of {len(files)} rollout files of run {run_id!r} could not be "
            "deleted; they stay committed, and no media was collected",
            run_id=run_id,
            files=survivors,
        )
    # gc lists the committed files itself, so anything (re)committed meanwhile keeps its media.
    report = _collect(store, grace_seconds, False, None, ignore_files=frozenset())
    return ReleaseReport(run_id=run_id, removed_files=files, gc=report, dry_run=False)


def _run_files(store: Store, run_dir: str) -> list[str]:
    return [f.path for f in store.rollout_files() if f.path.startswith(run_dir + "/")]


def _collect(
    store: Store,
    grace_seconds: float,
    dry_run: bool,
    progress: bool | None,
    ignore_files: frozenset[str],
) -> GcReport:
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, int | float):
        raise InvalidArgumentError(f"grace_seconds must be a number, got {grace_seconds!r}")
    if grace_seconds < 0:
        raise InvalidArgumentError(f"grace_seconds must be >= 0, got {grace_seconds}")
    cutoff = time.time() - grace_seconds
    if not dry_run:
        _restore_claims(store)
    # Order matters (module docstring): candidates first, then the marks.
    media = [m for m in store.backend.list(MEDIA) if media_hash(m.path) is not None]
    files = [f.path for f in store.rollout_files() if f.path not in ignore_files]
    marked = referenced_hashes(store, files, progress=progress, desc="gc: mark")
    pinned = pinned_hashes(store)
    marked |= pinned
    candidates = [m for m in media if media_hash(m.path) not in marked and m.mtime < cutoff]
    if dry_run:
        deleted = candidates
    else:
        with ThreadPoolExecutor(SWEEP_THREADS) as pool:
            swept = list(pool.map(lambda m: _sweep(store.backend, m, cutoff), candidates))
        deleted = [m for m, gone in zip(candidates, swept, strict=True) if gone]
    gone_paths = {m.path for m in deleted}
    kept = [m for m in media if m.path not in gone_paths]
    stale = [s.path for s in store.staging_files() if _stale(store.backend, s, cutoff)]
    if not dry_run:
        for path in stale:
            store.backend.delete(path)
    return GcReport(
        deleted=sorted(gone_paths),
        kept=len(kept),
        bytes_freed=sum(m.size for m in deleted),
        bytes_kept=sum(m.size for m in kept),
        staging_cleared=sorted(stale),
        dry_run=dry_run,
        referenced=len(marked),
        files_scanned=len(files),
        pinned=len(pinned),
        grace_seconds=float(grace_seconds),
    )


def _stale(backend: Backend, entry: FileStat, cutoff: float) -> bool:
    """A staging entry older than the cutoff, but never a concurrent gc's claim: a claimed
    file keeps its media's old mtime, while the rename that claimed it renewed its ctime."""
    if entry.mtime >= cutoff:
        return False
    if entry.path.startswith(f"{STAGING}/{CLAIM_PREFIX}") and isinstance(backend, LocalBackend):
        with contextlib.suppress(FileNotFoundError):
            return os.stat(backend.abspath(entry.path)).st_ctime < cutoff
    return True


def claim_path(rel: str) -> str:
    """Where gc moves media ``rel`` while it decides: the name is kept, so that a claim left
    by a killed gc can be put back."""
    return f"{STAGING}/{CLAIM_PREFIX}{uuid.uuid4().hex}-{rel.rsplit('/', 1)[1]}"


def _restore_claims(store: Store) -> None:
    """Put back media whose claim a killed gc left in ``_staging/``.

    Between its claim (a rename) and its decision, a gc holds the only name of a media file;
    killed there, a file touched by a writer meanwhile (and referenced by rows committed
    since) would be lost. Linking every claim back under its media name is always safe: it
    is the same content under its own name, and what nothing references is swept again
    below. A claim of a gc running right now is put back too: that gc's delete then leaves
    the file in place, to be collected next time.
    """
    backend = store.backend
    if not isinstance(backend, LocalBackend):
        return  # S3 gc claims nothing
    for entry in store.staging_files():
        name = entry.path.rsplit("/", 1)[1]
        if not name.startswith(CLAIM_PREFIX):
            continue
        media = name[len(CLAIM_PREFIX) :].partition("-")[2]
        digest, _, ext = media.partition(".")
        rel = media_path(digest, ext) if ext else ""
        if media_hash(rel) != digest:
            continue  # an older claim name, or not a claim of ours
        os.makedirs(os.path.dirname(backend.abspath(rel)), exist_ok=True)
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            os.link(backend.abspath(entry.path), backend.abspath(rel))


def _sweep(backend: Backend, media: FileStat, cutoff: float) -> bool:
    """Delete one unmarked media file if it is still older than ``cutoff``; True if deleted."""
    if isinstance(backend, LocalBackend):
        return _sweep_local(backend, media.path, cutoff)
    now = backend.stat(media.path)
    if now is None or now.mtime >= cutoff:
        return False
    backend.delete(media.path)
    return True


def _sweep_local(backend: LocalBackend, rel: str, cutoff: float) -> bool:
    """Claim by rename, so no touch can slip between the mtime check and the unlink."""
    source = backend.abspath(rel)
    claimed = backend.abspath(claim_path(rel))
    os.makedirs(os.path.dirname(claimed), exist_ok=True)
    try:
        os.rename(source, claimed)
    except FileNotFoundError:  # another gc got it first
        return False
    try:
        if os.stat(claimed).st_mtime < cutoff:
            return True
        # Touched since it was listed: put it back, unless a writer already re-created it.
        with contextlib.suppress(FileExistsError):
            os.link(claimed, source)
        return False
    finally:
        os.unlink(claimed)
