"""ByteLRU: byte-bounded, least recently used first, oversize entries never kept."""

from __future__ import annotations

from mmstore._cache import ByteLRU


def test_evicts_least_recently_used_by_bytes():
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "A", 4)
    lru.put("b", "B", 4)
    assert lru.get("a") == "A"  # a is now the most recent
    lru.put("c", "C", 4)  # 12 > 10: b goes
    assert "b" not in lru and lru.get("a") == "A" and lru.get("c") == "C"
    assert (lru.nbytes, len(lru), lru.hits, lru.misses) == (8, 2, 3, 0)
    assert lru.get("b") is None and lru.misses == 1


def test_an_entry_larger_than_the_capacity_is_not_kept_and_drops_its_old_value():
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "small", 2)
    lru.put("a", "huge", 11)
    assert "a" not in lru and lru.nbytes == 0
    zero: ByteLRU[str] = ByteLRU(0)
    zero.put("x", "X", 1)
    assert len(zero) == 0
