"""Every error mmstore raises, in one tree: ``mmstore.errors`` (each public one is also a
top-level name, ``mmstore.NoMatchError``, and prints as one).

::

    MmstoreError
    ├── InvalidRolloutError        (ValueError)      a row breaks an invariant; names sample + image
    │   ├── SampleTooLongError                       longer than the packed loader's max_tokens
    │   └── UnknownLayoutError                       a fingerprint no footer or family can lay out
    ├── LayoutMismatchError        (ValueError)      processor layout != stored layout / span
    ├── SchemaVersionError         (ValueError)      unknown store format or row schema version
    │   └── UpgradeRequiredError                     a format-1 store: run `mmstore upgrade ROOT`
    ├── WireFormatError            (ValueError)      a malformed wire-form image or video ref
    ├── UnsupportedProcessorError  (TypeError)       no family adapter for this image processor
    ├── ImageSizeError             (ValueError)      a size the family's layout cannot represent
    ├── NotAStoreError             (FileNotFoundError) opened a directory that holds no manifest
    ├── UntrustedURIError          (PermissionError) a URI outside the store and trusted roots
    ├── InvalidArgumentError       (ValueError)      a malformed or out-of-range argument
    ├── CorruptFileError           (ValueError)      a committed rollout or pin file that won't read
    ├── NoMatchError               (LookupError)     nothing matches a selection, id or name
    │   ├── RunNotFoundError                         a run the table version has never held
    │   └── StepNotCommittedError                    a known run's step not committed (yet)
    ├── DestinationExistsError     (FileExistsError) an export into a location holding data
    ├── DeleteFailedError          (OSError)         files a release could not delete
    ├── TableError                                   the rollouts table (its Delta log) refused
    │   ├── TableNotFoundError     (FileNotFoundError) no Delta log under the store's rollouts/
    │   ├── TableVersionError      (LookupError)     a version the table does not have (any more)
    │   ├── TableConflictError     (RuntimeError)    a commit that kept losing to other commits
    │   ├── ProducerConflictError  (ValueError)      a (producer, run, seq) used for other rows
    │   ├── TableForkError         (RuntimeError)    delta-rs called in a forked child
    │   └── VersionMismatchError   (RuntimeError)    ranks (or a state) name other versions
    ├── PinnedRowsError            (RuntimeError)    a release of rows a pin holds
    ├── LiveTimeoutError           (TimeoutError)    a live step not complete in time
    ├── LiveFinishedError          (EOFError)        every followed run finished and consumed
    ├── WorkerDiedError            (RuntimeError)    a loader's worker process died (OOM killer)
    ├── ImageDecodeError           (ValueError)      bytes that are not a safe, decodable image
    │   ├── DecompressionBombError                   more pixels than the configured limit
    │   └── VideoDecodeError                         a clip that is not a safe, decodable video
    │       └── VideoBombError                       (also a DecompressionBombError) too big a clip
    ├── MediaError                                   media bytes cannot be served as requested
    │   ├── MediaNotFoundError     (FileNotFoundError)
    │   ├── HashMismatchError      (ValueError)
    │   └── MediaPermissionError   (PermissionError) media this process may not read (EACCES)
    └── NetworkError               (ConnectionError) storage unreachable or too slow; retryable

Each error carries the context it was raised in (file, run, sample, image index) both in
its message and as attributes, so a caller can act on it without parsing text. A caller that
meets an error adds where it met it with :meth:`MmstoreError.with_context`, the one way an
error gains context.
"""

from __future__ import annotations

from typing import Any, TypeVar

E = TypeVar("E", bound="MmstoreError")


