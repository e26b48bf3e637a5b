"""The benchmark suite at a tiny scale: it must run and its correctness checks must hold;
and the goals table judges figures as declared, from keys the benchmarks really write.

Timing is never asserted; a benchmark fails here only by crashing or by a failed check.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import run

slow = pytest.mark.slow  # whole benchmarks, small: 15 s to 3 minutes each here

# Goal figures that a benchmark writes but its newest committed result predates: checked
# against the benchmark's source until a committed run has them (then drop them here).
NOT_YET_COMMITTED: set[str] = set()


def test_goals_judged_with_their_comparator():
    results = {
        "columns": {"unasked_over_plain": 1.02, "topk_disk_over_raw": None},
        "speed": {"grpo8": {"over_limit": 5.06}},
    }
    goals = [
        run.Goal(40, "at the bound", "columns.unasked_over_plain", "<=", 1.02, run.EXCLUDED),
        run.Goal(40, "over it", "columns.unasked_over_plain", "<=", 1.01, run.EXCLUDED),
        run.Goal(43, "under it", "speed.grpo8.over_limit", ">=", 6, run.IN),
        run.Goal(43, "over it", "speed.grpo8.over_limit", ">=", 5, run.IN),
        run.Goal(40, "recorded as None", "columns.topk_disk_over_raw", "<=", 1.3, run.NA),
        run.Goal(40, "a key the result lacks", "columns.renamed", "<=", 1.3, run.NA),
        run.Goal(43, "no benchmark", None, "<=", 1.5, run.NA),
        run.Goal(41, "benchmark not run", "forest.grpo.forest_tokens_over_ideal", "<=", 1, run.NA),
    ]
    holds = [run.judge(goal, results)[1] for goal in goals]
    assert holds == ["yes", "NO", "NO", "yes", "not measured", "not measured", "not measured",
                     "not run"]  # fmt: skip
    table = run.goals_table(results, goals)
    assert "| 43 | under it >= 6 | 5.06 | NO | in |" in table
    assert "| 40 | at the bound <= 1.02 | 1.02 | yes | excluded |" in table
    assert "| 41 | benchmark not run <= 1 | - | not run | n/a |" in table
    # The suite's table: each ratio with its start-up, then every declared goal.
    meta = {"date": "d", "scale": 1, "reps": 1, "cores": 2, "machine": "m"}
    live = {"pil": {"per_step_over_live_p50": 3.0}}
    text = run.markdown({"live": live}, meta)
    row = "| live step start p50 (pil): per-step loader / LiveLoader | 3 |"
    assert f"{row} higher = mmstore better | excluded |" in text
    goal_rows = text.split("## Goals")[1].splitlines()[4:]
    assert len(goal_rows) == len(run.GOALS) and "| not run |" in text


def test_goals_name_figures_the_benchmarks_write():
    """Each goal's figure is a key its benchmark's newest committed result has (a renamed key
    fails here); a figure newer than that result, or of a benchmark with none committed, is
    at least named in the benchmark's source."""
    committed = run.committed()
    for goal in run.GOALS:
        assert goal.op in run.OPS and goal.startup in run.STARTUPS, goal
        if goal.path is None:
            continue
        name, _, path = goal.path.partition(".")
        value, _ = run.judge(goal, committed)
        if name in committed and goal.path not in NOT_YET_COMMITTED:
            assert value is not None, f"{goal.path}: not in the committed {name} results"
            continue
        assert value is None, f"{goal.path} is committed now: drop it from NOT_YET_COMMITTED"
        spec = importlib.util.find_spec(run.SUITE[name][0])
        assert spec and spec.origin, name
        assert path.rsplit(".", 1)[-1] in Path(spec.origin).read_text(), goal.path
    for _, rows in run.SUITE.values():
        assert all(row[3] in run.STARTUPS for row in rows)


@slow
def test_suite_smoke(tmp_path):
    results = run.main(["--scale", "0.05", "--reps", "1", "--out", str(tmp_path)])
    assert set(results) == set(run.SUITE)
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md", ".png"]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert set(saved["results"]) == set(run.SUITE)
    table = next(tmp_path.glob("*.md")).read_text()
    for name in ("loader", "disk", "resume", "scan", "video", "live"):
        for label, value in run.headline(name, results[name]):
            assert label in table and value > 0


