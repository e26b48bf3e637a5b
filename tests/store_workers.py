"""Helpers of the store and writer tests, and the worker processes of the crash and
concurrency tests.

As a script (``python tests/store_workers.py crash|concurrent ...``) it is a small parent
that imports mmstore once and forks the writer processes: ``import mmstore`` costs seconds
(transformers and torch), a fork of an idle parent costs milliseconds, so many real writer
processes fit in a fast test. The parent never touches pyarrow or threads before forking.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import pyarrow.parquet as pq
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmstore
from mmstore._format.media import content_hash, encode_image
from mmstore.synth import VISION_END, VISION_START, screenshot

SMALL_MAX_PIXELS = 256 * 28 * 28  # as tests/conftest.py


def small_adapter() -> mmstore.QwenVLAdapter:
    return mmstore.adapter_for(Qwen2VLImageProcessorPil(max_pixels=SMALL_MAX_PIXELS))


def make_row(
    adapter: mmstore.QwenVLAdapter,
    media: Sequence[mmstore.MediaRef | mmstore.ImageRef],
    sample_id: str,
    *,
    group_id: str | None = None,
) -> mmstore.Rollout:
    """A valid rollout, a pure function of its sample id and media (so it can be re-made and
    compared with what a store holds)."""
    rng = random.Random(sample_id)
    prompt: list[int] = []
    for _ in media:
        prompt += [rng.randrange(1000, 150_000) for _ in range(rng.randint(1, 6))]
        prompt += [VISION_START, adapter.image_token_id, VISION_END]
    prompt += [rng.randrange(1000, 150_000) for _ in range(4)]
    tokens, refs = adapter.expand(prompt, list(media))
    completion = [rng.randrange(1000, 150_000) for _ in range(rng.randint(3, 12))]
    n = len(tokens) + len(completion)
    reward = float(rng.random() < 0.5)
    return mmstore.Rollout(
        sample_id=sample_id,
        group_id=group_id,
        tokens=tokens + completion,
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * len(completion),
        logprobs=[-rng.randrange(1, 4096) / 1024 for _ in range(n)],  # exact in float32
        reward=reward,
        advantage=reward - 0.5,
        images=refs,
        metadata={"sample": sample_id},
    )


def remake(adapter: mmstore.QwenVLAdapter, row: dict[str, Any]) -> mmstore.Rollout:
    """The row :func:`make_row` makes for a stored row's sample id and refs."""
    fields = ("hash", "uri", "width", "height", "nbytes")
    media = [mmstore.MediaRef(**{k: ref[k] for k in fields}) for ref in row["images"]]
    return make_row(adapter, media, row["sample_id"], group_id=row["group_id"])


