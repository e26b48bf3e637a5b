"""Bit rot in committed rollout files: single bit flips in the column chunks (page headers and
page bodies) are reported by verify and refused by the loader with a typed error naming the
file, or read back identical; never a crash, never silently different rows (issue 13, 7)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.schema import FILE_COLUMN, ROW_COLUMNS
from mmstore._rows.files import conform
from mmstore._rows.snapshot import read_units, take_snapshot
from tests.store_workers import image_bytes, make_row

# Page headers are the first bytes of a chunk (a few dozen bytes each): flipped exhaustively
# for these columns; page bodies are sampled.
HEADER_COLUMNS = ("sample_id", "tokens.list.element", "logprobs.list.element")
HEADER_BYTES = 24
BODY_FLIPS = 100


@pytest.fixture(scope="module")
def written(tmp_path_factory, adapter):
    store = mmstore.Store.open(tmp_path_factory.mktemp("rot") / "store", create=True)
    media = [store.put_media(image_bytes(seed)) for seed in range(3)]
    with store.writer(run_id="r", step=4, row_group_size=6) as w:
        for k in range(14):
            w.write(make_row(adapter, [media[k % 3]], f"s{k}", group_id=f"g{k // 4}"))
    [stat] = store.rollout_files()
    path = store.backend.abspath(stat.path)
    with open(path, "rb") as f:
        good = f.read()
    return store, stat.path, path, good


def flips(path):
    """Bit positions to flip: every bit of the first page header of chosen columns, and
    random bits anywhere in the column chunks."""
    meta = pq.ParquetFile(path).metadata
    chunks = [
        meta.row_group(g).column(c)
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    ]
    bits = [
        8 * chunk.data_page_offset + b
        for chunk in chunks[: meta.num_columns]
        if chunk.path_in_schema in HEADER_COLUMNS
        for b in range(8 * HEADER_BYTES)
    ]
    rng = random.Random(13)
    for _ in range(BODY_FLIPS):
        chunk = rng.choice(chunks)
        bits.append(8 * chunk.data_page_offset + rng.randrange(8 * chunk.total_compressed_size))
    return bits


def read_plainly(path):
    """The rows as an engine without checksum checks reads them, or None if it can't."""
    try:
        table = pq.read_table(path, partitioning=None)
        table.validate(full=True)
        return table
    except (OSError, pa.ArrowException):
        return None


@pytest.mark.slow
def test_every_flip_is_reported_or_harmless(written):
    store, rel, path, good = written
    clean = pq.read_table(path, partitioning=None)
    loaded = conform(clean, ROW_COLUMNS, file=rel)  # the loader's rows, as it types them
    units = take_snapshot(store).units
    outcomes = {"refused": 0, "identical": 0, "reported": 0}
    try:
        for bit in flips(path):
            damaged = bytearray(good)
            damaged[bit // 8] ^= 1 << (bit % 8)
            with open(path, "wb") as f:
                f.write(damaged)
            # The loader's read: identical rows or a typed error naming the file.
            try:
                rows = read_units(store, units)
            except mmstore.CorruptFileError as exc:
                assert exc.file == rel and exc.run_id == "r" and exc.step == 4, exc
                outcomes["refused"] += 1
            else:
                assert rows.drop_columns([FILE_COLUMN]).equals(loaded), f"bit {bit}: rows changed"
                outcomes["identical"] += 1
            # verify: never crashes; ok only if the file still reads as written.
            report = mmstore.verify(store)
            if report.ok:
                plain = read_plainly(path)
                assert plain is not None and plain.equals(clean), f"bit {bit}: verify ok"
            else:
                assert {p.kind for p in report.problems} == {"unreadable_file"}, report
                assert all(p.file == rel for p in report.problems)
                outcomes["reported"] += 1
    finally:
        with open(path, "wb") as f:
            f.write(good)
    assert outcomes["refused"] > 0 and outcomes["reported"] > 0, outcomes


def test_the_loader_names_the_file_of_a_rotten_page(written, small_processor):
    store, rel, path, good = written
    meta = pq.ParquetFile(path).metadata
    tokens = next(
        meta.row_group(0).column(c)
        for c in range(meta.num_columns)
        if meta.row_group(0).column(c).path_in_schema == "tokens.list.element"
    )
    damaged = bytearray(good)
    damaged[tokens.data_page_offset + tokens.total_compressed_size - 5] ^= 0x04  # page body
    try:
        with open(path, "wb") as f:
            f.write(damaged)
        ds = mmstore.RolloutDataset(store, small_processor, shuffle=False)
        with pytest.raises(mmstore.CorruptFileError) as info:
            list(mmstore.RolloutLoader(ds, batch_size=4))
        assert info.value.file == rel and rel in str(info.value)
    finally:
        with open(path, "wb") as f:
            f.write(good)
