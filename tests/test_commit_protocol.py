"""The commit protocol never loses a commit nor makes one twice (issue 39, items 1 and 3).

- A commit recognises its own log entry: a put whose answer was lost (the server acted,
  the connection closed, boto3 retried and got 412) or a failure after the entry was
  durable, then a retry, is that commit: never a duplicate (whose file would be deleted
  while the log lists it), never a second version adding the same file.
- Exactly-once pairs are per producer *and run*; the same pair with other rows raises
  :class:`ProducerConflictError` instead of dropping them; a pair an older mmstore keyed by
  the bare producer still counts, for its own run.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import threading

import pytest

import mmstore
from mmstore._rows.log import TableLog
from tests.table_workers import write_part


def text_row(sample_id: str) -> mmstore.Rollout:
    return mmstore.Rollout(sample_id=sample_id, tokens=[9707, 11, 3838], prompt_len=2,
                           loss_mask=[False, False, True])  # fmt: skip


def sample_ids(store: mmstore.Store) -> list[str]:
    return sorted(r.sample_id for r in store.rollouts())


# -- a loopback proxy that loses the answer to a log put ----------------------------------


class AnswerDroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that forwards everything, except
    that the answer to the first ``PUT`` of a ``_delta_log/`` object is never delivered:
    the server has acted (it answered), and the client sees its connection close."""

    def __init__(self, upstream: tuple[str, int], drops: int = 1) -> None:
        self.upstream = upstream
        self.drops = drops
        self.dropped: list[str] = []  # the request lines whose answers were dropped
        self.cut: list[str] = []  # the status lines of the answers dropped (the server acted)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _shut(sock)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_drop(self, data: bytes) -> bool:
        line = data.split(b"\r\n", 1)[0]
        if not (line.startswith(b"PUT ") and b"/_delta_log/" in line):
            return False
        with self._lock:
            if len(self.dropped) >= self.drops:
                return False
            self.dropped.append(line.decode())
            return True

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        upstream = socket.create_connection(self.upstream, timeout=30)
        with self._lock:
            self._sockets += [client, upstream]
        drop = threading.Event()

        def forward_requests() -> None:
            try:
                while data := client.recv(65536):
                    if self._take_drop(data):
                        drop.set()  # before the request goes on: its answer is dropped
                    upstream.sendall(data)
            except OSError:
                pass
            _shut(upstream)

        threading.Thread(target=forward_requests, daemon=True).start()
        pending = b""  # an answer to a dropped request, until its head is whole
        try:
            while data := upstream.recv(65536):
                if not drop.is_set():
                    client.sendall(data)
                    continue
                pending += data
                # botocore sends PutObject with "Expect: 100-continue": an interim answer
                # goes through (the body follows it), the final one does not.
                while b"\r\n\r\n" in pending:
                    head, _, rest = pending.partition(b"\r\n\r\n")
                    if not head.startswith(b"HTTP/1.1 100"):
                        self.cut.append(head.split(b"\r\n", 1)[0].decode())
                        raise _Cut  # the server answered, so it acted: cut the client off
                    client.sendall(head + b"\r\n\r\n")
                    pending = rest
        except (OSError, _Cut):
            pass
        _shut(client)
        _shut(upstream)


class _Cut(Exception):
    pass


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture
def lossy(s3_store, s3_options):
    """The s3 store opened again through :class:`AnswerDroppingProxy`."""
    host, port = str(s3_options["endpoint_override"]).split(":")
    proxy = AnswerDroppingProxy((host, int(port)))
    options = {**s3_options, "endpoint_override": f"127.0.0.1:{proxy.port}"}
    try:
        yield mmstore.Store.open(s3_store.root, s3_options=options), proxy
    finally:
        proxy.close()


# -- item 1: a commit recognises its own entry --------------------------------------------


def test_a_lost_answer_to_the_s3_log_put_is_this_producers_commit_not_a_duplicate(lossy):
    """The conditional PUT of the log entry succeeds on the server, its answer is lost,
    boto3 retries and gets 412: the writer must see its own commit (it used to call it a
    duplicate and delete the file the log lists: every read of the run failed)."""
    store, proxy = lossy
    with store.writer("r1", 0, producer="sampler-0", seq=0) as w:
        w.write(text_row("a"))
    assert len(proxy.dropped) == 1 and "_delta_log/00000000000000000001.json" in proxy.dropped[0]
    assert proxy.cut == ["HTTP/1.1 200 OK"]  # the server made the entry; its answer was lost
    assert not w.duplicate and w.version == 1 and len(w.committed) == 1
    assert store.table.latest_version() == 1
    assert [f.path for f in store.files()] == w.committed
    assert store.backend.stat(w.committed[0]) is not None
    assert sample_ids(store) == ["a"]
    # A retry of the pair (the sampler did not hear back either) is the duplicate.
    with store.writer("r1", 0, producer="sampler-0", seq=0) as again:
        again.write(text_row("a"))
    assert again.duplicate and store.table.latest_version() == 1
    assert sample_ids(store) == ["a"] and mmstore.verify(store).ok


