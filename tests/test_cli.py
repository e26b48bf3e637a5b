"""The ``mmstore`` command line.

One subprocess per subcommand (and for a wrong path) runs it the way people and scripts do:
exit status, stdout, a clean one-line stderr. The finer points of each command's output run
in-process through ``main(argv)``, which is the same code without the interpreter start-up.
The store is written in-process with known contents.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import mmstore
from mmstore.cli import main
from mmstore.synth import screenshot


def run_cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m mmstore.cli ARGS`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "mmstore.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MMSTORE_PROGRESS": "0", **(env or {})},
    )


def call_cli(capsys, *args: object) -> subprocess.CompletedProcess[str]:
    """The same command in-process; returns status and output in the same shape."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def assert_user_error(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """A clear one-line message on stderr, no traceback, the given exit status."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 or code == 2  # argparse prints its usage line first
    for needle in needles:
        assert needle in lines[-1]


def make_rollout(adapter, sample_id, media, reward):
    ids = [11, 12]
    for _ in media:
        ids += [13, adapter.image_token_id, 14]
    tokens, refs = adapter.expand(ids, media)
    return mmstore.Rollout(
        sample_id=sample_id,
        tokens=[*tokens, 100, 101, 102],
        prompt_len=len(tokens),
        loss_mask=[False] * len(tokens) + [True] * 3,
        reward=reward,
        images=refs,
    )


