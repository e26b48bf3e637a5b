"""A byte-bounded LRU: processed pixels keyed by (content hash, layout fingerprint)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Least-recently-used entries go first once the byte total exceeds ``capacity``.

    An entry larger than the whole capacity is not kept. Not thread-safe by itself: each
    DataLoader worker owns one.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> V | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        if key in self._items:
            self.nbytes -= self._items.pop(key)[1]
        if nbytes > self.capacity:
            return
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.capacity:
            _, (_, size) = self._items.popitem(last=False)
            self.nbytes -= size
