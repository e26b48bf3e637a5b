"""export checks what it copies (issue 30, item 3): a rotted page is a corrupt file and a
forged row is refused as the loader refuses it, and nothing is written either way.

A rotted page is a flipped bit in a committed file's tokens column; forged files are written
through plain pyarrow and committed to the table, as another engine would leave them.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.media import content_hash
from mmstore.synth import photo
from tests import rows
from tests.forged import assert_names, loader_error, many_refs_table
from tests.store_workers import image_bytes
from tests.test_reader_trust import forge_table


def forge(store, adapter, table: pa.Table, run="forged", step=0) -> str:
    """Commit ``table`` (v1 columns) as one file written by plain pyarrow; its path."""
    return forge_table(store, adapter, table, run=run, step=step)


def rot_tokens_page(store, path):
    """Flip one bit in the body of the first tokens page of a committed file."""
    full = store.backend.abspath(path)
    meta = pq.ParquetFile(full).metadata
    chunk = next(
        meta.row_group(0).column(c)
        for c in range(meta.num_columns)
        if meta.row_group(0).column(c).path_in_schema == "tokens.list.element"
    )
    with open(full, "rb") as f:
        data = bytearray(f.read())
    data[chunk.data_page_offset + chunk.total_compressed_size - 5] ^= 0x04
    with open(full, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("external", [False, True], ids=["copied", "rewritten"])
def test_export_of_a_rotted_page_is_a_corrupt_file_and_writes_nothing(tmp_path, adapter, external):
    outside = tmp_path / "outside"
    outside.mkdir()
    photo(3, 48, 40).save(outside / "shot.png")
    data = (outside / "shot.png").read_bytes()
    source = mmstore.Store.open(tmp_path / "source", create=True, trusted_roots=[str(outside)])
    media = source.put_image(photo(4, 48, 40))
    if external:  # the rows are rewritten (their URIs), so their pages are decoded
        media = mmstore.MediaRef(
            hash=content_hash(data), uri=f"file://{outside}/shot.png", width=48, height=40
        )
    [path] = rows.commit(source, adapter, "r1", 3, [[media], [media]])
    mmstore.export(source, tmp_path / "clean", runs="r1")  # the same export, before the rot
    rot_tokens_page(source, path)
    assert {p.kind for p in mmstore.verify(source).problems} == {"unreadable_file"}

    with pytest.raises(mmstore.CorruptFileError) as info:
        mmstore.export(source, tmp_path / "dump", runs="r1")
    assert (info.value.file, info.value.run_id, info.value.step) == (path, "r1", 3)
    assert not (tmp_path / "dump").exists()  # nothing half-written, no store to open


def test_export_refuses_a_forged_row_the_loader_refuses(tmp_path, adapter, small_processor):
    store = mmstore.Store.open(tmp_path / "source", create=True)
    media = store.put_media(image_bytes(0, 56, 56))
    path = forge(store, adapter, many_refs_table(adapter, media, 3))
    expected = loader_error(store, small_processor)
    with pytest.raises(type(expected)) as info:
        mmstore.export(store, tmp_path / "dump")
    assert info.value.message == expected.message
    assert_names(info.value, path, "many")
    assert not (tmp_path / "dump").exists()
