"""RolloutDataset / RolloutLoader options: every one takes effect or is refused, typed.

Each refusal here is of an option that was once accepted and then silently ignored (or
failed later, in a worker, untyped): the error must be an :class:`InvalidArgumentError`
raised at construction, naming the option.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._loading import settings as _settings
from mmstore._loading.device import DeferredMaterializer
from mmstore.synth import grpo_rollouts
from tests.conftest import SMALL_MAX_PIXELS


@pytest.fixture(scope="module")
def processor():
    """A torchvision backend: the one processor every option (the device stage too) takes."""
    return Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, processor):
    """One step: 3 GRPO groups of 4 samples, one shared image each, row groups of 4."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("options") / "s", create=True)
    adapter = mmstore.adapter_for(processor)
    with store.writer(run_id="r", step=0, row_group_size=4) as w:
        for r in grpo_rollouts(store, adapter, groups=3, group_size=4, image_size=(96, 64)):
            w.write(r)
    return store


@pytest.fixture
def ds(stored, processor):
    return mmstore.RolloutDataset(stored, processor, node_cache_bytes=0)


# -- keyword-only ---------------------------------------------------------------------------


def test_dataset_arguments_after_the_processor_are_keyword_only(stored, processor):
    with pytest.raises(TypeError):
        mmstore.RolloutDataset(stored, processor, torch.float32)


def test_loader_arguments_after_the_dataset_are_keyword_only(ds):
    with pytest.raises(TypeError):
        mmstore.RolloutLoader(ds, 4)
    with pytest.raises(TypeError):
        mmstore.RolloutLoader(ds, 4, 0)
    # DESIGN's spelling keeps working.
    loader = mmstore.RolloutLoader(ds, batch_size=4, num_workers=0)
    assert sum(len(b["sample_ids"]) for b in loader) == 12


# -- the dataset's ranges and types ----------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("window_units", 0),
        ("window_units", -1),
        ("max_len", 0),
        ("max_len", -5),
        ("cache_bytes", -1),
        ("node_cache_bytes", -1),
        ("prefetch_requests", -1),
        ("seed", 1.5),
        ("seed", "3"),
        ("shuffle", "false"),
        ("world_size", 0),
    ],
)
def test_dataset_refuses_an_out_of_range_or_mistyped_option(stored, processor, option, value):
    with pytest.raises(mmstore.InvalidArgumentError, match=option):
        mmstore.RolloutDataset(stored, processor, **{option: value})


def test_a_negative_node_cache_bound_is_an_invalid_argument(stored, processor):
    # It was a bare ValueError; it is still one (InvalidArgumentError derives from it).
    with pytest.raises(mmstore.InvalidArgumentError, match="node_cache_bytes") as info:
        mmstore.RolloutDataset(stored, processor, node_cache_bytes=-1)
    assert isinstance(info.value, ValueError)


def test_world_size_without_rank_is_refused(stored, processor):
    # Every process would read rank 0's share.
    with pytest.raises(mmstore.InvalidArgumentError, match="without rank"):
        mmstore.RolloutDataset(stored, processor, world_size=2)
    ds = mmstore.RolloutDataset(stored, processor, rank=1, world_size=2, node_cache_bytes=0)
    assert (ds.rank, ds.world_size) == (1, 2)


def test_a_node_cache_bound_without_a_directory_is_refused(
    stored, processor, monkeypatch, tmp_path
):
    monkeypatch.setattr(_settings, "default_directory", lambda: None)  # no /dev/shm, no env
    with pytest.raises(mmstore.InvalidArgumentError, match="node_cache_dir"):
        mmstore.RolloutDataset(stored, processor, node_cache_bytes=2**20)
    # Left to its default, the node cache is simply off there; a directory turns it on.
    assert mmstore.RolloutDataset(stored, processor).node_cache_bytes == 0
    on = mmstore.RolloutDataset(
        stored, processor, node_cache_bytes=2**20, node_cache_dir=str(tmp_path / "node")
    )
    assert on.materializer().node_cache is not None


def test_a_read_ahead_bound_where_nothing_reads_ahead_is_refused(stored, processor):
    # A local store reads without read-ahead unless prefetch_requests asks for it.
    with pytest.raises(mmstore.InvalidArgumentError, match="prefetch_bytes"):
        mmstore.RolloutDataset(stored, processor, prefetch_bytes=2**20)
    with pytest.raises(mmstore.InvalidArgumentError, match="prefetch_bytes"):
        mmstore.RolloutDataset(stored, processor, prefetch_requests=2, prefetch_bytes=0)
    # Asked for, it takes effect; prefetch_requests=0 turns it off, the bound then moot.
    ahead = mmstore.RolloutDataset(
        stored, processor, prefetch_requests=2, prefetch_bytes=2**20, node_cache_bytes=0
    )
    list(mmstore.RolloutLoader(ahead, batch_size=4))
    assert ahead.source.prefetcher is not None
    assert ahead.source.prefetcher.max_bytes == 2**20
    off = mmstore.RolloutDataset(stored, processor, prefetch_requests=0, prefetch_bytes=2**20)
    assert off.source.get() is not None and off.source.prefetcher is None


def test_numpy_integers_are_ints(stored, processor):
    ds = mmstore.RolloutDataset(
        stored, processor, seed=np.int64(3), window_units=np.int32(2), node_cache_bytes=0
    )
    loader = mmstore.RolloutLoader(ds, batch_size=np.int64(4))
    assert loader.state_dict()["batch_size"] == 4 and ds.window_units == 2


# -- the loader: options packed batches do not take --------------------------------------------


