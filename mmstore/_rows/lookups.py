"""Which family checks a ref: the lookups a reader's row checks (:mod:`.check`) call.

A ref names its layout by fingerprint. The loader holds every ref to its own processor
(:func:`family_checker`, :func:`video_checker`); a reader without a processor (read-back,
export, ``verify``, ``debug``) trusts a layout record in the file's footer only when it
hashes to its key, else one built in this process (:func:`footer_checker`,
:func:`footer_video_checker`), and raises :class:`UnknownLayoutError` for a fingerprint
neither knows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mmstore._families import (
    Family,
    VideoFamily,
    family_for_layout,
    is_video_layout,
    layout_for_fingerprint,
    layout_from_record,
    video_family_for_layout,
)
from mmstore._format.schema import META_LAYOUTS
from mmstore.errors import (
    InvalidRolloutError,
    LayoutMismatchError,
    MmstoreError,
    UnknownLayoutError,
)

FamilyOf = Callable[[str, str], Family]  # (fingerprint, family name) -> Family, or raises
VideoFamilyOf = Callable[[str, str], VideoFamily]  # the same, for video refs


def footer_checker(footer: dict[bytes, bytes] | None) -> tuple[FamilyOf, list[int]]:
    """The family lookup and image token ids of a reader without a processor.

    A ref's family comes from the layout record in the file's footer when that record hashes
    to the ref's fingerprint, else from a layout built in this process
    (``mmstore.adapter_for``); a fingerprint neither knows raises
    :class:`UnknownLayoutError`. Token ids come from the footer's records (the writer's
    tokenizer): a reader without a processor cannot know the trainer's, so the loader checks
    again with its own.
    """
    families = _footer_families(footer)
    token_ids = sorted({t for f in families.values() for t in f.special_token_ids})

    def family_of(fingerprint: str, name: str) -> Family:
        family = families.get(fingerprint)
        if family is None:
            layout = layout_for_fingerprint(fingerprint)
            if layout is None:
                raise UnknownLayoutError(
                    f"layout fingerprint {fingerprint!r} is in neither the file's footer nor "
                    "this process: its spans cannot be checked without the processor"
                )
            family = families[fingerprint] = family_for_layout(layout)
        if family.family != name:
            raise InvalidRolloutError(
                f"ref says family {name!r} but fingerprint {fingerprint!r} is {family.family!r}"
            )
        return family

    return family_of, token_ids


def _footer_families(footer: dict[bytes, bytes] | None) -> dict[str, Family]:
    """Fingerprint -> Family, from the footer's image layout records."""
    return {
        fingerprint: family_for_layout(layout)
        for fingerprint, layout in _footer_layouts(footer).items()
        if not is_video_layout(layout)
    }


def _footer_layouts(footer: dict[bytes, bytes] | None) -> dict[str, Any]:
    """Fingerprint -> Layout, from the footer's layout records that hash to their key."""
    try:
        records = json.loads((footer or {}).get(META_LAYOUTS, b"{}"))
    except ValueError:
        return {}
    if not isinstance(records, dict):
        return {}
    layouts = {}
    for fingerprint, record in records.items():
        try:
            layout = layout_from_record(record)
            hash(layout)  # forged parameter values may be lists or dicts
        except (MmstoreError, TypeError, ValueError):
            continue  # an unknown family or a forged record: not evidence of anything
        if layout.fingerprint == fingerprint:
            layouts[fingerprint] = layout
    return layouts


def process_video_family(fingerprint: str, name: str) -> VideoFamily:
    """A video ref's family from the layouts built in this process (or raise)."""
    layout = layout_for_fingerprint(fingerprint)
    if layout is None or not is_video_layout(layout):
        raise UnknownLayoutError(
            f"video layout fingerprint {fingerprint!r} is in neither the file's footer nor "
            "this process: its spans cannot be checked without the processor"
        )
    return _named(video_family_for_layout(layout), fingerprint, name)


def footer_video_checker(footer: dict[bytes, bytes] | None) -> VideoFamilyOf:
    """The video family lookup of a reader without a processor (as :func:`footer_checker`)."""
    families = {
        fingerprint: video_family_for_layout(layout)
        for fingerprint, layout in _footer_layouts(footer).items()
        if is_video_layout(layout)
    }

    def video_family_of(fingerprint: str, name: str) -> VideoFamily:
        family = families.get(fingerprint)
        if family is None:
            return process_video_family(fingerprint, name)
        return _named(family, fingerprint, name)

    return video_family_of


def video_checker(adapter: Family) -> VideoFamilyOf:
    """The loader's video lookup: every video ref laid out by the loader's video processor."""

    def video_family_of(fingerprint: str, name: str) -> VideoFamily:
        video = adapter.video  # raises for a family or processor without video
        if fingerprint != video.fingerprint:
            raise LayoutMismatchError(
                f"video ref laid out by {fingerprint}, video processor is {video.fingerprint}"
            )
        return _named(video, fingerprint, name)

    return video_family_of


def _named(family: VideoFamily, fingerprint: str, name: str) -> VideoFamily:
    if family.family != name:
        raise InvalidRolloutError(
            f"video ref says family {name!r} but fingerprint {fingerprint!r} is {family.family!r}"
        )
    return family


def family_checker(adapter: Family) -> FamilyOf:
    """The loader's lookup: every ref must be laid out by the loader's own processor."""

    def family_of(fingerprint: str, family: str) -> Family:
        if fingerprint != adapter.fingerprint:
            raise LayoutMismatchError(
                f"ref laid out by {fingerprint}, processor is {adapter.fingerprint}"
            )
        if family != adapter.family:
            raise InvalidRolloutError(
                f"ref says family {family!r} but fingerprint {fingerprint!r} is {adapter.family!r}"
            )
        return adapter

    return family_of
