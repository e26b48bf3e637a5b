"""Every name the package's docstrings, comments and docs point at exists.

- a dotted ``mmstore.…`` name imports (a module, or an attribute of one), and so does a
  stage's name without the prefix (``_rows.check``, as ARCHITECTURE.md writes them);
- a Sphinx role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:data:``,
  ``:exc:``) in the package resolves from where it is written;
- a repository path (``mmstore/…``, ``tests/….py``, ``_rows/check.py``) is there.

Modules get renamed and merged; a docstring naming the old one sends its reader nowhere.

Role targets follow this package's use: ``.name`` is a sibling in the module's package
(``:mod:`.device``` in ``mmstore/_loading/``), never the module's own import of it; a bare
name is looked up in the classes around it, the module (its own and imported names), its
package, ``mmstore``, then the builtins.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mmstore"
SOURCES = sorted(PACKAGE.rglob("*.py"))
PAGES = [
    *sorted((ROOT / "docs").glob("*.md")),
    *(ROOT / n for n in ("ARCHITECTURE.md", "FORMAT.md")),
]
PAGES.append(ROOT / "README.md")
STAGES = "_families|_format|_lifecycle|_loading|_planning|_rows|_storage"

# A name not preceded by a word, a dot, a slash or a dash (a path, a URL, a file name).
DOTTED = re.compile(rf"(?<![\w./-])(?:mmstore|{STAGES})(?:\.[A-Za-z_]\w*)+")
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`[~!]?([\w.]+)`")
PATH = re.compile(
    rf"(?<![\w./-])(?:(?:mmstore|tests|benchmarks|examples|scripts|docs)/[\w/.-]*\w"
    rf"|(?:{STAGES})/[\w/]*\.py)"
)

# Dotted names that are no Python name: files, footer and commit keys, a pin file's format,
# a JSON schema's name, a logger.
NOT_PYTHON = {
    "mmstore.json",  # the manifest file
    "mmstore.schema_version",  # Parquet footer keys (FORMAT.md)
    "mmstore.run_id",
    "mmstore.step",
    "mmstore.layouts",
    "mmstore.num_tokens",
    "mmstore.final",  # a producer's final commit to its run
    "mmstore.columns",  # a file's declaration of its run's extra columns
    "mmstore.commitId",  # Delta commitInfo keys
    "mmstore.rowsDigest",
    "mmstore.pin",  # a pin file's "format"
    "mmstore.rollout",  # the JSON schema's name
    "mmstore.live",  # the live loader's logger
}
MISSING = object()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(path: Path) -> str:
    return module_name(path) if path.name == "__init__.py" else module_name(path.parent)


def declares(cls: type, attr: str) -> bool:
    """An attribute the class (or a base) annotates or assigns on ``self``."""
    assigned = re.compile(rf"\bself\.{attr}\b\s*(:[^=\n]*)?=[^=]")
    for klass in cls.__mro__:
        if attr in vars(klass).get("__annotations__", {}):
            return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def lookup(name: str) -> Any:
    """The module or attribute that ``name`` (dotted, absolute) names, or :data:`MISSING`.

    An attribute a class declares without a class value (a dataclass field, an instance
    attribute) counts, as ``None``. A module that exists but fails to import raises."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(head)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not head.startswith(exc.name):
                raise  # the module exists; something it imports does not
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and declares(obj, attr):
                obj = None
            else:
                return MISSING
        return obj
    return MISSING


def found(name: str) -> bool:
    return lookup(name) is not MISSING


@cache
def classes(path: Path) -> list[tuple[int, int, str]]:
    """Each class of a module: its first and last line and its dotted name in the module."""
    out: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                out.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def resolves(target: str, path: Path, line: int) -> bool:
    """Whether a role's target, written at ``line`` of ``path``, names something."""
    if target.startswith("mmstore."):
        return found(target)
    module, package = module_name(path), package_of(path)
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
        rest = target[dots:]
        if found(f"{base}.{rest}"):
            return True
        # ``.Class.method`` of the module itself; a module is named by its own path.
        obj = lookup(f"{module}.{rest}")
        return obj is not MISSING and not isinstance(obj, ModuleType)
    around = [f"{module}.{name}" for first, last, name in classes(path) if first <= line <= last]
    bases = [*reversed(around), module, package, "mmstore", "builtins"]
    return any(found(f"{base}.{target}") for base in bases) or found(target)


def lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), start=1))


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)} line {line}"


def stale(found_in: list[str], what: str) -> str:
    return f"{what} (rename them to what exists now):\n" + "\n".join(found_in)


def test_every_dotted_mmstore_name_imports():
    missing = [
        f"  {where(p, n)}: {m[0]}"
        for p in [*SOURCES, *PAGES]
        for n, text in lines(p)
        for m in DOTTED.finditer(text)
        if m[0] not in NOT_PYTHON
        and not found(m[0] if m[0].startswith("mmstore") else f"mmstore.{m[0]}")
    ]
    assert not missing, stale(missing, "names that do not import")


@pytest.mark.slow
def test_every_role_resolves():
    missing = [
        f"  {where(p, n)}: {m[0]}"
        for p in SOURCES
        for n, text in lines(p)
        for m in ROLE.finditer(text)
        if not resolves(m[1], p, n)
    ]
    assert not missing, stale(missing, "references that do not resolve")


def test_every_repository_path_exists():
    missing = [
        f"  {where(p, n)}: {m[0]}"
        for p in [*SOURCES, *PAGES]
        for n, text in lines(p)
        for m in PATH.finditer(text)
        if not (ROOT / m[0]).exists() and not (PACKAGE / m[0]).exists()
    ]
    assert not missing, stale(missing, "paths that do not exist")


@pytest.mark.parametrize(
    ("text", "module", "ok"),
    [
        ("mmstore.errors.NoMatchError", None, True),
        ("mmstore.RolloutLoader", None, True),
        ("mmstore._exceptions", None, False),
        ("mmstore._loading._order", None, False),
        ("mmstore._planning.order", None, True),
        (".device", "mmstore/_loading/materialize.py", True),
        ("._prefetch", "mmstore/_loading/dataset.py", False),
        # stack.py imports buffers as _buffers: the module is still named ``.buffers``
        ("._buffers", "mmstore/_loading/stack.py", False),
        (".stack.batch_images", "mmstore/_loading/device.py", True),
        ("PendingImage", "mmstore/_loading/device.py", True),
        ("Materialized", "mmstore/_loading/device.py", True),
        ("NoSuchThing", "mmstore/_loading/device.py", False),
        ("DeprecationWarning", "mmstore/_loading/device.py", True),
    ],
)
def test_the_checks_tell_a_stale_name(text, module, ok):
    if module is None:
        assert found(text) is ok
    else:
        assert resolves(text, ROOT / module, 1) is ok


def test_a_method_resolves_in_its_class():
    # ``:meth:`pin_memory``` inside PendingImage names PendingImage.pin_memory.
    device = ROOT / "mmstore/_loading/device.py"
    first, last, _ = next(c for c in classes(device) if c[2] == "PendingImage")
    assert resolves("pin_memory", device, last)
    assert not resolves("pin_memory", device, first - 2)
