"""The reader trusts nothing it did not check (issue 13, reader side).

Rows here are forged: written through plain pyarrow, as another engine, a copy or a rotting
disk would leave them, never through mmstore's writer (which would refuse them).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tracemalloc
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from PIL import Image

import mmstore
from mmstore import debug
from mmstore._format.schema import META_LAYOUTS, META_SCHEMA_VERSION, ROLLOUT_SCHEMA
from mmstore._rows import table as table_module
from mmstore.synth import photo
from tests import rows
from tests.forged import assert_names, huge_row_table, loader_error, many_refs_table
from tests.rows import commit_existing
from tests.store_workers import image_bytes

IMG = 151655  # Qwen-VL's image token
IMG_SIZE = (56, 56)  # 4 tokens in the small test layout


@pytest.fixture
def media(store):
    return [store.put_image(photo(seed, *IMG_SIZE)) for seed in range(2)]


def make_row(adapter, media, sample_id="s0", n_images=1):
    """A valid row as a dict of Python values: text, images, text."""
    ids = [7, *([adapter.image_token_id, 8] * n_images), 9]
    tokens, refs = adapter.expand(ids, media[:n_images])
    return {
        "sample_id": sample_id,
        "group_id": "g",
        "tokens": tokens,
        "prompt_len": len(tokens) - 1,
        "loss_mask": [False] * (len(tokens) - 1) + [True],
        "logprobs": [-0.5] * len(tokens),
        "reward": 1.0,
        "advantage": 0.5,
        "images": [ref.model_dump() for ref in refs],
        "metadata": None,
    }


def forge(store, adapter, rows, *, schema=ROLLOUT_SCHEMA, run="forged", step=0):
    """Commit ``rows`` as one file written by plain pyarrow (and committed to the table);
    its store-relative path."""
    return forge_table(store, adapter, pa.Table.from_pylist(rows, schema=schema), run, step)


def forge_table(store, adapter, table, run="forged", step=0):
    """:func:`forge` of an Arrow table (a forged huge row never becomes Python lists)."""
    path = f"rollouts/run_id={run}/step={step}/part-{uuid.uuid4().hex}-00000.parquet"
    layouts = {adapter.fingerprint: adapter.layout.params()}
    table = table.replace_schema_metadata(
        {META_SCHEMA_VERSION: b"1", META_LAYOUTS: json.dumps(layouts).encode()}
    )
    target = store.backend.abspath(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    pq.write_table(table, target)
    commit_existing(store, path)  # as another engine's writer would: the log lists it
    return path


def load(store, processor, **kwargs):
    ds = mmstore.RolloutDataset(store, processor, shuffle=False, **kwargs)
    return list(mmstore.RolloutLoader(ds, batch_size=4))


def refused(store, processor, path, error=mmstore.InvalidRolloutError, **kwargs):
    with pytest.raises(error) as info:
        load(store, processor, **kwargs)
    ctx = info.value.context
    assert ctx["file"] == path and ctx["run_id"] == "forged" and ctx["step"] == 0
    return info.value


def verify_kinds(store):
    report = mmstore.verify(store)
    return {(p.kind, p.sample_id, p.image_index) for p in report.problems}


# --- item 1: spans that do not match their tokens ------------------------------------------


def _shift(row):
    row["images"][0]["offset"] += 1  # onto the text token after the span


def _past_end(row):
    row["images"][-1]["offset"] = len(row["tokens"]) - 2


def _over_text(row):
    row["tokens"][row["images"][0]["offset"]] = 8


def _stray(row):
    row["tokens"][0] = IMG  # the image token, outside every span


def _twice(row):
    row["images"] = [row["images"][0], row["images"][0]]


def _other_size(row):
    row["images"][0]["width"] = row["images"][0]["height"] = 560


def _touching(row):
    # The text token between the two images removed: their spans touch, and Qwen-VL's model
    # would read their image tokens as one image.
    gap = row["images"][0]["offset"] + row["images"][0]["length"]
    for name in ("tokens", "loss_mask", "logprobs"):
        del row[name][gap]
    row["images"][1]["offset"] -= 1
    row["prompt_len"] -= 1


SPAN_DAMAGE = {
    "shifted": (_shift, 0),
    "past_the_end": (_past_end, 1),
    "over_text": (_over_text, 0),
    "stray_placeholder": (_stray, None),
    "same_ref_twice": (_twice, 1),
    "size_not_the_span": (_other_size, 0),
    "touching_images": (_touching, 1),
}


@pytest.mark.parametrize("damage", SPAN_DAMAGE)
def test_forged_spans_are_refused_by_loader_and_reported_by_verify(
    store, small_processor, adapter, media, damage
):
    fn, index = SPAN_DAMAGE[damage]
    good = make_row(adapter, media, "ok", n_images=2)
    bad = make_row(adapter, media, "bad", n_images=2)
    fn(bad)
    path = forge(store, adapter, [good, bad])
    err = refused(store, small_processor, path)
    assert err.sample_id == "bad" and err.context.get("image_index") == index
    assert verify_kinds(store) == {("invalid_row", "bad", index)}


# --- item 2: placeholders agree with their span, sizes are bounded ---------------------------


def test_placeholder_sizes_come_only_from_checked_refs(tmp_path, small_processor, adapter, media):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    huge = make_row(adapter, media, "huge")
    huge["images"][0].update(width=100_000, height=100_000, uri="media/00/00/" + "0" * 32 + ".png")
    liar = make_row(adapter, media, "liar")
    liar["images"][0].update(width=1000, height=1000, uri="media/00/00/" + "1" * 32 + ".png")
    for row, match in ((huge, "exceeds the store's limit"), (liar, "span length")):
        path = forge(store, adapter, [row])
        with pytest.raises(mmstore.InvalidRolloutError, match=match) as info:
            load(store, small_processor, missing="placeholder_zero_loss")
        assert info.value.file == path and info.value.sample_id == row["sample_id"]
        store.table.remove_files(lambda f, path=path: f.path == path)  # out of the store
        store.backend.delete(path)


# --- item 3: malformed rows and compatible types -------------------------------------------


def _negative_offset(row):
    row["images"][0]["offset"] = -3


def _hash_not_hex(row):
    row["images"][0]["hash"] = "Z" * 32


def _short_mask(row):
    row["loss_mask"] = row["loss_mask"][:-2]


def _short_logprobs(row):
    row["logprobs"] = row["logprobs"][:-1]


def _prompt_len(row):
    row["prompt_len"] = -1


MALFORMED = {
    "negative_offset": (_negative_offset, 0),
    "hash_not_hex": (_hash_not_hex, 0),
    "short_loss_mask": (_short_mask, None),
    "short_logprobs": (_short_logprobs, None),
    "negative_prompt_len": (_prompt_len, None),
}


@pytest.mark.parametrize("damage", MALFORMED)
def test_malformed_rows_are_typed_errors_naming_file_and_sample(
    store, small_processor, adapter, media, damage
):
    fn, index = MALFORMED[damage]
    bad = make_row(adapter, media, "bad")
    fn(bad)
    path = forge(store, adapter, [make_row(adapter, media, "ok"), bad])
    err = refused(store, small_processor, path)
    assert err.sample_id == "bad" and err.context.get("image_index") == index
    assert ("invalid_row", "bad", index) in verify_kinds(store)


def _schema_with(tokens_type):
    fields = [pa.field(f.name, tokens_type) if f.name == "tokens" else f for f in ROLLOUT_SCHEMA]
    return pa.schema(fields)


def test_int64_tokens_read_as_the_v1_schema(store, small_processor, adapter, media):
    rows = [make_row(adapter, media, f"s{i}", n_images=2) for i in range(4)]
    forge(store, adapter, rows)
    expected = load(store, small_processor)
    forge(store, adapter, rows, schema=_schema_with(pa.list_(pa.int64())), run="wide")
    narrow, wide = load(store, small_processor)  # one window over both files
    for key in ("input_ids", "pixel_values", "loss_mask", "mm_token_type_ids"):
        assert torch.equal(wide[key], expected[0][key])
        assert torch.equal(narrow[key], expected[0][key])
    assert mmstore.verify(store).ok


def test_int64_tokens_out_of_int32_range_are_refused_naming_the_file(
    store, small_processor, adapter, media
):
    row = make_row(adapter, media)
    row["tokens"][0] = 2**40
    path = forge(store, adapter, [row], schema=_schema_with(pa.list_(pa.int64())))
    err = refused(store, small_processor, path, error=mmstore.CorruptFileError)
    assert "tokens" in err.message
    assert {p.kind for p in mmstore.verify(store).problems} == {"unreadable_file"}


# --- item 4: bounded work per row ----------------------------------------------------------


def _long_row(adapter, media, n):
    row = make_row(adapter, media, "long")
    tail = (np.arange(n) % 50_000 + 1000).tolist()  # distinct ints: no small-int cache
    row["tokens"] += tail
    row["loss_mask"] += [True] * n
    row["logprobs"] = None
    return row


@pytest.mark.slow
def test_a_huge_row_costs_no_python_lists_with_max_len(store, small_processor, adapter, media):
    forge(store, adapter, [_long_row(adapter, media, 3_000_000)])
    ds = mmstore.RolloutDataset(store, small_processor, shuffle=False, max_len=32)
    tracemalloc.start()
    try:
        batches = list(mmstore.RolloutLoader(ds, batch_size=1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batches[0]["input_ids"].shape == (1, 32)
    # As Python lists the row's tokens alone would be ~120 MB; numpy views cost nothing.
    assert peak < 40 * 2**20, peak


@pytest.mark.parametrize("max_len", [None, 6])
def test_a_forged_span_past_the_cut_is_refused_as_without_max_len(
    store, small_processor, adapter, media, max_len
):
    # Two images; the second's span is damaged. max_len=6 keeps only the first image (its 4
    # tokens after one text token, one more text token): the damage lies past the cut, and
    # the row is still a forged row.
    row = make_row(adapter, media, n_images=2)
    second = row["images"][1]["offset"]
    assert second == 6
    row["tokens"][second + 1] = 8
    path = forge(store, adapter, [row])
    err = refused(store, small_processor, path, max_len=max_len)
    assert err.image_index == 1 and "inside the span" in err.message


def test_a_row_above_the_hard_cap_is_refused(store, small_processor, adapter, media, monkeypatch):
    from mmstore._rows import check as _rowcheck

    monkeypatch.setattr(_rowcheck, "MAX_ROW_TOKENS", 1000)
    path = forge(store, adapter, [_long_row(adapter, media, 2000)])
    err = refused(store, small_processor, path, max_len=64)
    assert "exceed" in err.message and err.sample_id == "long"


# --- item 5: only the formats put accepts are decoded --------------------------------------


@pytest.mark.parametrize("fmt", ["PPM", "TGA", "PCX", "SGI"])
def test_read_path_decodes_only_put_formats(store, fmt):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, format=fmt)
    data = buf.getvalue()
    digest = mmstore._format.media.content_hash(data)
    uri = mmstore._format.media.media_path(digest, "png")
    target = store.backend.abspath(uri)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(data)
    with pytest.raises(mmstore.ImageDecodeError):
        store.open_image(uri, digest)
    with pytest.raises(mmstore.ImageDecodeError):
        store.put_media(data, ext="png")


# --- item 15: trust is checked on cache hits too -------------------------------------------


def test_cache_hit_still_checks_the_uri(store, small_processor, adapter, media):
    good = make_row(adapter, media, "a")
    evil = make_row(adapter, media, "b")
    evil["images"][0]["uri"] = "https://evil.example/x.png"  # same hash: a cache hit
    path = forge(store, adapter, [good, evil])
    err = refused(store, small_processor, path, error=mmstore.UntrustedURIError)
    assert err.sample_id == "b" and err.image_index == 0


# --- property: whatever the corruption, batches agree or a typed error names the file -------

INTS = st.one_of(st.integers(-3, 300), st.sampled_from([0, 2**31 - 1, -(2**31), 100_000]))


@st.composite
def corruptions(draw):
    """A list of (operation, arguments) applied in order to a file's rows."""
    ops = st.one_of(
        st.tuples(
            st.just("ref_int"), st.sampled_from(["offset", "length", "width", "height"]), INTS
        ),
        st.tuples(st.just("token"), st.integers(0, 40), st.sampled_from([IMG, 7, 8, -1])),
        st.tuples(st.just("insert"), st.integers(0, 40), st.sampled_from([IMG, 7])),
        st.tuples(st.just("delete"), st.integers(0, 40)),
        st.tuples(st.just("shorten"), st.sampled_from(["loss_mask", "logprobs"])),
        st.tuples(st.just("refs"), st.sampled_from(["dup", "drop", "swap", "reverse"])),
        st.tuples(st.just("hash"), st.text("0123456789abcdefXYZ", min_size=0, max_size=33)),
        st.tuples(st.just("uri"), st.sampled_from(["https://x/y.png", "media/../x.png", "/etc/x"])),
        st.tuples(st.just("prompt_len"), INTS),
        st.tuples(st.just("family"), st.sampled_from(["glm4v", ""])),
        st.tuples(st.just("null"), st.sampled_from(NULLABLE_PLACES)),
    )
    return draw(st.lists(st.tuples(st.integers(0, 2), ops), min_size=1, max_size=4))


