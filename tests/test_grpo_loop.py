"""The worked GRPO loop (examples/grpo_loop.py): killed with SIGKILL at a random step and
resumed from its last checkpoint, it ends on the same weights, bit for bit, having trained
the same samples in the same order; and its replay export gives the same loss.

Every run is a subprocess (the loop as a user runs it); a run is mostly interpreter start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mmstore

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_loop.py"
STEPS = 12  # the example's defaults: 3 generations x 16 samples, 4 per optimizer step
CKPT_EVERY = 3

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def loop(tmp: Path, *args: str, kill_at: int | None = None) -> list[dict[str, Any]]:
    """Run the example on ``tmp``'s store and checkpoint; SIGKILL it once it reports step
    ``kill_at``. Returns its JSON progress lines."""
    cmd = [sys.executable, str(EXAMPLE), "--store", str(tmp / "store"), "--ckpt",
           str(tmp / "ckpt.pt"), "--ckpt-every", str(CKPT_EVERY), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMSTORE_PROGRESS": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        entry = json.loads(line)
        if "header" in entry:  # the first line says what the process is
            assert not lines and entry["header"]["store"] == str(tmp / "store")
            continue
        lines.append(entry)
        if kill_at is not None and lines[-1].get("step") == kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    rc = proc.wait(timeout=300)
    assert rc == (-signal.SIGKILL if kill_at is not None else 0), lines
    return lines


def final(tmp: Path) -> dict[str, Any]:
    return torch.load(tmp / "ckpt.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    lines = loop(tmp)
    assert [line["step"] for line in lines[:-1]] == list(range(1, STEPS + 1))
    return final(tmp)


@pytest.mark.parametrize("workers", [0, 2])
def test_killed_and_resumed_loop_ends_on_the_same_weights(tmp_path, reference, workers):
    kill_at = random.Random(workers).randrange(CKPT_EVERY + 1, STEPS)  # past a checkpoint
    killed = loop(tmp_path, "--workers", str(workers), kill_at=kill_at)
    assert killed[-1]["step"] == kill_at
    restart = final(tmp_path)["step"]  # the last checkpoint the killed run saved
    final_gen = final(tmp_path)["gen"]
    assert restart >= CKPT_EVERY and restart % CKPT_EVERY == 0
    resumed = loop(tmp_path, "--workers", str(workers), "--replay", str(tmp_path / "dump"))
    assert resumed[0] == {"resumed": restart, "gen": final_gen}, "no resume line first"
    assert resumed[1]["step"] == restart + 1, "the resume did not start at the checkpoint"

    got = final(tmp_path)
    assert got["trained"] == reference["trained"]  # the same sample ids, the same steps
    flat = [s for step in got["trained"] for s in step]
    assert len(flat) == len(set(flat)) == STEPS * 4
    for name, tensor in reference["model"].items():
        assert torch.equal(got["model"][name], tensor), f"{name} differs after the resume"
    for key, state in reference["opt"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["opt"]["state"][key][name], state[name])

    # pins: only the last checkpoint's; older generations released, their media collected
    store = mmstore.Store.open(tmp_path / "store")
    assert list(mmstore.list_pins(store)) == [f"grpo-ckpt-{STEPS}"]
    assert {f.run_id for f in store.files()} == {"gen-2"}
    rollouts = (tmp_path / "store" / "rollouts").iterdir()
    assert sorted(p.name for p in rollouts if p.name != "_delta_log") == ["run_id=gen-2"]
    assert mmstore.verify(store).ok

    # replay: the export of the last window holds exactly its rows and media, same loss
    losses = resumed[-1]
    assert losses["store_loss"] == losses["export_loss"] != 0
    assert mmstore.verify(mmstore.Store.open(tmp_path / "dump")).ok


def test_the_loop_runs_behind_the_family_flag_and_a_rerun_changes_nothing(tmp_path):
    """GLM-4.1V (M-RoPE of its own, other token ids): one generation, and its replay. Run
    again once finished, it says so and trains, writes and exports nothing."""
    args = ("--family", "glm4v", "--gens", "1", "--replay", str(tmp_path / "d"))
    lines = loop(tmp_path, *args)
    assert [line.get("step") for line in lines[:-2]] == [1, 2, 3, 4]
    assert all(isinstance(line["loss"], float) for line in lines[:-2])  # a loss per step
    assert lines[-1]["store_loss"] == lines[-1]["export_loss"] != 0

    ckpt = (tmp_path / "ckpt.pt").read_bytes()
    version = mmstore.Store.open(tmp_path / "store").table.latest_version()
    again = loop(tmp_path, *args)
    assert again == [
        {"finished": 4, "ckpt": str(tmp_path / "ckpt.pt")},
        {"replay_exists": str(tmp_path / "d")},
    ]
    assert (tmp_path / "ckpt.pt").read_bytes() == ckpt  # not one tensor changed
    assert mmstore.Store.open(tmp_path / "store").table.latest_version() == version


def test_the_async_loop_survives_sigkill_of_either_side_bit_for_bit(tmp_path):
    """--async-level 1: the rollout side in its own process generates step n with the
    weights of step n-1; the trainer follows it with a LiveLoader. Each side is killed with
    SIGKILL at a random point and started again: the final weights are those of an
    uninterrupted run, and every sample was trained once, in the same steps."""
    base = ("--async-level", "1", "--gens", "2", "--steps-per-gen", "2", "--timeout", "120")

    def side(tmp: Path, role: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, str(EXAMPLE), "--store", str(tmp / "store"), "--ckpt",
               str(tmp / "ckpt.pt"), *base, "--role", role]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MMSTORE_PROGRESS": "0"}
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)

    whole = tmp_path / "whole"
    whole.mkdir()
    both = [side(whole, "rollout"), side(whole, "train")]
    assert [p.wait(timeout=300) for p in both] == [0, 0]
    reference = torch.load(whole / "ckpt.pt")
    assert reference["finished"] and reference["step"] == 4

    rng = random.Random(29)
    killed = tmp_path / "killed"
    killed.mkdir()
    sides = {role: side(killed, role) for role in ("rollout", "train")}
    for role in ("train", "rollout"):  # each side in turn, while the other runs on
        process = sides[role]
        for _line in process.stdout:  # kill it after a random number of its progress lines
            if rng.random() < 0.5:
                break
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        sides[role] = side(killed, role)
    assert [p.wait(timeout=300) for p in sides.values()] == [0, 0]
    got = torch.load(killed / "ckpt.pt")
    assert got["trained"] == reference["trained"]
    flat = [s for step in got["trained"] for s in step]
    assert len(flat) == len(set(flat)) == 16
    for name, tensor in reference["model"].items():
        assert torch.equal(got["model"][name], tensor), f"{name} differs after the kills"
    store = mmstore.Store.open(killed / "store")
    assert store.table.producer_seq("rollout") == 3  # each step committed once
    assert len(store.rollouts("async")) == 16


def test_the_async_sides_die_together_and_a_finished_run_exits_0(tmp_path):
    """Issue 42: the rollout child dies with its SIGKILLed parent (no orphan commits steps
    later), a rollout side that dies is noticed by the trainer within seconds, naming it,
    and a run trained to the end exits 0."""
    base = ["--store", str(tmp_path / "store"), "--ckpt", str(tmp_path / "ckpt.pt"),
            "--async-level", "1", "--gens", "1", "--steps-per-gen", "2",
            "--timeout", "120"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMSTORE_PROGRESS": "0"}

    def start(*extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), *base, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )

    def children(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
        return found

    def alive(pid: int) -> bool:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        return False

    parent = start()
    assert json.loads(parent.stdout.readline())["header"]["mode"] == "async (K=1)"
    deadline = time.monotonic() + 60
    while not (kids := children(parent.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kids, "the trainer started no rollout process"
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    time.sleep(5)
    assert not [k for k in kids if alive(k)], "the rollout child outlived its parent"

    parent = start()  # again: resumes; now kill the child instead
    parent.stdout.readline()
    deadline = time.monotonic() + 60
    while not (kids := children(parent.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(kids[0], signal.SIGKILL)
    killed_at = time.monotonic()
    rc = parent.wait(timeout=60)
    err = parent.stderr.read()
    if rc != 0:  # unless the trainer had finished already, it noticed within seconds
        assert time.monotonic() - killed_at < 10
        assert "rollout process" in err and str(kids[0]) in err, err

    finished = start()  # a run trained to the end (again, if needed) exits 0
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    again = start()
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert '"finished"' in out
    weights = sorted(os.listdir(tmp_path / "ckpt.pt.weights"))
    assert weights == ["1.pt", "2.pt"], weights  # the rollout side can ask for no other
