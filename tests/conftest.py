"""Shared fixtures: real image processors built from parameters, stores on disk and on a
real S3-protocol server (moto_server) on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore

os.environ.setdefault("MMSTORE_PROGRESS", "0")
# Ray on loopback only: without this, Ray resolves 127.0.0.1 to the machine's network address
# (services.resolve_ip_for_localhost) and its nodes talk over that interface. Read by Ray at
# import, so it is set before any test imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Small max_pixels keep tests fast while exercising the same code as the defaults.
SMALL_MAX_PIXELS = 256 * 28 * 28


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on the S3 server is ``s3`` and ``slow``: those that ask for it by fixture
    (``s3_store``, ``s3_options``, ``s3_endpoint``) and those marked ``s3`` by hand (a fixture
    parameter that picks ``s3_store`` at run time). ``make check`` then needs no moto_server."""
    for item in items:
        if "s3_endpoint" in getattr(item, "fixturenames", ()) or item.get_closest_marker("s3"):
            item.add_marker(pytest.mark.s3)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_inherited_columns(monkeypatch):
    """The terminal's width is no test's input (the CLI fits its output to ``COLUMNS``):
    pytest-xdist's workers run with ``COLUMNS=80``. A test that wants a width sets it."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _own_node_cache(tmp_path_factory, monkeypatch):
    """Each test its own node-wide pixel cache: pixels cached by one test (whose media a
    later test corrupts or deletes) must not answer for another."""
    monkeypatch.setenv("MMSTORE_NODE_CACHE", str(tmp_path_factory.mktemp("node-cache")))


@pytest.fixture(scope="session")
def qwen2_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor with its published defaults (patch 14, merge 2)."""
    return Qwen2VLImageProcessorPil()


@pytest.fixture(scope="session")
def qwen3_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's settings: patch 16, merge 2, mean/std 0.5, 64K..16M pixels."""
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )


@pytest.fixture(scope="session")
def small_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL layout with a small pixel budget: fast materialization in tests."""
    return Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS)


@pytest.fixture(scope="session")
def adapter(small_processor: Qwen2VLImageProcessorPil) -> mmstore.QwenVLAdapter:
    return mmstore.adapter_for(small_processor)


@pytest.fixture
def store(tmp_path) -> mmstore.Store:
    return mmstore.Store.open(tmp_path / "store", create=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server (moto_server) on a free 127.0.0.1 port."""
    exe = shutil.which("moto_server") or os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )
    if not os.path.exists(exe):
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None:
                pytest.skip(f"moto_server exited with {proc.returncode} before listening")
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.skip("moto_server did not listen within 30 s")
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_options(s3_endpoint: str) -> dict[str, object]:
    return {
        "endpoint_override": s3_endpoint.removeprefix("http://"),
        "scheme": "http",
        "access_key": "testing",
        "secret_key": "testing",
        "region": "us-east-1",
        "allow_bucket_creation": True,
    }


@pytest.fixture
def s3_store(s3_options: dict[str, object]) -> mmstore.Store:
    """A fresh store under a new bucket on the moto server."""
    import pyarrow.fs as pafs

    bucket = f"mm-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    return mmstore.Store.open(f"s3://{bucket}/store", create=True, s3_options=s3_options)
