"""A thread-safe, byte-bounded LRU whose misses are computed once however many threads ask.

Storage and eviction are :class:`mmstore._loading.cache.ByteLRU`'s (a ``cachetools.LRUCache``).
Single flight: the first thread to miss a key computes it; threads asking for the same key
meanwhile wait for that result instead of computing it again. A failed computation is handed
to the threads waiting on it and never stored, so the next request retries.

Why not ``cachetools.cached(cache, lock=, condition=)``, which also computes a key once: its
waiters recompute, one after another, when the leader fails or its value is too large to
keep (each failing request would cost N computations, not one), and it counts no coalesced
waits, which the resolver's stats report.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

from mmstore._loading.cache import ByteLRU
from mmstore.errors import InvalidArgumentError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlightLRU(Generic[K, V]):
    """``get(key, compute)``: the cached value, or ``compute()`` run once for all askers."""

    def __init__(self, max_bytes: int, sizeof: Callable[[V], int]) -> None:
        if max_bytes < 0:
            raise InvalidArgumentError(f"max_bytes must be >= 0, got {max_bytes}")
        self._lru: ByteLRU[V] = ByteLRU(max_bytes)
        self._sizeof = sizeof
        self._inflight: dict[K, Future[V]] = {}
        self._lock = threading.Lock()
        self._hits = self._misses = self._coalesced = 0

    def get(self, key: K, compute: Callable[[], V]) -> V:
        with self._lock:
            value = self._lru.get(key)
            if value is not None:
                self._hits += 1
                return value
            pending = self._inflight.get(key)
            if pending is None:
                future: Future[V] = Future()
                self._inflight[key] = future
                self._misses += 1
            else:
                self._coalesced += 1
        if pending is not None:
            return pending.result()  # the leader's value, or its exception re-raised
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._lru.put(key, value, self._sizeof(value))
        future.set_result(value)
        return value

    def stats(self) -> dict[str, int]:
        """``hits`` (served from cache), ``misses`` (computed), ``coalesced`` (waited on
        another thread's computation), ``entries``, ``nbytes``, ``max_bytes``."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "coalesced": self._coalesced,
                "entries": len(self._lru),
                "nbytes": self._lru.nbytes,
                "max_bytes": self._lru.capacity,
            }
