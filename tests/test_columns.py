"""Extra columns a run declares (issue 40, item 4): per-token side streams (reference
logprobs, top-k logprob ids and values, routed experts) and per-sample values, stored typed,
read back bit for bit by every reader that asks for them and by Delta engines, never read
when nobody asks, and refused with errors that name the file, run, step, sample and column.
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import mmstore
from tests.live_workers import image_bytes, make_row, processor

COLUMNS = {
    "ref_logprobs": mmstore.per_token("float32"),
    "topk_ids": mmstore.per_token("int32", (4,)),
    "experts": mmstore.per_token("int16", (3, 2)),
    "difficulty": mmstore.per_sample("float32"),
    "env": mmstore.per_sample("string"),
}
ASKED = tuple(COLUMNS)


def values_for(sample_id: str, n: int) -> dict:
    """A row's column values: a pure function of its id and token count (exact in their
    dtypes, so a round trip compares bit for bit)."""
    rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
    return {
        "ref_logprobs": -rng.integers(0, 4096, n).astype(np.float32) / 1024,
        "topk_ids": rng.integers(0, 2**31 - 1, (n, 4)).astype(np.int32),
        "experts": rng.integers(-(2**15), 2**15 - 1, (n, 3, 2)).astype(np.int16),
        "difficulty": np.float32(rng.integers(0, 100) / 4),
        "env": f"env-{sample_id}",
    }


@pytest.fixture
def written(tmp_path):
    """A store with two steps of one run declaring every kind of column: 12 rows in GRPO
    groups of 2, one image in every other group (shared), policy versions 0..11."""
    store = mmstore.Store.open(tmp_path / "s", create=True)
    adapter = mmstore.adapter_for(processor())
    media = [store.put_media(image_bytes(1, 96, 64), ext="png")]
    rows = {}
    for step in range(2):
        with store.writer("run", step, columns=COLUMNS) as w:
            for k in range(6):
                sid = f"s{step}-{k}"
                base = make_row(adapter, media if (k // 2) % 2 else [], sid, group_id=f"g{k // 2}")
                row = mmstore.Rollout(
                    **{
                        **base.model_dump(),
                        "policy_version": step * 6 + k,
                        "columns": values_for(sid, len(base.tokens)),
                    }
                )
                rows[sid] = row
                w.write(row)
    return store, rows


def assert_padded(batch, rows):
    for i, sid in enumerate(batch["sample_ids"]):
        row = rows[sid]
        n = len(row.tokens)
        for name in ("ref_logprobs", "topk_ids", "experts"):
            got = batch[name][i]
            assert torch.equal(got[:n], torch.from_numpy(row.columns[name])), name
            assert not got[n:].any()  # zeros after the sample, as input_ids' padding
        assert batch["difficulty"][i].item() == row.columns["difficulty"]
        assert batch["env"][i] == row.columns["env"]
        assert batch["policy_versions"][i].item() == row.policy_version
        # where it was written: the producer's step (issue 42), not the trainer's
        assert (batch["run_ids"][i], batch["store_steps"][i].item()) == ("run", int(sid[1]))


def assert_packed(batch, rows):
    bounds = batch["cu_seqlens"].tolist()
    for segment, sid in enumerate(batch["sample_ids"]):
        lo, hi = bounds[segment], bounds[segment + 1]
        if batch["is_filler"][segment]:
            assert not batch["ref_logprobs"][0, lo:hi].any()
            assert (batch["policy_versions"][0, lo:hi] == -1).all()
            assert batch["env"][segment] == ""
            assert (batch["run_ids"][segment], batch["store_steps"][segment]) == (None, -1)
            continue
        row = rows[sid]
        for name in ("ref_logprobs", "topk_ids", "experts"):
            assert torch.equal(batch[name][0, lo:hi], torch.from_numpy(row.columns[name])), name
        assert batch["difficulty"][segment].item() == row.columns["difficulty"]
        assert batch["env"][segment] == row.columns["env"]
        assert (batch["policy_versions"][0, lo:hi] == row.policy_version).all()
        assert batch["store_steps"][segment].item() == int(sid[1])


def settings(**changes) -> mmstore.Materialize:
    return mmstore.Materialize(dtype="float32", node_cache_bytes=0, **changes)


# -- round trips -------------------------------------------------------------------------------


def test_read_back_as_rollouts_bit_for_bit(written):
    store, rows = written
    back = {r.sample_id: r for r in store.rollouts()}
    assert back == rows
    for sid, row in rows.items():
        for name, value in row.columns.items():
            stored = back[sid].columns[name]
            if name != "env":
                assert stored.dtype == value.dtype and stored.tobytes() == value.tobytes()


@pytest.mark.parametrize("distinct", [False, True], ids=["plain", "distinct_images"])
@pytest.mark.parametrize("max_tokens", [None, 2048], ids=["padded", "packed"])
def test_padded_and_packed_batches_carry_them(written, distinct, max_tokens):
    store, rows = written
    ds = mmstore.RolloutDataset(
        store,
        processor(),
        shuffle=False,
        columns=list(ASKED),  # a reader's keyword, beside materialize=
        materialize=settings(distinct_images=distinct),
    )
    seen = set()
    for batch in mmstore.RolloutLoader(ds, batch_size=4, max_tokens=max_tokens):
        (assert_padded if max_tokens is None else assert_packed)(batch, rows)
        seen.update(s for s in batch["sample_ids"] if s != "<filler>")
    assert seen == set(rows)


def test_the_live_loader_carries_them_and_each_samples_policy_version(written):
    store, rows = written
    live = mmstore.LiveLoader(
        store,
        processor(),
        runs="run",
        batch_size=6,
        max_tokens=2048,
        columns=list(ASKED),
        materialize=settings(),
    )
    seen = []
    for _ in range(2):
        for batch in live.next_step(policy_version=99, timeout=10):
            assert batch["policy_version"] == 99  # the step's, beside each sample's own
            assert_packed(batch, rows)
            seen += [s for s in batch["sample_ids"] if s != "<filler>"]
    live.close()
    assert sorted(seen) == sorted(rows)


def test_max_len_and_truncate_cut_per_token_columns_with_the_tokens(written):
    store, rows = written
    ds = mmstore.RolloutDataset(
        store, processor(), shuffle=False, columns=list(ASKED), materialize=settings(max_len=12)
    )
    for batch in mmstore.RolloutLoader(ds, batch_size=4):
        for i, sid in enumerate(batch["sample_ids"]):
            n = int(batch["attention_mask"][i].sum())
            assert n <= 12
            want = rows[sid].columns["experts"][:n]
            assert torch.equal(batch["experts"][i, :n], torch.from_numpy(want))
            assert batch["difficulty"][i].item() == rows[sid].columns["difficulty"]
    row = next(r for r in rows.values() if not r.images)
    cut = mmstore.truncate(row, 5, columns=COLUMNS)
    assert len(cut.tokens) == 5 and cut.columns["topk_ids"].shape == (5, 4)
    assert cut.columns["env"] == row.columns["env"]
    with pytest.raises(mmstore.InvalidArgumentError, match="columns="):
        mmstore.truncate(row, 5)  # which columns are per token? it cannot tell
    back = next(r for r in store.rollouts(sample_ids=[row.sample_id]))
    assert mmstore.truncate(back, 5) == cut  # a row read back knows its declaration


def test_export_keeps_them_for_mmstore_and_delta_engines(written, tmp_path):
    import polars as pl
    from deltalake import DeltaTable

    store, rows = written
    dest = mmstore.export(store, tmp_path / "copy")
    assert {r.sample_id: r for r in dest.rollouts()} == rows
    for each in (store, dest):
        schema = pa.schema(DeltaTable(each.table.uri).schema().to_arrow())
        assert str(schema.field("experts").type) == "list<element: list<element: int16>>"
        frame = pl.read_delta(each.table.uri).sort("sample_id")
        sid = frame["sample_id"][0]
        assert frame["ref_logprobs"][0].to_list() == rows[sid].columns["ref_logprobs"].tolist()
        assert frame["env"][0] == rows[sid].columns["env"]
        assert np.array(frame["experts"][0].to_list()).reshape(-1, 3, 2).tolist() == (
            rows[sid].columns["experts"].tolist()
        )


# -- refusals ------------------------------------------------------------------------------------


def one_row(sample_id="x", n=4, **columns):
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=list(range(1, n + 1)),
        prompt_len=1,
        loss_mask=[False] + [True] * (n - 1),
        columns=columns,
    )


def test_rows_that_do_not_match_the_declaration_are_refused_naming_run_step_sample_column(
    tmp_path,
):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    declared = {"ref": mmstore.per_token("float32"), "score": mmstore.per_sample("int32")}
    good = {"ref": np.zeros(4, np.float32), "score": 3}
    with store.writer("r", 0, columns=declared) as w:
        cases = [
            ({**good, "extra": 1.0}, "extra", "not declared"),
            ({"ref": good["ref"]}, "score", "has no value"),
            ({**good, "ref": np.zeros(3, np.float32)}, "ref", "4 tokens"),
            ({**good, "score": [1, 2]}, "score", "shape"),
            ({**good, "score": 1.5}, "score", "do not fit int32"),
        ]
        for values, column, says in cases:
            with pytest.raises(mmstore.InvalidRolloutError, match=says) as info:
                w.write(one_row("bad", **values))
            assert info.value.context == {
                "column": column,
                "run_id": "r",
                "step": 0,
                "sample_id": "bad",
            }
        w.write(one_row("ok", **good))  # the refusals left the writer usable
    assert [r.sample_id for r in store.rollouts()] == ["ok"]
    # A later writer of the run declaring other columns is refused before any row; one
    # declaring none takes the run's.
    with pytest.raises(mmstore.InvalidRolloutError, match="declares the columns") as info:
        store.writer("r", 1, columns={"ref": mmstore.per_token("float64")})
    assert info.value.context["run_id"] == "r" and info.value.context["column"] == "ref"
    with store.writer("r", 1) as w:
        assert w.columns == declared
        with pytest.raises(mmstore.InvalidRolloutError, match="has no value"):
            w.write(one_row("plain"))
        w.write(one_row("ok2", **good))
    # Another run may not give a name another type: the table's Delta schema has one.
    with pytest.raises(mmstore.InvalidArgumentError, match="'score' is int32 in the table"):
        store.writer("other", 0, columns={"score": mmstore.per_sample("float32")})
    for bad in ({"Bad-Name": "float32"}, {"tokens": "float32"}, {"x": "float16"}):
        with pytest.raises(mmstore.InvalidArgumentError):
            store.writer("third", 0, columns=bad)


def forge_file(store, path_of, mutate):
    """Rewrite a committed file with ``mutate(table)`` applied (footer kept): another
    engine's writer, or bit rot that kept the Parquet valid."""
    full = store.backend.abspath(path_of)
    parquet = pq.ParquetFile(full)
    table = mutate(parquet.read())
    pq.write_table(table.replace_schema_metadata(parquet.metadata.metadata), full)