@pytest.fixture(scope="module")
def known(tmp_path_factory, adapter):
    """Rows per (run, step) and the media they share; the store's root."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("cli") / "store", create=True)
    media = {
        "A": store.put_image(screenshot(1, 160, 120)),
        "B": store.put_image(screenshot(2, 200, 150)),
        "C": store.put_image(screenshot(3, 120, 100)),
    }
    A, B, C = media["A"], media["B"], media["C"]
    rows = {
        ("r1", 0): [
            make_rollout(adapter, "s0", [A, B], 1.0),
            make_rollout(adapter, "s1", [A, B], 0.0),
            make_rollout(adapter, "s2", [A], 1.0),
        ],
        ("r1", 1): [make_rollout(adapter, "s3", [B], 0.5), make_rollout(adapter, "s4", [], None)],
        ("r2", 0): [make_rollout(adapter, "s5", [C], 1.0)],
    }
    for (run_id, step), rollouts in rows.items():
        with store.writer(run_id=run_id, step=step) as w:
            w.write_many(rollouts)
    return {"root": Path(store.root), "media": media, "rows": rows}


@pytest.fixture
def copy(known, tmp_path) -> Path:
    """A private copy of the known store, for commands that change it."""
    shutil.copytree(known["root"], tmp_path / "store")
    return tmp_path / "store"


@pytest.mark.slow  # a subprocess per command
def test_inspect_lists_rollouts(known, capsys):
    result = run_cli("inspect", known["root"])
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for sample_id in ("s0", "s1", "s2", "s3", "s4", "s5"):
        assert sample_id in result.stdout
    assert "6 of 6 rollouts" in result.stdout
    header = result.stdout.splitlines()[0].split()
    assert header[:4] == ["run", "step", "sample", "group"]

    result = call_cli(capsys, "inspect", known["root"], "--run", "r1", "--step", "0", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert listing["total"] == 3
    assert [r["sample_id"] for r in listing["rows"]] == ["s0", "s1", "s2"]
    s0 = known["rows"]["r1", 0][0]
    assert listing["rows"][0]["tokens"] == len(s0.tokens)
    assert listing["rows"][0]["images"] == 2

    result = call_cli(capsys, "inspect", known["root"], "--limit", "2")
    assert "2 of 6 rollouts (--limit 0 shows all)" in result.stdout
    assert_user_error(
        call_cli(capsys, "inspect", known["root"], "--run", "r9"), 1, "no rollouts match --run r9"
    )


def test_inspect_one_sample_and_its_picture(known, tmp_path, capsys):
    png = tmp_path / "s0.png"
    result = call_cli(capsys, "inspect", known["root"], "--sample", "s0", "--view", png)
    assert result.returncode == 0, result.stderr
    s0 = known["rows"]["r1", 0][0]
    first, second = s0.images
    out = result.stdout
    assert "sample s0  run r1  step 0" in out
    assert f"image#0 [{first.offset},{first.offset + first.length})" in out
    assert f"image#1 [{second.offset},{second.offset + second.length})" in out
    assert f"completion [{s0.prompt_len},{len(s0.tokens)})" in out
    assert first.hash in out and second.uri in out
    with Image.open(png) as view:
        assert view.width > 200 and view.height > 100

    result = call_cli(capsys, "inspect", known["root"], "--sample", "s5", "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)
    s5 = known["rows"]["r2", 0][0]
    assert (row["run_id"], row["step"], row["tokens"]) == ("r2", 0, s5.tokens)
    assert row["images"][0]["hash"] == known["media"]["C"].hash

    assert_user_error(
        call_cli(capsys, "inspect", known["root"], "--sample", "nope"), 1, "no such sample", "nope"
    )


@pytest.mark.slow  # a subprocess per command
def test_stats_table_and_json(known, capsys):
    result = run_cli("stats", known["root"], "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    by_step = {(r["run_id"], r["step"]): r for r in stats["rows"]}
    for key, rollouts in known["rows"].items():
        hashes = [ref.hash for x in rollouts for ref in x.images]
        assert by_step[key]["samples"] == len(rollouts)
        assert by_step[key]["images"] == len(hashes)
        assert by_step[key]["unique_images"] == len(set(hashes))
    assert by_step["r1", 0]["dedup_ratio"] == 5 / 2  # A,B,A,B,A
    assert stats["total"]["samples"] == 6 and stats["total"]["unique_images"] == 3
    assert stats["total"]["missing_media"] == 0

    result = call_cli(capsys, "stats", known["root"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["run", "step", "rows", "images", "dedup"]
    assert max(map(len, lines)) <= 80  # fits a terminal
    assert [line.split()[:3] for line in lines[1:4]] == [
        ["r1", "0", "3"],
        ["r1", "1", "2"],
        ["r2", "0", "1"],
    ]
    assert "whole store" in result.stdout and "KiB" in result.stdout


@pytest.mark.slow  # a subprocess per command
def test_wrong_path_and_non_store_directory(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "store"
    assert_user_error(run_cli("stats", missing), 1, "no mmstore store", str(missing))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a store")
    for command in ("inspect", "stats", "verify", "gc"):
        assert_user_error(call_cli(capsys, command, plain), 1, "no mmstore store", str(plain))


def test_usage_errors_exit_2(known, tmp_path, capsys):
    for args in (
        ["export", known["root"], tmp_path / "d", "--steps", "3:x"],
        ["gc", known["root"], "--grace", "-1"],
        ["inspect"],
        ["inspect", known["root"], "--view", tmp_path / "v.png"],
        [],
    ):
        with pytest.raises(SystemExit) as exit_:
            main([str(a) for a in args])
        assert exit_.value.code == 2
    assert "3:x" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess per command
def test_verify_names_a_corrupted_media_file(copy, known, capsys):
    result = call_cli(capsys, "verify", copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")

    corrupted = known["media"]["B"].uri
    data = bytearray((copy / corrupted).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    (copy / corrupted).write_bytes(bytes(data))

    result = run_cli("verify", copy)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert corrupted in result.stdout and "hash_mismatch" in result.stdout
    assert result.stdout.strip().endswith("3 problem(s)")

    result = call_cli(capsys, "verify", copy, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert {p["uri"] for p in report["problems"]} == {corrupted}
    assert {p["kind"] for p in report["problems"]} == {"hash_mismatch"}
    # B is in s0, s1 (r1/0) and s3 (r1/1): every sample that holds it is named.
    assert {p["sample_id"] for p in report["problems"]} == {"s0", "s1", "s3"}

    # Presence and sizes only: the same-size corruption goes unnoticed, by design.
    assert call_cli(capsys, "verify", copy, "--no-hash").returncode == 0


@pytest.mark.slow  # a subprocess per command
def test_gc_dry_run_then_delete(copy, known, capsys):
    store = mmstore.Store.open(copy)
    orphan = store.put_image(screenshot(99, 100, 90))  # referenced by nothing
    result = run_cli("gc", copy, "--grace", "0", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and report["deleted"] == [orphan.uri]
    assert (copy / orphan.uri).exists()

    result = call_cli(capsys, "gc", copy, "--grace", "3600")
    assert result.returncode == 0, result.stderr
    assert "deleted 0 media files" in result.stdout  # the orphan is younger than an hour
    result = call_cli(capsys, "gc", copy, "--grace", "0")
    assert result.returncode == 0, result.stderr
    assert f"deleted {orphan.uri}" in result.stdout
    assert not (copy / orphan.uri).exists()
    assert all((copy / m.uri).exists() for m in known["media"].values())


@pytest.mark.slow  # a subprocess per command
def test_export_a_step_range(known, tmp_path, capsys):
    dest = tmp_path / "dump"
    result = run_cli("export", known["root"], dest, "--run", "r1", "--steps", "1:2", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows"] == 2 and summary["rollout_files"] == 1
    exported = mmstore.Store.open(dest)
    assert sorted(mmstore.debug.scan(exported).collect()["sample_id"]) == ["s3", "s4"]
    # Exactly the media those rows reference: B.
    media = sorted(p.name for p in (dest / "media").rglob("*.*"))
    assert media == [Path(known["media"]["B"].uri).name]
    # A second export into the now non-empty destination is refused, cleanly.
    assert_user_error(call_cli(capsys, "export", known["root"], dest), 1, str(dest))


@pytest.mark.slow  # a subprocess per command
def test_release_a_run(copy, known, capsys):
    result = call_cli(capsys, "release", copy, "r2", "--grace", "0", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert (copy / "rollouts" / "run_id=r2").exists()
    assert "would remove rollouts/run_id=r2/step=0/" in result.stdout

    result = run_cli("release", copy, "r2", "--grace", "0", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    only_r2 = known["media"]["C"].uri
    assert report["gc"]["deleted"] == [only_r2]
    assert not (copy / "rollouts" / "run_id=r2").exists()
    assert not (copy / only_r2).exists()
    assert (copy / known["media"]["A"].uri).exists()  # still referenced by r1


def test_a_grace_that_is_not_a_finite_number_of_seconds_is_a_usage_error(copy, capsys):
    """Issue 39.22: `release ROOT r2 --grace nan` released the run, then exited 1 with a
    traceback; `gc --grace nan` reported success and collected nothing."""
    for grace in ("nan", "inf", "-inf", "-1"):
        for command in (["release", copy, "r2"], ["gc", copy], ["stats", copy]):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_:
                main([*map(str, command), f"--grace={grace}"])
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err
            assert "--grace must be a finite number of seconds >= 0" in err.splitlines()[-1]
    assert [f.run_id for f in mmstore.Store.open(copy).files()].count("r2") == 1


@pytest.mark.slow  # a subprocess per command
def test_pin_keeps_a_released_runs_media(copy, known, capsys):
    only_r2 = known["media"]["C"].uri
    result = run_cli("pin", copy, "keep-r2", "--run", "r2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pin"] == "keep-r2"
    listing = call_cli(capsys, "pin", copy)
    assert listing.returncode == 0 and "keep-r2" in listing.stdout
    # The pin holds r2's rows: a release is refused, naming it, unless forced.
    assert_user_error(call_cli(capsys, "release", copy, "r2", "--grace", "0"), 1, "keep-r2")
    assert call_cli(capsys, "release", copy, "r2", "--grace", "0", "--force").returncode == 0
    assert (copy / only_r2).exists()  # pinned, so it survives the release
    assert list((copy / "rollouts" / "run_id=r2").rglob("*.parquet"))  # and so do its rows
    assert call_cli(capsys, "pin", copy, "keep-r2", "--remove").returncode == 0
    assert call_cli(capsys, "gc", copy, "--grace", "0").returncode == 0
    assert not (copy / only_r2).exists()
    missing = call_cli(capsys, "pin", copy, "nope", "--remove")
    assert_user_error(missing, 1, "no pin named")


def test_s3_store_through_environment(s3_store, s3_options, adapter, capsys, monkeypatch):
    media = s3_store.put_image(screenshot(5, 160, 120))
    with s3_store.writer(run_id="r", step=0) as w:
        w.write(make_rollout(adapter, "x", [media], 1.0))
    # A person at a shell has only the environment to point the command at a server.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_options['endpoint_override']}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    result = call_cli(capsys, "stats", s3_store.root, "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert (row["run_id"], row["samples"], row["images"]) == ("r", 1, 1)
    assert row["media_bytes"] == media.nbytes


@pytest.mark.slow  # a subprocess per command
def test_demo_runs(tmp_path):
    root = tmp_path / "demo"
    result = run_cli(
        "demo",
        "--root",
        root,
        "--groups",
        "1",
        "--group-size",
        "2",
        "--turns",
        "1",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--num-workers",
        "0",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows"] == 2 and summary["samples_read"] == 2
    assert mmstore.debug.scan(mmstore.Store.open(root)).collect().height == 2


TINY_DEMO = ["--groups", "1", "--group-size", "2", "--turns", "1", "--steps", "1"]
TINY_DEMO += ["--batch-size", "2", "--num-workers", "0"]


def test_demo_keeps_its_store_by_default_and_a_rerun_replaces_the_demo_run(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        result = call_cli(capsys, "demo", *TINY_DEMO)
        assert result.returncode == 0, result.stderr
    assert "store kept at mmstore-demo" in result.stdout
    assert "replaced the earlier demo run" in result.stdout
    store = mmstore.Store.open(tmp_path / "mmstore-demo")
    assert mmstore.debug.scan(store).collect().height == 2  # not 4


def test_demo_tmp_says_it_deletes_its_store(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = call_cli(capsys, "demo", "--tmp", *TINY_DEMO)
    assert result.returncode == 0, result.stderr
    assert "store deleted" in result.stdout and list(tmp_path.iterdir()) == []


def test_release_of_an_unknown_run_fails_naming_the_runs(copy, capsys):
    result = call_cli(capsys, "release", copy, "nosuchrun", "--grace", "0")
    assert_user_error(result, 1, "no run 'nosuchrun'", "r1", "r2")
    assert result.stdout == ""


def test_a_missing_store_error_speaks_to_a_shell_user(tmp_path, known, capsys):
    result = call_cli(capsys, "stats", tmp_path / "nowhere")
    assert_user_error(result, 1, "no mmstore store", "check the path")
    assert "create=True" not in result.stderr
    inner = Path(known["root"]) / "rollouts"
    assert_user_error(call_cli(capsys, "inspect", inner), 1, f"store at '{known['root']}'")


def test_output_fits_a_terminal_and_json_keeps_token_lists_on_one_line(known, capsys):
    result = call_cli(capsys, "inspect", known["root"], "--sample", "s2", "--run", "r1")
    assert result.returncode == 0 and max(map(len, result.stdout.splitlines())) <= 80
    result = call_cli(capsys, "inspect", known["root"], "--sample", "s2", "--run", "r1", "--json")
    row = json.loads(result.stdout)
    assert len(result.stdout.splitlines()) < len(row["tokens"])
    assert any(line.startswith('  "tokens": [') for line in result.stdout.splitlines())


def test_version_and_the_grace_unit(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert (
        exit_.value.code == 0
        and capsys.readouterr().out.strip() == f"mmstore {mmstore.__version__}"
    )
    with pytest.raises(SystemExit):
        main(["gc", "--help"])
    assert "--grace SECONDS" in capsys.readouterr().out


def lines_of(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Its output's lines, less those naming one file each (``deleted media/…``,
    ``  image#0  media/…``): a path is printed whole, to be copied."""
    path_line = re.compile(r"^((would )?(delete|deleted|remove|removed)|  (image|video)#\d+ ) \S+$")
    return [line for line in result.stdout.splitlines() if not path_line.match(line)]


