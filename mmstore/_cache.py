"""A byte-bounded LRU: processed pixels keyed by (content hash, layout fingerprint).

Storage and eviction are ``cachetools.LRUCache`` with a size function; this class adds the
hit/miss counters the loader reports per batch and keeps an entry larger than the whole
capacity out instead of raising.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

V = TypeVar("V")


def _entry_bytes(entry: tuple[object, int]) -> int:
    return entry[1]


class ByteLRU(Generic[V]):
    """Least-recently-used entries go first once the byte total exceeds ``capacity``.

    An entry larger than the whole capacity is not kept. Not thread-safe by itself: each
    DataLoader worker owns one (the vLLM resolver wraps it in a lock).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._items: LRUCache[Hashable, tuple[V, int]] = LRUCache(
            maxsize=capacity, getsizeof=_entry_bytes
        )

    @property
    def nbytes(self) -> int:
        return int(self._items.currsize)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> V | None:
        item = self._items.get(key)  # a hit becomes the most recently used
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        if nbytes > self.capacity:
            # cachetools raises "value too large"; a stale smaller entry must not linger.
            self._items.pop(key, None)
            return
        self._items[key] = (value, nbytes)
