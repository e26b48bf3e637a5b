"""The rollout writer: invariants at write time, atomic commits, Parquet layout."""

from __future__ import annotations

import re
import threading

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.media import content_hash
from mmstore._format.schema import META_LAYOUTS, META_RUN_ID, META_SCHEMA_VERSION, META_STEP
from mmstore._rows.writer import COLUMN_ENCODING, DEFAULT_ROW_GROUP_SIZE
from tests.store_workers import image_bytes, make_row, tree

PART = re.compile(r"^rollouts/run_id=(\w+)/step=(\d+)/part-([0-9a-f]{32})-(\d{5})\.parquet$")


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "local" else "s3_store")


def listing(store: mmstore.Store) -> dict[str, float | int]:
    """Every file of a store with its size and timestamp (local or S3)."""
    return {f.path: (f.size, f.mtime) for f in store.backend.list("")}


def read_rows(store: mmstore.Store) -> list[mmstore.Rollout]:
    rows = []
    for f in store.rollout_files():
        table = pq.read_table(
            store.backend.abspath(f.path), filesystem=store.backend.fs, partitioning=None
        )
        rows += [mmstore.Rollout(**row) for row in table.to_pylist()]
    return rows


def parquet(store: mmstore.Store, rel: str) -> pq.ParquetFile:
    return pq.ParquetFile(store.backend.fs.open_input_file(store.backend.abspath(rel)))


def test_rows_round_trip(any_store, adapter):
    media = [any_store.put_media(image_bytes(seed)) for seed in range(3)]
    rows = [
        make_row(adapter, [media[g], media[(g + k) % 3]], f"g{g}-{k}", group_id=f"g{g}")
        for g in range(3)
        for k in range(8)
    ]
    with any_store.writer(run_id="r1", step=3) as w:
        for row in rows:
            w.write(row)
    (part,) = any_store.rollout_files()
    assert PART.match(part.path).group(1, 2) == ("r1", "3")
    assert read_rows(any_store) == rows
    meta = parquet(any_store, part.path).metadata.metadata  # file key-value metadata
    assert (meta[META_RUN_ID], meta[META_STEP], meta[META_SCHEMA_VERSION]) == (b"r1", b"3", b"1")
    assert adapter.fingerprint.encode() in meta[META_LAYOUTS]
    assert any_store.staging_files() == []


def test_optional_fields_and_text_only_rows_round_trip(store, adapter):
    media = store.put_media(image_bytes(1))
    full = make_row(adapter, [media], "full")
    rows = [
        full,
        full.model_copy(update={"sample_id": "no-logprobs", "logprobs": None}),
        mmstore.Rollout(sample_id="text", tokens=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1]),
        mmstore.Rollout(sample_id="empty", tokens=[], prompt_len=0, loss_mask=[]),
    ]
    with store.writer(run_id="r", step=0, row_group_size=3) as w:
        for row in rows:
            w.write(row)
    assert read_rows(store) == rows
    table = pq.read_table(store.backend.abspath(store.rollout_files()[0].path))
    assert table.column("logprobs").null_count == 3
    assert table.column("reward").to_pylist()[2:] == [None, None]


def test_the_writer_keeps_what_it_validated(store, adapter):
    # A caller reusing its row object after write() cannot change (or break) the row.
    row = make_row(adapter, [store.put_media(image_bytes(1))], "s0")
    expected = row.model_copy(deep=True)
    with store.writer(run_id="r", step=0) as w:
        w.write(row)
        row.tokens[row.images[0].offset] = 7
        row.loss_mask.clear()
    assert read_rows(store) == [expected]