def flat(text: str) -> str:
    """``text`` with its line wrapping undone."""
    return " ".join(text.split())


WIDE_COMMANDS = (
    ["stats"],
    ["stats", "--by", "run"],
    ["inspect"],
    ["inspect", "--sample", "s0"],
    ["log"],
    ["gc", "--dry-run", "--grace", "0"],
    ["gc"],
    ["release", "r2", "--dry-run"],
)


@pytest.mark.parametrize("columns", [None, "200"])
def test_output_fits_80_columns(copy, capsys, monkeypatch, columns):
    """Issue 42.2: stats, inspect (a listing and one sample), log, gc and release fit 80
    columns when nothing says the width (a pipe) and on a wide terminal: the tables are
    narrow by themselves (no column goes on to a second table) and prose wraps at 80."""
    mmstore.Store.open(copy).put_image(screenshot(98, 90, 90))  # an orphan, for gc to list
    if columns is not None:
        monkeypatch.setenv("COLUMNS", columns)
    for args in WIDE_COMMANDS:
        result = call_cli(capsys, args[0], copy, *args[1:])
        assert result.returncode == 0, result.stderr
        too_wide = [line for line in lines_of(result) if len(line) > 80]
        assert not too_wide, f"{args}: {too_wide}"
    header = call_cli(capsys, "stats", copy).stdout.splitlines()[0]
    for name in STATS_HEADERS:
        assert name in header  # one table: every column on its first line
    sample = call_cli(capsys, "inspect", copy, "--sample", "s0").stdout
    assert "media/" in sample and ".png" in sample  # a cut URI keeps both ends


