"""A local S3 for the benchmarks: moto_server on loopback, and a proxy adding latency.

The proxy relays TCP between a client and moto_server and holds each request (the first
bytes a client sends after the server last answered on that connection) for a fixed
delay before forwarding it: one added round trip per request, as a distant object store
costs. Connections are served concurrently (asyncio), so requests in flight overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}") from None
            time.sleep(0.1)
    raise RuntimeError(f"nothing listened on port {port} within 30 s")


def moto_executable() -> str | None:
    exe = shutil.which("moto_server") or os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )
    return exe if os.path.exists(exe) else None


@contextlib.contextmanager
def moto_server() -> Iterator[int]:
    """A moto_server on a free loopback port; yields the port."""
    exe = moto_executable()
    if exe is None:
        raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    state: dict[str, bool],
    delay: float,
    upstream: bool,
) -> None:
    try:
        while data := await reader.read(65536):
            if upstream and not state["waiting"]:
                # A new request on this connection: one added round trip.
                state["waiting"] = True
                await asyncio.sleep(delay)
            elif not upstream:
                state["waiting"] = False
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class LatencyProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:target``, each request delayed by ``delay`` s."""

    def __init__(self, target: int, delay: float) -> None:
        self.target, self.delay = target, delay
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target)
        state = {"waiting": False}
        await asyncio.gather(
            _pipe(c_reader, s_writer, state, self.delay, upstream=True),
            _pipe(s_reader, c_writer, state, self.delay, upstream=False),
        )

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        start = asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def s3_options(port: int) -> dict[str, object]:
    return {
        "endpoint_override": f"127.0.0.1:{port}",
        "scheme": "http",
        "access_key": "testing",
        "secret_key": "testing",
        "region": "us-east-1",
        "allow_bucket_creation": True,
    }
