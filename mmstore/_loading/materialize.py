"""Rows -> training samples: verified media reads, decode, the real processor, dtype cast.

Runs inside DataLoader workers. Each worker keeps a byte-bounded cache of processed images
keyed by (hash, fingerprint), so the samples of a worker's batches process a shared image
once. On its miss, the node-wide cache (:mod:`.node_cache`, optional) is asked next: a GRPO
group's image, whose samples land in other workers and on other ranks of the machine, is
processed once per node. Both caches sit behind the URI trust check, which runs on every
image; media bytes are hash-checked whenever they are read, and the cached pixels are keyed
by that hash, so no cache ever serves pixels of other bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from mmstore._families import Family, takes_tensors
from mmstore._format.media import decode_rgb, decode_rgb_tensor
from mmstore._format.models import MAX_CLIP_FRAMES, ImageRef, VideoRef
from mmstore._format.video import clip_mismatch, decode_frames, probe_video
from mmstore._loading.cache import ByteLRU, WindowRetention
from mmstore._loading.node_cache import NodeCache, fits, processor_digest
from mmstore._rows.check import RowWindow, Sample
from mmstore._rows.lookups import family_checker, video_checker
from mmstore._rows.snapshot import Neighbours
from mmstore._rows.store import Store
from mmstore._tensors import cast_floats
from mmstore.errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    MediaNotFoundError,
    MmstoreError,
)

MissingPolicy = Literal["error", "placeholder_zero_loss"]
T = TypeVar("T")
DEFAULT_CACHE_BYTES = 256 * 2**20
_MAX_SHARED = 1 << 16  # shared hashes remembered (32-character strings: a few MiB)

#: A row's sample materialized: int64 ids, its own masks, and per image the family's tensors
#: (floats in the train dtype, each with a leading axis the family's collate concatenates
#: over; a deferred materializer's pending images instead, :mod:`.device`)
Materialized = Sample[torch.Tensor, Any]


def check_missing_policy(missing: str) -> None:
    if missing not in get_args(MissingPolicy):
        raise InvalidArgumentError(
            f"missing must be one of {get_args(MissingPolicy)}, got {missing!r}"
        )


def _tensor(value: Any) -> Any:
    """A column's value as the batch holds it: arrays as tensors (their own copy: the row's
    are views of its window), numbers as tensors, strings as they are."""
    if isinstance(value, str):
        return value
    return torch.from_numpy(np.array(value))


def row_window(store: Store, adapter: Family, max_len: int | None, table: pa.Table) -> RowWindow:
    """The loader's checks over ``table``'s rows (``_file`` naming their file), for
    ``adapter``'s processor: what a worker checks before it builds a sample."""
    return RowWindow(
        table,
        family_checker(adapter),
        max_pixels=store.max_image_pixels,
        max_len=max_len,
        image_token_ids=adapter.special_token_ids,
        video_family_of=video_checker(adapter),
    )


