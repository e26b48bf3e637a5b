"""verify: the log and the files agree, every committed file reads, every ref resolves,
every hash matches.

The files checked are those one table version lists (the latest by default): each must be
there with the size the log records. A Parquet file under ``rollouts/`` that no version
something needs lists (see :mod:`.gc`) and that is older than the grace period is reported
too: gc should have deleted it (an orphan of a killed writer, or released rows).

Work is proportional to refs but Python runs per *distinct* (uri, hash, nbytes) of a file:
refs are flattened with Arrow, checked once per distinct media, and only refs that fail are
turned into Python problems (by a join back onto the flattened refs).

``check_hashes=False`` is the metadata mode: footers, the ref leaf columns, one listing of
``media/`` and sizes against ``nbytes``; no media bytes are read and rows are not checked.
With ``check_hashes=True`` (the default) every row is decoded and checked as the loader
checks it (spans against tokens, lengths, fields; see :func:`_row_problems` for what verify
can and cannot know without a processor), and every distinct media file is read and hashed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mmstore._arguments import seconds
from mmstore._format.media import content_hash
from mmstore._format.schema import ROW_COLUMNS, check_schema_version
from mmstore._lifecycle.gc import needed_files
from mmstore._lifecycle.pins import PinRecord, read_pin_records
from mmstore._progress import bar
from mmstore._rows.check import RowWindow
from mmstore._rows.files import (
    HASH_RE,
    MEDIA_COLUMNS,
    conform,
    decode_every_page,
    flatten_refs,
    index_column,
    media_hash,
    open_rollout_file,
    read_ref_columns,
    reading,
    where_of_file,
)
from mmstore._rows.lookups import footer_checker, footer_video_checker
from mmstore._rows.store import Store
from mmstore._rows.table import TableFile
from mmstore._rows.versions import version_files
from mmstore._storage.backends import Backend, FileStat, LocalBackend, network_error
from mmstore._storage.store import MEDIA, PINS
from mmstore.errors import (
    MmstoreError,
    SchemaVersionError,
    UnknownLayoutError,
    UntrustedURIError,
)

PROBLEM_KINDS = (
    "missing_file",
    "size_mismatch",
    "file_added_twice",
    "orphan_file",
    "unreadable_file",
    "schema_version",
    "missing_media",
    "hash_mismatch",
    "untrusted_uri",
    "invalid_row",
    "unknown_layout",
)
HASH_THREADS = 8


@dataclass(frozen=True)
class Problem:
    kind: str  # one of PROBLEM_KINDS
    message: str
    file: str | None = None
    run_id: str | None = None
    step: int | None = None
    sample_id: str | None = None
    image_index: int | None = None
    uri: str | None = None
    video_index: int | None = None  # set where the ref is a video's (image_index is None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    refs_checked: int = 0
    media_checked: int = 0  # distinct media files stat'ed (and hashed, with check_hashes)
    check_hashes: bool = True
    table_version: int | None = None  # the version whose files were checked

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(
    store: Store,
    check_hashes: bool = True,
    progress: bool | None = None,
    *,
    version: int | None = None,
    grace_seconds: float = 3600,
) -> VerifyReport:
    """Check table ``version`` (None: the latest) and the store around it; problems are
    listed by file, run, step, sample and image or video (``image_index``,
    ``video_index``). With the latest version, Parquet files no needed version lists that
    are older than ``grace_seconds`` are reported as orphans."""
    grace_seconds = seconds("grace_seconds", grace_seconds)
    # Files before media: a file committed before the log was read had its media in place
    # before its commit, so the media listing below sees it even with writers running.
    listed = store.listed_rollout_files() if version is None else []
    table = version_files(store, version)
    checker = _MediaChecker(store, check_hashes)
    problems: list[Problem] = []
    refs = 0
    seen_samples: dict[str, set[str]] = {}
    sizes = {f.path: f.size for f in listed}
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for file in bar(table.files, desc="verify", unit="file", progress=progress):
            found, count = _verify_listed(store, file, checker, pool, seen_samples, sizes)
            problems += found
            refs += count
    problems += _added_twice(store, table.version)
    pins = _read_pins(store)
    if isinstance(pins, Problem):
        problems.append(pins)
    else:
        if version is None:
            problems += _orphans(store, listed, pins, grace_seconds)
        problems += _verify_pins(store, pins, checker)
    return VerifyReport(
        ok=not problems,
        problems=problems,
        files_checked=len(table.files),
        refs_checked=refs,
        media_checked=checker.checked,
        check_hashes=check_hashes,
        table_version=table.version,
    )


def _verify_listed(
    store: Store,
    file: TableFile,
    checker: _MediaChecker,
    pool: ThreadPoolExecutor,
    seen_samples: dict[str, set[str]],
    sizes: dict[str, int],
) -> tuple[list[Problem], int]:
    """A file the version lists: there, with the size the log records, then its rows."""
    where = where_of_file(file.path)
    size = sizes.get(file.path) if sizes else None
    if size is None:
        stat = store.backend.stat(file.path)
        size = None if stat is None else stat.size
    if size is None and not _exists(store, file.path):
        return [Problem("missing_file", "the table lists this file; it is gone", **where)], 0
    if size is not None and size != file.size:
        message = f"the file has {size} bytes, the table's log records {file.size}"
        return [Problem("size_mismatch", message, **where)], 0
    return _verify_file(store, file.path, checker, pool, seen_samples)


def _added_twice(store: Store, version: int) -> list[Problem]:
    """Files a log entry up to ``version`` adds while the table lists them already (no
    remove in between): a live loader following the log from the start trains their rows
    twice, though the version itself lists each once (two upgrades at once did this before
    issue 39). Reads each JSON entry once (from the last checkpoint's files where the
    entries below it are cleaned up)."""
    table = store.table
    live: set[str] = set()
    start = -1
    if version >= 0 and table.log_entry(0, check_cleaned=False) is None:
        checkpoint = table._log.last_checkpoint()  # entries below it were cleaned up
        if checkpoint is None or int(checkpoint["version"]) > version:
            return []
        start = int(checkpoint["version"])
        live = {f.path for f in table.replay(start).files}
    problems = []
    for entry in table.entries_after(start, limit=version - start):
        live.difference_update(entry.removed)
        for file in entry.added:
            if file.path in live:
                problems.append(
                    Problem(
                        "file_added_twice",
                        f"log version {entry.version} adds this file again while the table "
                        "lists it: a loader following the log trains its rows twice",
                        **where_of_file(file.path),
                    )
                )
            live.add(file.path)
    return problems


def _exists(store: Store, path: str) -> bool:
    """Something is at ``path`` (a FIFO in a file's place is there, and reported unread)."""
    backend = store.backend
    if isinstance(backend, LocalBackend):
        return os.path.lexists(backend.abspath(path))
    return False


def _raise_if_retryable(exc: BaseException, where: dict[str, Any]) -> None:
    """Storage that did not answer says nothing about the data: a :class:`NetworkError`
    (retryable) is raised, never reported as damage."""
    if isinstance(exc, MmstoreError) and exc.retryable:
        raise exc.with_context(**where) from None
    typed = network_error(exc, **where)
    if typed is not None:
        raise typed from None


def _read_pins(store: Store) -> dict[str, PinRecord] | Problem:
    try:
        return read_pin_records(store)
    except MmstoreError as exc:  # reported, not raised: verify lists everything it finds
        _raise_if_retryable(exc, {"file": exc.context.get("file", PINS)})
        return Problem("unreadable_file", exc.message, file=exc.context.get("file", PINS))


def _orphans(
    store: Store, listed: list[FileStat], pins: dict[str, PinRecord], grace_seconds: float
) -> list[Problem]:
    """Parquet files under ``rollouts/`` that no needed version lists, older than the grace
    period: what gc should have deleted (it deletes exactly these)."""
    cutoff = time.time() - grace_seconds
    _, needed = needed_files(store, cutoff, pins)
    return [
        Problem(
            "orphan_file",
            "no table version that something needs lists this Parquet file, and it is older "
            "than the grace period (a writer killed before its commit, or released rows): "
            "gc deletes it",
            **where_of_file(f.path),
        )
        for f in listed
        if f.path not in needed and f.mtime < cutoff
    ]


def _verify_file(
    store: Store,
    path: str,
    checker: _MediaChecker,
    pool: ThreadPoolExecutor,
    seen_samples: dict[str, set[str]],
) -> tuple[list[Problem], int]:
    where = where_of_file(path)
    try:
        parquet = open_rollout_file(store, path)
        check_schema_version(parquet.metadata.metadata, where=path)
        problems: list[Problem] = []
        if checker.check_hashes:
            # Every page decoded, and every row checked as the loader checks it.
            rows = conform(decode_every_page(parquet, path), ROW_COLUMNS, file=path)
            problems = _row_problems(store, rows, parquet.metadata.metadata, where)
        sample_ids, media = _media_refs(parquet, path)
    except SchemaVersionError as exc:
        return [Problem("schema_version", exc.message, **where)], 0
    except (MmstoreError, OSError, pa.ArrowException) as exc:
        _raise_if_retryable(exc, where)
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        return [Problem("unreadable_file", message, **where)], 0
    problems += _duplicate_samples(sample_ids, seen_samples, where)
    count = 0
    for column, (refs, keys) in media.items():
        checker.check_all(keys, pool)
        bad = [(key, found) for key in keys if (found := checker.results[key]) is not None]
        if bad:
            problems += _ref_problems(refs, bad, where, column)
        count += refs.num_rows
    return problems, count


MediaRefs = dict[str, tuple[pa.Table, list[tuple[Any, ...]]]]


def _media_refs(parquet: pq.ParquetFile, path: str) -> tuple[list[str], MediaRefs]:
    """The file's sample ids, and per media column (images, videos) its flattened refs
    and their distinct (uri, hash, nbytes): only those leaf columns are read."""
    media: MediaRefs = {}
    sample_ids: list[str] = []
    for column in MEDIA_COLUMNS:
        columns = read_ref_columns(parquet, file=path, column=column)
        with reading(path):  # a file without page checksums may still hold invalid UTF-8
            sample_ids = columns.column("sample_id").to_pylist()
            refs = flatten_refs(columns, column)
            distinct = refs.group_by(["uri", "hash", "nbytes"], use_threads=False).aggregate([])
            keys = list(
                zip(
                    *(distinct.column(c).to_pylist() for c in ("uri", "hash", "nbytes")),
                    strict=True,
                )
            )
        media[column] = (refs, keys)
    return sample_ids, media


def _row_problems(
    store: Store, rows: pa.Table, footer: dict[bytes, bytes] | None, where: dict[str, Any]
) -> list[Problem]:
    """The loader's row checks (:mod:`mmstore._rows.check`) on every row of one file.

    verify has no processor: families and token ids are :func:`footer_checker`'s. A
    fingerprint neither the footer nor this process knows is reported as ``unknown_layout``:
    its spans cannot be checked here, and the loader refuses it unless its processor has
    exactly that layout.
    """
    family_of, token_ids = footer_checker(footer)
    window = RowWindow(
        rows,
        family_of,
        max_pixels=store.max_image_pixels,
        image_token_ids=token_ids,
        file=where["file"],
        video_family_of=footer_video_checker(footer),
    )
    problems = []
    for i in range(window.num_rows):
        try:
            window.check(i)
        except MmstoreError as exc:
            kind = "unknown_layout" if isinstance(exc, UnknownLayoutError) else "invalid_row"
            context = {k: v for k, v in exc.context.items() if k in _PROBLEM_CONTEXT}
            problems.append(Problem(kind, exc.message, **{**where, **context}))
    return problems


_PROBLEM_CONTEXT = ("sample_id", "image_index", "video_index")


def _duplicate_samples(
    sample_ids: list[str], seen: dict[str, set[str]], where: dict[str, Any]
) -> list[Problem]:
    run = seen.setdefault(where["run_id"] or where["file"], set())
    problems = []
    for sample_id in sample_ids:
        if sample_id in run:
            problems.append(
                Problem(
                    "invalid_row", "sample_id repeated within the run", sample_id=sample_id, **where
                )
            )
        run.add(sample_id)
    return problems


def _ref_problems(
    refs: pa.Table,
    bad: list[tuple[tuple[Any, ...], tuple[str, str]]],
    where: dict[str, Any],
    column: str = "images",
) -> list[Problem]:
    """Join the failing (uri, hash, nbytes) back onto the refs of ``column`` that carry
    them; each problem names its ``image_index`` or ``video_index``."""
    index = index_column(column)
    failing = pa.table(
        {
            "uri": [k[0] for k, _ in bad],
            "hash": [k[1] for k, _ in bad],
            "nbytes_key": pa.array([-1 if k[2] is None else k[2] for k, _ in bad], pa.int64()),
            "kind": [p[0] for _, p in bad],
            "message": [p[1] for _, p in bad],
        }
    )
    keyed = refs.append_column("nbytes_key", pc.fill_null(refs.column("nbytes"), -1))
    joined = keyed.join(failing, keys=["uri", "hash", "nbytes_key"], join_type="inner")
    joined = joined.sort_by([("row", "ascending"), (index, "ascending")])
    return [
        Problem(
            r["kind"],
            r["message"],
            sample_id=r["sample_id"],
            uri=r["uri"],
            **{index: r[index]},
            **where,
        )
        for r in joined.select(["kind", "message", "sample_id", index, "uri"]).to_pylist()
    ]


def _verify_pins(store: Store, pins: dict[str, PinRecord], checker: _MediaChecker) -> list[Problem]:
    """Every hash and every rollout file a pin holds is there."""
    present = checker.present_hashes()
    problems = [
        Problem(
            "missing_media", f"pinned hash {digest} is not in the store", file=f"{PINS}/{name}.json"
        )
        for name, pin in pins.items()
        for digest in sorted(pin.hashes - present)
    ]
    for name, pin in pins.items():
        problems += [
            Problem("missing_file", f"pin {name!r} holds this file; it is gone", **where_of_file(p))
            for p in sorted(pin.files)
            if store.backend.stat(p) is None
        ]
    return problems


class _MediaChecker:
    """Checks each distinct (uri, hash, nbytes) once; results are (kind, message) or None."""

    def __init__(self, store: Store, check_hashes: bool) -> None:
        self.store = store
        self.check_hashes = check_hashes
        self.results: dict[tuple[Any, ...], tuple[str, str] | None] = {}
        self._files: dict[tuple[int, str], tuple[int | None, str | None]] = {}
        # One listing of media/ answers every store-relative existence and size question.
        self._listing = {m.path: m.size for m in store.backend.list(MEDIA)}

    @property
    def checked(self) -> int:
        return len(self._files)

    def present_hashes(self) -> set[str]:
        return {h for p in self._listing if (h := media_hash(p)) is not None}

    def check_all(self, keys: Iterable[tuple[Any, ...]], pool: ThreadPoolExecutor) -> None:
        new = [k for k in keys if k not in self.results]
        # Without hashing, store media is answered from the listing: threads would only add
        # overhead. Reading and hashing bytes is I/O and releases the GIL: threads help.
        results = pool.map(self._check, new) if self.check_hashes else map(self._check, new)
        for key, result in zip(new, results, strict=True):
            self.results[key] = result

    def _check(self, key: tuple[Any, ...]) -> tuple[str, str] | None:
        uri, digest, nbytes = key
        if not isinstance(digest, str) or not HASH_RE.match(digest):
            return ("invalid_row", f"hash {digest!r} is not 32 lowercase hex digits")
        try:
            backend, rel = self.store.resolve(uri)
        except UntrustedURIError as exc:
            return ("untrusted_uri", exc.message)
        if backend is self.store.backend and media_hash(rel) != digest:
            return ("hash_mismatch", f"store path {rel!r} is not the path of hash {digest}")
        size, actual = self._file(backend, rel)
        if size is None:
            return ("missing_media", "media file not found")
        if nbytes is not None and size != nbytes:
            return ("hash_mismatch", f"media file has {size} bytes, the ref records {nbytes}")
        if actual is not None and actual != digest:
            return ("hash_mismatch", f"media bytes hash to {actual}, the ref says {digest}")
        return None

    def _file(self, backend: Backend, rel: str) -> tuple[int | None, str | None]:
        """(size or None if absent, content hash if check_hashes), once per file."""
        key = (id(backend), rel)
        if key not in self._files:
            self._files[key] = self._inspect(backend, rel)
        return self._files[key]

    def _inspect(self, backend: Backend, rel: str) -> tuple[int | None, str | None]:
        if backend is self.store.backend:
            size = self._listing.get(rel)
        else:
            stat = backend.stat(rel)
            size = None if stat is None else stat.size
        if size is None or not self.check_hashes:
            return size, None
        try:
            data = backend.read(rel)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None, None
        return len(data), content_hash(data)