def test_row_groups_compression_and_encodings(store, adapter):
    media = store.put_media(image_bytes(1))
    with store.writer(run_id="r", step=0, row_group_size=4) as w:
        for k in range(10):
            w.write(make_row(adapter, [media], f"s{k}"))
    with store.writer(run_id="r", step=1) as w:
        for k in range(DEFAULT_ROW_GROUP_SIZE + 2):
            w.write(make_row(adapter, [media], f"s{k}"))
    small, default = (parquet(store, f.path).metadata for f in store.rollout_files())
    sizes = [small.row_group(i).num_rows for i in range(small.num_row_groups)]
    assert sizes == [4, 4, 2]
    assert default.row_group(0).num_rows == DEFAULT_ROW_GROUP_SIZE == 128
    for i in range(small.num_row_groups):
        for j in range(small.num_columns):
            column = small.row_group(i).column(j)
            assert column.compression == "ZSTD", column.path_in_schema
            assert not column.has_dictionary_page, column.path_in_schema  # measured: off
            if column.path_in_schema in COLUMN_ENCODING:
                assert COLUMN_ENCODING[column.path_in_schema] in column.encodings


def test_other_engines_read_the_files(store, adapter):
    # The encodings chosen (no dictionaries, BYTE_STREAM_SPLIT logprobs) must not cost
    # readers: polars, with the hive partitions, sees exactly what was written.
    import polars as pl

    media = store.put_media(image_bytes(1))
    rows = [make_row(adapter, [media], f"s{k}") for k in range(5)]
    with store.writer(run_id="r7", step=2, row_group_size=2) as w:
        for row in rows:
            w.write(row)
    frame = pl.read_parquet(store.backend.abspath("rollouts/**/*.parquet"), hive_partitioning=True)
    assert frame["run_id"].to_list() == ["r7"] * 5 and frame["step"].to_list() == [2] * 5
    assert frame["logprobs"].to_list() == [row.logprobs for row in rows]
    assert frame["tokens"].to_list() == [row.tokens for row in rows]
    assert frame["images"].to_list()[0][0]["hash"] == media.hash


def test_row_groups_encode_beside_the_writer_and_stay_in_order(store, adapter, monkeypatch):
    # Each full row group is encoded on a thread of its own (pyarrow drops the GIL) while
    # the next rows are validated; the file still holds every row group, in order.
    media = store.put_media(image_bytes(1))
    threads = []
    real = pq.ParquetWriter.write_table

    def spy(self, table, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", spy)
    rows = [make_row(adapter, [media], f"s{k}") for k in range(7)]
    with store.writer(run_id="r", step=0, row_group_size=2) as w:
        for row in rows:
            w.write(row)
    assert read_rows(store) == rows
    assert len(threads) == 4 and threading.main_thread() not in threads
    assert not any(t.is_alive() for t in threads)


def test_a_failed_encoding_commits_nothing_and_closes_the_writer(store, adapter, monkeypatch):
    media = store.put_media(image_bytes(1))

    def fail(self, table, *args, **kwargs):
        raise MemoryError("no room to encode")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail)
    w = store.writer(run_id="r", step=0, row_group_size=2)
    with pytest.raises(MemoryError, match="no room"):
        for k in range(4):  # the fourth row's flush waits for the first group: it failed
            w.write(make_row(adapter, [media], f"s{k}"))
    with pytest.raises(mmstore.InvalidRolloutError, match="closed"):
        w.commit()
    assert store.rollout_files() == []


def test_file_names_never_collide(store, adapter):
    media = store.put_media(image_bytes(1))
    writers = [store.writer(run_id="r", step=0) for _ in range(3)]
    for i, w in enumerate(writers):
        w.write(make_row(adapter, [media], f"w{i}"))
    first = writers[0].commit()
    writers[0].write(make_row(adapter, [media], "w0-again"))
    second = writers[0].commit()
    others = [w.commit() for w in writers[1:]]
    names = [first, second, *others]
    assert sorted(names) == [f.path for f in store.rollout_files()]
    ids = [PART.match(n).group(3) for n in names]
    assert ids[0] == ids[1] and len(set(ids[1:])) == 3  # one uuid per writer
    assert [PART.match(n).group(4) for n in names[:2]] == ["00000", "00001"]
    assert len(read_rows(store)) == 4


