"""ByteLRU: byte-bounded, least recently used first, oversize entries never kept.
WindowRetention: an image let go after its window's last use, unless it recurs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mmstore._loading.cache import ByteLRU, WindowRetention


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


def test_an_image_is_let_go_at_its_windows_last_use_and_kept_once_it_recurs():
    keep = WindowRetention()
    keep.begin(["a", "a", "b"])
    assert [keep.used(h) for h in ["a", "a", "b"]] == [False, True, True]
    assert keep.used("c") is False  # not listed by the window: the LRU's business
    keep.begin(["a", "c"])  # a comes back: from now on it stays
    assert [keep.used(h) for h in ["a", "c"]] == [False, True]
    keep.begin(["a"])
    assert keep.used("a") is False


windows = st.lists(st.lists(st.sampled_from("abcdef"), max_size=12), max_size=6)


@given(windows)
def test_retention_drops_each_image_once_per_window_until_it_recurs(windows):
    keep = WindowRetention()
    dropped: set[str] = set()
    recurring: set[str] = set()
    for window in windows:
        recurring |= dropped & set(window)
        keep.begin(window)
        for i, h in enumerate(window):
            last = h not in window[i + 1 :]
            assert keep.used(h) == (last and h not in recurring), (window, i)
            if last and h not in recurring:
                dropped.add(h)


@given(windows)
def test_retention_remembers_a_bounded_number_of_hashes(windows):
    keep = WindowRetention(remembered=2)
    for window in windows:
        keep.begin(window)
        for h in window:
            keep.used(h)
        assert len(keep._dropped) <= 2 and len(keep._recurring) <= 2
