"""Reads that fail for reasons other than the data say so, typed and with where they failed
(issue 30 items 11, 12):

- storage that stops answering: a real moto_server behind a TCP proxy on loopback that stops
  forwarding (a stalled endpoint: connections stay open, no answer comes), with short S3
  timeouts so that each request gives up in about a second. Rows and media read from it
  raise :class:`mmstore.NetworkError` (a ``ConnectionError``, ``retryable``), naming the
  file, run and step, or the URI, sample and image; never ``CorruptFileError``;
- media this process may not read (EACCES): :class:`mmstore.MediaPermissionError` (a
  ``PermissionError``) naming the URI, sample and image. Root reads any file whatever its
  mode, so the reading part runs in a forked child that has given up root (``setuid`` to
  ``nobody``), where the file's mode applies as it does to any user.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

import mmstore
from mmstore._format.media import content_hash
from mmstore.synth import write_grpo_steps
from tests.store_workers import image_bytes, make_row

# Each S3 request gives up after about a second, once (the defaults: 19 s and retries).
FAST_FAILING = {
    "connect_timeout": 1.0,
    "request_timeout": 1.0,
    "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1),
}
NOBODY = 65534  # the conventional unprivileged uid and gid
CHILD_BOUND_S = 120.0


class StallingProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:target``, forwarding until :meth:`stall`; from then
    on it reads what either side sends and forwards nothing, keeping connections open."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.stalled = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.stalled.set()

    def close(self) -> None:
        self.server.close()
        for sock in self.sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return  # closed
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.stalled.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[StallingProxy]:
    stalling = StallingProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    yield stalling
    stalling.close()


def through(proxy: StallingProxy, s3_options: dict[str, Any]) -> dict[str, Any]:
    """``s3_options`` sending every request through ``proxy``, giving up fast."""
    return {**s3_options, **FAST_FAILING, "endpoint_override": f"127.0.0.1:{proxy.port}"}


def new_bucket(s3_options: dict[str, Any]) -> str:
    bucket = f"mm-{uuid.uuid4().hex[:12]}"
    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    return bucket


def loaded(store: mmstore.Store, processor: Any, **options: Any) -> list[dict[str, Any]]:
    ds = mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False, **options)
    return list(mmstore.RolloutLoader(ds, batch_size=4))


# -- item 11: storage that stops answering ---------------------------------------------------


def test_opening_a_store_nobody_answers_for_is_a_network_error(s3_options):
    with socket.socket() as closed:  # a port nothing listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    options = {**s3_options, **FAST_FAILING, "endpoint_override": f"127.0.0.1:{port}"}
    with pytest.raises(mmstore.NetworkError) as info:
        mmstore.Store.open("s3://nobody-here/store", s3_options=options)
    err = info.value
    assert isinstance(err, ConnectionError) and err.retryable
    assert err.location == "s3://nobody-here/store/mmstore.json"
    assert not mmstore.CorruptFileError("x").retryable  # only what may pass is retryable


@pytest.mark.slow
def test_rows_from_a_stalled_endpoint_are_a_network_error_not_damage(
    s3_options, proxy, small_processor, adapter
):
    root = f"s3://{new_bucket(s3_options)}/store"
    writing = mmstore.Store.open(root, create=True, s3_options=s3_options)
    write_grpo_steps(
        writing, adapter, run_id="net", steps=[0], groups=1, group_size=4, image_size=(56, 56)
    )
    reader = mmstore.Store.open(root, s3_options=through(proxy, s3_options))
    ds = mmstore.RolloutDataset(reader, small_processor, dtype=torch.float32, shuffle=False)
    proxy.stall()  # the plan is made; the rows are read from here on
    with pytest.raises(mmstore.NetworkError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=4))
    err = info.value
    assert not isinstance(err, mmstore.CorruptFileError)
    assert isinstance(err, ConnectionError) and err.retryable
    assert err.file.startswith("rollouts/run_id=net/step=0/") and err.file.endswith(".parquet")
    assert (err.run_id, err.step) == ("net", 0)
    assert "NETWORK_CONNECTION" in str(err)  # what the storage said, kept


@pytest.mark.slow
def test_media_from_a_stalled_endpoint_are_a_network_error_naming_sample_and_image(
    tmp_path, s3_options, proxy, small_processor, adapter
):
    # Rows in a local store, media under a trusted S3 root: the rows read, the media stall.
    bucket = new_bucket(s3_options)
    data = image_bytes(3, 56, 56)
    digest = content_hash(data)
    s3 = pafs.S3FileSystem(**s3_options, allow_delayed_open=True)  # one PutObject
    with s3.open_output_stream(f"{bucket}/ext/{digest}.png") as f:
        f.write(data)
    uri = f"s3://{bucket}/ext/{digest}.png"
    media = mmstore.MediaRef(hash=digest, uri=uri, width=56, height=56, nbytes=len(data))
    trusted = [f"s3://{bucket}/ext"]
    writing = mmstore.Store.open(
        tmp_path / "s", create=True, trusted_roots=trusted, s3_options=s3_options
    )
    with writing.writer(run_id="net", step=0) as w:
        for k in range(4):
            w.write(make_row(adapter, [media], f"s{k}", group_id="g"))

    reader = mmstore.Store.open(
        tmp_path / "s", trusted_roots=trusted, s3_options=through(proxy, s3_options)
    )
    assert reader.read_media(uri, digest) == data  # the way through the proxy works
    ds = mmstore.RolloutDataset(reader, small_processor, dtype=torch.float32, shuffle=False)
    proxy.stall()
    with pytest.raises(mmstore.NetworkError) as info:
        list(mmstore.RolloutLoader(ds, batch_size=4))
    err = info.value
    assert isinstance(err, ConnectionError) and err.retryable
    assert (err.uri, err.sample_id, err.image_index) == (uri, "s0", 0)
    assert err.file.startswith("rollouts/run_id=net/step=0/") and err.file.endswith(".parquet")
    assert (err.run_id, err.step) == ("net", 0)


# -- item 12: media this process may not read ----------------------------------------------


def as_another_user(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()`` in a forked child that, where this process is root, first becomes
    ``nobody``; its JSON result back through a pipe (a bounded wait: a hang fails)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            result = work()
        except BaseException as exc:  # reported, not raised: this is a forked pytest
            result, status = {"crashed": repr(exc)}, 1
        os.write(write_end, json.dumps(result, default=str).encode())
        os._exit(status)
    os.close(write_end)
    chunks = []
    try:
        while select.select([read_end], [], [], CHILD_BOUND_S)[0]:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the reading child gave no answer in {CHILD_BOUND_S} s")
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A new folder every user may traverse (pytest's own are 0700, its parents too)."""
    folder = Path(tempfile.mkdtemp(prefix="mmstore-eacces-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_media_the_process_may_not_read_is_a_typed_error_naming_sample_and_image(
    open_folder, small_processor, adapter
):
    # A store every user may traverse; one of its media files readable by nobody.
    top = open_folder
    store = mmstore.Store.open(top / "s", create=True)
    media = [store.put_media(image_bytes(seed, 56, 56)) for seed in range(2)]
    with store.writer(run_id="perm", step=0) as w:
        for k in range(4):
            w.write(make_row(adapter, [media[k // 2]], f"s{k}", group_id=f"g{k // 2}"))
    # The whole path read once here, as root: the child imports nothing new.
    assert len(loaded(store, small_processor, node_cache_bytes=0)) == 1
    denied = Path(store.backend.abspath(media[1].uri))
    denied.chmod(0)
    # Planned here: a forked child must not call delta-rs (TableForkError); it reads files.
    ds = mmstore.RolloutDataset(
        store, small_processor, dtype=torch.float32, shuffle=False, node_cache_bytes=0
    )
    loader = mmstore.RolloutLoader(ds, batch_size=4)

    def read() -> dict[str, Any]:
        if os.access(denied, os.R_OK):
            return {"skip": f"uid {os.getuid()} reads a file of mode 000"}
        try:
            list(loader)
        except Exception as exc:
            context = getattr(exc, "context", None)
            return {"mro": [c.__name__ for c in type(exc).__mro__], "context": context}
        return {"mro": None}

    try:
        result = as_another_user(read)
    finally:
        denied.chmod(0o644)
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "crashed" not in result, result
    assert result["mro"] is not None, "the loader read media it may not read"
    assert {"MediaPermissionError", "MediaError", "PermissionError"} <= set(result["mro"]), result
    context = result["context"]
    assert context["uri"] == media[1].uri
    assert (context["sample_id"], context["image_index"]) == ("s2", 0)
    assert (context["run_id"], context["step"]) == ("perm", 0)
    assert context["file"].startswith("rollouts/run_id=perm/step=0/")
