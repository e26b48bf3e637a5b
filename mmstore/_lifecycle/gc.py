"""Reachability gc and run release, on the rollouts table's log.

Bytes are deleted because nothing reaches them, never because of where they sit. What a
gc keeps:

- **rollout files** still needed: every file of a version someone may still read. That is
  the version that was the latest at ``start - grace_seconds`` (a reader that opened the
  latest within the grace period may be reading it), every file a commit since added, and
  every file a pin holds (``pin_rows``). A file that none of these lists (removed by
  ``release_run`` longer ago than the grace period, or an orphan no commit ever listed: a
  writer killed between its rename and its commit) is deleted once its own bytes are older
  than the grace period too.
- **media** referenced by a kept rollout file (only their ``images[].hash`` and
  ``videos[].hash`` leaf columns are read; a file written before ``videos`` existed has
  none) or held by a pin.
- **run layout records** (``runs/<run>/<fingerprint>.json``, see :mod:`mmstore._rows.runs`)
  of every run a kept or remaining rollout file belongs to; a record of a run with none is
  deleted once it is older than the grace period (writers renew theirs).

Why concurrent writers never end up with a dangling ref
-------------------------------------------------------
The writer's contract: ``put_media`` writes a file, or renews the timestamp (mtime) of the
one already there, before any row referencing it is written, and the row's file is written
and committed within ``grace_seconds`` of that put. gc, with ``cutoff = start - grace``:

1. lists media with their mtimes (the candidates), then the Parquet files under
   ``rollouts/`` with theirs,
2. reads the log (the kept files, above) and the marks: the hashes those files reference,
   then the pins,
3. sweeps each unmarked candidate listed older than the cutoff, re-checking its mtime at the
   moment it is claimed: locally by renaming it into ``_staging/`` first (atomic), so a touch
   lands either before the claim, and is seen, or after it, and finds no file, so the put
   writes the file anew; on S3 by a HEAD just before the DELETE.

Suppose gc deletes media M that a committed row R references. M's mtime was older than the
cutoff when claimed, so every put of M came before ``start - grace`` or after the claim. A
put after the claim re-creates M (M is not deleted after all). A put before
``start - grace`` means R was committed before ``start`` by the contract, so the log read in
step 2 lists R's file and M was marked: no such M. The same holds for R's file: deleted only
if no version read in step 2 lists it and its bytes were written before the cutoff, so a
writer's file is either committed before step 2 (and kept) or still within its grace.

A gc killed between a claim and its decision leaves the only name of that media in
``_staging/``; the next gc links every such claim back first (the claim keeps the media's
name), so a file touched meanwhile is referenced again; until then it reads as missing.

What is left: S3 has no atomic claim, so a put that lands between the HEAD and the DELETE
(one round trip) of unreferenced media older than the grace period can still lose it;
keep the grace period far above any write's duration and clock skew between machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from mmstore._arguments import seconds
from mmstore._format.media import media_path
from mmstore._format.paths import check_partition, is_partition_dir, run_of
from mmstore._lifecycle.pins import PinRecord, read_pin_records
from mmstore._rows.entries import LOG_DIR
from mmstore._rows.files import media_hash, referenced_hashes, select_from
from mmstore._rows.runs import RUNS, run_dir, stale_records
from mmstore._rows.store import Store
from mmstore._rows.versions import table_of, version_at, version_files
from mmstore._storage.backends import STAGING, Backend, FileStat, LocalBackend
from mmstore._storage.store import MEDIA
from mmstore.errors import DeleteFailedError, PinnedRowsError

# Deletes are I/O bound (one or two S3 round trips each); a few threads hide the latency.
SWEEP_THREADS = 16
CLAIM_PREFIX = "gc-claim-"
# Written before a release removes a run's rows, removed when it is done: a release killed
# after the rows went finds it and finishes (the gc).
RELEASE_MARKER = "release.json"


@dataclass(frozen=True)
class GcReport:
    """What a gc deleted (or, on a dry run, would delete) and what it kept."""

    deleted: list[str]  # store-relative media paths
    kept: int  # media files kept (marked, or younger than the grace period)
    bytes_freed: int
    bytes_kept: int
    staging_cleared: list[str]
    dry_run: bool
    referenced: int  # distinct hashes marked by kept rollout files and pins
    files_scanned: int = 0  # kept rollout files read for their media
    pinned: int = 0  # distinct hashes the pins hold
    grace_seconds: float = 0.0
    table_version: int | None = None  # the latest version when gc read the log
    rollout_files_deleted: list[str] = field(default_factory=list)  # no version needs them
    rollout_bytes_freed: int = 0
    rollout_files_kept: int = 0  # Parquet files kept (needed, pinned or within grace)
    run_records_deleted: list[str] = field(default_factory=list)  # runs/<run>/<fp>.json
    # the log's files (entries, checkpoints) of versions no reader may open any more
    log_files_deleted: int = 0
    log_bytes_freed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReleaseReport:
    run_id: str
    removed_files: list[str]  # rollout files removed from the latest version (or that would be)
    gc: GcReport
    dry_run: bool
    version: int | None = None  # the table version that removed them

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(
    store: Store,
    grace_seconds: float = 3600,
    dry_run: bool = False,
    progress: bool | None = None,
) -> GcReport:
    """Delete what nothing needs and that is older than ``grace_seconds``: media that no
    kept rollout file or pin references, rollout files that no version still needed lists
    (see the module docstring), and ``_staging/`` leftovers. Safe next to running writers
    and readers. Raises :class:`DeleteFailedError` naming the rollout files that survived
    their delete (their media is kept), after doing everything else."""
    grace_seconds = seconds("grace_seconds", grace_seconds)
    report = _collect(store, grace_seconds, dry_run, progress)
    _raise_failed(report, _failed(store, report))
    return report


def release_run(
    store: Store,
    run_id: str,
    grace_seconds: float = 3600,
    dry_run: bool = False,
    *,
    force: bool = False,
) -> ReleaseReport:
    """Remove run ``run_id``'s rows from the latest table version (a Delta remove; versions
    before it still list them), then gc: their bytes and media go once no version
    something needs lists them (after ``grace_seconds``; ``grace_seconds=0`` frees them
    now), media other runs or pins reference stays. A dry run changes nothing and reports
    what a real one would.

    A run the latest version does not hold raises :class:`NoMatchError` naming the runs it
    does (unless a release of it was interrupted: then this one finishes it). Rows a pin
    holds raise :class:`PinnedRowsError` naming the pin, unless ``force`` (the pin then
    keeps its copy). Rollout files that survive their delete raise
    :class:`DeleteFailedError` naming them (their media is kept); calling it again finishes.
    """
    check_partition(run_id, 0)
    grace_seconds = seconds("grace_seconds", grace_seconds)
    store.check_log()
    latest = version_files(store)
    files = [f.path for f in latest.files if f.run_id == run_id]
    marker = f"{run_dir(run_id)}/{RELEASE_MARKER}"
    if not files and store.backend.stat(marker) is None:
        select_from(latest, [run_id], root=store.root)  # NoMatchError naming the runs held
    if files and not force:
        _refuse_pinned(read_pin_records(store), run_id, set(files))
    if dry_run:
        report = _collect(store, grace_seconds, True, None, removing=frozenset(files))
        return ReleaseReport(run_id, files, report, True, None)
    version = None
    if files:
        store.backend.write_atomic(marker, json.dumps({"run_id": run_id}).encode())
        version = store.table.remove_run(run_id).version
    report = _collect(store, grace_seconds, False, None)
    _raise_failed(report, _failed(store, report), run_id=run_id)
    store.backend.delete(marker)
    return ReleaseReport(run_id, files, report, False, version)


def _refuse_pinned(pins: dict[str, PinRecord], run_id: str, files: set[str]) -> None:
    holding = sorted(name for name, pin in pins.items() if pin.files & files)
    if holding:
        raise PinnedRowsError(
            f"pin(s) {', '.join(map(repr, holding))} hold rows of run {run_id!r}: unpin them "
            "first, or release with force=True (the pins then keep their copy)",
            run_id=run_id,
            pins=holding,
        )


def _failed(store: Store, report: GcReport) -> list[str]:
    """The rollout files gc meant to delete that are still there."""
    if report.dry_run:
        return []
    return [p for p in report.rollout_files_deleted if store.backend.stat(p) is not None]


def _raise_failed(report: GcReport, failed: list[str], run_id: str | None = None) -> None:
    if failed:
        raise DeleteFailedError(
            f"{len(failed)} rollout files that no version needs could not be deleted "
            "(permissions, immutable, busy); their media was kept: remove what blocks them "
            "and run gc again",
            run_id=run_id,
            files=failed,
        )


def _collect(
    store: Store,
    grace_seconds: float,
    dry_run: bool,
    progress: bool | None,
    removing: frozenset[str] = frozenset(),
) -> GcReport:
    """One gc (``grace_seconds`` checked by the caller). ``removing``: files a dry-run
    release would remove from the latest version now (kept while within the grace period,
    as removed files are)."""
    now = time.time()
    cutoff = now - grace_seconds
    if not dry_run:
        _restore_claims(store)
    # Order matters (module docstring): candidates first (media, then Parquet), then marks.
    media = [m for m in store.backend.list(MEDIA) if media_hash(m.path) is not None]
    parquet = store.listed_rollout_files()
    records = store.backend.list(RUNS)
    pins = read_pin_records(store)
    latest, needed = needed_files(store, cutoff, pins)
    if removing and cutoff >= now:
        needed -= removing
    doomed = [f for f in parquet if f.path not in needed and f.mtime < cutoff]
    if not dry_run:
        _delete_rollout_files(store, doomed)
    survivors = {f.path for f in doomed if not dry_run and store.backend.stat(f.path)}
    stale = _stale_run_records(records, parquet, doomed, needed | survivors, cutoff)
    if not dry_run:
        # Re-checked just before: a writer may have renewed it since the listing.
        stale = [r for r in stale if _delete_if_older(store.backend, r, cutoff)]
    kept_files = sorted(needed | survivors)  # a survivor's media stays with it
    marked = referenced_hashes(store, kept_files, progress=progress, desc="gc: mark")
    pinned = set().union(*(pin.hashes for pin in pins.values()))
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
    staged = [s.path for s in store.staging_files() if _stale(store.backend, s, cutoff)]
    if not dry_run:
        for path in staged:
            store.backend.delete(path)
    # Last: the marks above read the log.
    log_files = table_of(store).collect_log_before(
        log_boundary(store, cutoff, pins, latest), dry_run=dry_run
    )
    return GcReport(
        deleted=sorted(gone_paths),
        kept=len(kept),
        bytes_freed=sum(m.size for m in deleted),
        bytes_kept=sum(m.size for m in kept),
        staging_cleared=sorted(staged),
        dry_run=dry_run,
        referenced=len(marked),
        files_scanned=len(kept_files),
        pinned=len(pinned),
        grace_seconds=float(grace_seconds),
        table_version=latest,
        rollout_files_deleted=sorted(f.path for f in doomed),
        rollout_bytes_freed=sum(f.size for f in doomed if f.path not in survivors),
        rollout_files_kept=len(parquet) - len(doomed) + len(survivors),
        run_records_deleted=stale,
        log_files_deleted=len(log_files),
        log_bytes_freed=sum(f.size for f in log_files),
    )


def _stale_run_records(
    records: list[FileStat],
    parquet: list[FileStat],
    doomed: list[FileStat],
    kept: set[str],
    cutoff: float,
) -> list[str]:
    """The run layout records (``runs/<run>/<fp>.json``) no one needs: of runs with no file
    in a version something still needs (``kept``: needed, pinned, or surviving its delete)
    and no Parquet file left on storage (an orphan within its grace may be a writer's
    file about to be committed: its run's records stay), older than the cutoff."""
    gone = {f.path for f in doomed}
    paths = kept | {f.path for f in parquet if f.path not in gone}
    keep_runs = {run_of(path) for path in paths}
    return sorted(r.path for r in stale_records(records, keep_runs, cutoff))


def _delete_if_older(backend: Backend, rel: str, cutoff: float) -> bool:
    now = backend.stat(rel)
    if now is None or now.mtime >= cutoff:
        return False
    backend.delete(rel)
    return True


def needed_files(store: Store, cutoff: float, pins: dict[str, PinRecord]) -> tuple[int, set[str]]:
    """The latest version, and every rollout file a version someone may read lists: the
    versions from the one that was the latest at ``cutoff`` on (the latest's files and
    every file a commit since removed), and the pins'. Reads the log's entries after its
    last checkpoint and the checkpoint's tombstones, not every commit since ``cutoff``.

    A log that does not start where a log starts (version 0, or a checkpoint) is refused
    first (:meth:`Store.check_log`): read as it stands it lists nothing, so every file
    would look unneeded."""
    store.check_log()
    latest = version_files(store)
    at_cutoff = version_at(store, cutoff * 1000, latest.version)
    needed = {f.path for f in latest.files}
    if at_cutoff != latest.version:
        needed |= store.table.removed_after(at_cutoff, cutoff * 1000)
    for pin in pins.values():
        needed |= pin.files
    return latest.version, needed


def log_boundary(store: Store, cutoff: float, pins: dict[str, PinRecord], latest: int) -> int:
    """The oldest version gc keeps openable: the one that was the latest at ``cutoff`` (a
    reader may have opened it within the grace period: a dataset's or a live loader's
    state), or an older one a pin holds. The log's files below the newest checkpoint at
    or below it are collected: without that, checkpoints (each lists every live file)
    would grow the log quadratically with the commits."""
    pinned = [pin.table_version for pin in pins.values() if pin.table_version is not None]
    return min([version_at(store, cutoff * 1000, latest), *pinned])


def _delete_rollout_files(store: Store, files: list[FileStat]) -> None:
    """Delete rollout files no version needs (a failure is found by the caller's stat),
    then the partition directories left empty (locally)."""
    for file in files:
        with contextlib.suppress(OSError):
            store.backend.delete(file.path)
    if isinstance(store.backend, LocalBackend):
        for directory in sorted({f.path.rsplit("/", 1)[0] for f in files}, reverse=True):
            for part in (directory, directory.rsplit("/", 1)[0]):  # step=…, then run_id=…
                if is_partition_dir(part):
                    with contextlib.suppress(OSError):
                        os.rmdir(store.backend.abspath(part))


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


# -- accounting (read-only) ----------------------------------------------------------------


@dataclass(frozen=True)
class DiskUsage:
    """Where a store's bytes are, and what ``gc(store, grace_seconds)`` would do with them.
    Counts are files, sizes bytes; nothing is deleted to find out."""

    grace_seconds: float
    rollout_files: int  # every Parquet file under rollouts/ (committed or not)
    rollout_bytes: int
    media_referenced: int  # media the latest version's rows or a pin reference
    media_referenced_bytes: int
    media_pinned_only: int  # of those, held by a pin alone (no row of the latest version)
    media_unreferenced: int  # media nothing of the latest version or a pin references
    media_unreferenced_bytes: int
    staging_bytes: int  # in-flight writes and gc leftovers in _staging/
    free_now_files: int  # what a gc with this grace period deletes now (rollouts + media)
    free_now_bytes: int
    grace_files: int  # what it keeps only for the grace period (released or young)
    grace_bytes: int
    free_by: float | None  # when (seconds since the epoch) those are collectable, at the latest
    log_files: int = 0  # the table's log: entries and checkpoints
    log_bytes: int = 0
    log_free_now_files: int = 0  # of those, what the gc collects now (versions nobody opens)
    log_free_now_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.rollout_bytes
            + self.media_referenced_bytes
            + self.media_unreferenced_bytes
            + self.log_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def disk_usage(store: Store, grace_seconds: float = 3600) -> DiskUsage:
    """Account for every byte of ``store`` by what holds it: rollout files, media that rows
    of the latest version or pins reference, and media nothing references; and split what a
    gc with ``grace_seconds`` would do into what it frees now and what it keeps only for the
    grace period (released rows, young unreferenced media), with when that goes. Uses gc's
    own rule (:func:`needed_files`), so the two never disagree; reads, never deletes."""
    grace_seconds = seconds("grace_seconds", grace_seconds)
    now = time.time()
    cutoff = now - grace_seconds
    media = [m for m in store.backend.list(MEDIA) if media_hash(m.path) is not None]
    parquet = store.listed_rollout_files()
    pins = read_pin_records(store)
    latest, needed = needed_files(store, cutoff, pins)
    pinned = set().union(*(pin.hashes for pin in pins.values()))
    pinned_files = set().union(*(pin.files for pin in pins.values()))
    latest_files = {f.path for f in version_files(store, latest).files}
    rows = referenced_hashes(store, sorted(latest_files))
    live = rows | referenced_hashes(store, sorted(pinned_files)) | pinned
    marked = live | referenced_hashes(store, sorted(needed - pinned_files))
    free_rollouts = [f for f in parquet if f.path not in needed and f.mtime < cutoff]
    free_media = [m for m in media if media_hash(m.path) not in marked and m.mtime < cutoff]
    freed = {f.path for f in [*free_rollouts, *free_media]}
    latest_files |= pinned_files
    held = [f for f in parquet if f.path not in latest_files and f.path not in freed]
    held += [m for m in media if media_hash(m.path) not in live and m.path not in freed]
    referenced = [m for m in media if media_hash(m.path) in live]
    log = store.backend.list(LOG_DIR)
    free_log = table_of(store).collect_log_before(
        log_boundary(store, cutoff, pins, latest), dry_run=True
    )
    return DiskUsage(
        grace_seconds=float(grace_seconds),
        rollout_files=len(parquet),
        rollout_bytes=sum(f.size for f in parquet),
        media_referenced=len(referenced),
        media_referenced_bytes=sum(m.size for m in referenced),
        media_pinned_only=sum(media_hash(m.path) not in rows for m in referenced),
        media_unreferenced=len(media) - len(referenced),
        media_unreferenced_bytes=sum(m.size for m in media) - sum(m.size for m in referenced),
        staging_bytes=sum(s.size for s in store.staging_files()),
        free_now_files=len(freed),
        free_now_bytes=sum(f.size for f in [*free_rollouts, *free_media]),
        grace_files=len(held),
        grace_bytes=sum(f.size for f in held),
        free_by=_free_by(store, latest, held, needed - latest_files, grace_seconds),
        log_files=len(log),
        log_bytes=sum(f.size for f in log),
        log_free_now_files=len(free_log),
        log_free_now_bytes=sum(f.size for f in free_log),
    )


def _free_by(
    store: Store, latest: int, held: list[FileStat], released: set[str], grace: float
) -> float | None:
    """The latest time gc frees what it keeps for the grace period, if nothing changes: a
    young file once it is ``grace`` old; released rows (and their media) once the latest
    commit is, for no version older than that is needed then."""
    if not held:
        return None
    times = [f.mtime + grace for f in held]
    if released:
        entry = table_of(store).log_entry(latest)
        stamp = None if entry is None else entry.timestamp_ms
        times.append((time.time() if stamp is None else stamp / 1000) + grace)
    return max(times)
