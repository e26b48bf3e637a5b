"""Read-ahead of media on object storage (moto_server): same batches, bounded, typed errors."""

from __future__ import annotations

from concurrent import futures

import pytest
import torch

import mmstore
from mmstore._loading.prefetch import Prefetcher
from mmstore.synth import photo
from tests.rows import commit


def _filled(store, adapter, images=6):
    refs = [store.put_image(photo(s, 48 + 8 * s, 40)) for s in range(images)]
    # Rows share images (as a GRPO group does) and hold several each.
    commit(store, adapter, "r1", 0, [[refs[i % images], refs[(i + 1) % images]] for i in range(8)])
    return refs


def _batches(store, processor, **kwargs):
    # No node cache: every image is read (and compared), none served from disk.
    ds = mmstore.RolloutDataset(
        store, processor, seed=3, dtype=torch.float32, node_cache_bytes=0, **kwargs
    )
    return ds, list(mmstore.RolloutLoader(ds, batch_size=3))


def test_prefetch_gives_the_same_batches_on_s3(s3_store, adapter, small_processor):
    _filled(s3_store, adapter)
    plain_ds, plain = _batches(s3_store, small_processor, prefetch_requests=0)
    ahead_ds, ahead = _batches(s3_store, small_processor)  # remote store: prefetch on
    assert plain_ds.source.prefetcher is None
    assert isinstance(ahead_ds.source.prefetcher, Prefetcher)
    assert len(plain) == len(ahead) == 3
    for a, b in zip(plain, ahead, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, torch.Tensor):  # advantage is NaN where none was given
                torch.testing.assert_close(value, b[key], rtol=0, atol=0, equal_nan=True)
            else:
                assert value == b[key], key


def test_a_local_store_reads_without_a_prefetcher(store, adapter, small_processor):
    _filled(store, adapter)
    ds, batches = _batches(store, small_processor)
    assert batches and ds.source.prefetcher is None


def test_read_ahead_stays_within_its_byte_bound(s3_store, adapter):
    refs = _filled(s3_store, adapter, images=8)
    sizes = {r.hash: len(s3_store.read_media(r.uri, r.hash)) for r in refs}
    bound = 2 * max(sizes.values())
    pre = Prefetcher(s3_store, max_requests=2, max_bytes=bound)
    pre.feed((r.uri, r.hash) for r in refs)
    assert len(pre._started) <= 2  # no more requests in flight than allowed
    for r in refs:
        # Let the reads in flight land first: what is then held does not depend on timing.
        futures.wait(list(pre._started.values()))
        image = pre.open_image(r.uri, r.hash)
        assert image.tobytes() == s3_store.open_image(r.uri, r.hash).tobytes()
    # At most max_bytes held, plus the reads in flight when that was reached.
    assert 0 < pre.peak_held_bytes <= bound + 2 * max(sizes.values())
    pre.close()


def test_a_missing_image_is_still_a_typed_error_naming_the_sample(
    s3_store, adapter, small_processor
):
    refs = _filled(s3_store, adapter)
    s3_store.backend.delete(refs[2].uri)
    ds = mmstore.RolloutDataset(s3_store, small_processor, shuffle=False, node_cache_bytes=0)
    with pytest.raises(mmstore.MediaNotFoundError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=3))
    assert isinstance(ds.source.prefetcher, Prefetcher)
    assert info.value.context["uri"] == refs[2].uri
    assert info.value.context["sample_id"] == "r1-0-1"
    assert info.value.context["image_index"] == 1


def test_a_hash_mismatch_read_ahead_is_still_refused(s3_store, adapter):
    refs = _filled(s3_store, adapter)
    pre = Prefetcher(s3_store)
    wrong = refs[1].hash
    pre.feed([(refs[0].uri, wrong)])
    with pytest.raises(mmstore.HashMismatchError):
        pre.open_image(refs[0].uri, wrong)
    pre.close()


def test_prefetch_bounds_must_be_positive(s3_store):
    with pytest.raises(mmstore.InvalidArgumentError):
        Prefetcher(s3_store, max_requests=0)


def test_images_in_the_node_cache_are_not_read_ahead(
    s3_store, adapter, small_processor, tmp_path, monkeypatch
):
    _filled(s3_store, adapter)
    cached = {"node_cache_dir": str(tmp_path / "node"), "node_cache_bytes": 2**26}
    # Rows in file order, in batches of one over two workers: row i holds images i and i+1,
    # rows i and i+1 go to different workers, so each image is published to the node cache.
    ds = mmstore.RolloutDataset(s3_store, small_processor, shuffle=False, **cached)
    first = list(mmstore.RolloutLoader(ds, batch_size=1, num_workers=2))
    reads = []
    real = s3_store.read_media
    monkeypatch.setattr(s3_store, "read_media", lambda *a: reads.append(a) or real(*a))
    again = mmstore.RolloutDataset(s3_store, small_processor, **cached)
    second = list(mmstore.RolloutLoader(again, batch_size=3))
    assert isinstance(again.source.prefetcher, Prefetcher)
    assert sorted(s for b in second for s in b["sample_ids"]) == sorted(
        b["sample_ids"][0] for b in first
    )
    assert sum(b["node_cache_misses"] for b in first) == 6
    assert reads == []  # every image came from the node cache; none was fetched for nothing