def test_a_lost_answer_to_the_s3_log_put_commits_the_file_once(lossy):
    """Without a producer the same loss used to commit the file again at the next version
    (a live loader trained it twice)."""
    store, proxy = lossy
    with store.writer("r1", 0) as w:
        w.write(text_row("a"))
    assert len(proxy.dropped) == 1 and proxy.cut == ["HTTP/1.1 200 OK"]
    assert w.version == 1 and store.table.latest_version() == 1
    added = [f.path for e in store.table.entries_after(0) for f in e.added]
    assert added == w.committed
    assert sample_ids(store) == ["a"] and mmstore.verify(store).ok


@pytest.mark.parametrize("pair", [None, ("sampler-0", 0)], ids=["no-producer", "producer"])
def test_a_failure_after_the_entry_is_durable_then_a_retry_is_the_same_commit(store, monkeypatch,
                                                                              pair):  # fmt: skip
    """Locally: the entry is linked and durable, then the commit raises (an fsync error, an
    interrupt); calling commit() again finds its entry: one version, the file kept."""
    real = TableLog._put_entry
    failed: list[int] = []

    def durable_then_raises(self, version, text):
        made = real(self, version, text)
        if made and not failed:
            failed.append(version)
            raise OSError(errno.EIO, "I/O error after the entry was made")
        return made

    monkeypatch.setattr(TableLog, "_put_entry", durable_then_raises)
    producer, seq = pair or (None, None)
    w = store.writer("r1", 0, producer=producer, seq=seq)
    w.write(text_row("a"))
    with pytest.raises(OSError, match="after the entry"):
        w.commit()
    assert failed == [1] and store.table.latest_version() == 1  # committed, unbeknownst
    path = w.commit()
    assert path is not None and not w.duplicate and w.version == 1
    assert store.table.latest_version() == 1
    assert [f.path for f in store.files()] == [path] and store.backend.stat(path) is not None
    assert sample_ids(store) == ["a"] and mmstore.verify(store).ok


def test_a_retried_table_commit_whose_entry_was_made_returns_its_version(store):
    """The table's own retry rule: the same commit id again is the same commit."""
    table = store.table
    file = write_part(store, "r", 0, "a")
    real = TableLog._put_entry
    calls = []

    def raises_once(self, version, text):
        made = real(self, version, text)
        calls.append(version)
        if len(calls) == 1:
            raise ConnectionError("reply lost")
        return made

    log = table._log
    log._put_entry = raises_once.__get__(log)  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        table.commit([file], commit_id="c0ffee")
    assert table.commit([file], commit_id="c0ffee").version == 1
    assert calls == [1] and table.latest_version() == 1


# -- item 3: pairs per producer and run, compared ----------------------------------------


def test_the_documented_recipe_in_a_second_run_commits_its_steps(store, caplog):
    """``producer="sampler-0", seq=step`` in run r2 after run r1: r2's steps used to be
    dropped as duplicates of r1's with only a warning."""
    for run in ("r1", "r2"):
        for step in range(4):
            with store.writer(run, step, producer="sampler-0", seq=step) as w:
                w.write(text_row(f"{run}-{step}"))
            assert w.version is not None and not w.duplicate, (run, step)
    assert sample_ids(store) == sorted(f"{r}-{s}" for r in ("r1", "r2") for s in range(4))
    assert store.table.producer_seq("sampler-0", run_id="r2") == 3
    assert store.table.producer_seq("sampler-0", run_id="r3") is None
    assert "committed nothing" not in caplog.text


def test_other_rows_under_a_used_pair_raise_instead_of_being_dropped(store):
    with store.writer("r1", 0, producer="sampler-0", seq=0) as w:
        w.write(text_row("a"))
    listed = store.listed_rollout_files()
    other = store.writer("r1", 0, producer="sampler-0", seq=0)
    other.write(text_row("b"))
    with pytest.raises(mmstore.ProducerConflictError, match="other rows") as info:
        other.commit()
    assert (info.value.producer, info.value.run_id, info.value.seq) == ("sampler-0", "r1", 0)
    assert info.value.version == 1 and isinstance(info.value, mmstore.TableError)
    assert not other.duplicate and store.table.latest_version() == 1
    # Its file stays for gc (an orphan no entry lists); nothing listed was deleted.
    assert len(store.listed_rollout_files()) == len(listed) + 1
    assert sample_ids(store) == ["a"]
    # The same rows again are the duplicate, dropped with a warning as before.
    with store.writer("r1", 0, producer="sampler-0", seq=0) as same:
        same.write(text_row("a"))
    assert same.duplicate and sample_ids(store) == ["a"]


