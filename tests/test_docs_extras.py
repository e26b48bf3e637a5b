"""The docs name the extras their blocks need, and a missing extra says how to install it
(issue 42.4: docs/engines.md's block needs DuckDB, which only the `dev` extra has;
docs/video.md's first failure was a raw `ModuleNotFoundError: av` from
`synth.screen_recording`; the GPU marker was an invisible HTML comment)."""

from __future__ import annotations

import sys

import pytest

import mmstore
from mmstore import synth
from tests.test_readme import DOCS, GPU_MARK, README, ROOT, python_blocks

# What a block uses -> the install hint the page must give above it.
NEEDS = {
    "import duckdb": "pip install duckdb",
    "put_video(": "mmstore[video]",
    "screen_recording(": "mmstore[video]",
    "integrations import ray": "mmstore[ray]",
}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_a_block_that_needs_an_extra_is_preceded_by_its_install_line(page):
    text = page.read_text()
    for block in python_blocks(text, page.name):
        line = int(block.where.rsplit(" ", 1)[1])
        above = "\n".join(text.splitlines()[:line])
        for use, hint in NEEDS.items():
            if use in block.code:
                assert hint in above, f"{block.where} uses {use!r}: say {hint!r} above it"


def test_the_video_page_says_its_extra_at_the_top():
    top = "\n".join((ROOT / "docs" / "video.md").read_text().splitlines()[:10])
    assert "pip install 'mmstore[video]'" in top


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_a_gpu_block_says_so_in_visible_text(page):
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == GPU_MARK:
            visible = [x for x in lines[max(0, i - 3) : i] if x.strip()]
            assert visible and "GPU" in visible[-1], f"{page.name} line {i + 1}"


def test_screen_recording_without_pyav_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(mmstore.InvalidArgumentError, match=r'pip install "mmstore\[video\]"'):
        synth.screen_recording(0, num_frames=2, width=32, height=32)