def test_an_exception_in_the_block_writes_nothing(any_store, adapter):
    media = any_store.put_media(image_bytes(1))
    before = listing(any_store)
    writer = any_store.writer(run_id="r", step=0, row_group_size=2)
    with pytest.raises(RuntimeError, match="rollout failed"), writer as w:
        for k in range(5):  # two row groups already encoded
            w.write(make_row(adapter, [media], f"s{k}"))
        raise RuntimeError("rollout failed")
    assert listing(any_store) == before
    with pytest.raises(mmstore.InvalidRolloutError, match="closed"):
        w.write(make_row(adapter, [media], "late"))


def test_empty_writer_commits_nothing(store):
    with store.writer(run_id="r", step=0):
        pass
    assert store.rollout_files() == []


@pytest.mark.parametrize(
    ("run_id", "step"),
    [
        ("../escape", 0),
        ("a/b", 0),
        ("", 0),
        (".hidden", 0),
        ("run id", 0),
        ("r" * 129, 0),
        (7, 0),
        ("r", -1),
        ("r", 2**31),
        ("r", "3"),
        ("r", 1.0),
        ("r", True),
    ],
)
def test_bad_partition_is_refused(store, run_id, step):
    before = tree(store.backend.base)
    with pytest.raises(mmstore.InvalidRolloutError) as err:
        store.writer(run_id=run_id, step=step)
    assert err.value.run_id == run_id
    assert tree(store.backend.base) == before


@pytest.mark.parametrize("seq", [2**63, 2**64, -1, True, 1.0, "7"])
def test_a_seq_no_delta_reader_can_hold_is_refused_before_any_work(store, adapter, seq):
    """Issue 39.17: seq >= 2**63 was committed; delta-rs then wrote no checkpoint again,
    opens slowed 12-18x and producer_seq() raised an untyped DeltaError."""
    before = tree(store.backend.base)
    with pytest.raises(mmstore.InvalidArgumentError, match=re.escape("[0, 2**63 - 1]")) as err:
        store.writer(run_id="r", step=0, producer="p", seq=seq)
    assert err.value.producer == "p"
    assert tree(store.backend.base) == before
    # The largest seq a Delta txn version holds commits once, and reads back.
    media = store.put_media(image_bytes(1, 32, 32))
    for attempt in range(2):
        with store.writer(run_id="r", step=0, producer="p", seq=2**63 - 1) as w:
            w.write(make_row(adapter, [media], "s0"))
        assert w.duplicate == (attempt == 1)
    assert store.table.producer_seq("p") == 2**63 - 1
    assert [f.rows for f in mmstore.Store.open(store.root).files()] == [1]


def test_bad_row_group_size_is_refused(store):
    with pytest.raises(ValueError, match="positive"):
        store.writer(run_id="r", step=0, row_group_size=0)


# -- refused rows ---------------------------------------------------------------------------


def _image(row: mmstore.Rollout, index: int, **changes) -> dict:
    images = [ref.model_dump() for ref in row.images]
    images[index].update(changes)
    return {"images": images}


