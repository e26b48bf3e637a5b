"""SIGKILL where trust is hardest won (issue 39, "Must show"): after every kill the store
verifies clean (``mmstore.verify`` of the store as the kill left it) and every committed
sample is trained exactly once.

- **S3 commits with lost answers.** Producer processes commit steps with ``producer``/``seq``
  to a store on a real S3 server (moto_server) through a loopback proxy that loses the
  answer to every few log puts (the server made the entry; the client sees its connection
  close, retries and gets 412). Each producer is SIGKILLed at random moments of its
  commits, several times, and restarted from the start of its plan: exactly-once makes the
  re-commits no-ops. A live loader follows the run directly meanwhile. The table then holds
  every planned sample once (no loss, no duplicate, no file listed twice or missing), each
  producer's last seq is recorded, and the loader trained every sample once.
- **Concurrent upgrades killed.** Two processes upgrade the same format-1 store at once
  (one commit per file, so their commits interleave), each SIGKILLed at a random moment
  (mostly a few ms after the log reached a random number of commits); after every kill the
  store checks out (every file there, the table a sorted prefix of them, each added once),
  re-runs finish it, and the finished store verifies clean with every format-1 row once.
- **A release while a live loader follows.** A producer commits steps to runs A and B; a
  live loader follows both in a process SIGKILLed at random points and resumed from its
  checkpoint; ``release_run(B)`` runs meanwhile in a process that is itself SIGKILLed once
  and run again (whose gc then deletes the released files' bytes). Every sample of A and
  of B's files the release left in the table is trained exactly once; a sample of a
  released file is trained at most once, and those not trained are the loader's
  ``removed_samples``; the loader never wedges, and the store verifies clean.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # as a script: the repository's tests package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

import mmstore
from mmstore._lifecycle.gc import RELEASE_MARKER
from mmstore._rows.runs import run_dir
from tests import live_workers, store_workers
from tests.store_workers import fork_child, image_bytes, make_row, remake, small_adapter
from tests.test_commit_protocol import AnswerDroppingProxy

HERE = os.path.abspath(__file__)

# -- 1. S3 commits through a proxy that loses answers, producers SIGKILLed ----------------

S3_RUN = "s3run"


class EveryKthDroppingProxy(AnswerDroppingProxy):
    """Loses the answer to every ``every``-th ``PUT`` of a log entry (``_delta_log/*.json``)
    that passes, up to ``drops`` of them, whichever process sent it."""

    def __init__(self, upstream: tuple[str, int], *, every: int, drops: int) -> None:
        self.every = every
        self.seen = 0  # log-entry puts that passed
        super().__init__(upstream, drops=drops)

    def _take_drop(self, data: bytes) -> bool:
        line = data.split(b"\r\n", 1)[0]
        if not (line.startswith(b"PUT ") and b"/_delta_log/" in line and b".json" in line):
            return False
        with self._lock:
            self.seen += 1
            if self.seen % self.every or len(self.dropped) >= self.drops:
                return False
            self.dropped.append(line.decode())
            return True


def s3_plan(seed: int, producers: int, commits: int) -> list[list[dict[str, Any]]]:
    """Each producer's commits: a group of 1-3 samples, some with an image."""
    rng = random.Random(seed)
    return [
        [{"seq": c, "size": rng.randint(1, 3), "image": rng.random() < 0.5} for c in range(commits)]
        for _ in range(producers)
    ]


def s3_sample_ids(plan: list[list[dict[str, Any]]]) -> list[str]:
    return [
        f"p{p}-c{c['seq']}-{k}" for p, commits in enumerate(plan) for c in commits
        for k in range(c["size"])
    ]  # fmt: skip


def s3_producer(
    root: str, options: dict[str, Any], index: int, plan: list[dict[str, Any]], events: str,
    marker_fd: int,
) -> None:  # fmt: skip
    """Commit ``plan`` from its start as producer ``p<index>`` (seq = step = commit), saying
    ``c`` as each commit begins and ``d`` as it returns. First records the seq the table
    holds for it (what a restarted producer finds)."""
    store = mmstore.Store.open(root, s3_options=options)
    adapter = small_adapter()
    found = store.table.producer_seq(f"p{index}", run_id=S3_RUN)
    line = json.dumps({"producer": index, "pid": os.getpid(), "found": found}) + "\n"
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())
    os.close(fd)
    for commit in plan:
        seq = commit["seq"]
        media = []
        if commit["image"]:  # a pool shared by every producer: some puts renew a file
            media = [store.put_media(image_bytes((index * 7 + seq) % 12, 64, 48), "png")]
        rows = [
            make_row(adapter, media, f"p{index}-c{seq}-{k}", group_id=f"p{index}c{seq}")
            for k in range(commit["size"])
        ]
        os.write(marker_fd, b"c")
        with store.writer(S3_RUN, seq, producer=f"p{index}", seq=seq) as w:
            w.write_many(rows)
        assert w.duplicate or len(w.committed) == 1, (index, seq)
        os.write(marker_fd, b"d")


def verified(root: str, s3_options: dict[str, Any] | None = None) -> list[str]:
    """``mmstore.verify`` of the store as a kill left it, in a forked child (the forking
    parent stays free of delta-rs): its problems, none when it verifies clean."""
    read_fd, write_fd = os.pipe()

    def check() -> None:
        store = mmstore.Store.open(root, s3_options=s3_options)
        problems = [str(p) for p in mmstore.verify(store).problems]
        os.write(write_fd, json.dumps(problems).encode())

    pid = fork_child(check, close=read_fd)
    os.close(write_fd)
    with os.fdopen(read_fd) as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"verify failed with status {status}")
    return json.loads(text)


def s3_kills(spec: dict[str, Any]) -> dict[str, Any]:
    """Run every producer at once, SIGKILL each ``kills`` times at a random moment of a
    random commit (from the moment it begins to ``within`` s later) and restart it from the
    start of its plan; the last run of each goes to its end. Returns what happened."""
    rng = random.Random(spec["seed"])
    plans, kills_each, within = spec["plan"], spec["kills"], spec["within"]
    producers: dict[int, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []  # one per kill

    def start(index: int) -> None:
        read_fd, write_fd = os.pipe()
        args = (spec["root"], spec["options"], index, plans[index], spec["events"], write_fd)
        pid = fork_child(s3_producer, *args, close=read_fd)
        os.close(write_fd)
        state = producers.setdefault(index, {"kills": 0, "runs": 0})
        target = None
        if state["kills"] < kills_each:  # the commit to die in, and when in it
            target = (rng.randint(1, len(plans[index]) - 1), rng.uniform(0, within))
        state.update(pid=pid, fd=read_fd, begun=0, done=0, target=target, deadline=None)
        state["runs"] += 1

    for index in range(len(plans)):
        start(index)
    running = set(producers)
    deadline_all = time.monotonic() + spec["timeout"]
    while running:
        if time.monotonic() > deadline_all:
            raise RuntimeError("the producers did not finish in time")
        now = time.monotonic()
        deadlines = [producers[i]["deadline"] for i in running if producers[i]["deadline"]]
        wait = max(0.0, min(deadlines) - now) if deadlines else 1.0
        fds = {producers[i]["fd"]: i for i in running}
        ready, _, _ = select.select(list(fds), [], [], wait)
        for fd in ready:
            index = fds[fd]
            state = producers[index]
            data = os.read(fd, 256)
            if not data:  # it ended on its own: at the end of its plan, or it failed
                os.close(fd)
                _, status = os.waitpid(state["pid"], 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    raise RuntimeError(f"producer {index} failed with status {status}")
                running.discard(index)
                continue
            for byte in data:
                if byte == ord("c"):
                    state["begun"] += 1
                    if state["target"] and state["begun"] == state["target"][0]:
                        state["deadline"] = time.monotonic() + state["target"][1]
                elif byte == ord("d"):
                    state["done"] += 1
        for index in list(running):
            state = producers[index]
            if state["deadline"] is None or time.monotonic() < state["deadline"]:
                continue
            os.kill(state["pid"], signal.SIGKILL)
            _, status = os.waitpid(state["pid"], 0)
            os.close(state["fd"])
            if not os.WIFSIGNALED(status):  # it finished before the moment came
                if os.waitstatus_to_exitcode(status) != 0:
                    raise RuntimeError(f"producer {index} failed with status {status}")
                running.discard(index)
                continue
            state["kills"] += 1
            # The commit it was in: begun and not returned (None: killed between commits).
            in_flight = state["done"] if state["begun"] > state["done"] else None
            # Verified as the kill left it: the others paused meanwhile, their moments moved.
            paused = time.monotonic()
            others = [producers[i]["pid"] for i in running if i != index]
            for pid in others:
                os.kill(pid, signal.SIGSTOP)
            try:
                problems = verified(spec["root"], spec["options"])
            finally:
                for pid in others:
                    os.kill(pid, signal.SIGCONT)
            shift = time.monotonic() - paused
            deadline_all += shift
            for i in running:
                if producers[i]["deadline"] is not None:
                    producers[i]["deadline"] += shift
            records.append({"producer": index, "in_flight": in_flight, "problems": problems})
            start(index)
    return {
        "kills": sum(s["kills"] for s in producers.values()),
        "runs": {i: s["runs"] for i, s in producers.items()},
        "records": records,
    }


@pytest.fixture
def s3_proxy(s3_options):
    host, port = str(s3_options["endpoint_override"]).split(":")
    proxy = EveryKthDroppingProxy((host, int(port)), every=4, drops=1000)
    try:
        yield proxy, {**s3_options, "endpoint_override": f"127.0.0.1:{proxy.port}"}
    finally:
        proxy.close()


def _drain(live: mmstore.LiveLoader, trained: list[str], timeout: float) -> bool:
    """Train every complete step; False once ``timeout`` passes with none, True at the end
    (every followed run finished and every sample consumed)."""
    try:
        while True:
            for batch in live.next_step(timeout=timeout):
                fillers = batch["is_filler"].tolist()
                trained += [s for s, f in zip(batch["sample_ids"], fillers, strict=True) if not f]
    except mmstore.LiveTimeoutError:
        return False
    except mmstore.LiveFinishedError:
        return True


@pytest.mark.slow  # a SIGKILL loop of processes on an S3 server
def test_sigkill_of_producers_whose_s3_log_answers_are_lost_commits_each_sample_once(
    s3_store, s3_proxy, small_processor, tmp_path
):
    proxy, lossy_options = s3_proxy
    producers, commits = 3, 12
    plan = s3_plan(3, producers, commits)
    events = tmp_path / "events.jsonl"
    spec = {"root": s3_store.root, "options": lossy_options, "plan": plan, "kills": 3,
            "within": 0.6, "seed": 11, "events": str(events), "timeout": 240}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    driver = subprocess.Popen(
        [sys.executable, HERE, "s3-kills", str(tmp_path / "spec.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A live loader follows the run on the store itself (not through the proxy) meanwhile.
    live = mmstore.LiveLoader(s3_store, small_processor, runs=[S3_RUN], batch_size=4,
                              max_tokens=None, poll_interval=0.25,
                              materialize=mmstore.Materialize(dtype="float32",
                                                              node_cache_bytes=0))  # fmt: skip
    trained: list[str] = []
    try:
        while driver.poll() is None:
            _drain(live, trained, timeout=0.5)
        out, err = driver.communicate()
        assert driver.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        # The end of the run: one more producer's final commit; the loader then trains
        # what waits as a last, short step.
        adapter = mmstore.adapter_for(small_processor)
        last = [make_row(adapter, [], f"last-{k}", group_id="last") for k in range(2)]
        with s3_store.writer(S3_RUN, commits, producer="closer", seq=0, final=True) as w:
            w.write_many(last)
        deadline = time.monotonic() + 60
        while not _drain(live, trained, timeout=5):
            assert time.monotonic() < deadline, "the live loader did not reach the end"
    finally:
        live.close()
        if driver.poll() is None:
            driver.kill()
            driver.wait()

    expected = sorted([*s3_sample_ids(plan), "last-0", "last-1"])
    unheard, fresh = _kills_after_the_entry(result["records"], events)
    print({"kills": result["kills"], "in_a_new_commit": fresh, "after_its_entry": unheard,
           "dropped": len(proxy.dropped), "log_puts": proxy.seen,
           "version": s3_store.table.latest_version()})  # fmt: skip
    assert result["kills"] >= 2 * producers, result  # (one may finish before its moment)
    assert all(not r["problems"] for r in result["records"]), result  # clean after each kill
    assert fresh >= 3, result  # kills in a commit of a new seq, not only in re-commits
    assert len(proxy.dropped) >= 5, proxy.dropped  # answers lost ...
    assert proxy.cut.count("HTTP/1.1 200 OK") >= 3, proxy.cut  # ... of entries the server made

    store = mmstore.Store.open(s3_store.root, s3_options=s3_store.s3_options)
    report = mmstore.verify(store)
    assert report.ok, report.problems
    files = [f.path for f in store.files()]
    assert len(files) == len(set(files)), "a file listed twice"
    assert all(store.backend.stat(p) is not None for p in files), "a listed file missing"
    added = [f.path for e in store.table.entries_after(-1) for f in e.added]
    assert sorted(added) == sorted(files), "a file added twice, or added and gone"
    rows = store.rollouts(S3_RUN)
    assert sorted(r.sample_id for r in rows) == expected  # each sample once, none lost
    for row in rows:
        if row.sample_id.startswith("p"):
            assert row == remake(adapter, row.model_dump()), row.sample_id
    for p in range(producers):
        assert store.table.producer_seq(f"p{p}", run_id=S3_RUN) == commits - 1
    assert sorted(trained) == expected  # the live loader trained every sample once


def _kills_after_the_entry(records: list[dict[str, Any]], events: Path) -> tuple[int, int]:
    """Of the kills in a commit of a seq not committed before (``fresh``), those that came
    after its entry was made (the restart found the seq committed): for the producer, what
    a lost answer is. (``unheard``, ``fresh``)."""
    found: dict[int, list[int | None]] = {}
    for line in events.read_text().splitlines():
        event = json.loads(line)
        found.setdefault(event["producer"], []).append(event["found"])
    unheard = fresh = 0
    nth: dict[int, int] = {}
    for record in records:
        p, seq = record["producer"], record["in_flight"]
        k = nth[p] = nth.get(p, -1) + 1  # the producer's k-th kill ended its k-th run
        before, after = found[p][k], found[p][k + 1]
        if seq is None or (before is not None and before >= seq):
            continue  # between commits, or in a re-commit of a committed seq
        fresh += 1
        unheard += after is not None and after >= seq
    return unheard, fresh


# -- 2. two upgrades of one format-1 store at once, SIGKILLed -------------------------------


def _format_version(root: str) -> int:
    with open(os.path.join(root, "mmstore.json")) as f:
        return json.load(f)["format_version"]


def upgrade_racer(go: tuple[int, int], marker_fd: int, root: str) -> None:
    os.close(go[1])
    os.read(go[0], 1)  # blocks until the parent lets both go at once (EOF)
    store_workers.upgrade_op(root, marker_fd)


def _committed(root: str) -> int:
    """Commits in the table's log beyond its version 0 (-1: no table yet), read as files."""
    try:
        names = os.listdir(os.path.join(root, "rollouts", "_delta_log"))
    except FileNotFoundError:
        return -1
    return sum(n.endswith(".json") and n[:-5].isdigit() for n in names) - 1


def upgrade_races(root: str, rounds: int, seed: int) -> dict[str, Any]:
    """``rounds`` times: the format-1 store upgraded by two processes at once, again and
    again until it is format 2. In the first two trials both are SIGKILLed, in the third
    one of them (the other runs to its end), in any later one neither. A racer is killed a
    few ms after the log has reached a random number of commits (by either racer: from
    the next one to the last, so also after its last commit, in the run records and the
    manifest's bump), or one in four at a random moment from its start (before the
    table's first commit). After every trial the store is checked
    (:func:`tests.store_workers.upgrade_check`). The last round's store stays format 2."""
    adapter = small_adapter()
    rng = random.Random(seed)
    store_workers._run_to_end(lambda: store_workers.upgrade_prepare(root, adapter))
    store_workers.to_format_1(root)
    expected = [f"rollouts/{p}" for p in store_workers.format_1_files(root)]
    outcome: dict[str, Any] = {"trials": 0, "killed": 0, "finished": 0, "upgraded": 0,
                               "trials_per_round": [], "committed_after_kills": []}  # fmt: skip
    within = 1.0  # how long an upgrade was last seen to take
    for round_ in range(rounds):
        trials = 0
        while _format_version(root) == 1:
            trials += 1
            kill = [[True, True], [True, True], [True, True], [False, False]][min(trials, 4) - 1]
            if trials == 3:
                kill[rng.randrange(2)] = False
            files = len(expected)
            base = min(max(_committed(root), 0) + 1, files)  # the next commit to come
            # Per racer: (commits to wait for, then seconds) or None (runs to its end).
            targets = [
                None if not k
                else (-1, rng.uniform(0, 0.5 * within)) if rng.random() < 0.25
                else (rng.randint(base, files), rng.uniform(0, 0.005))
                for k in kill
            ]  # fmt: skip
            go_r, go_w = os.pipe()
            pending: dict[int, dict[str, Any]] = {}
            for target in targets:
                read_fd, write_fd = os.pipe()
                pid = fork_child(upgrade_racer, (go_r, go_w), write_fd, root, close=read_fd)
                os.close(write_fd)
                pending[read_fd] = {"pid": pid, "target": target, "end": None}
            os.close(go_r)
            os.close(go_w)  # EOF: both go
            started = time.monotonic()
            while pending:
                committed = _committed(root)
                for fd, racer in list(pending.items()):
                    target = racer["target"]
                    if target is not None and racer["end"] is None and committed >= target[0]:
                        racer["end"] = time.monotonic() + target[1]
                    if racer["end"] is not None and time.monotonic() >= racer["end"]:
                        os.kill(racer["pid"], signal.SIGKILL)  # its moment
                        outcome[_reap(racer["pid"], fd)] += 1
                        del pending[fd]
                for fd in select.select(list(pending), [], [], 0.002)[0]:
                    data = os.read(fd, 16)
                    if b"d" in data:
                        within = time.monotonic() - started
                    if not data:  # it ended on its own
                        outcome[_reap(pending.pop(fd)["pid"], fd)] += 1
            store_workers._run_to_end(lambda: store_workers.upgrade_check(root, expected, adapter))
            if _format_version(root) == 1:  # where the kills left it
                outcome["committed_after_kills"].append(_committed(root))
        outcome["trials"] += trials
        outcome["trials_per_round"].append(trials)
        outcome["upgraded"] += 1
        if round_ < rounds - 1:
            store_workers.to_format_1(root)
    return outcome


def _reap(pid: int, fd: int) -> str:
    """Wait for a child that was killed or ended: ``killed`` or ``finished``."""
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    if os.WIFSIGNALED(status):
        return "killed"
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"an upgrade failed with status {status}")
    return "finished"


@pytest.mark.slow  # a SIGKILL loop of racing processes
def test_sigkill_of_two_upgrades_at_once_loses_nothing_and_adds_each_file_once(tmp_path, adapter):
    root = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, HERE, "upgrade-races", str(root), "5", "9"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    print(outcome)
    assert outcome["upgraded"] == 5 and outcome["killed"] >= 10, outcome
    # Some kills left the upgrade half done: some files committed, not all.
    files = store_workers.UPGRADE_RUNS * store_workers.UPGRADE_STEPS
    assert any(0 < n < files for n in outcome["committed_after_kills"]), outcome
    store = mmstore.Store.open(root)
    report = mmstore.verify(store)
    assert report.ok, report.problems
    expected = [f"rollouts/{p}" for p in store_workers.format_1_files(str(root))]
    added = [f.path for e in store.table.entries_after(-1) for f in e.added]
    assert added == expected  # each file added once, in sorted order
    rows = store_workers.check_store(store, adapter)
    planned = sorted(
        f"u{r}-{s}"
        for r in range(store_workers.UPGRADE_RUNS)
        for s in range(store_workers.UPGRADE_STEPS)
    )
    assert sorted(r["sample_id"] for r in rows) == planned
    # A live loader from the start of the log (which replays every add, not the latest
    # version's deduplicated files) trains every format-1 row exactly once.
    runs = [f"u{r}" for r in range(store_workers.UPGRADE_RUNS)]
    with live_workers.live_loader(store, runs=runs, batch_size=1, max_tokens=None) as live:
        trained: list[str] = []
        assert _drain(live, trained, timeout=2) is False  # no final commit: it waits on
    assert sorted(trained) == planned


# -- 3. release_run while a live loader follows, both SIGKILLed ----------------------------

AB_RUNS = ["A", "B"]


def ab_plan(seed: int, commits: int, after: int) -> list[dict[str, Any]]:
    """Commits to runs A and B of 2-3 groups of 1-3 samples, sometimes with an image; the
    last ``after`` come after the release of B (the producer waits for it), and hold each
    run's final commit. Sample ids ``c<seq>-g<group>-<k>``. Fewer than 20 commits: no
    checkpoint of the log, so gc cleans none of it up and any checkpoint of the loader
    resumes (a state older than the grace period below a cleaned-up log would not)."""
    rng = random.Random(seed)
    runs = [rng.choice(AB_RUNS) for _ in range(commits - 2)] + AB_RUNS
    before = runs[: commits - after]
    assert {"A", "B"} <= set(before) and {"A", "B"} <= set(runs[commits - after : -2])
    plan = []
    for c, run in enumerate(runs):
        groups = [{"size": rng.randint(1, 3), "image": rng.random() < 0.3}
                  for _ in range(rng.randint(2, 3))]  # fmt: skip
        plan.append({"run": run, "seq": c, "groups": groups, "delay": rng.uniform(0.02, 0.1),
                     "final": c >= commits - 2, "wait": c == commits - after})  # fmt: skip
    return plan


def ab_produce(root: str, plan: list[dict[str, Any]], released: str) -> None:
    """Commit ``plan`` (producer ``sampler``, seq = step = commit); before the commit marked
    ``wait``, wait until the file ``released`` exists."""
    store = mmstore.Store.open(root)
    adapter = small_adapter()
    for commit in plan:
        if commit["wait"]:
            deadline = time.monotonic() + 120
            while not os.path.exists(released):
                assert time.monotonic() < deadline, "the release did not happen"
                time.sleep(0.02)
        time.sleep(commit["delay"])
        rows = []
        for g, group in enumerate(commit["groups"]):
            seed = commit["seq"] * 10 + g
            media = [store.put_media(image_bytes(seed, 64, 48), "png")] if group["image"] else []
            rows += [make_row(adapter, media, f"c{commit['seq']}-g{g}-{k}", group_id=f"g{g}")
                     for k in range(group["size"])]  # fmt: skip
        run, seq = commit["run"], commit["seq"]
        with store.writer(run, seq, producer="sampler", seq=seq, final=commit["final"]) as w:
            w.write_many(rows)


def ab_release(root: str, grace: float, marker_fd: int) -> None:
    store = mmstore.Store.open(root)
    os.write(marker_fd, b"s")
    mmstore.release_run(store, "B", grace_seconds=grace)
    os.write(marker_fd, b"d")


def ab_release_again(root: str, grace: float) -> None:
    """Run the release again after its SIGKILL. A kill that landed after the release had
    finished (its marker deleted, before it said so or while the process exited) leaves
    nothing to finish: then ``release_run`` rightly says B is not in the store, and B's
    rows must be gone."""
    store = mmstore.Store.open(root)
    try:
        mmstore.release_run(store, "B", grace_seconds=grace)
    except mmstore.RunNotFoundError:
        assert store.backend.stat(f"{run_dir('B')}/{RELEASE_MARKER}") is None
        assert "B" not in {f.run_id for f in store.table.snapshot().files}


def ab_gc(root: str, grace: float) -> None:
    mmstore.gc(mmstore.Store.open(root), grace_seconds=grace)


def _log_removes(root: str) -> int:
    """The log entries that remove files (read as plain files: no delta-rs here)."""
    log_dir = os.path.join(root, "rollouts", "_delta_log")
    count = 0
    for name in os.listdir(log_dir):
        if name.endswith(".json") and name[:-5].isdigit():
            with open(os.path.join(log_dir, name)) as f:
                count += '"remove"' in f.read()
    return count


def ab_drive(spec: dict[str, Any]) -> dict[str, Any]:
    """The producer, and the release of B: once the loader has checkpointed a few steps,
    ``release_run`` is SIGKILLed a random moment (up to ``within`` s) after its remove is
    in the log, and run again to its end; a gc a grace period later deletes the released
    files' bytes; then the producer goes on with its last commits (B's among them: rows of
    B committed after its release)."""
    rng = random.Random(spec["seed"])
    root, grace, released = spec["root"], spec["grace"], spec["released"]
    producer = fork_child(ab_produce, root, spec["plan"], released)
    deadline = time.monotonic() + 120
    while True:  # the loader has trained a few steps (of A and B)
        assert time.monotonic() < deadline, "the loader made no progress"
        try:
            with open(spec["checkpoint"]) as f:
                if json.load(f)["state"]["step"] >= spec["release_after_step"]:
                    break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    read_fd, write_fd = os.pipe()
    pid = fork_child(ab_release, root, grace, write_fd, close=read_fd)
    os.close(write_fd)
    outcome: dict[str, Any] = {"release_killed": False}
    if store_workers._await_marker(read_fd, b"s", 1):
        # Killed a random moment after its remove is in the log: in its gc (the rows are
        # gone from the table, their bytes not yet).
        deadline = time.monotonic() + 60
        while not _log_removes(root) and time.monotonic() < deadline:
            time.sleep(0.002)
        removed_at = time.monotonic()
        store_workers._await_marker(read_fd, b"d", 1, timeout=rng.uniform(0, spec["within"]))
        outcome["killed_after_remove_s"] = round(time.monotonic() - removed_at, 3)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(read_fd)
    if os.WIFSIGNALED(status):
        outcome["release_killed"] = True
        outcome["problems_after_release_kill"] = verified(root)
    elif os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"release_run failed with status {status}")
    store_workers._run_to_end(lambda: ab_release_again(root, grace))
    time.sleep(grace + 0.5)
    store_workers._run_to_end(lambda: ab_gc(root, grace))  # the released bytes go
    with open(released, "w"):
        pass
    _, status = os.waitpid(producer, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the producer failed with status {status}")
    outcome["removes"] = _log_removes(root)
    return outcome


def ab_consume(root: str, out: str, die: tuple[int, str] | None, workers: int) -> None:
    """Train runs A and B to their end, checkpointing after each step (the loader state
    and the history of what was trained, atomically); SIGKILL at ``die`` = (step, point)
    as :func:`tests.live_workers.consume` does. The last checkpoint says ``finished``; each
    keeps the states of every step before it (``states``: each with the number of history
    records then)."""
    saved: dict[str, Any] = {"state": None, "history": [], "finished": False, "states": []}
    if os.path.exists(out):
        with open(out) as f:
            saved = json.load(f)
    store = mmstore.Store.open(root)
    live = live_workers.live_loader(store, runs=AB_RUNS, max_staleness=None, num_workers=workers)
    if saved["state"] is not None:
        live.load_state_dict(saved["state"])
    history = list(saved["history"])
    while True:
        step = live.step
        try:
            batches = live.next_step(policy_version=step, timeout=60)
        except mmstore.LiveFinishedError:
            break
        for micro, batch in enumerate(batches):
            history.append(live_workers.micro_record(batch))
            if die == (step, "mid") and micro == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        if die == (step, "save"):
            os.kill(os.getpid(), signal.SIGKILL)
        states = [*saved["states"], {"state": live.state_dict(), "trained": len(history)}]
        saved = {"state": states[-1]["state"], "history": history, "finished": False,
                 "states": states}  # fmt: skip
        _save(out, saved)
        if die == (step, "saved"):
            os.kill(os.getpid(), signal.SIGKILL)
    _save(out, {**saved, "state": live.state_dict(), "history": history, "finished": True})
    live.close()


def _save(out: str, doc: dict[str, Any]) -> None:
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def ab_kills(root: str, out: str, seed: int, max_kills: int) -> int:
    """Fork consumers until one finishes; the first ``max_kills`` die at a random point of
    the step they are at or one of the next few. The kills."""
    rng = random.Random(seed)
    killed = 0
    while True:
        done = 0
        if os.path.exists(out):
            with open(out) as f:
                saved = json.load(f)
            if saved["finished"]:
                return killed
            done = saved["state"]["step"]
        die = None
        if killed < max_kills:
            die = (done + rng.choice([0, 0, 1, 2]), rng.choice(["mid", "save", "saved"]))
        workers = rng.choice([0, 0, 2])

        def consumer(die: tuple[int, str] | None = die, workers: int = workers) -> None:
            # A consumer that hangs says where, and ends, instead of hanging the test.
            faulthandler.dump_traceback_later(120, exit=True)
            ab_consume(root, out, die, workers)

        _, status = os.waitpid(fork_child(consumer), 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed += 1
            problems = verified(root)  # while the producer and the release go on
            if problems:
                raise SystemExit(f"verify after consumer kill {killed}: {problems}")
        elif status:
            raise SystemExit(f"consumer failed with status {status}")


@pytest.mark.slow  # processes killed and resumed while a run is released
def test_sigkill_of_a_live_loader_and_of_release_run_trains_each_kept_sample_once(tmp_path):
    root = tmp_path / "store"
    mmstore.Store.open(root, create=True)
    plan = ab_plan(21, commits=16, after=5)
    checkpoint = tmp_path / "ckpt.json"
    # "within": the release ends about 20 ms after its remove is in the log here, so a kill
    # up to 10 ms after it lands inside the release (at 100 ms, seed 4 drew 24 ms: a miss).
    spec = {"root": str(root), "plan": plan, "released": str(tmp_path / "released"),
            "checkpoint": str(checkpoint), "grace": 2.0, "within": 0.01, "seed": 4,
            "release_after_step": 3}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    consumers = subprocess.Popen(
        [sys.executable, HERE, "ab-kills", str(root), str(checkpoint), "6", "15"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        driver = subprocess.run([sys.executable, HERE, "ab-drive", str(tmp_path / "spec.json")],
                                capture_output=True, text=True, timeout=240)  # fmt: skip
        out, err = consumers.communicate(timeout=240)  # the loader never wedges
    finally:
        if consumers.poll() is None:
            consumers.kill()
            consumers.wait()
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert consumers.returncode == 0, err[-3000:]
    outcome = json.loads(driver.stdout.strip().splitlines()[-1])
    kills = int(out.split()[-1])
    saved = json.loads(checkpoint.read_text())
    assert saved["finished"]

    store = mmstore.Store.open(root)
    report = mmstore.verify(store)
    assert report.ok, report.problems
    planned = {
        f"c{c['seq']}-g{g}-{k}": c["run"]
        for c in plan for g, group in enumerate(c["groups"]) for k in range(group["size"])
    }  # fmt: skip
    held = [r.sample_id for r in store.rollouts()]  # what the release left in the table
    assert len(held) == len(set(held)) and set(held) <= set(planned)
    kept, released = set(held), set(planned) - set(held)
    trained = [sid for record in saved["history"] for sid in record[3]]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    assert all(planned[s] == "B" for s in released)  # only B's files were released
    assert kept <= set(trained), sorted(kept - set(trained))[:5]  # every kept sample trained
    assert set(trained) <= kept | released
    untrained = released - set(trained)
    counted = saved["state"]["stats"]["removed_samples"]
    # The released files' bytes are gone (a loader resumed after this never reads them).
    assert store.table.first_version() == 0  # no log cleaned up
    removed = {p for e in store.table.entries_after(-1) for p in e.removed}
    assert removed and all(store.backend.stat(p) is None for p in removed)
    print({"kills": kills, **outcome, "samples": len(planned), "trained": len(trained),
           "released": len(released), "released_trained": len(released & set(trained)),
           "removed_samples": counted, "untrained_released": len(untrained)})  # fmt: skip
    assert kills >= 10 and outcome["release_killed"], (kills, outcome)
    assert outcome["problems_after_release_kill"] == [], outcome
    assert released & set(trained) and untrained  # B trained before the release, and not

    # Checkpoints taken before the release resume on the store as it is now (the released
    # files' bytes gone): the loader trains exactly the kept samples not trained by then,
    # never a released one, and reaches the end.
    first_remove = min(v for v in range(store.table.latest_version() + 1)
                       if store.table.log_entry(v).removed)  # fmt: skip
    before = [s for s in saved["states"] if s["state"]["cursor"][0] <= first_remove]
    assert before
    before = [before[0], before[-1]]  # the first and the last
    counts = []  # (removed_samples, released samples not trained before the state)
    for old in before:
        done = {sid for record in saved["history"][: old["trained"]] for sid in record[3]}
        with live_workers.live_loader(store, runs=AB_RUNS, max_staleness=None) as live:
            live.load_state_dict(old["state"])
            rest: list[str] = []
            assert _drain(live, rest, timeout=10), "the resumed loader did not reach the end"
        assert len(rest) == len(set(rest)) and set(rest) == kept - done, old["state"]
        counts.append((live.stats()["removed_samples"], len(released - done)))
    # Last: every released sample not trained is counted in removed_samples, by the run
    # (across its resumes) and by each resume from an earlier checkpoint.
    assert counted == len(untrained), (counted, len(untrained))
    assert all(a == b for a, b in counts), counts


# -- as a script: the forking parents of the kill loops ------------------------------------

if __name__ == "__main__":
    command = sys.argv[1]
    if command == "s3-kills":
        with open(sys.argv[2]) as f:
            print(json.dumps(s3_kills(json.load(f))))
    elif command == "ab-drive":
        with open(sys.argv[2]) as f:
            print(json.dumps(ab_drive(json.load(f))))
    elif command == "ab-kills":
        print(ab_kills(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    elif command == "upgrade-races":
        print(json.dumps(upgrade_races(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        raise SystemExit(f"unknown command {command!r}")
