"""What a user installs: the wheel carries ``py.typed`` (so mypy checks code that uses
mmstore) and ``__main__`` (``python -m mmstore``); the notebooks extra can open and run the
notebooks with progress widgets."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mmstore

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmstore", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # a subprocess
def test_the_built_wheel_holds_py_typed_and_main(tmp_path):
    pytest.importorskip("hatchling")  # the dev extra has it; the build runs offline
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(ROOT), "-w", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("mmstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"mmstore/py.typed", "mmstore/__main__.py", "mmstore/cli.py"} <= names


@pytest.mark.slow  # a subprocess
def test_python_dash_m_mmstore_prints_the_version():
    done = run_module("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mmstore {mmstore.__version__}"


@pytest.mark.slow  # a subprocess
def test_python_dash_m_mmstore_runs_a_command(tmp_path):
    done = run_module("stats", str(tmp_path / "nothing"))
    assert done.returncode == 1
    assert done.stderr.startswith("mmstore stats: error: ")


def test_the_notebooks_extra_brings_widgets_and_a_way_to_open_them():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {spec.split(">")[0].split("=")[0].split("[")[0] for spec in extras["notebooks"]}
    assert {"ipywidgets", "notebook", "ipykernel"} <= names
