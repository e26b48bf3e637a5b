"""Helpers of the rollouts-table tests, and the processes of its concurrency tests.

As a script (``python tests/table_workers.py MODE ROOT ...``) it is a small parent that
imports mmstore without ever calling delta-rs, then forks the writer processes: each child
starts its own delta-rs runtime (a fork *after* delta-rs ran would panic, see
``mmstore._rows.table``), and a fork of an idle parent costs milliseconds where a fresh
interpreter costs seconds. Children wait on a pipe so that they all start at once.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmstore._format.schema import ROLLOUT_SCHEMA
from mmstore._rows.table import RolloutTable, TableFile
from mmstore._storage.store import Storage


def rollout_rows(name: str, rows: int, *, extra_column: bool = False) -> pa.Table:
    """``rows`` rows of the rollout schema (sample ids ``<name>-<i>``): nested token lists,
    an image ref struct in the first row, a JSON ``metadata`` string in every other one."""
    records = []
    for i in range(rows):
        tokens = [100 + i, 7, 8, 9]
        records.append(
            {
                "sample_id": f"{name}-{i}",
                "group_id": f"{name}-g",
                "tokens": tokens,
                "prompt_len": 2,
                "loss_mask": [False, False, True, True],
                "logprobs": [-0.5, -0.25],
                "reward": float(i),
                "advantage": None,
                "images": [_image_ref(name)] if i == 0 else [],
                "metadata": json.dumps({"i": i}) if i % 2 else None,
            }
        )
    table = pa.Table.from_pylist(records, schema=ROLLOUT_SCHEMA)
    if extra_column:  # a column added to the schema later (see add_columns)
        table = table.append_column(
            pa.field("extra_score", pa.int64()), pa.array(range(rows), pa.int64())
        )
    return table


def _image_ref(name: str) -> dict[str, Any]:
    return {
        "uri": f"media/ab/cd/{name}.png",
        "hash": "ab" * 16,
        "width": 56,
        "height": 56,
        "nbytes": 123,
        "offset": 0,
        "length": 4,
        "family": "qwen_vl",
        "layout_fingerprint": "f" * 16,
        "payload": None,
    }


def write_part(
    storage: Storage, run_id: str, step: int, name: str, rows: int = 2, **kwargs: Any
) -> TableFile:
    """A real rollout Parquet file written in place (as the writer lays files out), and the
    TableFile that commits it."""
    path = f"rollouts/run_id={run_id}/step={step}/part-{name}.parquet"
    sink = io.BytesIO()
    pq.write_table(rollout_rows(name, rows, **kwargs), sink, compression="zstd")
    data = sink.getvalue()
    storage.backend.write_atomic(path, data)
    return TableFile(path, run_id, step, len(data), rows)


def open_table(root: str, s3: str | None) -> RolloutTable:
    options = json.loads(s3) if s3 else None
    return RolloutTable(Storage.open(root, s3_options=options))


# -- children ----------------------------------------------------------------------------


def writer_child(root: str, s3: str | None, index: int, commits: int) -> list[dict[str, Any]]:
    """Commit ``commits`` files, one transaction each, as producer ``w<index>``."""
    table = open_table(root, s3)
    done = []
    for seq in range(commits):
        file = write_part(table.storage, "conc", seq % 3, f"w{index}-{seq}", rows=1)
        result = table.commit([file], producer=f"w{index}", seq=seq)
        done.append({"path": file.path, "version": result.version, "dup": result.duplicate})
    return done


def same_pair_child(root: str, s3: str | None, index: int, rounds: int) -> list[dict[str, Any]]:
    """Every child commits its own file under the same ``(producer "p", seq)``, round after
    round: of each round's racers exactly one may commit."""
    table = open_table(root, s3)
    done = []
    for seq in range(rounds):
        file = write_part(table.storage, "pair", 0, f"c{index}-{seq}", rows=1)
        result = table.commit([file], producer="p", seq=seq)
        done.append({"path": file.path, "seq": seq, "version": result.version,
                     "dup": result.duplicate})  # fmt: skip
    return done


def create_child(root: str, s3: str | None) -> int:
    """Create the table (racing the other children); the version it then reports."""
    return open_table(root, s3).create()


def release_together(children: list[Callable[[], Any]]) -> dict[str, Any]:
    """Fork one process per child, let them all go at once, collect what each returns."""
    go_read, go_write = os.pipe()
    pids, outputs = [], []
    for child in children:
        out_read, out_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            os.close(out_read)
            os.read(go_read, 1)  # blocks until the parent closes the pipe
            code = 0
            try:
                payload = json.dumps(child()).encode()
                with os.fdopen(out_write, "wb") as out:
                    out.write(payload)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(out_write)
        pids.append(pid)
        outputs.append(out_read)
    os.close(go_read)
    os.close(go_write)  # EOF: every child starts now
    results = []
    for fd in outputs:
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        results.append(json.loads(raw) if raw else None)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return {"exit_codes": codes, "results": results}


# -- single-process modes ------------------------------------------------------------------


def commit_then_crash(root: str, s3: str | None, name: str, producer: str, seq: int) -> None:
    """Commit one file as ``(producer, seq)`` and die before anyone hears of it."""
    table = open_table(root, s3)
    file = write_part(table.storage, "crash", 0, name, rows=3)
    table.commit([file], producer=producer, seq=seq)
    os._exit(17)  # no reply, no cleanup: as a process killed right after its commit


def fork_guard(root: str) -> dict[str, Any]:
    """Use the table, fork, and report what the child got from a commit (delta-rs) and
    from reading the log."""
    table = open_table(root, None)
    version = table.latest_version()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        report: dict[str, Any] = {}
        try:
            table.commit([write_part(table.storage, "r", 9, "child")])
            report["delta"] = "no error"
        except BaseException as exc:  # a PanicException is a BaseException
            report["delta"] = type(exc).__name__
            report["message"] = str(exc)
        # Reading a version needs no delta-rs: the log is replayed in Python.
        report["latest_in_child"] = table.latest_version()
        report["files_in_child"] = [f.path for f in table.snapshot().files]
        entry = table.log_entry(version)
        report["log_entry_version"] = None if entry is None else entry.version
        with os.fdopen(write_fd, "w") as out:
            out.write(json.dumps(report))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        report = json.loads(f.read())
    os.waitpid(pid, 0)
    report["parent_after_fork"] = table.latest_version()
    return report


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["writers", "same-pair", "create", "crash", "fork-guard"])
    parser.add_argument("root")
    parser.add_argument("--s3", default=None, help="the store's s3_options as JSON")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--commits", type=int, default=25)
    parser.add_argument("--name", default="crash")
    parser.add_argument("--producer", default="p")
    parser.add_argument("--seq", type=int, default=0)
    args = parser.parse_args(argv)
    if args.mode == "writers":
        result = release_together(
            [
                lambda i=i: writer_child(args.root, args.s3, i, args.commits)
                for i in range(args.procs)
            ]
        )
    elif args.mode == "same-pair":
        result = release_together(
            [
                lambda i=i: same_pair_child(args.root, args.s3, i, args.commits)
                for i in range(args.procs)
            ]
        )
    elif args.mode == "create":
        result = release_together(
            [lambda: create_child(args.root, args.s3) for _ in range(args.procs)]
        )
    elif args.mode == "crash":
        commit_then_crash(args.root, args.s3, args.name, args.producer, args.seq)
        return
    else:
        result = fork_guard(args.root)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