def test_a_narrow_terminal_splits_tables_and_loses_no_column(copy, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    for args in WIDE_COMMANDS:
        result = call_cli(capsys, args[0], copy, *args[1:])
        too_wide = [line for line in lines_of(result) if len(line) > 50]
        assert result.returncode == 0 and not too_wide, f"{args}: {too_wide}"
    narrow = call_cli(capsys, "stats", copy)
    for header in STATS_HEADERS:
        assert header in narrow.stdout


STATS_HEADERS = ("run", "rows", "images", "dedup", "parquet", "media", "dense fp32", "reward")


def files_under(root: Path, *parts: str) -> list[Path]:
    return [p for part in parts for p in (root / part).rglob("*") if p.is_file()]


def test_stats_accounts_for_every_byte_and_gc_says_why_it_kept(copy, known, capsys):
    store = mmstore.Store.open(copy)
    orphans = [store.put_image(screenshot(90 + i, 80, 60)) for i in range(2)]
    orphan_bytes = sum((copy / m.uri).stat().st_size for m in orphans)
    disk = json.loads(call_cli(capsys, "stats", copy, "--json").stdout)["disk"]
    media = files_under(copy, "media")
    log = files_under(copy, "rollouts/_delta_log")
    parquet = [p for p in files_under(copy, "rollouts") if p.suffix == ".parquet" and p not in log]
    assert disk["total_bytes"] == sum(p.stat().st_size for p in [*media, *parquet, *log])
    assert (disk["log_files"], disk["log_bytes"]) == (len(log), sum(p.stat().st_size for p in log))
    assert (disk["media_referenced"], disk["media_unreferenced"]) == (3, 2)
    assert disk["media_unreferenced_bytes"] == orphan_bytes
    # Younger than the hour's grace: kept, and said until when.
    assert (disk["free_now_files"], disk["grace_files"]) == (0, 2)
    newest = max((copy / m.uri).stat().st_mtime for m in orphans)
    assert disk["free_by"] == pytest.approx(newest + 3600, abs=1)
    text = flat(call_cli(capsys, "stats", copy).stdout)
    assert "media, unreferenced" in text and "for the grace period" in text
    now = json.loads(call_cli(capsys, "stats", copy, "--json", "--grace", "0").stdout)["disk"]
    assert (now["free_now_files"], now["free_now_bytes"]) == (2, orphan_bytes)

    kept = flat(call_cli(capsys, "gc", copy).stdout)  # the default hour's grace
    assert "kept 5 media files" in kept and "3 referenced" in kept
    assert "2 only for the grace period (3600 s)" in kept

    # A released run: its rows and the media only they use stay for the grace period.
    released = flat(call_cli(capsys, "release", copy, "r2").stdout)
    assert "3 only for the grace period" in released  # the two orphans and C
    disk = json.loads(call_cli(capsys, "stats", copy, "--json").stdout)["disk"]
    assert disk["grace_files"] == 4 and disk["media_referenced"] == 2  # + r2's Parquet file
    assert disk["free_by"] is not None
    assert "gc --grace 0 would free" in call_cli(capsys, "stats", copy, "--grace", "0").stdout


def test_pinned_media_is_said_to_be_kept_by_a_pin(copy, capsys):
    assert call_cli(capsys, "pin", copy, "keep", "--run", "r2").returncode == 0
    assert call_cli(capsys, "release", copy, "r2", "--grace", "0", "--force").returncode == 0
    kept = flat(call_cli(capsys, "gc", copy, "--grace", "0").stdout)
    assert "kept 3 media files" in kept and "1 of them by pins alone" in kept


def test_inspect_of_an_unknown_run_lists_the_runs_the_store_holds(known, capsys):
    typo = call_cli(capsys, "inspect", known["root"], "--run", "r9")
    assert_user_error(typo, 1, "no rollouts match --run r9", "r1 (steps 0-1)", "r2 (step 0)")
    later = call_cli(capsys, "inspect", known["root"], "--run", "r1", "--step", "7")
    assert_user_error(later, 1, "--run r1 --step 7", "r1 (steps 0-1)")


def test_inspect_view_without_sample_is_a_usage_error_of_inspect(known, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(known["root"]), "--view", str(tmp_path / "v.png")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: mmstore inspect ")
    assert "--view needs --sample ID" in err


@pytest.mark.parametrize(
    ("command", "needles"),
    [
        ("stats", ["one table row per run and step", "(default step)", "(default 3600)"]),
        ("release", ["RUN_ID", "the run whose rows to release"]),
        ("demo", ["GRPO groups per step (default 8)", "DataLoader workers (default 2)"]),
    ],
)
def test_options_have_help_and_defaults(command, needles, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help text at the terminal's width
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out


def test_a_store_in_a_missing_bucket_names_the_bucket(s3_options, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_options['endpoint_override']}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    result = call_cli(capsys, "stats", "s3://no-such-bucket-x1/store")
    assert_user_error(result, 1, "the bucket 'no-such-bucket-x1' does not exist")
    # Creating one there fails with a typed error naming the bucket (pyarrow's NO_SUCH_BUCKET).
    with pytest.raises(mmstore.NotAStoreError, match="bucket 'no-such-bucket-x1' does not") as err:
        mmstore.Store.open("s3://no-such-bucket-x1/store", create=True, s3_options=s3_options)
    assert err.value.bucket == "no-such-bucket-x1"
    # A bucket that exists, without a store in it, is the usual "no store" message.
    bucket = f"mm-{os.getpid()}-plain"
    import pyarrow.fs as pafs

    pafs.S3FileSystem(**s3_options).create_dir(bucket)
    plain = call_cli(capsys, "stats", f"s3://{bucket}/store")
    assert_user_error(plain, 1, "no mmstore store", "check the path")
    assert "bucket" not in plain.stderr.replace(bucket, "")


# -- issue 42: stats without torch, videos, log, time travel, tokens as text -----------------


def test_stats_imports_neither_torch_nor_transformers(known):
    """Issue 42.2: `stats` took 7.4 s on a 2 MB store, 7.2 of them importing transformers,
    torchvision and torch._dynamo for the dense fp32 column. It is computed from the layouts
    in the footers now."""
    code = (
        "import sys; from mmstore.cli import main; "
        f"assert main(['stats', {str(known['root'])!r}]) == 0; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}); "
        "print('heavy', heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "dense fp32" in result.stdout and "heavy []" in result.stdout


@pytest.fixture(scope="module")
def video_root(tmp_path_factory, small_processor) -> Path:
    """A store whose one run holds video rows only: two refs of one 24-frame clip."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from mmstore.synth import screen_recording

    small = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    video = Qwen2VLVideoProcessor(size=small, cap_pixels_per_frame=False)
    adapter = mmstore.adapter_for(small_processor, video_processor=video)
    store = mmstore.Store.open(tmp_path_factory.mktemp("video") / "store", create=True)
    clip = store.put_video(screen_recording(0, num_frames=24, width=168, height=112, fps=12))
    prompt = [11, 151652, adapter.video.video_token_id, 151653, 14]
    expanded = adapter.expand_media(prompt, videos=[clip], fps=2.0)
    n = len(expanded.tokens)
    with store.writer(run_id="v", step=0) as w:
        for k in range(2):
            w.write(
                mmstore.Rollout(
                    sample_id=f"v{k}", tokens=[*expanded.tokens, 100], prompt_len=n,
                    loss_mask=[False] * n + [True], videos=expanded.videos, reward=float(k),
                )
            )  # fmt: skip
    return Path(store.root)


def test_stats_of_a_video_only_store_counts_clips_and_frames(video_root, capsys):
    """Issue 42.2: a video-only store showed `images 0` and `dense fp32 0 B`."""
    stats = json.loads(call_cli(capsys, "stats", video_root, "--json").stdout)
    total = stats["total"]
    assert (total["videos"], total["video_frames"], total["images"]) == (2, 8, 0)
    text = call_cli(capsys, "stats", video_root).stdout
    header = text.splitlines()[0].split()
    assert header[:5] == ["run", "step", "rows", "videos", "frames"]
    assert "images" not in header and "dense" not in text  # no image column to mislead
    assert text.splitlines()[1].split()[:5] == ["v", "0", "2", "2", "8"]
    listing = call_cli(capsys, "inspect", video_root).stdout
    assert "videos" in listing.splitlines()[0] and "images" not in listing.splitlines()[0]


def test_stats_shows_missing_media_only_where_some_is(copy, known, capsys):
    assert "missing media: none" in call_cli(capsys, "stats", copy).stdout
    (copy / known["media"]["C"].uri).unlink()  # r2's image
    text = call_cli(capsys, "stats", copy).stdout.splitlines()
    assert text[0].split()[-1] == "missing"
    assert [line.split()[-1] for line in text[1:4]] == ["0", "0", "1"]  # r1/0, r1/1, r2/0


def test_the_release_refusal_names_the_cli_flag(copy, capsys):
    """Issue 42.2: the refusal told a shell user to pass `force=True`."""
    assert call_cli(capsys, "pin", copy, "keep", "--run", "r2").returncode == 0
    refused = call_cli(capsys, "release", copy, "r2", "--grace", "0")
    assert_user_error(refused, 1, "'keep'", "--force")
    assert "force=True" not in refused.stderr


def released_r2(copy: Path, capsys) -> list[dict]:
    """The known store's copy after a producer's commit and r2's release with no grace:
    the versions that listed r2's file are collected."""
    store = mmstore.Store.open(copy)
    with store.writer(run_id="r3", step=4, producer="actor-0", seq=7) as w:
        w.write(mmstore.Rollout(sample_id="p0", tokens=[1, 2], prompt_len=1, loss_mask=[0, 1]))
    assert call_cli(capsys, "release", copy, "r2", "--grace", "0").returncode == 0
    return json.loads(call_cli(capsys, "log", copy, "--json").stdout)["versions"]


def test_log_lists_the_versions_newest_first(copy, capsys):
    """Issue 42.3: the table's history: version, time, operation, run/step, producer/seq,
    rows, and which versions gc left readable."""
    versions = released_r2(copy, capsys)
    assert [v["version"] for v in versions] == [5, 4, 3, 2, 1, 0]
    release, write, *_, create = versions
    assert (release["operation"], release["partitions"]) == ("DELETE", [["r2", 0]])
    assert (release["rows_removed"], release["readable"]) == (1, True)
    assert write["producers"] == [{"producer": "actor-0", "seq": 7}]
    assert (write["partitions"], write["rows_added"]) == ([["r3", 4]], 1)
    assert create["operation"] == "CREATE TABLE"
    # Versions 3 and 4 list r2's file, which gc deleted; the others read whole.
    assert [v["version"] for v in versions if not v["readable"]] == [4, 3]

    text = call_cli(capsys, "log", copy, "--limit", "2").stdout.splitlines()
    assert text[0].split() == [
        "version", "time", "(UTC)", "operation", "run/step", "producer/seq", "rows", "readable"
    ]  # fmt: skip
    assert text[1].split()[:1] + text[1].split()[3:] == ["5", "delete", "r2/0", "-", "-1", "yes"]
    assert text[2].split()[3:] == ["write", "r3/4", "actor-0/7", "+1", "no"]
    assert "2 of 6 versions (--limit 0 shows all)" in text
    assert "readable: 0-2, 5 (gc collected files the others list)" in text


def test_inspect_an_older_version(copy, capsys):
    """Issue 42.3: time travel; a collected version is one line naming TableVersionError's
    message and the versions that still read."""
    released_r2(copy, capsys)
    old = json.loads(call_cli(capsys, "inspect", copy, "--version", "1", "--json").stdout)
    assert [r["sample_id"] for r in old["rows"]] == ["s0", "s1", "s2"]  # r1/0 alone
    now = json.loads(call_cli(capsys, "inspect", copy, "--json").stdout)
    assert "s5" not in {r["sample_id"] for r in now["rows"]}  # released
    sample = call_cli(capsys, "inspect", copy, "--version", "2", "--sample", "s3")
    assert sample.returncode == 0 and "sample s3  run r1  step 1" in sample.stdout
    gone = call_cli(capsys, "inspect", copy, "--version", "3")
    assert_user_error(gone, 1, "version 3 can no longer be read", "0-2, 5")
    assert_user_error(call_cli(capsys, "inspect", copy, "--version", "9"), 1, "no version 9")
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(copy), "--version", "-1"])
    assert exit_.value.code == 2


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer over the known store's text tokens, saved as a model's is."""
    from tests.families_common import word_level_tokenizer

    vocab = {"[UNK]": 0, "look": 11, "at": 12, "<im>": 13, "</im>": 14}
    vocab |= {"the": 100, "cat": 101, "sat": 102}
    path = tmp_path_factory.mktemp("tokenizer")
    word_level_tokenizer(vocab, unk="[UNK]").save_pretrained(path)
    return path


def test_inspect_decodes_tokens_with_a_tokenizer(known, tokenizer_dir, capsys):
    """Issue 42.3: a sample's tokens as text, each image span one marker."""
    s0 = known["rows"]["r1", 0][0]
    first, second = s0.images
    result = call_cli(capsys, "inspect", known["root"], "--sample", "s0", "--tokenizer",
                      tokenizer_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Each text span decoded on its own ("</im> <im>" between the images), each image one
    # marker in place of its span.
    prompt = (
        f"look at <im>[image#0: {first.length} tokens]</im> <im>"
        f"[image#1: {second.length} tokens]</im>"
    )
    lines = result.stdout.splitlines()
    assert "text (--tokenizer):" in lines and max(map(len, lines)) <= 80  # wrapped
    assert "  completion: the cat sat" in lines
    assert f"prompt: {prompt} completion:" in flat(result.stdout)
    as_json = ["inspect", known["root"], "--sample", "s0", "--tokenizer", tokenizer_dir, "--json"]
    row = json.loads(call_cli(capsys, *as_json).stdout)
    assert row["text"] == {"prompt": prompt, "completion": "the cat sat"}


def test_a_tokenizer_needs_a_sample_and_a_path_it_loads_from(known, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(known["root"]), "--tokenizer", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--tokenizer needs --sample ID" in capsys.readouterr().err
    missing = call_cli(capsys, "inspect", known["root"], "--sample", "s0", "--tokenizer",
                       tmp_path / "nothing")  # fmt: skip
    assert_user_error(missing, 1, "--tokenizer", "no tokenizer loads from there")
