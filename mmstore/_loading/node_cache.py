"""A node-wide cache of processed images, shared by every process of one machine.

A GRPO group's samples share their prompt image, but land in different DataLoader workers
and on different ranks of the node; a per-worker cache processes that image once per worker.
This cache processes it once per node: entries are files in a directory on ``/dev/shm``
(memory, not disk), shared by every process of the user on that machine.

- **The user's own**: the directory is created 0700 and, when it exists, must be a real
  directory (never followed through a symbolic link) that this user owns and nobody else may
  enter; otherwise another local user could plant pixels under a key anyone can compute. A
  directory that fails this turns the cache off with a warning: training goes on, each
  process processing its own images.
- **Checked entries**: an entry carries an xxh3 checksum of its header and payload, so a
  damaged entry (a flipped bit, a torn or foreign file) is never served: it is recomputed and
  replaced. A caller may also check that a whole entry is what it expects (the adapter's
  shapes, the train dtype), and confirm on a hit that what the entry stands for still exists
  (the media file), so that what a loader trains on never depends on what an earlier process
  left on the node.
- **Atomic publish**: an entry is written to a temporary file and renamed into place, so a
  reader sees a whole entry or none; a process killed mid-write leaves only a temporary file,
  never served and swept once its writer is gone. A publish that fails (a full file system)
  is a miss: the computed tensors are served, nothing is raised.
- **Single flight**: computing a missing entry holds a per-entry ``filelock`` (fcntl locks
  the kernel releases when the holder dies), so concurrent requests for one image wait for
  the one computing it instead of computing it again; for at most ``lock_wait`` seconds (the
  holder may be stopped, not dead), after which the waiter processes the image itself.
- **Bounded**: the entries hold at most ``capacity`` bytes, and at most half of what the file
  system has room for (Docker's default ``/dev/shm`` is 64 MB; DataLoader workers need it
  too). A running total of the entries' bytes, shared by the node's processes in a small
  file, makes a publish's bookkeeping O(1); a sweep of the directory runs only when the total
  passes the bound (it then lets the least recently used entries go, by mtime, renewed on
  every hit, down to 7/8 of the bound) or every ``SWEEP_EVERY`` publishes (correcting what a
  killed process left uncounted).
- **Keys** name everything that decides the pixels: the content hash, the layout
  fingerprint, the train dtype and a digest of the whole processor configuration and class
  (two processors of one layout may normalize differently, or be different backends).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import xxhash
from filelock import FileLock, Timeout

# The default bound of a RolloutDataset's node cache, where /dev/shm (or
# $MMSTORE_NODE_CACHE) is usable.
DEFAULT_NODE_CACHE_BYTES = 2 * 2**30
# Temporary files older than this whose writer may have died are swept.
STALE_SECONDS = 600
# How long a request waits for another process computing the same entry: far longer than
# processing one image takes; past it the holder is stopped or stuck, and the image is
# processed here (the lock only saves work; publishing is atomic without it).
LOCK_WAIT_SECONDS = 10.0
# Publishes (node-wide) between sweeps that recount the directory: the running total misses
# what a process killed between its rename and its bookkeeping published.
SWEEP_EVERY = 4096
# A sweep over the bound lets entries go down to this share of it, so the next sweep waits
# for an eighth of the bound of publishes.
LOW_WATER = 7 / 8

# An entry: magic (format and version), xxh3_64 of everything after it, the header's length,
# the header (JSON: name -> [dtype, shape, offset]; padded so the payload starts aligned),
# then the tensors' bytes.
_MAGIC = b"MMSNC\x00\x00\x02"
_PREFIX = struct.Struct("<8sQI")
_CHECKED_FROM = 16  # the checksum covers the entry from the header's length on
_ALIGN = 64
_USAGE = ".usage"  # the running total: bytes of the entries, publishes since the last sweep
_USAGE_FORMAT = struct.Struct("<qq")
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
# madvise(2): fill a mapping's page tables now (Python's mmap module lacks the constant).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

Tensors = dict[str, torch.Tensor]


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


def fits(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Any], floats: torch.dtype
) -> bool:
    """Whether ``tensors`` are what ``expected`` (the family's placeholder for the image: the
    processor's names and shapes, zero pixels, its grids and sizes) describes: the same names
    and shapes, floats in ``floats`` (the train dtype), integer tensors equal."""
    if tensors.keys() != expected.keys():
        return False
    for name, want in expected.items():
        want = np.asarray(want)
        got = tensors[name]
        if tuple(got.shape) != want.shape:
            return False
        if want.dtype.kind == "f":
            if got.dtype != floats:
                return False
            continue
        wanted = torch.from_numpy(want)
        if got.dtype != wanted.dtype or not torch.equal(got, wanted):
            return False
    return True


class NodeCache:
    """Processed-image tensors by key, shared across the processes of one machine."""

    def __init__(
        self, directory: str, capacity: int, *, lock_wait: float = LOCK_WAIT_SECONDS
    ) -> None:
        self.directory = directory
        self.capacity = capacity
        self.lock_wait = lock_wait
        self.hits = 0
        self.misses = 0  # images this process computed
        refused = _claim(directory)
        self.enabled = refused is None
        if refused is not None:
            warnings.warn(
                f"node cache off: {directory!r} {refused}, so it is not this user's own (another "
                "user could plant pixels there); each process processes its images itself. "
                "Remove it, or point MMSTORE_NODE_CACHE / node_cache_dir at a directory of "
                "your own (mode 0700)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.bound = self._room(self._usage_total()) if self.enabled else 0
        self._warned_publish = False

    def key(self, *parts: str) -> str:
        return xxhash.xxh3_128_hexdigest("\0".join(parts).encode())

    def __contains__(self, key: str) -> bool:
        """Whether an entry is published at ``key`` (not checked: a hint, e.g. for read-ahead)."""
        return self.enabled and os.path.isfile(self._path(key))

    def get_or_compute(
        self,
        key: str,
        compute: Callable[[], Mapping[str, torch.Tensor]],
        *,
        publish: bool = True,
        check: Callable[[Tensors], bool] | None = None,
        confirm: Callable[[], None] | None = None,
    ) -> Tensors:
        """The entry at ``key``; on a miss ``compute()`` runs once on this node and publishes.

        ``publish=False`` (an image nobody else is expected to ask for): a published entry
        is still used, but a miss is computed here, without the lock, and not published.
        ``check``: whether a whole entry is what the caller expects (one that is not is
        computed again, and replaced where published). ``confirm``: runs before a hit is
        served and may raise (what the entry stands for is gone: the caller's policy).
        """
        if not self.enabled:
            return self._computed(compute)
        path = self._path(key)
        found = self._read(path, check)
        if found is not None:
            return self._hit(found, confirm)
        if not publish:
            return self._computed(compute)
        return self._single_flight(path, compute, check, confirm)

    def nbytes(self) -> int:
        """Bytes of the published entries (what the bound applies to)."""
        return sum(size for _, size, _ in self._entries()) if self.enabled else 0

    # -- lookups ----------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if not key or key.startswith(".") or os.sep in key or key.endswith(".lock"):
            raise ValueError(f"node cache keys are plain file names, got {key!r}")
        return os.path.join(self.directory, key)

    def _hit(self, found: Tensors, confirm: Callable[[], None] | None) -> Tensors:
        if confirm is not None:
            confirm()
        self.hits += 1
        return found

    def _computed(self, compute: Callable[[], Mapping[str, torch.Tensor]]) -> Tensors:
        self.misses += 1
        return {k: v.contiguous() for k, v in compute().items()}

    def _single_flight(
        self,
        path: str,
        compute: Callable[[], Mapping[str, torch.Tensor]],
        check: Callable[[Tensors], bool] | None,
        confirm: Callable[[], None] | None,
    ) -> Tensors:
        lock = FileLock(path + ".lock", timeout=self.lock_wait)
        try:
            lock.acquire()
        except Timeout:  # the holder is stopped or stuck: process the image here
            return self._publish(path, self._computed(compute))
        except OSError:  # no lock file (a full or read-only file system): a plain miss
            return self._computed(compute)
        try:
            found = self._read(path, check)  # computed by whoever held the lock before us
            if found is None:
                return self._publish(path, self._computed(compute))
        finally:
            lock.release()
            with contextlib.suppress(OSError):
                os.unlink(path + ".lock")  # lock files of published entries are not needed again
        return self._hit(found, confirm)

    def _read(self, path: str, check: Callable[[Tensors], bool] | None) -> Tensors | None:
        """The whole, undamaged entry at ``path`` that passes ``check``; else None (a
        damaged entry is removed)."""
        try:
            data, identity = _map(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            # Empty, or not a plain file (a link: ELOOP): not an entry. Any other error
            # (descriptors exhausted, ...) is a miss that leaves the file alone.
            if isinstance(exc, ValueError) or exc.errno == errno.ELOOP:
                self._discard(path, None)
            return None
        found = _decode(data)
        if found is None:
            self._discard(path, identity)
            return None
        if check is not None and not check(found):
            return None  # whole, but not what this caller expects: recomputed
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return found

    def _discard(self, path: str, identity: os.stat_result | None) -> None:
        """Remove the damaged file (or empty directory) at ``path``, unless it was replaced
        since it was read."""
        try:
            now = os.lstat(path)
            if identity is not None and not os.path.samestat(now, identity):
                return
            (os.rmdir if stat.S_ISDIR(now.st_mode) else os.unlink)(path)
        except OSError:
            return
        if stat.S_ISREG(now.st_mode):
            self._account(-now.st_size, publishes=0)

    # -- publishing ---------------------------------------------------------------------

    def _publish(self, path: str, tensors: Tensors) -> Tensors:
        """Write ``tensors`` as the entry at ``path``, whole or not at all; ``tensors``."""
        prefix, chunks, size = _encode(tensors)
        if size > self.bound:
            self.bound = self._room(self._usage_total())  # room may have come back since
            if size > self.bound:
                return tensors
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(prefix)
                for chunk in chunks:  # straight from the tensors' memory: no copy made here
                    f.write(chunk)
            replaced = _size_of(path)
            os.replace(tmp, path)  # whole or absent: never a torn entry
        except OSError as exc:  # a full file system: this image is a miss, not an error
            _remove(tmp)
            self._publish_failed(exc)
            return tensors
        except BaseException:
            _remove(tmp)
            raise
        self._account(size - replaced, publishes=1, keep=path)
        return tensors

    def _publish_failed(self, exc: OSError) -> None:
        if not self._warned_publish:
            self._warned_publish = True
            warnings.warn(
                f"node cache: an entry could not be written to {self.directory!r} "
                f"({exc.strerror or exc}); such images are processed by each process that "
                "needs them",
                RuntimeWarning,
                stacklevel=5,  # get_or_compute's caller
            )
        with contextlib.suppress(OSError), self._usage() as usage:
            usage.write(self._sweep(None), 0)  # the file system's room has shrunk: bound anew

    # -- the bound ----------------------------------------------------------------------

    def _account(self, delta: int, *, publishes: int, keep: str | None = None) -> None:
        """Add ``delta`` bytes to the node's running total; sweep where it passes the bound,
        or where enough publishes went by that the total may have drifted."""
        with contextlib.suppress(OSError), self._usage() as usage:
            total, since = usage.read()
            total, since = total + delta, since + publishes
            if total < 0 or total > self.bound or since >= SWEEP_EVERY:
                total, since = self._sweep(keep), 0
            usage.write(total, since)

    def _usage_total(self) -> int:
        """The running total as last written (unlocked, nothing created: an estimate)."""
        try:
            fd = os.open(os.path.join(self.directory, _USAGE), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return 0
        try:
            return max(_Usage(fd).read()[0], 0)
        except OSError:
            return 0
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _usage(self) -> Iterator[_Usage]:
        """The running total, locked against the node's other processes while held."""
        fd = os.open(
            os.path.join(self.directory, _USAGE),
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a lock of this open file: a fork shares none
            yield _Usage(fd)
        finally:
            os.close(fd)  # releases the lock

    def _room(self, ours: int) -> int:
        """The bound: ``capacity``, or half of what the file system could hold, if less."""
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return self.capacity
        return min(self.capacity, (fs.f_bavail * fs.f_frsize + ours) // 2)

    def _sweep(self, keep: str | None) -> int:
        """Recount the entries, the bound with them; over it, let the least recently used go
        (not ``keep``, the entry just published). The entries' bytes."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        self.bound = self._room(total)
        if total <= self.bound:
            return total
        for _, size, path in entries:
            if total <= self.bound * LOW_WATER:
                break
            if path == keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                total -= size
        return total

    def _entries(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, path) of each entry; sweeps what dead processes left behind."""
        entries = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-") or entry.name.endswith(".lock"):
                    if now - st.st_mtime > STALE_SECONDS:  # its writer or holder died
                        _remove(entry.path)
                    continue
                if not entry.name.startswith("."):
                    entries.append((st.st_mtime, st.st_size, entry.path))
        return entries


class _Usage:
    """The running total's file: bytes of the entries, publishes since the last sweep. A new
    (empty) file reads as due for a sweep."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self) -> tuple[int, int]:
        data = os.pread(self.fd, _USAGE_FORMAT.size, 0)
        if len(data) < _USAGE_FORMAT.size:
            return 0, SWEEP_EVERY
        total, since = _USAGE_FORMAT.unpack(data)
        return total, since

    def write(self, total: int, since: int) -> None:
        os.pwrite(self.fd, _USAGE_FORMAT.pack(total, since), 0)


def _claim(directory: str) -> str | None:
    """Create ``directory`` (0700), or check that the one there is this user's own: why it is
    not, or None."""
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)  # never through a symbolic link: it exists
        st = os.lstat(directory)
        above = os.stat(parent)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX:
        # Others may rename it away and put theirs in its place.
        return f"lies in {parent!r}, which others may write to and is not sticky"
    return None


def _map(path: str) -> tuple[mmap.mmap, os.stat_result]:
    """The entry's pages, mapped rather than copied: a hit costs no copy of its pixels.

    Copy-on-write (a write to a cached tensor stays in this process, never reaches the
    entry), its page tables filled in one call (``MADV_POPULATE_READ``, Linux 5.14+) rather
    than a fault per page. The mapping outlives an eviction's unlink; entries are never
    rewritten in place (publish renames a whole new file), so what it maps stays whole.
    Only a plain file: never followed through a link, never a FIFO that would block.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a plain file")
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        data.madvise(_MADV_POPULATE_READ)
    return data, st


def _encode(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[memoryview], int]:
    """The entry's prefix (magic, checksum, header), each tensor's bytes as a view of its own
    memory, and the entry's size."""
    header: dict[str, Any] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
        header[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset]
        chunks.append(raw)
        offset += raw.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(_PREFIX.size + len(encoded)) % _ALIGN)  # JSON ignores the padding
    length = len(encoded).to_bytes(4, "little")
    digest = xxhash.xxh3_64(length)
    digest.update(encoded)
    for chunk in chunks:
        digest.update(chunk)
    prefix = _MAGIC + digest.intdigest().to_bytes(8, "little") + length + encoded
    return prefix, chunks, len(prefix) + offset


def _decode(data: mmap.mmap) -> Tensors | None:
    """The tensors of a whole, undamaged entry; None for anything else."""
    if len(data) < _PREFIX.size:
        return None
    magic, digest, length = _PREFIX.unpack_from(data)
    if magic != _MAGIC or _PREFIX.size + length > len(data):
        return None
    view = memoryview(data)
    if xxhash.xxh3_64_intdigest(view[_CHECKED_FROM:]) != digest:
        return None
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + length]))
    except ValueError:
        return None
    return _tensors(header, view[_PREFIX.size + length :])


def _tensors(header: Any, payload: memoryview) -> Tensors | None:
    """The tensors ``header`` lays out over ``payload``, back to back and filling it."""
    if not isinstance(header, dict):
        return None
    out = {}
    offset = 0
    for name, spec in header.items():
        if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in _DTYPES):
            return None
        dtype, shape, start = _DTYPES[spec[0]], spec[1], spec[2]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            return None
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if start != offset or offset + nbytes > len(payload):
            return None
        flat = (
            torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)
            if count
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.view(shape)
        offset += nbytes
    return out if offset == len(payload) else None


def _size_of(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _remove(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