def _corrupt(rows, row_index, op):
    # An earlier op may have nulled what this one edits (a list, a ref): then it does nothing.
    with contextlib.suppress(TypeError, AttributeError, IndexError):
        _apply(rows[row_index], op)


def _apply(row, op):
    kind, *args = op
    refs = row["images"]
    if kind == "ref_int" and refs:
        refs[0][args[0]] = args[1]
    elif kind == "token" and row["tokens"]:
        row["tokens"][args[0] % len(row["tokens"])] = args[1]
    elif kind in ("insert", "delete"):
        pos = args[0] % (len(row["tokens"]) + 1)
        if kind == "insert":
            for name, value in (("tokens", args[1]), ("loss_mask", True), ("logprobs", 0.0)):
                row[name].insert(pos, value)
        elif pos < len(row["tokens"]):
            for name in ("tokens", "loss_mask", "logprobs"):
                del row[name][pos]
    elif kind == "shorten" and row[args[0]]:
        row[args[0]].pop()
    elif kind == "refs" and refs:
        how = args[0]
        row["images"] = {
            "dup": refs + refs[-1:],
            "drop": refs[1:],
            "swap": refs[1:2] + refs[:1] + refs[2:],
            "reverse": refs[::-1],
        }[how]
    elif kind in ("hash", "uri", "family") and refs:
        refs[-1][kind] = args[0]
    elif kind == "prompt_len":
        row["prompt_len"] = args[0]
    elif kind == "null":
        _null(row, args[0])