@slow
def test_speed_benchmark_smoke():
    from benchmarks import bench_speed

    result = bench_speed.run(scale=0.05, reps=1)
    assert result["direction"] == "every ratio: higher = mmstore better"
    for key in (
        "torchvision_over_limit",
        "torchvision_over_tensor_limit",
        "torchvision_over_cast_inside_limit",
        "torchvision_over_limit_at_once",
        "torchvision_over_pil",
        "persistent_first_over_limit",
        "persistent_later_over_limit",
        "persistent_cached_later_over_limit",
        "persistent_later_over_cast_inside_limit",
        "persistent_later_over_limit_at_once",
    ):
        assert result["distinct"][key] > 0
    passes = result["distinct"]["persistent_passes_images_per_s"]
    counts = [len(rates) for per_rep in passes.values() for rates in per_rep]
    assert counts == [bench_speed.PASSES] * 2
    grpo = result["grpo8"]
    assert grpo["over_limit_at_once"] > 0 and grpo["distinct_over_limit_at_once"] > 0
    assert grpo["steady_over_limit"] > 0 and grpo["steady_distinct_over_limit"] > 0
    # Persistent workers' later passes each processed (nearly) every distinct image again:
    # a worker's last image of a pass may begin the next.
    later, workers = bench_speed.PASSES - 1, len(bench_speed.RANKS) * bench_speed.WORKERS
    for [processed] in grpo["steady_processed_per_rep"].values():
        assert later * (grpo["distinct_images"] - workers) <= processed
        assert processed <= later * grpo["distinct_images"]
    # Every ratio also within each repetition; with one repetition, that ratio is the value.
    for section in (result["distinct"], grpo):
        paired = section["paired"]
        assert paired and all(s["median"] == pytest.approx(section[k]) for k, s in paired.items())
    # Each distinct image processed once on the node, however samples fell on workers/ranks,
    # and every image of every sample counted, whichever form the batches took.
    for mode, reps in grpo["node_cache_per_rep"].items():
        assert [c["misses"] for c in reps] == [grpo["distinct_images"]], mode
        assert [c["images"] for c in reps] == [grpo["images"]], mode
    assert result["write"]["plain_fsync_over_mmstore"] > 0
    # CPU per image counts the DataLoader workers (and the simulated ranks' processes): a
    # loader's CPU per image cannot be below processing each distinct image once.
    cpu = result["distinct"]["cpu_seconds_per_image"]
    assert cpu["mmstore_torchvision"] > 0.5 * cpu["limit_torchvision_tensor"] > 0
    # The limit at once counts its forked processes' CPU: the same work as the one-process
    # limit with the cast inside, so about the same CPU per image, never near none.
    assert cpu["limit_torchvision_at_once"] > 0.5 * cpu["limit_torchvision_cast_inside"] > 0
    assert 0 < grpo["cpu_limit_over_mmstore"] < 16
    assert 0 < grpo["cpu_limit_over_distinct"] < 16
    assert "GRPO-8" in bench_speed.table(result) and "CPU s/image" in bench_speed.table(result)


@slow
def test_table_benchmark_smoke():
    """The Delta table benchmark, locally and on moto_server (direct and at 30 ms): its
    file-count checks hold, every side was timed, and the worst-case tail is as built."""
    from benchmarks import bench_table
    from mmstore._rows.table import CHECKPOINT_INTERVAL

    result = bench_table.run(scale=0.005, reps=1, s3=True)
    assert result["direction"] == "every ratio: higher = mmstore better (1 = parity)"
    snapshots = [result["local"]["snapshot"], result["s3"]["0ms"]["snapshot"]]
    snapshots.append(result["s3"]["30ms"]["snapshot"])
    for snapshot in snapshots:
        assert snapshot["entries_after_checkpoint"] == CHECKPOINT_INTERVAL - 1
        assert set(snapshot["median_ms"]) == {"listing", "delta_latest", "delta_checkpoint"}
    assert set(result["local"]["commit"]["median_ms"]) == {"rename_only", "log", "log_large_table"}
    for key in ("rename_over_log", "log_small_over_large", "listing_over_delta_latest",
                "listing_over_delta_checkpoint", "s3_rename_over_log",
                "s3_listing_over_delta_latest", "s3_30ms_rename_over_log",
                "s3_30ms_listing_over_delta_latest"):  # fmt: skip
        assert result[key] > 0, key


@slow
def test_columns_benchmark_smoke():
    """Issue 40's extra columns: a loader asking for none reads what it reads without them
    (Parquet projection), asking for them reads them, and every figure was measured."""
    from benchmarks import bench_columns

    result = bench_columns.run(scale=0.05, reps=1)
    read = result["read"]
    assert abs(result["unasked_over_plain"] - 1) <= 0.02
    assert read["unasked"]["batches"] == read["plain"]["batches"] == read["asked"]["batches"] > 0
    assert result["asked_over_plain"] > 10  # the columns asked for are the bulk of the bytes
    for name in bench_columns.COLUMNS:
        disk = result["disk"][name]
        assert disk["codec"] == ["ZSTD"] and 0 < disk["disk_over_raw"] <= 1.3, name
    assert result["write_with_over_without"] > 0
    assert "bytes read per batch" in bench_columns.table(result)


@slow
def test_forest_benchmark_smoke():
    """Issue 41's prefix forests: a GRPO step and a per-turn agent forward exactly their
    distinct tokens and run each distinct screenshot once; unshared packing forwards more."""
    from benchmarks import bench_forest

    result = bench_forest.run(scale=0.25, reps=1)
    for kind in ("grpo", "agent"):
        r = result[kind]
        assert r["forest"]["tokens"] == r["ideal"]["tokens"], kind
        assert r["forest"]["images"] == r["ideal"]["images"], kind
        assert r["flat_over_forest_tokens"] > 2, kind
    window = result["agent-window"]
    assert window["forest"]["tokens"] <= window["flat"]["tokens"]
    assert window["forest"]["samples"] == window["flat"]["samples"] > 0
    assert result["grpo"]["forest_over_flat_samples_per_s"]["median"] > 0
    assert "tokens: forest / ideal" in bench_forest.table(result)