def _bad_rows(store, adapter, good):
    """(name, changes to the good row, expected error, image index in the error)."""
    a, b = good.images
    other = store.put_media(image_bytes(9))
    absent = content_hash(b"never stored")
    place = adapter.image_token_id
    return [
        ("span length", _image(good, 0, length=a.length + 1), mmstore.InvalidRolloutError, 0),
        ("shifted span", _image(good, 1, offset=b.offset + 1), mmstore.InvalidRolloutError, 1),
        ("unsorted", {"images": [b.model_dump(), a.model_dump()]}, mmstore.InvalidRolloutError, 1),
        ("overlap", _image(good, 1, offset=a.offset + 1), mmstore.InvalidRolloutError, 1),
        ("outside", _image(good, 1, offset=len(good.tokens)), mmstore.InvalidRolloutError, 1),
        ("stray placeholder", {"tokens": [*good.tokens[:-1], place]}, mmstore.InvalidRolloutError,
         None),
        ("text in span", {"tokens": [*good.tokens[: a.offset], 5, *good.tokens[a.offset + 1 :]]},
         mmstore.InvalidRolloutError, 0),
        ("loss_mask length", {"loss_mask": good.loss_mask[:-1]}, mmstore.InvalidRolloutError, None),
        ("logprobs length", {"logprobs": good.logprobs[1:]}, mmstore.InvalidRolloutError, None),
        ("prompt_len", {"prompt_len": len(good.tokens) + 1}, mmstore.InvalidRolloutError, None),
        ("fingerprint", _image(good, 0, layout_fingerprint="0" * 16), mmstore.InvalidRolloutError,
         0),
        ("family", _image(good, 0, family="llava"), mmstore.InvalidRolloutError, 0),
        ("missing media", _image(good, 1, hash=absent, uri=f"media/{absent[:2]}/{absent[2:4]}/"
         f"{absent}.png"), mmstore.MediaNotFoundError, 1),
        ("uri of other bytes", _image(good, 0, uri=other.uri), mmstore.HashMismatchError, 0),
        ("misplaced uri", _image(good, 0, uri=f"media/00/00/{a.hash}.png"),
         mmstore.HashMismatchError, 0),
        ("http uri", _image(good, 0, uri="http://example.com/a.png"), mmstore.UntrustedURIError,
         0),
        ("dotdot uri", _image(good, 1, uri=f"media/../media/{b.uri[6:]}"),
         mmstore.UntrustedURIError, 1),
        ("file uri", _image(good, 0, uri="file:///etc/hosts"), mmstore.UntrustedURIError, 0),
    ]  # fmt: skip


BAD_NAMES = [
    "span length", "shifted span", "unsorted", "overlap", "outside", "stray placeholder",
    "text in span", "loss_mask length", "logprobs length", "prompt_len", "fingerprint", "family",
    "missing media", "uri of other bytes", "misplaced uri", "http uri", "dotdot uri", "file uri",
]  # fmt: skip


@pytest.mark.parametrize("name", BAD_NAMES)
def test_refused_row_leaves_store_and_writer_as_they_were(store, adapter, name):
    media = [store.put_media(image_bytes(seed)) for seed in (1, 2)]
    good = make_row(adapter, media, "good")
    cases = {case[0]: case[1:] for case in _bad_rows(store, adapter, good)}
    assert list(cases) == BAD_NAMES
    changes, error, image_index = cases[name]
    bad = mmstore.Rollout(**{**good.model_dump(), **changes, "sample_id": "bad"})
    with store.writer(run_id="r", step=5, row_group_size=1) as w:
        w.write(make_row(adapter, media, "before"))  # a row group is already encoded
        before = tree(store.backend.base)
        with pytest.raises(error) as err:
            w.write(bad)
        assert type(err.value) is error
        context = {"run_id": "r", "step": 5, "sample_id": "bad", "image_index": image_index}
        assert {k: err.value.context.get(k) for k in context} == context
        assert tree(store.backend.base) == before  # no file, no staging, no timestamp moved
        w.write(good)  # the writer is still usable
    assert [r.sample_id for r in read_rows(store)] == ["before", "good"]
    assert store.staging_files() == []


def test_other_refusals(any_store, adapter):
    media = any_store.put_media(image_bytes(1))
    row = make_row(adapter, [media], "s0")
    with any_store.writer(run_id="r", step=0) as w:
        w.write(row)
        before = listing(any_store)
        with pytest.raises(mmstore.InvalidRolloutError, match="duplicate sample_id"):
            w.write(row)
        with pytest.raises(mmstore.InvalidRolloutError, match=r"expected an mmstore\.Rollout"):
            w.write(row.model_dump())
        absent = content_hash(b"gone")
        gone = _image(row, 0, hash=absent, uri=f"media/{absent[:2]}/{absent[2:4]}/{absent}.png")
        with pytest.raises(mmstore.MediaNotFoundError) as err:
            w.write(mmstore.Rollout(**{**row.model_dump(), **gone, "sample_id": "s1"}))
        assert (err.value.sample_id, err.value.image_index) == ("s1", 0)
        assert listing(any_store) == before
    assert read_rows(any_store) == [row]
    with pytest.raises(mmstore.InvalidRolloutError, match="dense"):
        mmstore.Rollout(**row.model_dump(), pixel_values=[[0.0]])


