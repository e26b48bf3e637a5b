"""Helpers of the store and writer tests, and the worker processes of the crash and
concurrency tests.

As a script (``python tests/store_workers.py crash|concurrent ...``) it is a small parent
that imports mmstore once and forks the writer processes: ``import mmstore`` costs seconds
(transformers and torch), a fork of an idle parent costs milliseconds, so many real writer
processes fit in a fast test. The parent never touches pyarrow or threads before forking.
"""

from __future__ import annotations

import argparse
import contextlib
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

    The rollouts table opens; every media file hashes to its name; every file under
    ``rollouts/`` (beside the table's log) is a Parquet file that reads whole, and every
    file the latest version lists is there, holding intact rows whose media is all present.
    Files no version lists (a writer killed between its rename and its commit) may be
    there, whole. Every file a pin holds is there.
    """
    base = store.backend.base
    listed = {f.path for f in store.files()}  # the table opens, at its latest version
    rows: list[dict[str, Any]] = []
    media: set[str] = set()
    found: set[str] = set()
    for rel in tree(base):
        rel = rel.replace(os.sep, "/")
        top = rel.split("/", 1)[0]
        if rel == "mmstore.json" or top in ("_staging", "pins"):  # pins: verify reads them
            continue
        if top == "runs":  # the runs' layout records: small JSON documents
            with open(os.path.join(base, rel), "rb") as f:
                assert isinstance(json.loads(f.read()), dict), f"torn run record {rel}"
            continue
        if top == "media":
            name = rel.rsplit("/", 1)[1]
            with open(os.path.join(base, rel), "rb") as f:
                assert content_hash(f.read()) == name.split(".")[0], f"torn media file {rel}"
            assert rel == f"media/{name[:2]}/{name[2:4]}/{name}", rel
            media.add(rel)
            continue
        assert top == "rollouts", f"unexpected file outside _staging: {rel}"
        if rel.startswith("rollouts/_delta_log/"):
            continue
        assert rel.endswith(".parquet") and "/part-" in rel, f"stray file {rel}"
        table = pq.read_table(os.path.join(base, rel), partitioning=None)
        found.add(rel)
        if rel in listed:
            rows += table.to_pylist()
    assert listed <= found, f"listed files missing: {sorted(listed - found)[:3]}"
    for row in rows:
        assert mmstore.Rollout(**row) == remake(adapter, row), row["sample_id"]
        for ref in row["images"]:
            assert ref["uri"] in media, f"{row['sample_id']} references missing {ref['uri']}"
    for pin in mmstore._lifecycle.pins.read_pin_records(store).values():
        assert pin.files <= found, f"pin {pin.name} lost files {sorted(pin.files - found)[:3]}"
    return rows


# -- crash: writers killed with SIGKILL at random moments ----------------------------------

# Phase marker -> how long after it the parent may kill (s); a put is a few fsyncs, a commit
# a few fsyncs, a rename and a Delta transaction.
PHASES = {b"p": 0.1, b"w": 0.015, b"c": 0.06}  # media puts, row writes, commit


def crash_commit(
    store: mmstore.Store, adapter: mmstore.QwenVLAdapter, trial: int, commit: int, marker_fd: int
) -> mmstore.RolloutWriter:
    """Commit ``commit`` of trial ``trial``: the same rows and media every time it is made
    (seeded by both), as producer ``t<trial>`` with seq ``commit``."""
    rng = random.Random(f"{trial}/{commit}")
    os.write(marker_fd, b"p")
    # A pool shared by every trial: some puts write, some renew a present file.
    media = [store.put_media(image_bytes(rng.randrange(60)), "png") for _ in range(4)]
    os.write(marker_fd, b"w")
    writer = store.writer(
        run_id="crash", step=trial, row_group_size=3, producer=f"t{trial}", seq=commit
    )
    with writer:
        for k in range(8):
            pair = rng.sample(media, 2)
            writer.write(make_row(adapter, pair, f"t{trial}-c{commit}-{k}", group_id="g"))
        os.write(marker_fd, b"c")  # the commit runs as the block exits
    os.write(marker_fd, b"d")
    return writer


def crash_child(root: str, trial: int, adapter: mmstore.QwenVLAdapter, marker_fd: int) -> None:
    store = mmstore.Store.open(root)
    for commit in range(100):
        crash_commit(store, adapter, trial, commit, marker_fd)


def crash_retry(root: str, trial: int, adapter: mmstore.QwenVLAdapter) -> None:
    """What a restarted producer does: make its last committed commit again (the table must
    refuse it as a duplicate) and the one it may have been killed in (committed once)."""
    store = mmstore.Store.open(root)
    done = store.table.producer_seq(f"t{trial}")
    sink = os.open(os.devnull, os.O_WRONLY)
    if done is not None:
        again = crash_commit(store, adapter, trial, done, sink)
        assert again.duplicate and again.committed == [], f"trial {trial} seq {done} twice"
    nxt = crash_commit(store, adapter, trial, 0 if done is None else done + 1, sink)
    assert not nxt.duplicate and len(nxt.committed) == 1


def crash(root: str, trials: int, seed: int) -> dict[str, Any]:
    adapter = small_adapter()
    rng = random.Random(seed)
    kills: dict[str, int] = dict.fromkeys((p.decode() for p in PHASES), 0)
    for trial in range(trials):
        phase = list(PHASES)[trial % len(PHASES)]
        read_fd, write_fd = os.pipe()

        pid = fork_child(crash_child, root, trial, adapter, write_fd, close=read_fd)  # writer
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
        _run_to_end(lambda t=trial: crash_retry(root, t, adapter))
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

        def writer(index: int = index) -> None:
            os.close(write_fd)
            os.read(read_fd, 1)  # blocks until the parent lets every writer go at once
            concurrent_child(root, index, adapter, shared, rows)

        pid = fork_child(writer)
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
    else:  # pin a run's rows, then release it (forced: the pin holds them): the pin must
        # keep every one of its files and images
        mmstore.pin_rows(store, f"pin{trial}", runs=[f"run{trial}"])
        mmstore.release_run(store, f"run{trial}", grace_seconds=60, force=True)
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
        pid = fork_child(lifecycle_op, root, trial, op, write_fd, close=read_fd)
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


# -- upgrade: a format-1 store upgraded by processes killed with SIGKILL -------------------

UPGRADE_RUNS, UPGRADE_STEPS = 3, 6


def to_format_1(root: str) -> None:
    """Make a format-2 store the format-1 store its files were: no log, no run records,
    the manifest at format 1 (no pyarrow, no delta-rs: plain file operations)."""
    import shutil

    shutil.rmtree(os.path.join(root, "rollouts", "_delta_log"), ignore_errors=True)
    shutil.rmtree(os.path.join(root, "runs"), ignore_errors=True)
    path = os.path.join(root, "mmstore.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["format_version"] = 1
    manifest.pop("upgraded", None)
    with open(path, "w") as f:
        json.dump(manifest, f)


def format_1_files(root: str) -> list[str]:
    return sorted(
        rel.replace(os.sep, "/")
        for rel in tree(os.path.join(root, "rollouts"))
        if rel.endswith(".parquet") and not rel.startswith("_")
    )


def upgrade_prepare(root: str, adapter: mmstore.QwenVLAdapter) -> None:
    """Runs of one-row files over shared media, and a pin, in a store made as format 2."""
    store = mmstore.Store.open(root, create=True)
    media = [store.put_media(image_bytes(seed, 64, 48)) for seed in range(6)]
    for r in range(UPGRADE_RUNS):
        for step in range(UPGRADE_STEPS):
            with store.writer(run_id=f"u{r}", step=step) as writer:
                pair = [media[(r + step) % 6], media[(r + step + 1) % 6]]
                writer.write(make_row(adapter, pair, f"u{r}-{step}", group_id="g"))
    mmstore.pin(store, "keep", [media[0]])


def upgrade_op(root: str, marker_fd: int) -> None:
    os.write(marker_fd, b"s")
    mmstore.upgrade(root, batch_files=1)  # one commit per file: many points to die at
    os.write(marker_fd, b"d")


def upgrade_check(root: str, expected: list[str], adapter: mmstore.QwenVLAdapter) -> None:
    """After any kill: every format-1 file is there, the table (if begun) opens and lists a
    sorted prefix of them, each once; a finished upgrade is a whole format-2 store."""
    from mmstore._rows.table import RolloutTable
    from mmstore._storage.store import Storage

    assert [f"rollouts/{p}" for p in format_1_files(root)] == expected, "a file was lost"
    with open(os.path.join(root, "mmstore.json")) as f:
        version = json.load(f)["format_version"]
    assert version in (1, 2), version
    # A table is begun once its version 0 is there (a kill may leave its folder empty).
    if os.path.exists(os.path.join(root, "rollouts", "_delta_log", f"{0:020d}.json")):
        table = RolloutTable(Storage.open_format(root, False, (1, 2)))
        added = [f.path for e in table.entries_after(-1) for f in e.added]
        assert added == expected[: len(added)], "not committed once each, in sorted order"
        assert sorted(f.path for f in table.snapshot().files) == added
    else:
        assert version == 1
    if version == 2:
        store = mmstore.Store.open(root)
        assert [f.path for f in store.files()] == expected
        rows = check_store(store, adapter)
        assert sorted(r["sample_id"] for r in rows) == sorted(
            f"u{r}-{s}" for r in range(UPGRADE_RUNS) for s in range(UPGRADE_STEPS)
        )
        assert mmstore.list_pins(store) == {"keep": 1}
        assert mmstore.verify(store).ok
    else:
        with contextlib.suppress(mmstore.UpgradeRequiredError):
            mmstore.Store.open(root)
            raise AssertionError("a format-1 store opened without an upgrade")


def upgrade_trials(root: str, trials: int, seed: int) -> dict[str, Any]:
    adapter = small_adapter()
    rng = random.Random(seed)
    _run_to_end(lambda: upgrade_prepare(root, adapter))
    to_format_1(root)
    expected = [f"rollouts/{p}" for p in format_1_files(root)]
    outcome = {"killed": 0, "finished": 0, "upgraded": 0}
    within = 1.0  # until an upgrade is seen to finish: then within the time it took
    for trial in range(trials):
        # Every tenth upgrade runs to its end: finished upgrades are checked whole however
        # slow the machine is (the others die at a random moment within an upgrade's time).
        wait = rng.uniform(0, within) if trial % 10 != 9 else 120.0
        read_fd, write_fd = os.pipe()
        pid = fork_child(upgrade_op, root, write_fd, close=read_fd)
        os.close(write_fd)
        if _await_marker(read_fd, b"s", 1):
            started = time.monotonic()
            if _await_marker(read_fd, b"d", 1, timeout=wait):
                within = time.monotonic() - started
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
        if os.WIFSIGNALED(status):
            outcome["killed"] += 1
        elif os.waitstatus_to_exitcode(status) == 0:
            outcome["finished"] += 1
        else:
            raise RuntimeError(f"an upgrade failed with status {status}")
        _run_to_end(lambda: upgrade_check(root, expected, adapter))
        with open(os.path.join(root, "mmstore.json")) as f:
            if json.load(f)["format_version"] == 2:  # done: start over from format 1
                outcome["upgraded"] += 1
                to_format_1(root)
    return outcome


def fork_child(fn: Any, *args: Any, close: int | None = None) -> int:
    """Fork a child that closes ``close`` (the pipe end it does not use), runs
    ``fn(*args)`` and exits: 0, or 1 after printing the traceback of what it raised.
    Returns the child's pid (in the parent only)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if close is not None:
                os.close(close)
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def _run_to_end(fn: Any) -> None:
    """``fn()`` in a forked child (the parent stays free of pyarrow and threads)."""
    _, status = os.waitpid(fork_child(fn), 0)
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
    u = sub.add_parser("upgrade")
    u.add_argument("root")
    u.add_argument("--trials", type=int, default=40)
    u.add_argument("--seed", type=int, default=0)
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
    elif args.mode == "upgrade":
        result = upgrade_trials(args.root, args.trials, args.seed)
    else:
        result = concurrent(args.root, args.writers, args.shared, args.rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