class MmstoreError(Exception):
    """Base of every mmstore error. ``context`` holds where it happened."""

    __module__ = "mmstore"  # its subclasses get theirs from __init_subclass__

    #: True where the same call may succeed if tried again (:class:`NetworkError`): the data
    #: is fine, the way to it failed. A caller's retry loop reads this, not the message.
    retryable = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__()
        self._describe(message, context)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Tracebacks name a class by its module: show the public `mmstore.NoMatchError`, not
        # `mmstore.errors.NoMatchError`. Pickle finds it there too (mmstore exports every
        # error; tests/test_exceptions.py checks). Only this module's classes: a user's own
        # subclass keeps its module.
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__:
            cls.__module__ = "mmstore"

    def _describe(self, message: str, context: dict[str, Any]) -> None:
        self.message = message
        self.context = {k: v for k, v in context.items() if v is not None}
        where = ", ".join(f"{k}={v!r}" for k, v in self.context.items())
        self.args = (f"{message} ({where})" if where else message,)

    def with_context(self: E, **where: Any) -> E:
        """A copy of this error with ``where`` added to its context (and message).

        The same class and every attribute of this one (a subclass's own too); its context
        keeps its order, and a key it already holds keeps its value: the raise site saw the
        fault first hand, a caller only adds where it met the error. None values are dropped.
        """
        added = {k: v for k, v in where.items() if k not in self.context}
        err = type(self).__new__(type(self))
        err.__dict__.update(self.__dict__)
        err._describe(self.message, {**self.context, **added})
        return err

    def __getattr__(self, name: str) -> Any:
        # Context keys read as attributes: err.sample_id, err.image_index, err.uri ...
        context = self.__dict__.get("context", {})
        if name in context:
            return context[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross DataLoader worker boundaries by pickling; keep their context.
        return (_rebuild, (type(self), self.message, self.context))


def _rebuild(cls: type[MmstoreError], message: str, context: dict[str, Any]) -> MmstoreError:
    return cls(message, **context)


class InvalidRolloutError(MmstoreError, ValueError):
    """A rollout row breaks an invariant and was not committed."""


class LayoutMismatchError(MmstoreError, ValueError):
    """The processor's token layout disagrees with what the store recorded."""


class SchemaVersionError(MmstoreError, ValueError):
    """A store manifest or Parquet file of a version this mmstore does not read."""


class UpgradeRequiredError(SchemaVersionError):
    """A store of format 1 (rollouts as a directory of files, no commit log): run
    ``mmstore upgrade ROOT`` (or ``mmstore.upgrade(root)``) once, in place."""


class WireFormatError(MmstoreError, ValueError):
    """A wire-form media ref that does not decode to a valid ImageRef (``mmraw:``) or
    VideoRef (``mmvid:``)."""


class UnsupportedProcessorError(MmstoreError, TypeError):
    """No family adapter knows this image processor."""


class ImageSizeError(MmstoreError, ValueError):
    """An image size the family's layout cannot represent (e.g. aspect ratio above 200)."""


class NotAStoreError(MmstoreError, FileNotFoundError):
    """The location exists (or not) but holds no mmstore manifest."""


class UntrustedURIError(MmstoreError, PermissionError):
    """A media URI that resolves outside the store and every trusted root."""


class InvalidArgumentError(MmstoreError, ValueError):
    """A caller's argument is malformed or out of range (pin name, grace, selection, state)."""


class CorruptFileError(MmstoreError, ValueError):
    """A committed rollout or pin file that cannot be read."""


class NoMatchError(MmstoreError, LookupError):
    """Nothing in the store matches a selection, sample id or pin name."""


class RunNotFoundError(NoMatchError):
    """A selection names a run the table version holds no rows of (a typo, or a run not
    started yet): ``err.missing_runs`` are those runs; the message names the runs there are.
    A consumer polling for new steps should stop here rather than wait."""


class StepNotCommittedError(NoMatchError):
    """A selection names steps of runs the table version holds, but none of those steps is
    committed (not written yet, or released): polling again later may find them."""


class DestinationExistsError(MmstoreError, FileExistsError):
    """An export destination that already holds a store or other files."""


class DeleteFailedError(MmstoreError, OSError):
    """Files that could not be deleted (permissions, immutable, busy); they stay committed."""


class ImageDecodeError(MmstoreError, ValueError):
    """Media bytes that Pillow cannot decode safely."""


class DecompressionBombError(ImageDecodeError):
    """An image whose pixel count exceeds the configured limit."""


class VideoDecodeError(ImageDecodeError):
    """Video bytes that are not a safe, decodable clip of an accepted container and codec."""


class VideoBombError(VideoDecodeError, DecompressionBombError):
    """A clip with more pixels per frame, or more frames, than the configured limit."""


class MediaError(MmstoreError):
    """Media bytes that cannot be served as requested."""


class MediaNotFoundError(MediaError, FileNotFoundError):
    """A referenced media file does not exist."""


class HashMismatchError(MediaError, ValueError):
    """Media bytes whose content hash differs from the one referenced."""


class SampleTooLongError(InvalidRolloutError):
    """A sample longer than the packed loader's ``max_tokens`` (refused when planning)."""


class UnknownLayoutError(InvalidRolloutError):
    """A fingerprint that neither the file's footer nor this process can lay out: its spans
    cannot be checked without the processor."""


class TableError(MmstoreError):
    """The rollouts table (``rollouts/``, a Delta Lake table) refused an operation; the
    context names the table (``table``) and, where one is concerned, the ``version``."""


class TableNotFoundError(TableError, FileNotFoundError):
    """No Delta log under the store's ``rollouts/`` (a store copied without its ``_``
    folders, a log deleted since the store was opened): refused, never read as empty."""


class TableVersionError(TableError, LookupError):
    """A table version that does not exist, or whose log entries are gone."""


class TableConflictError(TableError, RuntimeError):
    """A commit that kept losing to conflicting concurrent commits; nothing was committed."""


class ProducerConflictError(TableError, ValueError):
    """An exactly-once commit whose ``(producer, run, seq)`` the table already holds for other
    rows (or whose seq lies below the producer's latest in the run and was never committed):
    nothing was committed and nothing dropped. The context names ``producer``, ``run_id``,
    ``seq`` and the ``version`` that holds the pair, if one does."""


class TableForkError(TableError, RuntimeError):
    """delta-rs called in a forked child of a process that already used it (it would panic:
    its runtime does not survive a fork). Plan in the parent; workers read files by path."""


class VersionMismatchError(TableError, RuntimeError):
    """The ranks of a job (or a saved state and the other ranks) name different table
    versions: they would plan different epochs. Raised on every rank, before any batch."""


class PinnedRowsError(MmstoreError, RuntimeError):
    """A release of rows that a pin holds (``pin_rows``): unpin it first, or pass
    ``force=True`` (the pin then keeps its own copy of the rows and their media)."""


class MediaPermissionError(MediaError, PermissionError):
    """Media this process may not read (``EACCES``: file modes, an ACL, a mount's policy);
    names the URI, and the file, run, step, sample and image where the loader met it."""


class NetworkError(MmstoreError, ConnectionError):
    """The storage could not be reached or did not answer in time (a connection refused or
    reset, a timeout, throttling, a 5xx): nothing is known to be wrong with the data, so the
    same read may succeed later (``retryable`` is True). Names what was read: the object's
    ``location``, and the file, run and step, or the URI, sample and image."""

    retryable = True


class LiveTimeoutError(MmstoreError, TimeoutError):
    """A :class:`LiveLoader` step was not complete within its ``timeout``: nothing was
    consumed, and calling ``next_step`` again waits on. Names the runs followed, the step,
    the samples waiting and the samples a step needs."""


class LiveFinishedError(MmstoreError, EOFError):
    """A :class:`LiveLoader` has followed the final commit (``store.writer(final=True)``) of
    every run it follows and consumed every sample: there is no next step."""


class WorkerDiedError(MmstoreError, RuntimeError):
    """A loader's worker process died (killed: the OOM killer's usual victim). The loader
    let its workers go; for a :class:`LiveLoader` the step was not consumed, so calling
    ``next_step`` again starts new workers and yields the step again from its first
    micro-batch (discard what the trainer did with this step's earlier micro-batches)."""


# Internal signals: raised and caught inside mmstore, never met by a user as such.


class NotAFileError(FileNotFoundError):
    """Something other than a regular file (FIFO, device, directory) where a file should be;
    it reads as absent."""


class GroupTooLarge(ValueError):
    """A group holds more samples than a whole step (the caller names it)."""

    def __init__(self, index: int, size: int) -> None:
        super().__init__(f"group {index} of {size} samples exceeds the step")
        self.index = index
        self.size = size


class RefRefused(Exception):
    """One ref failed a check; carries the reason a client sees."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