def test_media_under_a_trusted_root_is_verified_at_write(tmp_path, adapter):
    outside = tmp_path / "images"
    outside.mkdir()
    (outside / "a.png").write_bytes(image_bytes(1))
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=[outside])
    media = mmstore.MediaRef(
        uri=f"file://{outside}/a.png", hash=content_hash(image_bytes(1)), width=120, height=80
    )
    liar = media.model_copy(update={"hash": content_hash(image_bytes(2))})
    with store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [media], "ok"))
        with pytest.raises(mmstore.HashMismatchError):
            w.write(make_row(adapter, [liar], "liar"))
    assert [r.images[0].uri for r in read_rows(store)] == [media.uri]


# -- stray placeholders in text-only rows -----------------------------------------------


def stray_text_row(sample_id, token_id):
    return mmstore.Rollout(
        sample_id=sample_id, tokens=[1, token_id, 3], prompt_len=1, loss_mask=[0, 1, 1]
    )


def test_text_only_row_with_a_placeholder_is_refused_without_adapter_argument(
    store, adapter, monkeypatch
):
    """An adapter built anywhere in this process tells the writer the family's placeholder,
    when the adapters of this process are all of one family."""
    monkeypatch.setattr(
        mmstore._families._registry, "_LAYOUTS", {adapter.fingerprint: adapter.layout}
    )
    with store.writer(run_id="r", step=0) as w:  # no adapter=
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
            w.write(stray_text_row("bad", adapter.image_token_id))
        w.write(stray_text_row("fine", 5))
    assert [r.sample_id for r in read_rows(store)] == ["fine"]


def test_adapters_of_several_families_leave_text_only_rows_to_the_run(store, adapter, monkeypatch):
    """One family's image-only token is another's text (Pixtral's [IMG_END] is 13): with
    adapters of two families in this process and nothing else to go by, a text-only row of
    a new run cannot be judged and is accepted; once the run has images, it can."""
    from mmstore._families import Layout

    other = Layout.make(
        "pixtral",
        {"patch_size": 14, "spatial_merge_size": 2, "longest_edge": 1540},
        {
            "image_token_id": 10,
            "image_break_token_id": 12,
            "image_end_token_id": 13,
            "pad_token_id": 11,
        },
    )
    monkeypatch.setattr(
        mmstore._families._registry,
        "_LAYOUTS",
        {adapter.fingerprint: adapter.layout, other.fingerprint: other},
    )
    with store.writer(run_id="r", step=0) as w:
        w.write(stray_text_row("text", 13))
        w.write(make_row(adapter, [store.put_media(image_bytes(1))], "with-image"))
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
            w.write(stray_text_row("bad", adapter.image_token_id))


def test_the_runs_recorded_layouts_tell_a_fresh_process(store, adapter, monkeypatch):
    """No adapter in this process: the layouts in the run's committed footers decide."""
    with store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [store.put_media(image_bytes(1))], "with-image"))
    monkeypatch.setattr(
        mmstore._families._registry, "_LAYOUTS", {}
    )  # as in a process that built none
    with store.writer(run_id="r", step=1) as w:
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span") as err:
            w.write(stray_text_row("bad", adapter.image_token_id))
        assert err.value.step == 1 and err.value.sample_id == "bad"
    with store.writer(run_id="new-run", step=0) as w:  # knows nothing: accepted, as documented
        w.write(stray_text_row("unknowable", adapter.image_token_id))


def test_a_custom_tokenizers_adapter_decides_alone(store, small_processor):
    custom = mmstore.adapter_for(small_processor, image_token_id=99)
    with store.writer(run_id="r", step=0, adapter=custom) as w:
        with pytest.raises(mmstore.InvalidRolloutError, match="outside every image span"):
            w.write(stray_text_row("bad", 99))
        # Qwen's published placeholder id is ordinary text to this tokenizer.
        published = mmstore.QwenVL.token_table["image_token_id"].published_id
        w.write(stray_text_row("ordinary-text", published))