class Materializer:
    """Turns rows (Arrow) into :class:`Sample` s for one adapter and train dtype."""

    def __init__(
        self,
        store: Store,
        adapter: Family,
        *,
        dtype: torch.dtype = torch.bfloat16,
        missing: MissingPolicy = "error",
        max_len: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        node_cache: NodeCache | None = None,
    ) -> None:
        check_missing_policy(missing)
        self.store = store
        self.adapter = adapter
        self.dtype = dtype
        self.missing = missing
        self.max_len = max_len
        # processed tensors by (hash, fingerprint); decoded images in a DeferredMaterializer
        self.cache: ByteLRU[Any] = ByteLRU(cache_bytes)
        self.retention = WindowRetention()  # what the cache lets go once a window is done
        self.media: Any = store  # or a Prefetcher (.prefetch): same read_media, read ahead
        self.node_cache = node_cache
        # Everything besides hash and fingerprint that decides the pixels: the train dtype
        # and the processor's whole configuration and class (backend, normalization).
        self._node_key = (
            (str(dtype), processor_digest(adapter.image_processor)) if node_cache else ()
        )
        # Hashes another process of the node may ask for (:func:`wanted_elsewhere`): the only
        # ones worth publishing to the node cache, at about a tenth of processing them
        # (writing fresh /dev/shm pages), which an image nobody else asks for pays for nothing.
        self._publish: set[str] = set()
        self._video_digest: str | None = None  # of the video processor, once it is needed

    def samples(self, table: pa.Table) -> Iterator[Materialized]:
        """The rows of ``table`` (loader columns, ``_file`` naming their file) as samples,
        each checked first (:mod:`mmstore._rows.check`): a bad row raises when it is reached."""
        window = self.window(table)
        self.retention.begin(window.images.hashes())
        for i in range(window.num_rows):
            row = window.row(i)
            sample = self.checked_sample(row)
            for ref in row.images:
                if self.retention.used(ref.hash):
                    self.cache.pop(self.cache_key(ref))
            yield sample

    def window(self, table: pa.Table) -> RowWindow:
        """The reader's checks over ``table``'s rows, for this loader's processor."""
        return row_window(self.store, self.adapter, self.max_len, table)

    def note_window(
        self,
        table: pa.Table,
        unit_rows: Sequence[int],
        mine: np.ndarray | None = None,
        neighbours: Sequence[Neighbours] | None = None,
    ) -> None:
        """Learn which images of a window (``table``, in file order) to publish on a miss:
        those :func:`wanted_elsewhere` finds."""
        if self.node_cache is None:
            return
        if len(self._publish) > _MAX_SHARED:  # a bound: forget the oldest windows' hashes
            self._publish.clear()
        self._publish |= wanted_elsewhere(table, unit_rows, mine, neighbours)

    def checked_sample(self, row: Sample[np.ndarray, ImageRef]) -> Materialized:
        """A row that passed the reader's checks -> tensors, images materialized."""
        sample: Materialized = Sample(
            sample_id=row.sample_id,
            group_id=row.group_id,
            # copies: the row's arrays are views of its whole window
            input_ids=torch.from_numpy(row.input_ids.astype(np.int64)),
            loss_mask=torch.from_numpy(row.loss_mask.copy()),
            logprobs=None if row.logprobs is None else torch.from_numpy(row.logprobs.copy()),
            prompt_len=row.prompt_len,
            reward=row.reward,
            advantage=row.advantage,
            images=[],
            where=row.where,
            policy_version=row.policy_version,
            columns={name: _tensor(value) for name, value in row.columns.items()},
            token_columns=row.token_columns,
        )
        for index, ref in enumerate(row.images):
            where = {**row.where, "image_index": index}
            sample.images.append(self.image(ref, where, sample))
        for index, video in enumerate(row.videos):
            where = {**row.where, "video_index": index}
            sample.videos.append(self.video(video, where, sample))
        if sample.missing_uris:
            sample.loss_mask.zero_()
        missing = set(sample.missing_uris)
        sample.spans = [
            (ref.offset, ref.length, "" if ref.uri in missing else ref.hash) for ref in row.images
        ] + [(video.offset, video.length, "") for video in row.videos]
        return sample

    def image(
        self, ref: ImageRef, where: dict[str, Any], sample: Materialized
    ) -> dict[str, torch.Tensor]:
        """One image's tensors (floats in the train dtype), from cache or the processor."""
        self.check_ref(ref, where)
        key = self.cache_key(ref)
        outputs = self.cache.get(key)
        hit = outputs is not None
        if outputs is None:
            outputs = self.guarded(ref, where, sample, lambda: self._processed(ref))
            if outputs is None:
                return self._placeholder(ref)
        try:
            # On every hit too (this worker's cache or the node's): the pixels fit this hash,
            # the check ties them to this ref's size and span, which a row may forge around
            # a known hash.
            self.adapter.check_output(
                outputs, ref, sample_id=where.get("sample_id"), image_index=where["image_index"]
            )
        except MmstoreError as exc:
            raise exc.with_context(**where) from None
        if not hit:
            self.cache.put(
                key, outputs, sum(t.numel() * t.element_size() for t in outputs.values())
            )
        return outputs

    def video(
        self, ref: VideoRef, where: dict[str, Any], sample: Materialized
    ) -> dict[str, torch.Tensor]:
        """One video's tensors: the ref's frames decoded (seeking, never the whole clip), the
        real video processor, floats in the train dtype; from this worker's cache when the
        same frames of the same clip were processed (a GRPO group's shared clip)."""
        self.check_trust(ref, where)
        video = self.adapter.video
        key = (video.fingerprint, *ref.clip_key)
        outputs = self.cache.get(key)
        if outputs is None:
            processed = self.guarded(ref, where, sample, lambda: self._processed_video(ref))
            if processed is None:  # missing media under the placeholder policy
                return {**cast_floats(video.placeholder(ref), self.dtype), **video.extras(ref)}
            self._check_video(processed, ref, where)
            # One object per entry, extras included (they follow from the key): a batch's
            # samples of one clip share it, which distinct batches carry once.
            outputs = {**processed, **video.extras(ref)}
            self.cache.put(
                key, outputs, sum(t.numel() * t.element_size() for t in outputs.values())
            )
        else:  # on hits too: the tensors fit this ref's frames, size and span
            self._check_video(outputs, ref, where)
        return outputs

    def _check_video(
        self, outputs: dict[str, torch.Tensor], ref: VideoRef, where: dict[str, Any]
    ) -> None:
        try:
            self.adapter.video.check_output(
                outputs, ref, sample_id=where.get("sample_id"), video_index=where["video_index"]
            )
        except MmstoreError as exc:
            raise exc.with_context(**where) from None

    def _processed_video(self, ref: VideoRef) -> dict[str, torch.Tensor]:
        """The node cache's entry for these frames of ``ref``'s clip, or processed here.

        Always published: a clip costs a hundred times an image, and a group's clip is asked
        for by every rank of the node."""
        if self.node_cache is None:
            return self._process_video(ref)
        video = self.adapter.video
        if self._video_digest is None:
            self._video_digest = processor_digest(video.video_processor)
        key = self.node_cache.key(
            video.fingerprint, repr(ref.clip_key), str(self.dtype), self._video_digest
        )
        return self.node_cache.get_or_compute(
            key,
            lambda: self._process_video(ref),
            check=lambda got: fits(got, video.placeholder(ref), self.dtype),
            confirm=lambda: self._media_exists(ref),
        )

    def _process_video(self, ref: VideoRef) -> dict[str, torch.Tensor]:
        data = self.media.read_media(ref.uri, ref.hash)
        limit = self.store.max_image_pixels
        info = probe_video(data, max_pixels=limit, max_frames=MAX_CLIP_FRAMES, where=ref.uri)
        if (problem := clip_mismatch(info, ref)) is not None:
            raise LayoutMismatchError(problem, uri=ref.uri)
        frames = decode_frames(data, ref.frames, max_pixels=limit, where=ref.uri)
        return self.adapter.video.process(frames, ref, self.dtype)

    def cache_key(self, ref: ImageRef) -> tuple[Any, ...]:
        return (ref.hash, self.adapter.fingerprint)

    def guarded(
        self,
        ref: ImageRef | VideoRef,
        where: dict[str, Any],
        sample: Materialized,
        read: Callable[[], T],
    ) -> T | None:
        """``read()``, ``where`` added to its errors; None for missing media under the
        placeholder policy (the sample marked, its loss masked)."""
        try:
            return read()
        except MediaNotFoundError as exc:
            if self.missing == "error":
                raise exc.with_context(**where) from None
            sample.missing_uris.append(ref.uri)
            return None
        except MmstoreError as exc:
            raise exc.with_context(**where) from None

    def _processed(self, ref: ImageRef) -> dict[str, torch.Tensor]:
        """The node cache's entry for ``ref`` (processed once per node), or processed here."""
        if self.node_cache is None:
            return self._process(ref)
        key = self.node_cache.key(ref.hash, self.adapter.fingerprint, *self._node_key)
        publish = ref.hash in self._publish
        return self.node_cache.get_or_compute(
            key,
            lambda: self._process(ref),
            publish=publish,
            # An entry is served only in the shapes and dtypes this ref's image takes, and only
            # while its media exists: what a loader trains on, and which errors it raises, must
            # not depend on what an earlier process left on the node.
            check=lambda got: fits(
                got, self.adapter.placeholder(ref.width, ref.height), self.dtype
            ),
            confirm=lambda: self._media_exists(ref),
        )

    def _media_exists(self, ref: ImageRef | VideoRef) -> None:
        """Raise what a read would for media that is gone (a stat, not a read)."""
        if self.store.media_stat(ref.uri) is None:
            raise MediaNotFoundError("media file not found", uri=ref.uri)

    def _process(self, ref: ImageRef) -> dict[str, torch.Tensor]:
        """Verified read, decode, the processor, floats cast to the train dtype."""
        data = self.media.read_media(ref.uri, ref.hash)
        # A torchvision processor takes the decoded tensor as is; a PIL one, a PIL image.
        if takes_tensors(self.adapter.image_processor):
            pixels = decode_rgb_tensor(data, max_pixels=self.store.max_image_pixels, where=ref.uri)
            check_decoded_size(ref, int(pixels.shape[2]), int(pixels.shape[1]))
            return self.adapter.process([pixels], self.dtype)
        image = decode_rgb(data, max_pixels=self.store.max_image_pixels, where=ref.uri)
        check_decoded_size(ref, *image.size)
        return self.adapter.process([image], self.dtype)

    def check_ref(self, ref: ImageRef, where: dict[str, Any]) -> None:
        """Refuse a ref laid out for another processor, or at a URI nobody trusts."""
        if ref.layout_fingerprint != self.adapter.fingerprint:
            raise LayoutMismatchError(
                f"ref laid out by {ref.layout_fingerprint}, processor is "
                f"{self.adapter.fingerprint}",
                uri=ref.uri,
                **where,
            )
        self.check_trust(ref, where)

    def check_trust(self, ref: ImageRef | VideoRef, where: dict[str, Any]) -> None:
        """Refuse an untrusted URI, hit or miss: cached pixels must not serve a URI nobody
        trusts (a row may pair a known hash with any URI)."""
        try:
            self.store.resolve(ref.uri)
        except MmstoreError as exc:
            raise exc.with_context(**where) from None

    def _placeholder(self, ref: ImageRef) -> dict[str, torch.Tensor]:
        # Never cached: the file may reappear, and a zero tensor is cheap to rebuild.
        return cast_floats(self.adapter.placeholder(ref.width, ref.height), self.dtype)


