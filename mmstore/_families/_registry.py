"""Which family serves which processor: a table of names to dotted paths, imported on first use.

Shaped like fsspec's ``registry.py``: importing mmstore imports no family module (and so no
transformers); ``adapter_for`` looks the processor's exact class up, then imports the family.
A third party adds a family with :func:`register_family`.

Exact classes, not subclasses: another model's processor deriving from one of these may
resize differently, and a wrong layout would fail silently.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

from mmstore._families._base import Family
from mmstore._families._layout import Layout, published_token_ids
from mmstore._families._video import VideoFamily, is_video_layout
from mmstore.errors import InvalidArgumentError, UnsupportedProcessorError

_TF = "transformers.models."

# family name -> "module.Class" of its Family
_FAMILIES: dict[str, str] = {
    "qwen-vl": "mmstore._families.qwen_vl.QwenVL",
    "glm4v": "mmstore._families.glm4v.Glm4v",
    "kimi-k25": "mmstore._families.kimi_k25.KimiK25",
    "gemma3": "mmstore._families.gemma3.Gemma3",
    "pixtral": "mmstore._families.pixtral.Pixtral",
}

# family name -> "module.Class" of its VideoFamily (the families with a video layout)
_VIDEO_FAMILIES: dict[str, str] = {
    # Qwen3-VL too: QwenVLVideo.class_for_processor/class_for_parameters pick Qwen3VLVideo
    "qwen-vl": "mmstore._families.qwen_vl.QwenVLVideo",
    "glm4v": "mmstore._families.glm4v.Glm4vVideo",
    "kimi-k25": "mmstore._families.kimi_k25.KimiK25Video",
}

# image processor class ("module.QualName") -> family name
_PROCESSORS: dict[str, str] = {
    # Qwen2-VL; transformers 5 maps Qwen2.5-VL and Qwen3-VL checkpoints to these same classes.
    _TF + "qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil": "qwen-vl",
    _TF + "qwen2_vl.image_processing_qwen2_vl.Qwen2VLImageProcessor": "qwen-vl",
    # GLM-4.1V; transformers 5 maps GLM-4.5V (glm4v_moe) checkpoints to these same classes.
    _TF + "glm4v.image_processing_pil_glm4v.Glm4vImageProcessorPil": "glm4v",
    _TF + "glm4v.image_processing_glm4v.Glm4vImageProcessor": "glm4v",
    _TF + "kimi_k25.image_processing_kimi_k25.Kimi_K25ImageProcessor": "kimi-k25",
    # Gemma 3: the PIL and the torchvision backend lay images out alike.
    _TF + "gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil": "gemma3",
    _TF + "gemma3.image_processing_gemma3.Gemma3ImageProcessor": "gemma3",
    # Pixtral-12B and Mistral 3 (Mistral-Small-3.1 / 3.2); layout set by PixtralProcessor.
    _TF + "pixtral.image_processing_pil_pixtral.PixtralImageProcessorPil": "pixtral",
    _TF + "pixtral.image_processing_pixtral.PixtralImageProcessor": "pixtral",
}

_LOADED: dict[str, type[Family]] = {}
_LAYOUTS: dict[str, Layout] = {}


def register_family(
    family: type[Family] | str,
    processors: tuple[str | type, ...] = (),
    *,
    name: str | None = None,
    clobber: bool = False,
) -> None:
    """Make a family known: ``family`` is a :class:`Family` subclass or its dotted path.

    ``processors`` are the image processor classes (or their ``module.QualName``) it serves,
    matched exactly. ``name`` is needed with a dotted path (a class carries its own). A name
    or processor that is already registered is refused unless ``clobber`` is set.
    """
    if isinstance(family, str):
        if name is None:
            raise InvalidArgumentError("register_family with a dotted path needs name=")
        path = family
    else:
        if not (isinstance(family, type) and issubclass(family, Family)):
            raise InvalidArgumentError(f"{family!r} is not an mmstore Family subclass")
        name = name or family.name
        path = f"{family.__module__}.{family.__qualname__}"
    keys = [p if isinstance(p, str) else f"{p.__module__}.{p.__qualname__}" for p in processors]
    if not clobber:
        if name in _FAMILIES and _FAMILIES[name] != path:
            raise InvalidArgumentError(f"family {name!r} is already registered ({_FAMILIES[name]})")
        taken = [k for k in keys if _PROCESSORS.get(k, name) != name]
        if taken:
            raise InvalidArgumentError(f"processors already served by another family: {taken}")
    # Accepted: only now does the registry change (a refused call leaves it as it was).
    _FAMILIES[name] = path
    if isinstance(family, str):
        _LOADED.pop(name, None)  # imported on first use
    else:
        _LOADED[name] = family
    _PROCESSORS.update(dict.fromkeys(keys, name))


def known_families() -> list[str]:
    return sorted(_FAMILIES)


def family_class(name: str) -> type[Family]:
    """The Family class registered as ``name``, imported on first use."""
    if name not in _LOADED:
        path = _FAMILIES.get(name)
        if path is None:
            raise UnsupportedProcessorError(
                f"unknown image family {name!r}; known: {known_families()}"
            )
        module, _, attr = path.rpartition(".")
        _LOADED[name] = getattr(importlib.import_module(module), attr)
    return _LOADED[name]


def adapter_for(
    processor: Any,
    *,
    image_token_id: int | None = None,
    video_processor: Any = None,
    model_config: Any = None,
) -> Family:
    """The family adapter for a transformers image processor or full processor.

    A full processor (image processor + tokenizer) supplies the token ids from its tokenizer;
    an image processor alone gets the family's published ids. The adapter's video half
    (:attr:`Family.video`) binds to the full processor's video processor, or to
    ``video_processor`` given beside an image processor. ``model_config``: the model's
    config, for position ids that read it (packing Qwen2.5-VL videos). An adapter is its own
    adapter.
    """
    if isinstance(processor, Family):
        return processor
    image_processor = getattr(processor, "image_processor", processor)
    cls = type(image_processor)
    key = f"{cls.__module__}.{cls.__qualname__}"
    name = _PROCESSORS.get(key)
    if name is None:
        raise UnsupportedProcessorError(
            f"no mmstore family adapter for {key}; supported: "
            + ", ".join(f"{k.rpartition('.')[2]} ({v})" for k, v in sorted(_PROCESSORS.items()))
            + "; a subclass needs its own family (mmstore.register_family)"
        )
    adapter = family_class(name).from_processor(processor, image_token_id=image_token_id)
    if video_processor is not None:
        if processor is not image_processor:
            raise InvalidArgumentError(
                "video_processor= is for an image processor alone; a full processor brings its own"
            )
        processor = SimpleNamespace(
            image_processor=image_processor, video_processor=video_processor
        )
    adapter.video_source = processor  # its video half is bound on first use (Family.video)
    adapter.video_binder = video_adapter_for
    adapter.model_config = model_config
    register_layout(adapter.layout)  # readers of this process can now redo its layout math
    return adapter


def video_half(adapter: Family) -> VideoFamily | None:
    """``adapter.video``, or None where the family or its processor has no video half."""
    try:
        return adapter.video
    except UnsupportedProcessorError:
        return None


def video_family_class(name: str) -> type[VideoFamily]:
    """The :class:`VideoFamily` of family ``name``; a family without one is refused."""
    path = _VIDEO_FAMILIES.get(name)
    if path is None:
        raise UnsupportedProcessorError(
            f"the {name!r} family has no video layout in mmstore (families with video: "
            f"{', '.join(sorted(_VIDEO_FAMILIES))})"
        )
    module, _, attr = path.rpartition(".")
    cls: type[VideoFamily] = getattr(importlib.import_module(module), attr)
    return cls


def video_adapter_for(adapter: Family) -> VideoFamily:
    """The video half of ``adapter``, bound to the video processor of the processor it was
    built from (:attr:`Family.video`)."""
    cls = video_family_class(adapter.family)
    source = adapter.video_source
    if source is None or getattr(source, "video_processor", None) is None:
        raise UnsupportedProcessorError(
            f"{adapter!r} was built without a video processor: pass the full processor "
            "(with its video_processor) to mmstore.adapter_for"
        )
    video = cls.from_processor(source, dict(adapter.layout.token_ids))
    register_layout(video.layout)
    return video


def register_layout(layout: Layout) -> None:
    # The fingerprint leaves token ids out, so two adapters of one layout may differ in them;
    # the registry keeps the family's published ids, never whichever adapter came last. Rows
    # of a custom tokenizer are checked against their own adapter (``writer(adapter=...)``).
    published = published_token_ids(_class_of(layout))
    _LAYOUTS[layout.fingerprint] = Layout.make(
        layout.family, dict(layout.parameters), {**dict(layout.token_ids), **published}
    )


def known_layouts() -> list[Layout]:
    """Every layout an adapter of this process has registered."""
    return list(_LAYOUTS.values())


def layout_for_fingerprint(fingerprint: str) -> Layout | None:
    """The layout of an adapter built in this process, or None."""
    return _LAYOUTS.get(fingerprint)


def _class_of(layout: Layout) -> type[Family] | type[VideoFamily]:
    if is_video_layout(layout):
        return _video_class_of(layout)
    return family_class(layout.family)


def _video_class_of(layout: Layout) -> type[VideoFamily]:
    return video_family_class(layout.family).class_for_parameters(dict(layout.parameters))


_BY_LAYOUT: dict[Layout, Family] = {}
_VIDEO_BY_LAYOUT: dict[Layout, VideoFamily] = {}


def family_for_layout(layout: Layout) -> Family:
    """A layout-only family instance (layout math without a processor), one per layout."""
    if is_video_layout(layout):
        raise InvalidArgumentError(f"a video layout where an image layout belongs: {layout}")
    family = _BY_LAYOUT.get(layout)
    if family is None:
        family = _BY_LAYOUT[layout] = family_class(layout.family)(layout)
    return family


def video_family_for_layout(layout: Layout) -> VideoFamily:
    """A layout-only video family instance, one per video layout."""
    family = _VIDEO_BY_LAYOUT.get(layout)
    if family is None:
        family = _VIDEO_BY_LAYOUT[layout] = _video_class_of(layout)(layout)
    return family


def special_token_ids(layout: Layout) -> frozenset[int]:
    """Tokens only the spans of ``layout``'s media hold (an image or a video layout)."""
    if is_video_layout(layout):
        return video_family_for_layout(layout).special_token_ids
    return family_for_layout(layout).special_token_ids


def layout_from_record(record: dict[str, Any]) -> Layout:
    """A layout from a footer record (``Layout.params()``); unknown keys are refused."""
    if not isinstance(record, dict) or not isinstance(record.get("family"), str):
        raise InvalidArgumentError(f"layout record without a family: {record!r}")
    video = record.get("media") == "video"
    cls: type[Family] | type[VideoFamily] = (
        video_family_class(record["family"]).class_for_parameters(record)
        if video
        else family_class(record["family"])
    )
    params = {k: record[k] for k in cls.parameter_names if k in record}
    missing = set(cls.parameter_names) - params.keys()
    if missing:
        raise InvalidArgumentError(f"layout record misses {sorted(missing)}: {record!r}")
    token_ids = published_token_ids(cls)
    for key, value in record.items():
        if key.endswith("_token_id") and isinstance(value, int) and not isinstance(value, bool):
            token_ids[key] = value
    if video:
        params["media"] = "video"
    return Layout.make(cls.name, params, token_ids)
