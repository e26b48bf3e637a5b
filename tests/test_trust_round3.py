"""Issue 30, the readers' items: export checks what it copies (3), every reader bounds what it
reads (9), a footer is parsed once per file (10), run ids the writer refuses are refused when
read (17), a state naming a file twice is refused (18); verify does not call a network error
damage, and S3's ACCESS_DENIED on media is a MediaPermissionError.

Forged files are written through plain pyarrow and committed to the table, as another engine
would leave them; a rotted page is a flipped bit in a committed file's tokens column.
"""

from __future__ import annotations

import os
import shutil
import time
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore import debug
from mmstore._format.media import content_hash
from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._rows import table as table_module
from mmstore._rows.check import MAX_ROW_IMAGES, MAX_ROW_TOKENS
from mmstore._rows.files import open_rollout_file
from mmstore.integrations import vllm
from mmstore.synth import photo
from tests import rows
from tests.rows import commit_existing
from tests.store_workers import image_bytes, make_row
from tests.test_reader_trust import forge_table

# -- helpers -------------------------------------------------------------------------------


def forge(store, adapter, table: pa.Table, run="forged", step=0) -> str:
    """Commit ``table`` (v1 columns) as one file written by plain pyarrow; its path."""
    return forge_table(store, adapter, table, run=run, step=step)


def one_row(**columns) -> pa.Table:
    """One row of the v1 schema: ``columns`` as given (Arrow arrays), every other null."""
    arrays = [
        columns.get(f.name, pa.nulls(1, f.type))
        for f in ROLLOUT_SCHEMA
        if f.name in columns or f.nullable
    ]
    names = [f.name for f in ROLLOUT_SCHEMA if f.name in columns or f.nullable]
    return pa.Table.from_arrays(arrays, names=names)


def list_of(values: np.ndarray, name: str) -> pa.ListArray:
    kind = ROLLOUT_SCHEMA.field(name).type
    offsets = pa.array([0, len(values)], pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values, kind.value_type), type=kind)


def huge_row_table(n_tokens: int) -> pa.Table:
    """A text-only row claiming ``n_tokens`` tokens: a few KB of Parquet (one repeated value)."""
    return one_row(
        sample_id=pa.array(["huge"]),
        tokens=list_of(np.full(n_tokens, 7, np.int32), "tokens"),
        prompt_len=pa.array([1], pa.int32()),
        loss_mask=list_of(np.zeros(n_tokens, np.bool_), "loss_mask"),
        images=pa.array([[]], ROLLOUT_SCHEMA.field("images").type),
    )


def many_refs_table(adapter, media, n_refs: int) -> pa.Table:
    """A short valid row whose one image ref is repeated ``n_refs`` times."""
    row = make_row(adapter, [media], "many")
    refs = [row.images[0].model_dump()] * n_refs
    return one_row(
        sample_id=pa.array(["many"]),
        tokens=list_of(np.asarray(row.tokens, np.int32), "tokens"),
        prompt_len=pa.array([row.prompt_len], pa.int32()),
        loss_mask=list_of(np.asarray(row.loss_mask, np.bool_), "loss_mask"),
        images=pa.array([refs], ROLLOUT_SCHEMA.field("images").type),
    )


def assert_names(err, path, sample_id):
    assert (err.file, err.run_id, err.step, err.sample_id) == (path, "forged", 0, sample_id), err


def loader_error(store, processor):
    ds = mmstore.RolloutDataset(store, processor, shuffle=False, node_cache_bytes=0)
    with pytest.raises(mmstore.MmstoreError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=2))
    return info.value


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


# -- item 3: export does not launder bit rot -----------------------------------------------


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


# -- item 9: every reader bounds what it reads ---------------------------------------------


def test_a_forged_row_of_20m_tokens_is_refused_by_every_reader(store, adapter, small_processor):
    path = forge(store, adapter, huge_row_table(20_000_000))
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
    path = forge(store, adapter, many_refs_table(adapter, media, 6000))
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


def test_the_vllm_prompt_refuses_rows_above_the_loaders_caps(store, adapter):
    media = store.put_media(image_bytes(0, 56, 56))
    row = make_row(adapter, [media], "s")
    too_long = mmstore.Rollout.model_construct(
        **{**dict(row), "tokens": [7] * (MAX_ROW_TOKENS + 1), "images": []}
    )
    too_many = mmstore.Rollout.model_construct(**{**dict(row), "images": row.images * 6000})
    for forged, what in ((too_long, "exceed"), (too_many, "6000 images")):
        for build in (vllm.to_vllm_prompt, vllm.to_prefill_request):
            with pytest.raises(mmstore.InvalidRolloutError, match=what) as info:
                build(store, forged)
            assert info.value.sample_id == "s"
    assert MAX_ROW_IMAGES > 6000  # refused as the loader does: more images than tokens