def check_decoded_size(ref: ImageRef, width: int, height: int) -> None:
    """Refuse media that decodes (upright: EXIF orientation applied) to another size than its
    ref says, and so its span was laid out for: other pixels than the rollout's."""
    if (width, height) != (ref.width, ref.height):
        raise LayoutMismatchError(
            f"media decodes to a {width}x{height} image (upright), the ref and its span say "
            f"{ref.width}x{ref.height}",
            uri=ref.uri,
        )


def wanted_elsewhere(
    table: pa.Table,
    unit_rows: Sequence[int],
    mine: np.ndarray | None = None,
    neighbours: Sequence[Neighbours] | None = None,
) -> set[str]:
    """The image hashes of one window (``table``: its units' rows in file order, ``unit_rows``
    rows each) that another process of the node may ask for, besides this one:

    - those shown by a row another DataLoader worker builds (``mine``: the rows, by index,
      this worker builds; None where that is unknown: those several rows show);
    - those of a GRPO group at a unit's first or last row: the group may go on in the
      neighbouring unit (row group), which another rank, or a later window, reads. Unless
      that unit's group ids (``neighbours``, per unit: the range of the row group before
      and after, from the footer's statistics; None: unknown) cannot hold the group's.

    A group that is all this worker's, inside one unit, is served by the worker's own cache:
    publishing its image would cost a write to /dev/shm nobody reads back.
    """
    try:
        images = table.column("images").combine_chunks()
        flat = pc.struct_field(pc.list_flatten(images), "hash")
        rows = pc.list_parent_indices(images).to_numpy()
        groups = table.column("group_id").to_pylist()
    except (KeyError, pa.ArrowException):  # a malformed column: RowWindow names it
        return set()
    hashes = flat.to_numpy(zero_copy_only=False)
    elsewhere = np.zeros(table.num_rows, dtype=bool)
    if mine is None:
        counts = pc.value_counts(flat)
        wanted = set(
            pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1)).to_pylist()
        )
    else:
        elsewhere[:] = True
        elsewhere[mine] = False
        wanted = set()
    for unit, start, stop in _unit_bounds(unit_rows):
        around = neighbours[unit] if neighbours is not None else (None, None)
        for (edge, step), beyond in zip(((start, 1), (stop - 1, -1)), around, strict=True):
            group = groups[edge]
            if group is None or (beyond is not None and not beyond[0] <= group <= beyond[1]):
                continue  # no group, or none of its id in the neighbouring row group
            row = edge  # the edge row's block: rows of its group_id, run from the edge
            while start <= row < stop and groups[row] == group:
                elsewhere[row] = True
                row += step
    wanted.update(hashes[elsewhere[rows]].tolist())
    return {h for h in wanted if isinstance(h, str)}


def _unit_bounds(unit_rows: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(unit index, first row, end row) of each unit that has rows."""
    start = 0
    for unit, count in enumerate(unit_rows):
        if count:
            yield unit, start, start + count
        start += count