def tree(root: str | os.PathLike[str]) -> dict[str, tuple[int, int, int]]:
    """Every file under a local root: relative path -> (size, mtime_ns, inode)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            st = os.stat(full)
            out[os.path.relpath(full, root)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def image_bytes(seed: int, width: int = 120, height: int = 80) -> bytes:
    return encode_image(screenshot(seed, width, height))[0]


def check_store(store: mmstore.Store, adapter: mmstore.QwenVLAdapter) -> list[dict[str, Any]]:
    """Assert a local store is whole: garbage only in ``_staging/``; return committed rows.

    Every media file hashes to its name; every file under ``rollouts/`` is a committed
    Parquet file that reads whole, holding intact rows whose media is all present.
    """
    base = store.backend.base
    rows: list[dict[str, Any]] = []
    media: set[str] = set()
    for rel in tree(base):
        rel = rel.replace(os.sep, "/")
        top = rel.split("/", 1)[0]
        if rel == "mmstore.json" or top in ("_staging", "pins"):  # pins: verify reads them
            continue
        if top == "media":
            name = rel.rsplit("/", 1)[1]
            with open(os.path.join(base, rel), "rb") as f:
                assert content_hash(f.read()) == name.split(".")[0], f"torn media file {rel}"
            assert rel == f"media/{name[:2]}/{name[2:4]}/{name}", rel
            media.add(rel)
            continue
        assert top == "rollouts", f"unexpected file outside _staging: {rel}"
        assert rel.endswith(".parquet") and "/part-" in rel, f"stray file {rel}"
        table = pq.read_table(os.path.join(base, rel), partitioning=None)
        rows += table.to_pylist()
    for row in rows:
        assert mmstore.Rollout(**row) == remake(adapter, row), row["sample_id"]
        for ref in row["images"]:
            assert ref["uri"] in media, f"{row['sample_id']} references missing {ref['uri']}"
    return rows


# -- crash: writers killed with SIGKILL at random moments ----------------------------------

# Phase marker -> how long after it the parent may kill (s); a put or commit is a few fsyncs.
PHASES = {b"p": 0.1, b"w": 0.015, b"c": 0.03}  # media puts, row writes, commit


def crash_child(root: str, trial: int, adapter: mmstore.QwenVLAdapter, marker_fd: int) -> None:
    store = mmstore.Store.open(root)
    rng = random.Random(trial)
    for commit in range(100):
        os.write(marker_fd, b"p")
        # A pool shared by every trial: some puts write, some renew a present file.
        media = [store.put_media(image_bytes(rng.randrange(60)), "png") for _ in range(4)]
        os.write(marker_fd, b"w")
        with store.writer(run_id="crash", step=trial, row_group_size=3) as writer:
            for k in range(8):
                pair = rng.sample(media, 2)
                writer.write(make_row(adapter, pair, f"t{trial}-c{commit}-{k}", group_id="g"))
            os.write(marker_fd, b"c")  # the commit runs as the block exits
        os.write(marker_fd, b"d")


def crash(root: str, trials: int, seed: int) -> dict[str, Any]:
    adapter = small_adapter()
    rng = random.Random(seed)
    kills: dict[str, int] = dict.fromkeys((p.decode() for p in PHASES), 0)
    for trial in range(trials):
        phase = list(PHASES)[trial % len(PHASES)]
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            os.close(read_fd)
            code = 0
            try:
                crash_child(root, trial, adapter, write_fd)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(write_fd)
        if _await_marker(read_fd, phase, rng.randint(1, 3)):
            time.sleep(rng.uniform(0, PHASES[phase]))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
        if os.WIFSIGNALED(status):
            kills[phase.decode()] += 1
        else:
            raise RuntimeError(f"writer of trial {trial} exited with status {status}")
    return {"kills": kills}


def _await_marker(fd: int, marker: bytes, occurrence: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        if not ready:
            break
        byte = os.read(fd, 1)
        if not byte:
            return False  # the writer died on its own
        seen += byte == marker
        if seen == occurrence:
            return True
    return False


# -- concurrency: writers released at once, sharing images ---------------------------------


def concurrent_child(
    root: str, index: int, adapter: mmstore.QwenVLAdapter, shared: int, rows: int
) -> None:
    store = mmstore.Store.open(root)
    common = [store.put_media(image_bytes(seed), "png") for seed in range(shared)]
    own = [store.put_media(image_bytes(10_000 + 100 * index + j), "png") for j in range(4)]
    with store.writer(run_id="conc", step=index % 2, row_group_size=8) as writer:
        for k in range(rows):
            media = [common[(k * 7 + index) % shared], own[k % len(own)]]
            writer.write(make_row(adapter, media, f"w{index}-{k}", group_id=f"w{index}"))


def concurrent(root: str, writers: int, shared: int, rows: int) -> dict[str, Any]:
    adapter = small_adapter()
    read_fd, write_fd = os.pipe()
    pids = []
    for index in range(writers):
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            os.read(read_fd, 1)  # blocks until the parent lets every writer go at once
            code = 0
            try:
                concurrent_child(root, index, adapter, shared, rows)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(read_fd)
    os.close(write_fd)  # EOF releases all writers together
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    return {"exit_codes": [os.waitstatus_to_exitcode(s) for s in statuses]}


# -- lifecycle: gc, release_run, export and pin_rows killed with SIGKILL -------------------

LIFECYCLE_OPS = ("gc", "release_run", "export", "pin_rows")
# How long after an operation starts the parent may kill it (s) until it has seen one of its
# kind finish; from then on, within the time that one took.
LIFECYCLE_KILL_WITHIN = 0.3
OLD = 7200.0  # seconds: media this old is past any grace period the trials use


def lifecycle_prepare(root: str, trial: int, adapter: mmstore.QwenVLAdapter) -> None:
    """Give trial ``trial`` something to do: a run of three steps over fresh media, media
    shared with earlier runs, and unreferenced media; all of it older than the grace."""
    store = mmstore.Store.open(root)
    rng = random.Random(trial)
    fresh = [store.put_media(image_bytes(1000 + 40 * trial + j, 64, 48)) for j in range(16)]
    shared = [store.put_media(image_bytes(rng.randrange(6), 64, 48)) for _ in range(4)]
    for step in range(3):
        with store.writer(run_id=f"run{trial}", step=step, row_group_size=2) as writer:
            for k in range(4):
                pair = [fresh[4 * step + k], shared[(step + k) % len(shared)]]
                writer.write(make_row(adapter, pair, f"t{trial}-{step}-{k}", group_id="g"))
    past = time.time() - OLD
    for path in {m.path for m in store.backend.list("media")}:
        os.utime(store.backend.abspath(path), (past, past))


def lifecycle_op(root: str, trial: int, op: str, marker_fd: int) -> None:
    store = mmstore.Store.open(root)
    os.write(marker_fd, b"s")
    if op == "gc":
        mmstore.gc(store, grace_seconds=60)
    elif op == "release_run":
        mmstore.release_run(store, f"run{trial}", grace_seconds=60)
    elif op == "export":
        # An earlier trial may have released the previous run: export the runs still there.
        held = {f.path.split("/")[1].removeprefix("run_id=") for f in store.rollout_files()}
        runs = [r for r in (f"run{trial}", f"run{trial - 1}") if r in held]
        mmstore.export(store, f"{root}-export-{trial}", runs=runs)
    else:  # pin a run's rows, then release it: the pin must keep every one of its images
        mmstore.pin_rows(store, f"pin{trial}", runs=[f"run{trial}"])
        mmstore.release_run(store, f"run{trial}", grace_seconds=60)
    os.write(marker_fd, b"d")


def lifecycle(root: str, trials: int, seed: int) -> dict[str, Any]:
    adapter = small_adapter()
    rng = random.Random(seed)
    outcome: dict[str, dict[str, int]] = {op: {"killed": 0, "finished": 0} for op in LIFECYCLE_OPS}
    within = dict.fromkeys(LIFECYCLE_OPS, LIFECYCLE_KILL_WITHIN)
    for trial in range(trials):
        _run_to_end(lambda t=trial: lifecycle_prepare(root, t, adapter))
        op = LIFECYCLE_OPS[trial % len(LIFECYCLE_OPS)]
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            code = 0
            try:
                lifecycle_op(root, trial, op, write_fd)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(write_fd)
        if _await_marker(read_fd, b"s", 1):
            started = time.monotonic()
            if _await_marker(read_fd, b"d", 1, timeout=rng.uniform(0, within[op])):
                within[op] = time.monotonic() - started
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
        if os.WIFSIGNALED(status):
            outcome[op]["killed"] += 1
        elif os.waitstatus_to_exitcode(status) == 0:
            outcome[op]["finished"] += 1
        else:
            raise RuntimeError(f"{op} of trial {trial} failed with status {status}")
    return {"ops": outcome}


def _run_to_end(fn: Any) -> None:
    """``fn()`` in a forked child (the parent stays free of pyarrow and threads)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"preparing a trial failed with status {status}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("crash")
    p.add_argument("root")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    lc = sub.add_parser("lifecycle")
    lc.add_argument("root")
    lc.add_argument("--trials", type=int, default=12)
    lc.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("concurrent")
    c.add_argument("root")
    c.add_argument("--writers", type=int, default=4)
    c.add_argument("--shared", type=int, default=40)
    c.add_argument("--rows", type=int, default=24)
    args = parser.parse_args(argv)
    if args.mode == "crash":
        result = crash(args.root, args.trials, args.seed)
    elif args.mode == "lifecycle":
        result = lifecycle(args.root, args.trials, args.seed)
    else:
        result = concurrent(args.root, args.writers, args.shared, args.rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