def test_sample_view_draws_a_bounded_canvas_for_a_long_valid_row(store):
    # Within the loader's caps, yet drawn whole: 6,000 tiles of 640 px side by side (7.8 GB
    # of RGB) and 3,125 lines of tokens. What is drawn is bounded; the header counts all.
    refs = [
        {"uri": "media/00/00/none.png", "hash": "0" * 32, "width": 8, "height": 8}
        | {"offset": 2 * k, "length": 1}
        for k in range(6000)
    ]
    n = 400_000
    row = {"images": refs, "tokens": [7] * n, "loss_mask": [False] * n, "prompt_len": 1}
    tiles = debug.thumbnails(store, row)
    assert tiles.width * tiles.height < 50_000_000, tiles.size
    strip = debug.token_strip(row)
    assert strip.width * strip.height < 10_000_000, strip.size


# -- item 10: one footer parse per file ----------------------------------------------------


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


# -- item 17: run ids the writer refuses are refused when read -----------------------------

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


# -- item 18: a state naming a file twice --------------------------------------------------


def test_a_state_naming_a_file_twice_is_refused(store, adapter, small_processor):
    media = [store.put_media(image_bytes(0, 56, 56))]
    first = rows.commit(store, adapter, "r", 0, [media] * 2)[0]
    rows.commit(store, adapter, "r", 1, [media] * 2)
    loader = mmstore.RolloutLoader(mmstore.RolloutDataset(store, small_processor), batch_size=2)
    state = loader.state_dict()
    for target in (loader, loader.dataset):
        for files in ([first, first], [*state["files"], first]):
            sub = target.state_dict()
            with pytest.raises(mmstore.InvalidArgumentError, match="twice") as info:
                target.load_state_dict({**sub, "files": files})
            assert info.value.file == first
    loader.load_state_dict(state)  # the state as taken still loads
    assert len(list(loader)) == 2


# -- last round: verify and network errors; S3 refusals on media ---------------------------

STALLED = (
    "When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION during "
    "HeadObject operation: curlCode: 28, Timeout was reached"
)
# pyarrow's texts for S3's refusals: a HEAD's (no body: the SDK names the code from the
# status) and a GET whose 403 carried a code the SDK does not know.
DENIED = [
    "When reading information for key 'ext/shot.png' in bucket 'locked': AWS Error "
    "ACCESS_DENIED during HeadObject operation: No response body.",
    "When reading 'ext/shot.png' in bucket 'locked': AWS Error UNKNOWN (HTTP status 403) "
    "during GetObject operation: AllAccessDisabled",
]


class FailingFS:
    """A pyarrow file system whose every open and stat fails with ``message`` (pyarrow's own
    text); anything else goes to ``fs``."""

    def __init__(self, fs, message):
        self._fs, self._message = fs, message

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def _fail(self, *args, **kwargs):
        raise OSError(self._message)

    open_input_file = open_input_stream = get_file_info = _fail


def test_verify_raises_a_network_error_instead_of_reporting_damage(store, adapter):
    media = [store.put_media(image_bytes(0, 56, 56))]
    [path] = rows.commit(store, adapter, "r", 2, [media])
    assert mmstore.verify(store).ok
    store.backend.fs = FailingFS(store.backend.fs, STALLED)
    with pytest.raises(mmstore.NetworkError) as info:
        mmstore.verify(store)
    assert info.value.retryable and (info.value.file, info.value.run_id) == (path, "r")


@pytest.mark.parametrize("message", DENIED, ids=["access_denied", "403"])
def test_s3_access_denied_on_media_is_a_media_permission_error(tmp_path, message):
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=["s3://locked/ext"])
    uri = "s3://locked/ext/shot.png"
    backend, _ = store.resolve(uri)
    backend.fs = FailingFS(backend.fs, message)
    for read in (lambda: store.read_media(uri, "0" * 32), lambda: store.media_stat(uri)):
        with pytest.raises(mmstore.MediaPermissionError, match="access denied") as info:
            read()
        assert isinstance(info.value, PermissionError) and info.value.uri == uri
        assert not info.value.retryable
