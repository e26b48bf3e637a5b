"""Concurrent media reads for the samples a loader worker is about to materialize.

On object storage each image read is one request; read one after another inside a worker,
every image costs a full round trip in series. The dataset feeds a :class:`Prefetcher` the
refs of the rows it is about to materialize; a small thread pool reads and hash-verifies
their bytes ahead (pyarrow's S3 filesystem releases the GIL), and the materializer takes
them through :meth:`Prefetcher.open_image`, which has :meth:`Store.open_image`'s signature.

Bounds: at most ``max_requests`` reads in flight, and no new read starts while the bytes
read but not yet taken reach ``max_bytes`` (so at most ``max_bytes`` plus ``max_requests``
images are held). A read's error (missing, hash mismatch, untrusted URI) is kept and raised,
typed as the store raised it, when the materializer takes that image, so it names the sample
and image index exactly as a blocking read would. Local stores get no prefetcher.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa

from mmstore._format.media import decode_rgb
from mmstore._rows.store import Store
from mmstore._storage.backends import LocalBackend
from mmstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_PREFETCH_REQUESTS = 16
DEFAULT_PREFETCH_BYTES = 64 * 2**20

Key = tuple[str, str]  # (uri, hash)


class Prefetcher:
    """Reads ahead the media of upcoming rows, bounded in requests and bytes."""

    def __init__(
        self,
        store: Store,
        max_requests: int = DEFAULT_PREFETCH_REQUESTS,
        max_bytes: int = DEFAULT_PREFETCH_BYTES,
    ) -> None:
        if max_requests < 1 or max_bytes < 1:
            raise InvalidArgumentError(
                "prefetch needs max_requests >= 1 and max_bytes >= 1",
                max_requests=max_requests,
                max_bytes=max_bytes,
            )
        self.store = store
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._queued: OrderedDict[Key, None] = OrderedDict()
        self._started: dict[Key, Future[bytes]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self.peak_held_bytes = 0  # the most bytes read ahead and not yet taken (for tests)

    def feed(self, refs: Iterable[Key]) -> None:
        """Queue these (uri, hash) reads, in the order they will be taken."""
        for key in refs:
            if key not in self._started:
                self._queued[key] = None
        self._pump()

    def feed_rows(self, rows: pa.Table, skip: Callable[[str], bool] | None = None) -> None:
        """Queue the media of ``rows`` (an ``images`` column), but hashes ``skip`` says."""
        refs = rows.column("images").combine_chunks().flatten()
        uris, hashes = refs.field("uri").to_pylist(), refs.field("hash").to_pylist()
        self.feed(
            (u, h)
            for u, h in zip(uris, hashes, strict=True)
            if isinstance(u, str) and isinstance(h, str) and not (skip and skip(h))
        )

    def read_media(self, uri: str, expected_hash: str) -> bytes:
        """The verified bytes: read ahead if they were fed, else read now."""
        self._after_fork()
        future = self._started.pop((uri, expected_hash), None)
        self._queued.pop((uri, expected_hash), None)
        if future is None:
            return self.store.read_media(uri, expected_hash)
        try:
            return future.result()  # re-raises the read's own typed error
        finally:
            self._pump()

    def open_image(self, uri: str, expected_hash: str) -> Image.Image:
        """The verified, decoded image (:meth:`Store.open_image`), read ahead if fed."""
        data = self.read_media(uri, expected_hash)
        return decode_rgb(data, max_pixels=self.store.max_image_pixels, where=uri)

    def clear(self) -> None:
        """Drop everything not taken (the rows it was fed for are done)."""
        self._queued.clear()
        for future in self._started.values():
            future.cancel()
        self._started.clear()

    def close(self) -> None:
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def held_bytes(self) -> int:
        """Bytes read ahead and not yet taken."""
        return sum(
            len(f.result()) for f in self._started.values() if f.done() and not f.exception()
        )

    def _pump(self) -> None:
        # Runs on the consumer's thread only (feed / take), so the bookkeeping needs no lock.
        self._after_fork()
        in_flight = sum(not f.done() for f in self._started.values())
        held = self.held_bytes()
        self.peak_held_bytes = max(self.peak_held_bytes, held)
        while self._queued and in_flight < self.max_requests and held < self.max_bytes:
            key, _ = self._queued.popitem(last=False)
            self._started[key] = self._executor().submit(self.store.read_media, *key)
            in_flight += 1

    def _after_fork(self) -> None:
        # A forked DataLoader worker inherits the pool without its threads: reads submitted
        # there would never run. Start afresh in the child.
        if self._pid != os.getpid():
            self._pid, self._pool = os.getpid(), None
            self._queued.clear()
            self._started.clear()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # built lazily: a worker process makes its own
            self._pool = ThreadPoolExecutor(self.max_requests, thread_name_prefix="mmstore-fetch")
        return self._pool


def prefetcher_for(store: Store, max_requests: int | None, max_bytes: int) -> Prefetcher | None:
    """A prefetcher for remote stores; None for a local one (reads there cost no round trip)
    or when ``max_requests`` is 0. ``None`` picks the default for the store."""
    if max_requests is None:
        max_requests = default_requests(store)
    if max_requests == 0:
        return None
    return Prefetcher(store, max_requests=max_requests, max_bytes=max_bytes)


def default_requests(store: Store) -> int:
    """Reads in flight per worker when none is asked: none on a local store."""
    return 0 if isinstance(store.backend, LocalBackend) else DEFAULT_PREFETCH_REQUESTS
