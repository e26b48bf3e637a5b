"""A footer's token counts plan the packed loader; one that lies is a corrupt file, never a
sample blamed for being too long (issue 30, item 15)."""

from __future__ import annotations

import glob

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.schema import META_NUM_TOKENS, encode_num_tokens
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