def test_a_forged_column_is_refused_by_every_reader_naming_the_sample(written):
    store, _ = written
    first = sorted(f.path for f in store.files())[0]

    def short_ref(table):  # the second row's ref_logprobs one value short
        values = table.column("ref_logprobs").to_pylist()
        values[1] = values[1][:-1]
        index = table.schema.get_field_index("ref_logprobs")
        return table.set_column(index, "ref_logprobs", pa.array(values, pa.list_(pa.float32())))

    forge_file(store, first, short_ref)
    sid = pq.read_table(store.backend.abspath(first), columns=["sample_id"])[0][1].as_py()
    ds = mmstore.RolloutDataset(
        store, processor(), shuffle=False, columns=["ref_logprobs"], materialize=settings()
    )
    readers = {
        "loader": lambda: list(mmstore.RolloutLoader(ds, batch_size=4)),
        "rollouts": lambda: store.rollouts(),
    }
    for name, read in readers.items():
        with pytest.raises(mmstore.InvalidRolloutError, match="values for") as info:
            read()
        ctx = info.value.context
        assert (ctx["file"], ctx["run_id"], ctx["sample_id"], ctx["column"]) == (
            first,
            "run",
            sid,
            "ref_logprobs",
        ), name
    # Not asked for, it is not read: the loader trains the rows as before.
    plain = mmstore.RolloutDataset(store, processor(), shuffle=False, materialize=settings())
    assert sum(len(b["sample_ids"]) for b in mmstore.RolloutLoader(plain, batch_size=4)) == 12


