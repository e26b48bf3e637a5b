"""Which family serves which processor: a table of names to dotted paths, imported on first use.

Shaped like fsspec's ``registry.py``: importing mmstore imports no family module (and so no
transformers); ``adapter_for`` looks the processor's exact class up, then imports the family.
A third party adds a family with :func:`register_family`.

Exact classes, not subclasses: another model's processor deriving from one of these may
resize differently, and a wrong layout would fail silently.
"""

from __future__ import annotations

import importlib
from typing import Any

from mmstore._exceptions import InvalidArgumentError, UnsupportedProcessorError
from mmstore._families._base import Family, Layout, published_token_ids

_TF = "transformers.models."

# family name -> "module.Class" of its Family
_FAMILIES: dict[str, str] = {
    "qwen-vl": "mmstore._families.qwen_vl.QwenVL",
    "glm4v": "mmstore._families.glm4v.Glm4v",
    "kimi-k25": "mmstore._families.kimi_k25.KimiK25",
    "gemma3": "mmstore._families.gemma3.Gemma3",
    "pixtral": "mmstore._families.pixtral.Pixtral",
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


def adapter_for(processor: Any, *, image_token_id: int | None = None) -> Family:
    """The family adapter for a transformers image processor or full processor.

    A full processor (image processor + tokenizer) supplies the token ids from its tokenizer;
    an image processor alone gets the family's published ids.
    """
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
    register_layout(adapter.layout)  # readers of this process can now redo its layout math
    return adapter


def register_layout(layout: Layout) -> None:
    # The fingerprint leaves token ids out, so two adapters of one layout may differ in them;
    # the registry keeps the family's published ids, never whichever adapter came last. Rows
    # of a custom tokenizer are checked against their own adapter (``writer(adapter=...)``).
    published = published_token_ids(family_class(layout.family))
    _LAYOUTS[layout.fingerprint] = Layout.make(
        layout.family, dict(layout.parameters), {**dict(layout.token_ids), **published}
    )


def known_layouts() -> list[Layout]:
    """Every layout an adapter of this process has registered."""
    return list(_LAYOUTS.values())


def layout_for_fingerprint(fingerprint: str) -> Layout | None:
    """The layout of an adapter built in this process, or None."""
    return _LAYOUTS.get(fingerprint)


_BY_LAYOUT: dict[Layout, Family] = {}


def family_for_layout(layout: Layout) -> Family:
    """A layout-only family instance (layout math without a processor), one per layout."""
    family = _BY_LAYOUT.get(layout)
    if family is None:
        family = _BY_LAYOUT[layout] = family_class(layout.family)(layout)
    return family


def layout_from_record(record: dict[str, Any]) -> Layout:
    """A layout from a footer record (``Layout.params()``); unknown keys are refused."""
    if not isinstance(record, dict) or not isinstance(record.get("family"), str):
        raise InvalidArgumentError(f"layout record without a family: {record!r}")
    cls = family_class(record["family"])
    params = {k: record[k] for k in cls.parameter_names if k in record}
    missing = set(cls.parameter_names) - params.keys()
    if missing:
        raise InvalidArgumentError(f"layout record misses {sorted(missing)}: {record!r}")
    token_ids = published_token_ids(cls)
    for key, value in record.items():
        if key.endswith("_token_id") and isinstance(value, int) and not isinstance(value, bool):
            token_ids[key] = value
    return Layout.make(cls.name, params, token_ids)