def test_a_pair_an_older_mmstore_keyed_by_the_bare_producer_counts_for_its_own_run(store):
    """Tables written before pairs were scoped hold txns whose appId is the producer: such a
    pair was committed in the run its entry's files are in. A retry of it in that run is a
    duplicate; the same seq in another run is that run's own commit."""
    old = write_part(store, "r1", 0, "old", rows=1)
    text = _legacy_entry(store, old, producer="sampler-0", seq=0)
    store.backend.write_atomic("rollouts/_delta_log/00000000000000000001.json", text.encode())
    assert store.table.producer_seq("sampler-0", run_id="r1") == 0
    assert store.table.producer_seq("sampler-0", run_id="r2") is None
    retry = store.table.commit([write_part(store, "r1", 0, "retry", rows=1)],
                               producer="sampler-0", seq=0)  # fmt: skip
    assert retry.duplicate and retry.version is None
    with pytest.raises(mmstore.ProducerConflictError):  # other rows under the old pair
        store.table.commit([write_part(store, "r1", 0, "x", rows=3)], producer="sampler-0", seq=0)
    fresh = store.table.commit([write_part(store, "r2", 0, "new", rows=1)],
                               producer="sampler-0", seq=0)  # fmt: skip
    assert fresh.version == 2 and not fresh.duplicate
    nxt = store.table.commit([write_part(store, "r1", 1, "next", rows=1)],
                             producer="sampler-0", seq=1)  # fmt: skip
    assert nxt.version == 3
    assert store.table.producer_seq("sampler-0") == 1


def _legacy_entry(store: mmstore.Store, file, producer: str, seq: int) -> str:
    """A log entry as mmstore wrote it before pairs were scoped by run."""
    actions = [
        {"commitInfo": {"timestamp": 1, "operation": "WRITE", "mmstore.commitId": "old"}},
        {"txn": {"appId": producer, "version": seq, "lastUpdated": 1}},
        {"add": {"path": file.path.removeprefix("rollouts/"),
                 "partitionValues": {"run_id": file.run_id, "step": str(file.step)},
                 "size": file.size, "modificationTime": 1, "dataChange": True,
                 "stats": json.dumps({"numRecords": file.rows})}},
    ]  # fmt: skip
    return "".join(json.dumps(a) + "\n" for a in actions)


def test_commits_through_delta_rs_recognise_themselves_and_scope_pairs(store, monkeypatch):
    """Where the store cannot put-if-absent (S3 without boto3) commits go through delta-rs:
    the same rules hold there (a retry after a durable commit, pairs per run, other rows
    refused)."""
    from mmstore._rows.delta import DeltaRsTable
    from mmstore._storage.backends import LocalBackend

    monkeypatch.setattr(LocalBackend, "puts_if_absent", property(lambda self: False))
    real = DeltaRsTable._transact
    failed: list[bool] = []

    def durable_then_raises(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if not failed:
            failed.append(True)
            raise ConnectionError("reply lost")

    monkeypatch.setattr(DeltaRsTable, "_transact", durable_then_raises)
    w = store.writer("r1", 0, producer="sampler-0", seq=0)
    w.write(text_row("a"))
    with pytest.raises(ConnectionError):
        w.commit()
    assert w.commit() is not None and not w.duplicate and w.version == 1
    with store.writer("r2", 0, producer="sampler-0", seq=0) as second_run:
        second_run.write(text_row("b"))
    assert second_run.version == 2
    other = store.writer("r1", 0, producer="sampler-0", seq=0)
    other.write(text_row("c"))
    with pytest.raises(mmstore.ProducerConflictError):
        other.commit()
    assert store.table.latest_version() == 2 and sample_ids(store) == ["a", "b"]


# -- item 7: a commit that leaves out files added since its caller read the table ----------


@pytest.mark.parametrize("path", ["log", "delta-rs"])
def test_a_commit_leaves_out_files_added_since_the_version_its_caller_read(store, monkeypatch,
                                                                           path):  # fmt: skip
    """What keeps two upgrades at once from adding a file twice (tests/test_upgrade.py
    races two real ones), on both commit paths."""
    from mmstore._storage.backends import LocalBackend

    if path == "delta-rs":
        monkeypatch.setattr(LocalBackend, "puts_if_absent", property(lambda self: False))
    table = store.table
    read = table.latest_version()
    a, b = write_part(store, "r", 0, "a"), write_part(store, "r", 0, "b")
    assert table.commit([a]).version == 1  # the other upgrade's commit
    result = table.commit([a, b], absent_since=read)
    assert result.version == 2 and result.skipped == (a.path,)
    assert [f.path for f in table.log_entry(2).added] == [b.path]
    again = table.commit([a, b], absent_since=read)
    assert again.version is None and again.skipped == (a.path, b.path)
    added = [f.path for e in table.entries_after(0) for f in e.added]
    assert table.latest_version() == 2 and sorted(added) == [a.path, b.path]