def test_a_column_nobody_asks_for_is_never_read(written):
    """Its pages damaged on disk: a loader that does not ask reads the file as before (its
    every page checksum-verified: so the column's pages were never read); one that asks is
    refused."""
    store, _ = written
    path = sorted(f.path for f in store.files())[0]
    full = store.backend.abspath(path)
    meta = pq.ParquetFile(full).metadata
    names = meta.schema.to_arrow_schema().names
    chunk = meta.row_group(0).column(
        [meta.schema.column(i).path for i in range(meta.num_columns)].index(
            "experts.list.element.list.element"
        )
    )
    start = chunk.data_page_offset
    with open(full, "r+b") as f:  # a byte in the middle of the column's first data page
        f.seek(start + chunk.total_compressed_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "experts" in names
    asked = ["ref_logprobs", "topk_ids", "difficulty", "env"]
    for max_tokens in (None, 2048):
        ds = mmstore.RolloutDataset(
            store, processor(), shuffle=False, columns=asked, materialize=settings()
        )
        got = [b for b in mmstore.RolloutLoader(ds, batch_size=4, max_tokens=max_tokens)]
        assert sum(len([s for s in b["sample_ids"] if s != "<filler>"]) for b in got) == 12
        assert all("experts" not in b for b in got)
    ds = mmstore.RolloutDataset(
        store, processor(), shuffle=False, columns=["experts"], materialize=settings()
    )
    with pytest.raises(mmstore.CorruptFileError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=4))
    assert info.value.context["file"] == path


def test_asking_for_a_column_a_run_does_not_declare_is_refused(written):
    store, _ = written
    with store.writer("plain", 0) as w:
        w.write(one_row("p"))
    ds = mmstore.RolloutDataset(
        store, processor(), shuffle=False, columns=["difficulty"], materialize=settings()
    )
    with pytest.raises(mmstore.InvalidArgumentError, match="select runs") as info:
        list(mmstore.RolloutLoader(ds, batch_size=4))
    assert info.value.context["run_id"] == "plain" and info.value.context["column"] == "difficulty"
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.Materialize(columns="difficulty")  # a name, not a list of names
    with pytest.raises(mmstore.InvalidArgumentError):
        mmstore.RolloutDataset(
            store, processor(), columns=["a"], materialize=mmstore.Materialize(columns=("b",))
        )
