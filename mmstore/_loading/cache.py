"""A byte-bounded LRU: processed pixels keyed by (content hash, layout fingerprint), and
the rule that drops an image from it once the window being built is done with it.

Storage and eviction are ``cachetools.LRUCache`` with a size function; this class adds the
hit/miss counters the loader reports per batch and keeps an entry larger than the whole
capacity out instead of raising.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
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

    def pop(self, key: Hashable) -> None:
        self._items.pop(key, None)


class WindowRetention:
    """Which images a worker's cache lets go after their last use in the window it builds.

    Kept until the byte budget was full, every processed image went to fresh memory in a
    pass shorter than that budget (22 1080p images at 256 MiB: a worker's whole share of a
    step, often): its pages faulted in and zeroed, 2807 faults for 11.5 MB of bf16, about
    5 ms here, and the memory of images nobody asks for again held on every worker. An image
    is dropped once the rows of the window (known before they are built) need it no more, so
    the next image reuses its memory. One that recurs in a later window (a start screen
    many tasks share) is kept from then on, by LRU as before: it costs one extra processing.
    """

    def __init__(self, remembered: int = 1 << 16) -> None:
        self.remembered = remembered  # hashes remembered as dropped, and as recurring
        self._left: Counter[str] = Counter()  # uses left in the window being built
        self._dropped: dict[str, None] = {}  # insertion order: the oldest go first
        self._recurring: dict[str, None] = {}

    def begin(self, hashes: Iterable[str]) -> None:
        """A new window whose rows show ``hashes`` (once per use)."""
        self._left = Counter(hashes)
        for digest in self._left:
            if digest in self._dropped:
                _remember(self._recurring, digest, self.remembered)

    def used(self, digest: str) -> bool:
        """Note one use of ``digest``; True when the cache should drop it now (its window's
        last use, and not recurring). False for a hash the window did not list."""
        left = self._left.get(digest)
        if left is None:
            return False
        if left > 1:
            self._left[digest] = left - 1
            return False
        del self._left[digest]
        if digest in self._recurring:
            return False
        _remember(self._dropped, digest, self.remembered)
        return True


def _remember(seen: dict[str, None], digest: str, bound: int) -> None:
    seen.pop(digest, None)
    seen[digest] = None
    if len(seen) > bound:
        del seen[next(iter(seen))]
