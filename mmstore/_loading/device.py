"""Preprocessing on a device: workers decode, the main process runs the processor there.

With ``RolloutLoader(preprocess_device=...)`` (a torchvision image processor) a DataLoader
worker does everything but the processor: trust check, verified read, decode to a uint8
``(3, H, W)`` tensor, token tensors and masks. Each image travels to the main process as a
:class:`PendingImage` (uint8 through shared memory: half the bytes of bf16 pixels), and
:class:`DevicePreprocessor` runs the real processor on the device there (resize, rescale,
normalize), casts floats to the train dtype, checks each output against its ref's span, and
collates the family's image tensors on the device.

A pending image carries the integer tensors its processed form will have (the grid, from
the family's layout math for the decoded size): packed micro-batches compute position ids
from them in the worker, and the device stage refuses processor output that disagrees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmstore._families import Family, run_processor, takes_tensors
from mmstore._format.media import decode_rgb_tensor
from mmstore._format.models import ImageRef
from mmstore._loading.distinct import INDEX_KEY, ROWS_KEY, distinct, rows
from mmstore._loading.materialize import Materialized, Materializer, check_decoded_size
from mmstore._loading.stack import batch_images
from mmstore.errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    MmstoreError,
)

#: the batch key under which a worker's batch carries its images to the device stage
PENDING_KEY = "_pending_images"


@dataclass(eq=False)
class PendingImage:
    """One decoded image on its way to the device stage.

    Reads like the processed image's integer tensors (``image["image_grid_thw"]``), which is
    all position ids need. Deliberately not a ``Mapping``: DataLoader's ``default_convert``
    rebuilds mappings and would drop the pixels.
    """

    pixels: torch.Tensor  # uint8 (3, H, W), exactly the decoder's pixels
    layout: dict[str, torch.Tensor]  # integer tensors the processor gives this size
    ref: ImageRef
    where: dict[str, Any]  # file, run, step, sample_id, image_index: for errors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.layout[key]

    def pin_memory(self) -> PendingImage:
        # DataLoader(pin_memory=True) calls this: pinned pixels copy to the GPU asynchronously.
        return replace(self, pixels=self.pixels.pin_memory())


class DeferredMaterializer(Materializer):
    """A :class:`Materializer` whose images stop before the processor (worker side).

    Its cache holds decoded images (uint8), within the worker cache's byte budget: a GRPO
    group's image is read and decoded once per worker, its pixels go to shared memory the
    first time a batch carries them and travel by handle after, and the device stage
    processes each distinct image of a batch once (``cache_misses``: images decoded). An
    error the device stage raises for an image several samples show names the first.
    """

    def image(self, ref: ImageRef, where: dict[str, Any], sample: Materialized) -> Any:
        """A :class:`PendingImage`, or the processed zero placeholder of missing media."""
        self.check_ref(ref, where)
        key = self.cache_key(ref)
        pending = self.cache.get(key)
        if pending is None:
            pending = self.guarded(ref, where, sample, lambda: self._decoded(ref, where))
            if pending is None:
                return self._placeholder(ref)
            self.cache.put(key, pending, pending.pixels.numel())
        return pending

    def cache_key(self, ref: ImageRef) -> tuple[Any, ...]:
        return decoded_key(ref)

    def _decoded(self, ref: ImageRef, where: dict[str, Any]) -> PendingImage:
        data = self.media.read_media(ref.uri, ref.hash)
        pixels = decode_rgb_tensor(data, max_pixels=self.store.max_image_pixels, where=ref.uri)
        check_decoded_size(ref, int(pixels.shape[2]), int(pixels.shape[1]))
        # Layout math for that size: what the processor's output will hold.
        layout = self.adapter.integer_tensors(ref.width, ref.height)
        integers = {key: torch.from_numpy(value) for key, value in layout.items()}
        return PendingImage(pixels, integers, ref, where)


def decoded_key(ref: ImageRef) -> tuple[str, int, int, int]:
    """What decides a pending image and its checks: its bytes (verified against the hash) and
    the size and span its ref declares. The device stage checks a decoded image against the
    span of the ref it was decoded for; a ref declaring another size or span for the same
    bytes is decoded, and checked, on its own."""
    return (ref.hash, ref.width, ref.height, ref.length)


def no_images(family: Family, distinct_images: bool) -> dict[str, Any]:
    """The image inputs of a batch or micro-batch without images: None, every model's own "no
    images" (their vision towers cannot run on zero images: Qwen-VL, GLM-4V and Mistral 3 cat
    an empty list, SigLIP and MoonViT reshape an empty batch)."""
    out: dict[str, Any] = dict.fromkeys(family.image_inputs)
    if distinct_images:
        out.update({INDEX_KEY: torch.zeros(0, dtype=torch.int64), ROWS_KEY: {}})
    return out


def collate_images(
    family: Family, images: Sequence[Any], *, distinct_images: bool = False
) -> dict[str, Any]:
    """The batched image tensors (:func:`.stack.batch_images`), unless pending images are
    among them: then every image travels as it is, in order, for the device stage to process
    and collate. No images at all: :func:`no_images` (None, never zero-length tensors), for
    padded batches and packed micro-batches alike.

    ``distinct_images``: each image object once, with ``image_index`` and ``image_rows``
    (:mod:`.distinct`; the device stage adds the rows of the images it processes).
    """
    if not images:
        return no_images(family, distinct_images)
    index = None
    if distinct_images:
        images, index = distinct(images)
    if any(isinstance(image, PendingImage) for image in images):
        out: dict[str, Any] = {PENDING_KEY: list(images)}
    else:
        out = dict(batch_images(family, images))
        if index is not None:
            out[ROWS_KEY] = rows(family.image_inputs, images)
    if index is not None:
        out[INDEX_KEY] = index
    return out


def check_device(device: str | torch.device, family: Family) -> torch.device:
    """The device to preprocess on, refused early if torch or the processor cannot use it."""
    if not takes_tensors(family.image_processor):
        raise InvalidArgumentError(
            f"preprocess_device needs a torchvision image processor; "
            f"{type(family.image_processor).__name__} is not one (build the family's "
            "torchvision backend, e.g. Qwen2VLImageProcessor rather than "
            "Qwen2VLImageProcessorPil)"
        )
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"preprocess_device {device!r} is no torch device: {exc}"
        ) from None
    if found.type == "meta":
        raise InvalidArgumentError("preprocess_device 'meta' holds no data to process")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"preprocess_device {str(found)!r}: CUDA is not available here "
            "(torch.cuda.is_available() is False)"
        )
    try:
        torch.zeros(1, device=found)
    except (RuntimeError, AssertionError) as exc:
        raise InvalidArgumentError(
            f"preprocess_device {str(found)!r} is not usable: {exc}"
        ) from None
    return found


class DevicePreprocessor:
    """The main-process stage: a worker's batch with pending images -> the finished batch."""

    def __init__(self, family: Family, device: torch.device, dtype: torch.dtype) -> None:
        self.family = family
        self.device = device
        self.dtype = dtype

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        pending = batch.pop(PENDING_KEY, None)
        if pending is not None:
            # Each image once: by content, not identity (pin_memory copies each entry).
            done: dict[tuple[str, int, int, int], dict[str, torch.Tensor]] = {}
            images = []
            for entry in pending:
                if not isinstance(entry, PendingImage):  # a placeholder or dummy: moved
                    images.append(self.image(entry))
                    continue
                seen = decoded_key(entry.ref)
                if seen not in done:
                    done[seen] = self.image(entry)
                images.append(done[seen])
            batch.update(batch_images(self.family, images))
            if INDEX_KEY in batch:  # a distinct batch: the rows of what was processed here
                batch[ROWS_KEY] = rows(self.family.image_inputs, images)
        # Batches whose images were all placeholders (or a dummy) came collated: move them too.
        for key in self.family.image_inputs:
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = batch[key].to(self.device)
        return batch

    def image(self, entry: PendingImage | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One image's tensors on the device (a placeholder or dummy: moved as it is)."""
        if not isinstance(entry, PendingImage):
            return {key: value.to(self.device) for key, value in entry.items()}
        try:
            outputs = self.process(entry)
            # The span check on the CPU integers: families read them with numpy.
            self.family.check_output(
                outputs,
                entry.ref,
                sample_id=entry.where.get("sample_id"),
                image_index=entry.where["image_index"],
            )
            self.check_layout(outputs, entry)
        except MmstoreError as exc:
            raise exc.with_context(**entry.where) from None
        return {key: value.to(self.device) for key, value in outputs.items()}

    def process(self, entry: PendingImage) -> dict[str, torch.Tensor]:
        """The processor on the device: floats there in the train dtype, integers on the CPU."""
        pixels = entry.pixels.to(self.device, non_blocking=entry.pixels.is_pinned())
        out = run_processor(
            self.family, [pixels], cast_to=self.dtype, device=self.device, return_tensors="pt"
        )
        tensors: dict[str, torch.Tensor] = {}
        for key in self.family.image_inputs:
            value = torch.as_tensor(out[key])
            if value.is_floating_point():
                tensors[key] = value.to(self.device, self.dtype)
            else:  # the dtype the worker path gives (the layout's): grids are int64
                tensors[key] = value.cpu().to(entry.layout[key].dtype)
        return tensors

    def check_layout(self, outputs: Mapping[str, torch.Tensor], entry: PendingImage) -> None:
        """Refuse integer outputs other than those the worker laid out (its position ids)."""
        for key, expected in entry.layout.items():
            if not torch.equal(outputs[key], expected):
                height, width = entry.pixels.shape[1:]
                raise LayoutMismatchError(
                    f"processor output has {key} {outputs[key].tolist()}, the layout of a "
                    f"{width}x{height} image says {expected.tolist()}",
                    uri=entry.ref.uri,
                )
