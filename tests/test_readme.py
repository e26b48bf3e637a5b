"""Every ```python block of README.md runs as printed: in order, one namespace, in an empty
directory, offline (processors are built from parameters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_the_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 3


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_readme_blocks_run_as_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict[str, object] = {"__name__": "readme"}
    for index, block in enumerate(python_blocks(README.read_text())):
        code = compile(block, f"README.md python block {index}", "exec")
        exec(code, namespace)  # the README is this repository's own text
    out = capsys.readouterr().out
    assert "6 2" in out  # the resume block read exactly the rest of the run
    assert "True" in out  # verify().ok
