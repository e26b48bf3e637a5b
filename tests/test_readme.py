"""Every ```python block of README.md and docs/*.md runs as printed: README first, then the
docs pages in name order, in one namespace, in an empty directory, offline (processors are
built from parameters). Indented blocks (inside a list item) count too. A block preceded by
``<!-- gpu -->`` needs CUDA: it is skipped, and said to be, where there is none."""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# A fence opens at any indentation and closes at the same indentation.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
GPU_MARK = "<!-- gpu -->"


class Block(NamedTuple):
    where: str  # "docs/training.md line 80"
    code: str
    gpu: bool


def python_blocks(text: str, name: str = "text") -> list[Block]:
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        gpu = bool(before) and before[-1].strip() == GPU_MARK
        line = text.count("\n", 0, match.start()) + 1
        code = textwrap.dedent(match["body"])
        blocks.append(Block(f"{name} line {line}", code, gpu))
    return blocks


def all_blocks() -> list[Block]:
    pages = [README, *DOCS]
    return [b for p in pages for b in python_blocks(p.read_text(), str(p.relative_to(ROOT)))]


def test_indented_and_gpu_marked_blocks_are_found():
    text = (
        "intro\n```python\nx = 1\n```\n- item\n\n  <!-- gpu -->\n  ```python\n"
        "  if x:\n      y = 2\n  ```\n```sh\nls\n```\n"
    )
    blocks = python_blocks(text)
    assert [b.code for b in blocks] == ["x = 1\n", "if x:\n    y = 2\n"]
    assert [b.gpu for b in blocks] == [False, True]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_python_fence_of_a_page_is_seen(page):
    # Every opening fence that names python is one block the test runs: none is missed
    # because of its indentation or a trailing space.
    text = page.read_text()
    opening = re.findall(r"^[ \t]*```python", text, re.M)
    assert len(python_blocks(text)) == len(opening)
    assert not re.search(r"^[ \t]*```(py|python3)\s*$", text, re.M), "use ```python"


def test_the_pages_have_python_blocks():
    assert len(python_blocks(README.read_text())) >= 4
    assert DOCS, "docs/ holds the internals the README links to"
    assert any(b.gpu for b in all_blocks())


def test_the_readme_links_only_pages_that_exist():
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_readme_is_short_and_starts_with_what_and_how_to_install():
    text = README.read_text()
    assert len(text.split()) < 1500  # wc -w
    first_screen = "\n".join(text.splitlines()[:40])
    assert "pip install" in first_screen
    assert "make test" in first_screen and "make demo" in first_screen
    assert "instead of plain Parquet or HF datasets" in first_screen


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_every_block_runs_as_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict[str, object] = {"__name__": "readme"}
    skipped = []
    for block in all_blocks():
        if block.gpu and not torch.cuda.is_available():
            skipped.append(block.where)
            continue
        code = compile(block.code, f"{block.where} (python block)", "exec")
        exec(code, namespace)  # the README and docs are this repository's own text
    out = capsys.readouterr().out
    assert "6 2" in out  # the resume block read exactly the rest of the run
    assert "True" in out  # verify().ok
    assert "[('0042', 7, 'INTEGER')]" in out  # the DuckDB recipe keeps run ids strings
    assert "video 24 12.0 640 400" in out  # docs/video.md: put_video read the clip's facts
    # docs/live.md: a trajectory held until its last turn, then one forest of its turns
    assert "False 1\n['t0', 't1', 't2'] True" in out
    if skipped:  # said, not hidden: the run passes on a machine without a GPU
        warnings.warn(f"GPU blocks not run (no CUDA here): {skipped}", stacklevel=1)


def test_what_the_readme_writes_is_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {"/runs/", "mmstore-demo/"} <= set(ignored)  # `runs/...` paths, `make demo`
