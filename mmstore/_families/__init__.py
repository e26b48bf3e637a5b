"""Model families: one small base protocol (:mod:`._base`), one module per family, and a
registry from processor classes to families (:mod:`._registry`)."""

from mmstore._families._base import (
    Collation,
    Family,
    Layout,
    Token,
    expansion_array,
    run_processor,
    takes_tensors,
)
from mmstore._families._layout import OfLayout
from mmstore._families._registry import (
    adapter_for,
    family_class,
    family_for_layout,
    known_families,
    known_layouts,
    layout_for_fingerprint,
    layout_from_record,
    register_family,
    register_layout,
    special_token_ids,
    video_family_class,
    video_family_for_layout,
    video_half,
)
from mmstore._families._video import Clip, VideoFamily, is_video_layout, sampled_fps

__all__ = [
    "Clip",
    "OfLayout",
    "VideoFamily",
    "is_video_layout",
    "sampled_fps",
    "special_token_ids",
    "video_family_class",
    "video_family_for_layout",
    "video_half",
    "Collation",
    "Family",
    "Layout",
    "Token",
    "adapter_for",
    "expansion_array",
    "family_class",
    "family_for_layout",
    "known_families",
    "known_layouts",
    "layout_for_fingerprint",
    "layout_from_record",
    "register_family",
    "register_layout",
    "run_processor",
    "takes_tensors",
]
