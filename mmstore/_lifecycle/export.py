"""export: chosen rows and exactly the media they reference, as a new self-contained store.

Selection is by partition (runs, steps) of one table version (the latest by default), so
whole committed files are chosen and copied byte for byte: rows, row groups and file
metadata stay exact, and store-relative URIs (``media/ab/cd/<hash>.png``) resolve in the new
store as they did in the old one. The new store is a format-2 store: its rollouts table
commits every copied file in one transaction, after all of them are in place.

Refs to external media (absolute ``file://`` / ``s3://`` URIs under a trusted root) would
tie the export to machines that can reach them, so their bytes are copied into the export's
``media/`` and the rows of those files are rewritten to the store-relative URI; only the
``uri`` field changes, in image and video refs alike. Every rollout file is first read as
the loader reads it (page checksums, the row checks and bounds) before anything is
written: a rotted page or a forged row stops the export with a typed error naming it,
instead of becoming a clean-looking copy.
Every media file is hash-checked when read from the source and again when read back from
the export; every Parquet file is read back and compared too. Media is
written before the rows that reference it, and the files before the commit that lists
them, so an interrupted export leaves a valid store (holding nothing, or everything).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._format.media import FORMAT_EXTENSIONS, content_hash, media_path, probe
from mmstore._format.models import MAX_CLIP_FRAMES
from mmstore._format.video import probe_video
from mmstore._progress import bar
from mmstore._rows.check import read_checked
from mmstore._rows.files import (
    MEDIA_COLUMNS,
    check_run_id,
    flatten_refs,
    index_column,
    read_ref_columns,
    reading,
    select_files,
    where_of_file,
)
from mmstore._rows.runs import record_columns, record_layouts, run_columns, run_layouts
from mmstore._rows.snapshot import collected
from mmstore._rows.store import Store
from mmstore._rows.table import TableFile
from mmstore._rows.versions import commit_files
from mmstore._rows.writer import parquet_options
from mmstore._storage.backends import Backend
from mmstore.errors import (
    CorruptFileError,
    DestinationExistsError,
    HashMismatchError,
    MmstoreError,
    NoMatchError,
    NotAStoreError,
)

COPY_THREADS = 8
MediaKey = tuple[str, str]  # (uri, hash) as the source rows spell it
# Each media key -> its column (images or videos) and where it is first used (for errors).
MediaUses = dict[MediaKey, tuple[str, dict[str, Any]]]


def export(
    store: Store,
    dest: str | os.PathLike[str],
    runs: str | Iterable[str] | None = None,
    steps: int | range | Iterable[int] | None = None,
    progress: bool | None = None,
    *,
    s3_options: dict[str, Any] | None = None,
    version: int | None = None,
) -> Store:
    """Copy the selected rows of table ``version`` (None: the latest) and their media into
    a new store at ``dest`` (a path or ``s3://`` URI, empty or absent); return it, opened.
    ``s3_options`` open an S3 ``dest`` (default: the source store's)."""
    selected = select_files(store, runs, steps, version=version)
    if not selected:
        raise NoMatchError(f"no committed rollout files match runs={runs!r}, steps={steps!r}")
    media: MediaUses = {}
    # Every file is read and checked before the destination is created: a file that fails
    # (bit rot, a forged row) stops the export with nothing written.
    for file in selected:
        check_run_id(file)
    checked = {}
    for file in selected:
        try:
            checked[file.path] = _collect_refs(store, file.path, media)
        except CorruptFileError as exc:  # gone: collected since ``version``?
            if version is None or store.backend.stat(file.path) is not None:
                raise
            raise collected(store, version, file.path) or exc from None
    target = _create_empty(os.fspath(dest), store.s3_options if s3_options is None else s3_options)
    with ThreadPoolExecutor(COPY_THREADS) as pool:
        jobs = pool.map(lambda item: _copy_media(store, target, *item), media.items())
        renamed = dict(
            bar(jobs, total=len(media), desc="export: media", unit="file", progress=progress)
        )
    external = {uri: rel for (uri, _), rel in renamed.items() if uri != rel}
    copied = [
        _copy_rollout_file(store, target, file, external, checked[file.path])
        for file in bar(selected, desc="export: rows", unit="file", progress=progress)
    ]
    for run_id in sorted({f.run_id for f in selected}):  # the writers' family rule, there too
        record_layouts(target, run_id, run_layouts(store, run_id))
        _declare_columns(store, target, run_id)
    commit_files(target, copied)
    return target


def _declare_columns(store: Store, target: Store, run_id: str) -> None:
    """A run's extra columns, in the export as in the store: its record, and the table's
    Delta schema (so that Delta engines read the copied files' columns typed)."""
    columns = run_columns(store, run_id)
    if columns:
        target.table.add_columns(pa.field(n, c.arrow_type) for n, c in columns.items())
        record_columns(target, run_id, columns)


def _collect_refs(store: Store, path: str, media: MediaUses) -> str:
    """Check one file as the loader reads it (:func:`read_checked`: every page's checksum,
    every row's checks and bounds) and note the media its rows use (images and videos);
    the content hash of the bytes checked, so that the copy is known to be of those very
    bytes."""
    with reading(path):
        data = store.backend.read(path)
        parquet = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
        rows = read_checked(parquet, path, max_pixels=store.max_image_pixels)
    for column in MEDIA_COLUMNS:
        index = index_column(column)
        refs = flatten_refs(rows, column)
        firsts = refs.group_by(["uri", "hash"], use_threads=False).aggregate(
            [("sample_id", "first"), (index, "first")]
        )
        for uri, digest, sample_id, position in zip(
            *(firsts.column(c).to_pylist() for c in firsts.column_names), strict=True
        ):
            where = {**where_of_file(path), "sample_id": sample_id, index: position}
            media.setdefault((uri, digest), (column, where))
    return content_hash(data)


def _create_empty(dest: str, s3_options: dict[str, Any]) -> Store:
    options = s3_options if dest.startswith("s3://") else None
    try:
        Store.open(dest, s3_options=options)
    except NotAStoreError:
        # create=True refuses a location that holds anything at all.
        return Store.open(dest, create=True, s3_options=options)
    raise DestinationExistsError(
        "export destination already holds a store; export into an empty one", root=dest
    )


def _copy_media(
    store: Store, target: Store, key: MediaKey, use: tuple[str, dict[str, Any]]
) -> tuple[MediaKey, str]:
    """Copy one media file, verified on both sides; return its store-relative URI there."""
    uri, digest = key
    column, where = use
    try:
        backend, rel = store.resolve(uri)
        data = store.read_media(uri, digest)
        if backend is not store.backend:  # external: into media/, under its canonical name
            rel = media_path(digest, _extension(store, column, data, uri))
    except MmstoreError as exc:  # name the row that needs these bytes
        raise exc.with_context(**where) from None
    target.backend.write_atomic(rel, data, replace=False)
    target.read_media(rel, digest)
    return key, rel


def _extension(store: Store, column: str, data: bytes, uri: str) -> str:
    """The extension ``put_image`` / ``put_video`` would store these bytes under (probed:
    an external file's own name says nothing the bytes do not)."""
    if column == "videos":
        limits = {"max_pixels": store.max_image_pixels, "max_frames": MAX_CLIP_FRAMES}
        return probe_video(data, **limits, where=uri).ext
    fmt, _, _ = probe(data, max_pixels=store.max_image_pixels, where=uri)
    return FORMAT_EXTENSIONS[fmt][0]


def _copy_rollout_file(
    store: Store, target: Store, file: TableFile, external: dict[str, str], digest: str
) -> TableFile:
    """Copy one rollout file (its URIs rewritten where media was external) if its bytes are
    still those checked (``digest``); what commits the copy."""
    path = file.path
    data = store.backend.read(path)
    if content_hash(data) != digest:
        raise CorruptFileError(
            "rollout file changed while it was exported (after its rows were checked)",
            **where_of_file(path),
        )
    parquet = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
    if external and _uris(parquet, path) & external.keys():
        with reading(path):
            data = _rewrite_uris(parquet, external)
    _write_verified(target.backend, path, data)
    return TableFile(path, file.run_id, file.step, len(data), parquet.metadata.num_rows)


def _uris(parquet: pq.ParquetFile, path: str) -> set[str]:
    """Every media URI the file's rows name (image and video refs; leaf columns only)."""
    uris: set[str] = set()
    for column in MEDIA_COLUMNS:
        refs = flatten_refs(read_ref_columns(parquet, file=path, column=column), column)
        uris.update(refs.column("uri").to_pylist())
    return uris


def _write_verified(backend: Backend, rel: str, data: bytes) -> None:
    if not backend.write_atomic(rel, data, replace=False):
        raise DestinationExistsError("export destination already has this rollout file", file=rel)
    if content_hash(backend.read(rel)) != content_hash(data):
        raise HashMismatchError("rollout file read back from the export differs", file=rel)


def _rewrite_uris(parquet: pq.ParquetFile, renamed: dict[str, str]) -> bytes:
    """The same file, row group by row group, with external URIs replaced."""
    metadata = {k: v for k, v in (parquet.metadata.metadata or {}).items() if k != b"ARROW:schema"}
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, parquet.schema_arrow, **parquet_options()) as writer:
        for i in range(parquet.num_row_groups):
            group = parquet.read_row_group(i)
            writer.write_table(_with_uris(group, renamed), row_group_size=max(1, group.num_rows))
        writer.add_key_value_metadata({k.decode(): v.decode() for k, v in metadata.items()})
    return bytes(sink.getvalue().to_pybytes())


def _with_uris(table: pa.Table, renamed: dict[str, str]) -> pa.Table:
    """``table`` with the URIs of every media column it has replaced (a file written
    before ``videos`` existed has no such column, and keeps having none)."""
    for column in MEDIA_COLUMNS:
        index = table.schema.get_field_index(column)
        if index >= 0:
            lists = _lists_with_uris(table.column(column).combine_chunks(), renamed)
            table = table.set_column(index, table.schema.field(index), lists)
    return table


def _lists_with_uris(lists: pa.ListArray, renamed: dict[str, str]) -> pa.ListArray:
    refs = lists.values  # every ref of the chunk; ``lists.offsets`` index into it
    uris = pa.array([renamed.get(u, u) for u in refs.field("uri").to_pylist()], pa.string())
    struct_type = refs.type
    children = [
        uris if struct_type.field(i).name == "uri" else refs.field(i)
        for i in range(struct_type.num_fields)
    ]
    new_refs = pa.StructArray.from_arrays(
        children, fields=[struct_type.field(i) for i in range(struct_type.num_fields)]
    )
    # ``offsets`` carries no validity: a null list (no videos) is kept null by the mask.
    mask = lists.is_null() if lists.null_count else None
    return pa.ListArray.from_arrays(lists.offsets, new_refs, type=lists.type, mask=mask)
