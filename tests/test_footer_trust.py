"""A footer's token counts plan the packed loader; one that lies is a corrupt file, never a
sample blamed for being too long (issue 30, item 15). A footer is parsed once per file, not
once per row group, and again when the file changes (issue 30, item 10)."""

from __future__ import annotations

import glob
import os
import time

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.schema import META_NUM_TOKENS, encode_num_tokens
from mmstore._rows.files import open_rollout_file
from tests import rows
from tests.store_workers import image_bytes, make_row
from tests.test_packing import MAX_TOKENS, packed, write_mixed


def forge_counts(path: str, change) -> str:
    """Rewrite ``path`` with its footer's per-row token counts changed by ``change``."""
    table = pq.read_table(path, partitioning=None)
    kv = dict(pq.ParquetFile(path).metadata.metadata)
    kv.pop(b"ARROW:schema")
    lengths = [len(t) for t in table.column("tokens").to_pylist()]
    change(lengths)
    kv[META_NUM_TOKENS] = encode_num_tokens(lengths)
    pq.write_table(table.replace_schema_metadata(kv), path, row_group_size=8)
    return table.column("sample_id")[0].as_py()


@pytest.mark.parametrize("max_len", [None, MAX_TOKENS - 10])
def test_a_footer_claiming_a_huge_row_is_a_corrupt_file(tmp_path, small_processor, max_len):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor), steps=1)
    (path,) = glob.glob(f"{tmp_path}/s/rollouts/**/*.parquet", recursive=True)

    def huge(lengths: list[int]) -> None:
        lengths[0] = 100_000

    sample_id = forge_counts(path, huge)
    with pytest.raises(mmstore.CorruptFileError) as err:
        list(packed(store, small_processor, batch_size=24, max_len=max_len))
    assert not isinstance(err.value, mmstore.SampleTooLongError)
    assert err.value.sample_id == sample_id and err.value.file.endswith(".parquet")
    assert "footer" in err.value.message


def test_a_row_really_too_long_is_still_the_samples_fault(tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_mixed(store, mmstore.adapter_for(small_processor), steps=1)
    with pytest.raises(mmstore.SampleTooLongError):
        list(packed(store, small_processor, batch_size=24, max_tokens=60))


# -- one footer parse per file --------------------------------------------------------------


@pytest.fixture
def footer_parses(monkeypatch):
    """Counts Parquet footers parsed (files opened without a footer already parsed)."""
    count = {"n": 0}
    init = pq.ParquetFile.__init__

    def counting(self, source, *args, metadata=None, **kwargs):
        count["n"] += metadata is None
        init(self, source, *args, metadata=metadata, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "__init__", counting)
    return count


def settle(store, path):
    """Date a committed file's last change a minute back (written well before it is read)."""
    full = store.backend.abspath(path)
    old = time.time() - 60
    os.utime(full, (old, old))


@pytest.mark.slow  # 300 row groups
def test_an_epoch_over_one_row_row_groups_parses_each_footer_once(
    store, adapter, small_processor, footer_parses
):
    media = [store.put_media(image_bytes(0, 56, 56))]
    with store.writer(run_id="r", step=0, row_group_size=1) as w:
        for k in range(300):
            w.write(make_row(adapter, media, f"s{k}", group_id=f"g{k}"))
    [path] = w.committed
    settle(store, path)
    assert pq.ParquetFile(store.backend.abspath(path)).metadata.num_row_groups == 300
    footer_parses["n"] = 0
    ds = mmstore.RolloutDataset(store, small_processor, node_cache_bytes=0)
    seen = [s for b in mmstore.RolloutLoader(ds, batch_size=16) for s in b["sample_ids"]]
    assert sorted(seen) == sorted(f"s{k}" for k in range(300))
    assert footer_parses["n"] <= 2, footer_parses  # O(files), not O(row groups)


def test_a_rewritten_file_has_its_footer_parsed_again(store, adapter):
    media = [store.put_media(image_bytes(0, 56, 56))]
    [path] = rows.commit(store, adapter, "r", 0, [media] * 3)
    settle(store, path)
    assert open_rollout_file(store, path).metadata.num_rows == 3
    full = store.backend.abspath(path)
    table = pq.read_table(full)
    pq.write_table(table.slice(0, 2).replace_schema_metadata(table.schema.metadata), full)
    assert open_rollout_file(store, path).metadata.num_rows == 2
