"""The notebooks run top to bottom in a real Jupyter kernel; a failing cell fails the test.

They are committed without outputs, so a diff of a notebook is a diff of its code.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["explore_store", "live_loader", "replay_and_resume"]


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    notebook = read(name)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail(
            "no python3 Jupyter kernel: run `.venv/bin/python -m ipykernel install "
            "--sys-prefix --name python3` (make venv does)"
        )
    # The kernel inherits this environment: no progress bars, and matplotlib without a display.
    monkeypatch.setenv("MMSTORE_PROGRESS", "0")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = read(name)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    # What a notebook makes for people (a figure) lies beside it, never inside a store.
    pictures = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.png")
                      if "media" not in p.parts)  # fmt: skip
    assert pictures == ([Path("reward_by_step.png")] if name == "explore_store" else [])


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_teach_the_public_api(name):
    """Tutorials import nothing private, keep their stores, and explain rather than assert."""
    code = "\n".join(c.source for c in read(name).cells if c.cell_type == "code")
    assert "mmstore._" not in code
    assert ".backend" not in code  # the store's internals: tutorials use public names
    assert "rmtree(workdir)" not in code.splitlines()[-1]
    assert not [line for line in code.splitlines() if line.lstrip().startswith("assert ")]
