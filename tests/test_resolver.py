"""The request-side ref resolver: inputs for good refs, a structured 400 error for bad ones,
and its cache (hit/miss counts, byte-budget LRU eviction, single flight, no cached failures)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore import wire
from mmstore._format.media import content_hash, media_path
from mmstore.integrations.vllm import RefResolver, resolve_wire_refs
from mmstore.synth import photo

SMALL_MAX_PIXELS = 256 * 28 * 28  # as conftest's small_processor


class CountingProxy:
    """Stands in for the adapter's real processor: counts calls; ``gate`` (if set) must turn
    true before the real call runs."""

    def __init__(self, processor):
        self.processor = processor
        self.calls = 0
        self.gate = None
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
        deadline = time.monotonic() + 20
        while self.gate is not None and not self.gate() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.processor(*args, **kwargs)


@pytest.fixture
def images():
    """Three distinct images of one size (equal cache entries), one of another size."""
    return [photo(1, 84, 56), photo(2, 84, 56), photo(3, 84, 56), photo(4, 56, 112)]


@pytest.fixture
def refs(store, adapter, images):
    media = [store.put_image(image) for image in images]
    _, out = adapter.expand([adapter.image_token_id] * len(media), media)
    return out


def ok(result):
    assert "error" not in result, result
    return result


def refused(result, index, reason):
    assert result["error"] == "invalid_mm_image_ref", result
    assert (result["index"], result["reason"]) == (index, reason), result
    assert isinstance(result["detail"], str) and result["detail"]
    assert set(result) == {"error", "index", "reason", "detail"}


def test_resolves_refs_to_processor_inputs(store, small_processor, adapter, images, refs):
    chosen = [refs[3], refs[0]]
    result = ok(resolve_wire_refs(store, [wire.encode(r) for r in chosen], small_processor))

    direct = adapter.process([images[3], images[0]])
    assert result["pixel_values"].dtype == np.float32
    assert np.array_equal(result["pixel_values"], direct["pixel_values"])
    assert result["image_grid_thw"].dtype == np.int64
    assert result["image_grid_thw"].tolist() == [
        list(adapter.grid(r.width, r.height)) for r in chosen
    ]
    assert result["hashes"] == [r.hash for r in chosen]


def test_no_refs_is_empty_inputs(store, small_processor):
    result = ok(resolve_wire_refs(store, [], small_processor))
    assert result["pixel_values"].shape == (0, 3 * 2 * 14 * 14)
    assert result["image_grid_thw"].shape == (0, 3)
    assert result["hashes"] == []


def _forge(store, ref, case):
    """A wire ref that fails in one way; written media is set up here where needed."""
    if case == "forged_hash":
        return wire.encode(ref.model_copy(update={"hash": "f" * 32}))
    if case == "fingerprint":
        return wire.encode(ref.model_copy(update={"layout_fingerprint": "0123456789abcdef"}))
    if case == "family":
        return wire.encode(ref.model_copy(update={"family": "llava"}))
    if case == "span_length":
        return wire.encode(ref.model_copy(update={"length": ref.length + 4}))
    if case == "size":
        # A size the layout maps to the same span, but not the image's own.
        lie = ref.model_copy(update={"width": ref.width + 1})
        assert (
            mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS)).num_tokens(
                lie.width, lie.height
            )
            == ref.length
        )
        return wire.encode(lie)
    if case == "untrusted_file":
        return wire.encode(ref.model_copy(update={"uri": "file:///etc/hosts"}))
    if case == "dotdot":
        return wire.encode(ref.model_copy(update={"uri": "media/../mmstore.json"}))
    if case == "missing":
        os.remove(store.backend.abspath(ref.uri))
        return wire.encode(ref)
    if case == "undecodable":
        garbage = b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8
        digest = content_hash(garbage)
        uri = media_path(digest, "png")
        os.makedirs(os.path.dirname(store.backend.abspath(uri)), exist_ok=True)
        with open(store.backend.abspath(uri), "wb") as f:
            f.write(garbage)
        return wire.encode(ref.model_copy(update={"uri": uri, "hash": digest}))
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("forged_hash", "hash_mismatch"),
        ("fingerprint", "fingerprint_mismatch"),
        ("family", "family_mismatch"),
        ("span_length", "span_length_mismatch"),
        ("size", "size_mismatch"),
        ("untrusted_file", "untrusted_uri"),
        ("dotdot", "untrusted_uri"),
        ("missing", "media_not_found"),
        ("undecodable", "undecodable_image"),
    ],
)
def test_bad_ref_is_a_structured_error_at_its_index(store, small_processor, refs, case, reason):
    good = wire.encode(refs[0])
    bad = _forge(store, refs[1], case)
    refused(resolve_wire_refs(store, [good, bad, good], small_processor), 1, reason)
    refused(resolve_wire_refs(store, [bad], small_processor), 0, reason)


@pytest.mark.parametrize(
    "text", ["mmraw:{", "not a ref", 42, None, "mmraw:{}", "mmraw:[1]", "mmraw:" + "x" * 9000]
)
def test_malformed_wire_text(store, small_processor, refs, text):
    result = resolve_wire_refs(store, [wire.encode(refs[0]), text], small_processor)
    refused(result, 1, "malformed_ref")


@pytest.mark.parametrize("payload", ["mmraw:{}", None, {"refs": []}, 7])
def test_malformed_request(store, small_processor, payload):
    refused(resolve_wire_refs(store, payload, small_processor), None, "malformed_request")


def test_too_many_refs(store, small_processor, refs):
    resolver = RefResolver(store, small_processor, max_refs=2)
    refused(resolver.resolve([wire.encode(refs[0])] * 3), None, "too_many_refs")


def test_cache_hits_and_misses(store, small_processor, refs):
    resolver = RefResolver(store, small_processor)
    a, b = wire.encode(refs[0]), wire.encode(refs[1])
    first = ok(resolver.resolve([a, a, b]))
    assert resolver.stats()["misses"] == 2 and resolver.stats()["hits"] == 1
    second = ok(resolver.resolve([b, a]))
    assert resolver.stats()["misses"] == 2 and resolver.stats()["hits"] == 3
    half = len(first["pixel_values"]) // 3
    assert np.array_equal(second["pixel_values"][:half], first["pixel_values"][2 * half :])


def test_cache_hit_still_checks_trust_and_claims(store, small_processor, refs):
    resolver = RefResolver(store, small_processor)
    ok(resolver.resolve([wire.encode(refs[1])]))
    refused(resolver.resolve([_forge(store, refs[1], "untrusted_file")]), 0, "untrusted_uri")
    refused(resolver.resolve([_forge(store, refs[1], "size")]), 0, "size_mismatch")
    assert resolver.stats()["misses"] == 1


def test_byte_budget_evicts_least_recently_used(store, small_processor, refs):
    a, b, c = (wire.encode(r) for r in refs[:3])
    first = ok(resolve_wire_refs(store, [a], small_processor))
    entry = first["pixel_values"].nbytes + first["image_grid_thw"].nbytes
    resolver = RefResolver(store, small_processor, cache_bytes=2 * entry + entry // 2)

    for request in ([a], [b], [a], [c]):  # c evicts b: a was used after b
        ok(resolver.resolve(request))
    stats = resolver.stats()
    assert (stats["misses"], stats["hits"]) == (3, 1)
    assert stats["entries"] == 2 and stats["nbytes"] == 2 * entry <= stats["max_bytes"]

    ok(resolver.resolve([a]))
    assert resolver.stats()["hits"] == 2
    ok(resolver.resolve([b]))
    assert resolver.stats()["misses"] == 4


def test_entry_larger_than_the_budget_is_served_not_kept(store, small_processor, refs):
    resolver = RefResolver(store, small_processor, cache_bytes=1024)
    for _ in range(2):
        assert ok(resolver.resolve([wire.encode(refs[0])]))["pixel_values"].nbytes > 1024
    assert resolver.stats()["misses"] == 2 and resolver.stats()["entries"] == 0


def test_single_flight_under_threads(store, small_processor, refs):
    resolver = RefResolver(store, small_processor)
    processor = resolver.adapter.image_processor = CountingProxy(small_processor)
    threads = 8
    # The first caller holds the processor until every other thread waits on its result.
    processor.gate = lambda: resolver.stats()["coalesced"] >= threads - 1
    start = threading.Barrier(threads)
    results: list[dict] = [{}] * threads
    text = wire.encode(refs[2])

    def ask(slot: int) -> None:
        start.wait()
        results[slot] = resolver.resolve([text])

    workers = [threading.Thread(target=ask, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)

    assert processor.calls == 1
    stats = resolver.stats()
    assert (stats["misses"], stats["coalesced"], stats["hits"]) == (1, threads - 1, 0)
    for result in results:
        assert np.array_equal(ok(result)["pixel_values"], results[0]["pixel_values"])


def test_failures_are_not_cached(store, small_processor, images, refs):
    resolver = RefResolver(store, small_processor)
    text = wire.encode(refs[0])
    os.remove(store.backend.abspath(refs[0].uri))
    refused(resolver.resolve([text]), 0, "media_not_found")
    refused(resolver.resolve([text]), 0, "media_not_found")

    assert store.put_image(images[0]).hash == refs[0].hash  # the same bytes come back
    ok(resolver.resolve([text]))
    stats = resolver.stats()
    assert (stats["misses"], stats["entries"]) == (3, 1)


def test_unexpected_failure_is_answered_not_raised(store, small_processor, refs, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("GPU fell off")

    resolver = RefResolver(store, small_processor)
    resolver.adapter.image_processor = broken
    result = resolver.resolve([wire.encode(refs[0])])
    refused(result, 0, "internal_error")
    assert "GPU fell off" in result["detail"]
    assert "failed unexpectedly" in caplog.text


@pytest.mark.slow
def test_request_over_the_pixel_budget_is_refused_before_any_decode(store, qwen2_processor):
    # 64 refs to one 1080p screenshot: 16 KB of text asking for ~3 GB of float32 pixels.
    media = store.put_image(photo(5, 1920, 1080))
    adapter = mmstore.adapter_for(qwen2_processor)
    _, refs = adapter.expand([adapter.image_token_id], [media])
    resolver = RefResolver(store, qwen2_processor)
    resolver.adapter.image_processor = CountingProxy(resolver.adapter.image_processor)
    result = resolver.resolve([wire.encode(refs[0])] * 64)
    refused(result, result["index"], "request_too_large")
    assert resolver.adapter.image_processor.calls == 0
    assert resolver.stats()["misses"] == 0
    small = RefResolver(store, qwen2_processor, max_request_bytes=2**20)
    refused(small.resolve([wire.encode(refs[0])]), 0, "request_too_large")
    ok(resolver.resolve([wire.encode(refs[0])] * 2))


def test_a_ref_above_the_pixel_limit_is_refused_unread(store, small_processor, refs):
    huge = refs[0].model_copy(update={"width": 100_000, "height": 100_000})
    result = RefResolver(store, small_processor).resolve([wire.encode(huge)])
    refused(result, 0, "image_too_large")


def test_memory_error_never_escapes_resolve(store, small_processor, refs, monkeypatch):
    def exhausted(*args, **kwargs):
        raise MemoryError

    resolver = RefResolver(store, small_processor)
    monkeypatch.setattr("mmstore._loading.stack.batch_images", exhausted)
    refused(resolver.resolve([wire.encode(refs[0])]), None, "out_of_memory")
    resolver = RefResolver(store, small_processor)
    resolver.adapter.image_processor = exhausted
    refused(resolver.resolve([wire.encode(refs[0])]), 0, "out_of_memory")
