"""A node-wide cache of processed images, shared by every process of one machine.

A GRPO group's samples share their prompt image, but land in different DataLoader workers
and on different ranks of the node; a per-worker cache processes that image once per worker.
This cache processes it once per node: entries are files in a directory on ``/dev/shm``
(memory, not disk), shared by every process of the user on that machine.

- **Atomic publish**: an entry is written to a temporary file and renamed into place, so a
  reader sees a whole entry or none; a process killed mid-write leaves only a temporary file,
  never served and swept once its writer is gone.
- **Single flight**: computing a missing entry holds a per-entry ``filelock`` (fcntl locks
  the kernel releases when the holder dies), so concurrent requests for one image wait for
  the one computing it instead of computing it again.
- **Bounded**: after each publish the least recently used entries (by mtime, renewed on
  every hit) go until the directory holds at most ``capacity`` bytes.
- **Keys** name everything that decides the pixels: the content hash, the layout
  fingerprint, the train dtype and a digest of the whole processor configuration and class
  (two processors of one layout may normalize differently, or be different backends).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import xxhash
from filelock import FileLock

# The default bound of a RolloutDataset's node cache, where /dev/shm (or
# $MMSTORE_NODE_CACHE) is usable.
DEFAULT_NODE_CACHE_BYTES = 2 * 2**30
# Temporary files older than this whose writer may have died are swept.
STALE_SECONDS = 600
_HEADER = 4  # bytes of the little-endian header length that opens an entry
# madvise(2): fill a mapping's page tables now (Python's mmap module lacks the constant).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def default_directory() -> str | None:
    """``$MMSTORE_NODE_CACHE``, else a per-user folder on ``/dev/shm``; None without one."""
    configured = os.environ.get("MMSTORE_NODE_CACHE")
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return f"/dev/shm/mmstore-cache-{os.getuid()}"
    return None


def processor_digest(image_processor: Any) -> str:
    """A digest of everything about the processor that decides the pixels."""
    cls = type(image_processor)
    try:
        config = image_processor.to_json_string()
    except AttributeError:  # not a transformers processor: its attributes
        config = json.dumps(vars(image_processor), sort_keys=True, default=repr)
    return xxhash.xxh3_64_hexdigest(f"{cls.__module__}.{cls.__qualname__}\n{config}".encode())


class NodeCache:
    """Processed-image tensors by key, shared across the processes of one machine."""

    def __init__(self, directory: str, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self.hits = 0
        self.misses = 0  # images this process computed
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def key(self, *parts: str) -> str:
        return xxhash.xxh3_128_hexdigest("\0".join(parts).encode())

    def get_or_compute(
        self,
        key: str,
        compute: Callable[[], Mapping[str, torch.Tensor]],
        *,
        publish: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The entry at ``key``; on a miss ``compute()`` runs once on this node and publishes.

        ``publish=False`` (an image nobody else is expected to ask for): a published entry
        is still used, but a miss is computed here, without the lock, and not published.
        """
        path = os.path.join(self.directory, key)
        found = self._read(path)
        if found is not None:
            self.hits += 1
            return found
        if not publish:
            self.misses += 1
            return dict(compute())
        with FileLock(path + ".lock"):
            found = self._read(path)  # computed by whoever held the lock before us
            computed = found is None
            if found is None:
                found = {k: v.contiguous() for k, v in compute().items()}
                self._publish(path, found)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".lock")  # lock files of published entries are not needed again
        if computed:
            self.misses += 1
            self._evict()
        else:
            self.hits += 1
        return found

    # -- entries ----------------------------------------------------------------------

    def _read(self, path: str) -> dict[str, torch.Tensor] | None:
        try:
            data = _map(path)
        except (FileNotFoundError, ValueError):  # gone, or empty
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        try:
            return _decode(data)
        except (ValueError, KeyError, RuntimeError, AttributeError, TypeError):  # not ours: drop it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return None

    def _publish(self, path: str, tensors: Mapping[str, torch.Tensor]) -> None:
        header, chunks = _encode(tensors)
        if len(header) + sum(c.nbytes for c in chunks) > self.capacity:
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                for chunk in chunks:  # straight from the tensors' memory: no copy made here
                    f.write(chunk)
            os.replace(tmp, path)  # whole or absent: never a torn entry
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _evict(self) -> None:
        entries = []
        total = 0
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_SECONDS:  # its writer died mid-write
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                    continue
                if entry.name.endswith(".lock"):
                    continue
                entries.append((st.st_mtime, st.st_size, entry.path))
                total += st.st_size
        for _, size, path in sorted(entries):
            if total <= self.capacity:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size

    def nbytes(self) -> int:
        """Bytes of the published entries (what the bound applies to)."""
        with os.scandir(self.directory) as it:
            return sum(
                e.stat().st_size
                for e in it
                if not e.name.startswith(".tmp-") and not e.name.endswith(".lock")
            )


def _map(path: str) -> mmap.mmap:
    """The entry's pages, mapped rather than copied: a hit costs no copy of its pixels.

    Copy-on-write (a write to a cached tensor stays in this process, never reaches the
    entry), its page tables filled in one call (``MADV_POPULATE_READ``, Linux 5.14+) rather
    than a fault per page. The mapping outlives an eviction's unlink; entries are never
    rewritten in place (publish renames a whole new file), so what it maps stays whole.
    """
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    with contextlib.suppress(OSError):
        data.madvise(_MADV_POPULATE_READ)
    return data


def _encode(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """The entry's header, and each tensor's bytes as a view of its own memory."""
    header: dict[str, Any] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().data
        header[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset]
        chunks.append(raw)
        offset += raw.nbytes
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(_HEADER, "little") + encoded, chunks


def _decode(data: mmap.mmap | bytearray) -> dict[str, torch.Tensor]:
    size = int.from_bytes(data[:_HEADER], "little")
    header = json.loads(bytes(data[_HEADER : _HEADER + size]))
    body = memoryview(data)[_HEADER + size :]
    out = {}
    for name, (dtype_name, shape, offset) in header.items():
        dtype = getattr(torch, dtype_name)
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(body):
            raise ValueError("truncated cache entry")
        flat = (
            torch.frombuffer(body, dtype=dtype, count=count, offset=offset)
            if count
            else (torch.empty(0, dtype=dtype))
        )
        out[name] = flat.view(shape)
    return out