@pytest.mark.parametrize("option", ["dummy_image", "even_ranks", "drop_last"])
def test_padded_batch_options_are_refused_when_packed(ds, option):
    with pytest.raises(mmstore.InvalidArgumentError, match=f"{option}.*packed"):
        mmstore.RolloutLoader(ds, batch_size=4, max_tokens=4096, **{option: True})
    # Padded, they take effect.
    mmstore.RolloutLoader(ds, batch_size=4, **{option: True})


# -- the loader: worker options without workers ----------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("prefetch_factor", 2),
        ("timeout", 5.0),
        ("multiprocessing_context", "spawn"),
        ("worker_threads", 1),
    ],
)
def test_worker_options_without_workers_are_refused(ds, option, value):
    with pytest.raises(mmstore.InvalidArgumentError, match=f"{option}.*num_workers=0"):
        mmstore.RolloutLoader(ds, batch_size=4, **{option: value})
    # With workers they apply.
    mmstore.RolloutLoader(ds, batch_size=4, num_workers=2, **{option: value})


# -- the loader's ranges and types -----------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_size", 2.5),
        ("batch_size", True),
        ("num_workers", -1),
        ("max_tokens", "4096"),
        ("max_tokens", 0),
        ("pad_token_id", -1),
        ("drop_last", "yes"),
        ("distinct_images", None),
        ("pin_memory", "no"),
    ],
)
def test_loader_refuses_an_out_of_range_or_mistyped_option(ds, option, value):
    with pytest.raises(mmstore.InvalidArgumentError, match=option):
        mmstore.RolloutLoader(ds, **{"batch_size": 4, option: value})


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("prefetch_factor", 0),
        ("timeout", -1),
        ("timeout", float("nan")),
        ("timeout", float("inf")),  # 0 is how to wait without a limit
        ("multiprocessing_context", "threads"),
    ],
)
def test_worker_options_out_of_range_are_refused(ds, option, value):
    with pytest.raises(mmstore.InvalidArgumentError, match=option):
        mmstore.RolloutLoader(ds, batch_size=4, num_workers=2, **{option: value})


# -- the device stage ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "node_cache",
    [{"node_cache_bytes": 2**20}, {"node_cache_dir": "node"}],
    ids=["bytes", "dir"],
)
def test_an_asked_for_node_cache_is_refused_with_preprocess_device(
    stored, processor, tmp_path, node_cache
):
    # Workers only decode: nothing is processed for the node cache to share.
    if "node_cache_dir" in node_cache:
        node_cache = {"node_cache_dir": str(tmp_path / "node")}
    ds = mmstore.RolloutDataset(stored, processor, **node_cache)
    with pytest.raises(mmstore.InvalidArgumentError, match=r"node_cache.*preprocess_device"):
        mmstore.RolloutLoader(ds, batch_size=4, preprocess_device="cpu")


def test_preprocess_device_takes_the_default_node_cache_or_none(stored, processor):
    for ds in (
        mmstore.RolloutDataset(stored, processor),  # the default: on, where usable
        mmstore.RolloutDataset(stored, processor, node_cache_bytes=0),
    ):
        loader = mmstore.RolloutLoader(ds, batch_size=4, preprocess_device="cpu")
        assert sum(b["node_cache_hits"] for b in loader) == 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_device_stage_reads_through_its_own_source(ds, packed):
    """The loader picks the decoding source once: its streams never build the dataset's
    processing materializer, and neither source ships a built one to a worker."""
    shape = {"max_tokens": 4096} if packed else {}
    loader = mmstore.RolloutLoader(ds, batch_size=4, preprocess_device="cpu", **shape)
    batches = list(loader)
    assert sum(len(b["sample_ids"]) for b in batches) == 12
    assert ds.source.built is None
    assert isinstance(loader._source.built, DeferredMaterializer)
    assert loader._source.built.cache.misses > 0  # the images were decoded there
    shipped = pickle.loads(pickle.dumps(loader._stream(0, 0, len(loader))))
    assert shipped.source.built is None and shipped.source.prefetcher is None


def test_forked_workers_build_their_own_materializer(stored, processor):
    """A forked DataLoader worker inherits the parent's objects without pickling them: it
    still builds its own materializer (cache, read-ahead) rather than go on with the
    parent's, so its batches count exactly what a fresh worker's do."""

    def misses(ds):
        loader = mmstore.RolloutLoader(
            ds, batch_size=4, num_workers=1, multiprocessing_context="fork"
        )
        return [(b["cache_hits"], b["cache_misses"]) for b in loader]

    fresh = mmstore.RolloutDataset(stored, processor, shuffle=False, node_cache_bytes=0)
    expected = misses(fresh)
    warm = mmstore.RolloutDataset(stored, processor, shuffle=False, node_cache_bytes=0)
    in_process = mmstore.RolloutLoader(warm, batch_size=4)
    list(in_process)
    list(in_process)  # images seen again in a later epoch stay in this process's cache
    assert len(warm.source.built.cache) > 0
    assert misses(warm) == expected


def test_drop_last_that_would_drop_a_ranks_whole_share_is_refused(stored, processor):
    # 12 samples over 2 ranks: shares of 6; batches of 8 with drop_last train nothing.
    for rank in (0, 1):
        ds = mmstore.RolloutDataset(
            stored,
            processor,
            rank=rank,
            world_size=2,
            materialize=mmstore.Materialize(node_cache_bytes=0),
        )
        with pytest.raises(mmstore.InvalidArgumentError, match="drop_last"):
            mmstore.RolloutLoader(ds, batch_size=8, drop_last=True)
        assert len(mmstore.RolloutLoader(ds, batch_size=6, drop_last=True)) == 1