# Fields the v1 schema declares non-null, which plain pyarrow still writes as null.
NULLABLE_PLACES = [
    "sample_id", "tokens", "prompt_len", "loss_mask", "images", "token", "ref", "ref.offset",
    "ref.width", "ref.uri", "ref.hash", "ref.layout_fingerprint",
]  # fmt: skip


def _nullable(schema):
    def loose(t):
        if pa.types.is_list(t):
            return pa.list_(pa.field("item", loose(t.value_type)))
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, loose(f.type)) for f in t])
        return t

    return pa.schema([pa.field(f.name, loose(f.type)) for f in schema])


def _null(row, place):
    if place == "token" and row["tokens"]:
        row["tokens"][0] = None
    elif place == "ref" and row["images"]:
        row["images"][0] = None
    elif place.startswith("ref.") and row["images"]:
        row["images"][0][place[4:]] = None
    elif place in row:
        row[place] = None


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    corruptions(),
    st.booleans(),
    st.sampled_from([None, 6, 11]),
    st.sampled_from(["error", "placeholder_zero_loss"]),
)
# Found by this test: max_len cuts every (damaged) image away, a batch holds none.
@example(
    [(1, ("ref_int", "length", 2**31 - 1)), (2, ("ref_int", "length", 2**31 - 1))],
    False,
    6,
    "error",
)
def test_corrupt_rows_give_consistent_batches_or_a_typed_error(
    tmp_path_factory, small_processor, adapter, damage, wide, max_len, missing
):
    store = mmstore.Store.open(tmp_path_factory.mktemp("fuzz") / "s", create=True)
    media = [store.put_image(photo(seed, *IMG_SIZE)) for seed in range(2)]
    rows = [make_row(adapter, media, f"s{i}", n_images=i) for i in range(3)]
    for row_index, op in damage:
        _corrupt(rows, row_index, op)
    schema = _schema_with(pa.list_(pa.int64())) if wide else ROLLOUT_SCHEMA
    if any(op[0] == "null" for _, op in damage):
        schema = _nullable(schema)  # as an engine that does not declare non-null writes
    try:
        path = forge(store, adapter, rows, schema=schema)
    except (pa.ArrowException, OverflowError) as exc:
        event(f"unwritable: {type(exc).__name__} {str(exc)[:60]}")
        return  # not even pyarrow writes this row
    try:
        batches = load(store, small_processor, max_len=max_len, missing=missing)
    except mmstore.MmstoreError as exc:
        event(f"refused: {type(exc).__name__}")
        # Errors met while reading name the file; the build-time layout check names all.
        assert exc.context.get("file") == path or exc.context.get("files") == [path], exc
        return
    event("read")
    merge = small_processor.merge_size**2
    for batch in batches:
        ids, grid = batch["input_ids"], batch["image_grid_thw"]
        image_tokens = int((ids == IMG).sum())
        if grid is None:  # no image in the batch: the model's own "no images"
            assert image_tokens == 0 and batch["pixel_values"] is None
            continue
        assert image_tokens == int(grid.prod(dim=1).sum()) // merge
        assert batch["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
        assert torch.equal(batch["mm_token_type_ids"].bool(), ids == IMG)


def _claims_a_larger_size(adapter, row, media):
    """``row``'s image re-laid out as if its (real 56x56) bytes were 112x112: a row whose
    tokens, span and size agree, and whose size the bytes contradict."""
    big = media[0].model_copy(update={"width": 112, "height": 112})
    tokens, refs = adapter.expand([7, adapter.image_token_id, 8, 9], [big])
    row.update(
        tokens=tokens,
        prompt_len=len(tokens) - 1,
        loss_mask=[False] * (len(tokens) - 1) + [True],
        logprobs=[-0.5] * len(tokens),
        images=[ref.model_dump() for ref in refs],
    )


@pytest.mark.parametrize("order", ["miss", "hit"])
def test_a_size_the_bytes_contradict_is_refused_on_a_cache_hit_too(
    store, small_processor, adapter, media, order
):
    honest = make_row(adapter, media, "honest")
    forged = make_row(adapter, media, "forged")
    _claims_a_larger_size(adapter, forged, media)
    rows = [honest, forged] if order == "hit" else [forged]  # "hit": the pixels are cached
    path = forge(store, adapter, rows)
    err = refused(store, small_processor, path, error=mmstore.LayoutMismatchError)
    assert err.sample_id == "forged" and err.image_index == 0


# --- issue 30, item 9: every reader bounds what it reads -------------------------------------


@pytest.mark.slow
def test_a_forged_row_of_20m_tokens_is_refused_by_every_reader(store, adapter, small_processor):
    path = forge_table(store, adapter, huge_row_table(20_000_000))
    assert os.path.getsize(store.backend.abspath(path)) < 256 * 1024  # a small row, forged
    expected = loader_error(store, small_processor)
    assert isinstance(expected, mmstore.InvalidRolloutError) and "exceed" in expected.message
    tracemalloc.start()
    try:
        every_reader_refuses(store, "huge", path, expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # As Python lists the row alone would take gigabytes; refused, it costs none.
    assert peak < 64 * 2**20, peak


def test_a_forged_row_of_6000_refs_is_refused_by_every_reader(store, adapter, small_processor):
    media = store.put_media(image_bytes(0, 56, 56))
    path = forge_table(store, adapter, many_refs_table(adapter, media, 6000))
    expected = loader_error(store, small_processor)
    assert isinstance(expected, mmstore.InvalidRolloutError) and "6000 images" in expected.message
    every_reader_refuses(store, "many", path, expected)


def every_reader_refuses(store, sample_id, path, expected):
    """Store.rollouts, debug.sample and debug.sample_view raise the loader's error."""
    for read in (
        lambda: store.rollouts(),
        lambda: debug.sample(store, sample_id),
        lambda: debug.sample_view(store, sample_id),
    ):
        with pytest.raises(mmstore.InvalidRolloutError) as info:
            read()
        assert info.value.message == expected.message
        assert_names(info.value, path, sample_id)


# --- issue 30, item 17: run ids the writer refuses are refused when read ---------------------

FOREIGN_RUN_IDS = ["rün", "exp 1", "a%2Fb", "r" * 129]


@pytest.mark.parametrize("run_id", FOREIGN_RUN_IDS, ids=["umlaut", "space", "escape", "129"])
def test_a_committed_file_under_a_refused_run_id_is_refused_when_read(
    store, adapter, small_processor, monkeypatch, run_id
):
    with pytest.raises(mmstore.InvalidRolloutError):
        store.writer(run_id=run_id, step=0)
    media = [store.put_media(image_bytes(0, 56, 56))]
    [good] = rows.commit(store, adapter, "good", 0, [media])
    path = f"rollouts/run_id={run_id}/step=0/part-foreign-00000.parquet"
    os.makedirs(os.path.dirname(store.backend.abspath(path)), exist_ok=True)
    shutil.copy(store.backend.abspath(good), store.backend.abspath(path))
    # Another engine's commit: mmstore's own commit refuses the run id, that engine's not.
    with monkeypatch.context() as m:
        m.setattr(table_module, "_check_file", lambda file: None)
        commit_existing(store, path)
    listed = [f.path for f in store.files() if f.path != good]
    assert len(listed) == 1

    for read in (
        lambda: mmstore.RolloutDataset(store, small_processor),  # when the snapshot is built
        lambda: store.rollouts(),
        lambda: mmstore.export(store, store.root + "-dump"),
        lambda: debug.sample(store, "good-0-0", run_id=run_id),
    ):
        with pytest.raises(mmstore.CorruptFileError, match="run id") as info:
            read()
        assert (info.value.file, info.value.run_id) == (listed[0], run_id)
    # Only what reads the foreign file refuses: the rest of the store reads.
    ds = mmstore.RolloutDataset(store, small_processor, runs=["good"])
    assert len(ds) == 1
