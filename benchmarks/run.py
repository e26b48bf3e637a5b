"""The benchmark suite: every benchmark, one command, one JSON + markdown table + PNG plot.

    python -m benchmarks.run [--scale S] [--reps N] [--out benchmarks/results]

Each figure is a ratio of two things measured in the same run, interleaved, over several
repetitions (median and spread in the JSON). The suite fails only if a benchmark crashes
or a correctness check inside one fails, never on timing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import platform
import tempfile
import time
from typing import Any

# name -> (module, the headline ratios to tabulate: (label, path in the result, higher is))
SUITE: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "loader": (
        "benchmarks.bench_loader",
        [
            ("loader / physical limit, screenshots", "screenshots.mmstore_over_limit", "better"),
            ("loader / naive Dataset, screenshots", "screenshots.mmstore_over_naive", "better"),
            ("loader / HF datasets, screenshots", "screenshots.mmstore_over_hf_datasets", "better"),
            (
                "loader / physical limit, distinct screenshots",
                "screenshots_distinct.mmstore_over_limit",
                "better",
            ),
            (
                "loader / naive Dataset, distinct screenshots",
                "screenshots_distinct.mmstore_over_naive",
                "better",
            ),
            ("loader / physical limit, photos", "photos.mmstore_over_limit", "better"),
            ("loader / naive Dataset, photos", "photos.mmstore_over_naive", "better"),
            ("loader / HF datasets, photos", "photos.mmstore_over_hf_datasets", "better"),
            ("peak batch memory bf16 / fp32", "bf16_over_fp32_memory", "lower"),
        ],
    ),
    "write": ("benchmarks.bench_write", []),
    "disk": (
        "benchmarks.bench_disk",
        [
            (
                "dense fp32 bytes / mmstore bytes, screenshots",
                "screenshots.dense_over_mmstore",
                "better",
            ),
            (
                "inline bytes / mmstore bytes, screenshots",
                "screenshots.inline_over_mmstore",
                "better",
            ),
            ("dense fp32 bytes / mmstore bytes, photos", "photos.dense_over_mmstore", "better"),
            ("inline bytes / mmstore bytes, photos", "photos.inline_over_mmstore", "better"),
        ],
    ),
    "resume": (
        "benchmarks.bench_resume",
        [
            ("replay / seek at 10%", "10%.replay_over_seek", "better"),
            ("replay / seek at 50%", "50%.replay_over_seek", "better"),
            ("replay / seek at 90%", "90%.replay_over_seek", "better"),
            ("seek time 90% / 10% (flat = 1)", "seek_90_over_10", "flat"),
        ],
    ),
    "lifecycle": ("benchmarks.bench_lifecycle", []),
    "trust": ("benchmarks.bench_trust", []),
    "s3": (
        "benchmarks.bench_s3",
        [
            ("S3 loader 30 ms / 0 ms latency, prefetch", "prefetch_30_over_0", "better"),
            ("S3 loader 30 ms / 0 ms latency, serial reads", "serial_30_over_0", "better"),
            ("S3 loader prefetch / serial at 30 ms", "prefetch_over_serial_at_30", "better"),
        ],
    ),
    "ray": (
        "benchmarks.bench_ray",
        [
            (
                "Ray iter_batches / RolloutLoader, 2 processes",
                "iter_batches_over_loader",
                "higher = Ray faster",
            ),
            (
                "Ray read_rollouts / RolloutLoader, 2 processes",
                "read_rollouts_over_loader",
                "higher = Ray faster",
            ),
        ],
    ),
    "pack": (
        "benchmarks.bench_pack",
        [
            ("packing efficiency mmstore / padded", "mmstore_over_padded", "better"),
            ("packing efficiency mmstore / greedy", "mmstore_over_greedy", "better"),
            ("max/mean rank load, greedy / mmstore", "greedy_over_mmstore_load", "better"),
        ],
    ),
    "scan": (
        "benchmarks.bench_scan",
        [
            ("polars scan / pyarrow dataset rows/s", "polars_over_pyarrow", "better"),
        ],
    ),
    # The rollouts Delta table (format v2) against format v1's rename and listing; the S3
    # rows only with S3=1 in the environment (moto_server, directly and at 30 ms).
    "table": (
        "benchmarks.bench_table",
        [
            ("whole writer commit: v1 (rename) / v2 (rename + log)", "writer_v1_over_v2", "better"),
            ("commit: rename-only / Delta log commit", "rename_over_log", "better"),
            ("Delta commit: small / 10k-file table (at scale 1)", "log_small_over_large", "flat"),
            ("commit: 10 / 10k committed files", "commit_10_over_10k_files", "flat"),
            ("dataset build: 10 / 10k committed files", "build_10_over_10k_files", "flat"),
            (
                "snapshot: listing / Delta open (checkpoint + 19 entries)",
                "listing_over_delta_latest",
                "better",
            ),
            (
                "snapshot: listing / Delta open (checkpoint alone)",
                "listing_over_delta_checkpoint",
                "better",
            ),
            ("S3 commit: rename-only / Delta log commit", "s3_rename_over_log", "better"),
            (
                "S3 snapshot: listing / Delta open (checkpoint + 19)",
                "s3_listing_over_delta_latest",
                "better",
            ),
            ("S3 30 ms commit: rename-only / Delta commit", "s3_30ms_rename_over_log", "better"),
            (
                "S3 30 ms snapshot: listing / Delta open (checkpoint + 19)",
                "s3_30ms_listing_over_delta_latest",
                "better",
            ),
        ],
    ),
    # Video rollouts (Qwen2-VL, 10 s screen recordings sampled at 2 fps): the loader against
    # decoding + processing each distinct clip once and a Dataset decoding whole clips.
    "video": (
        "benchmarks.bench_video",
        [
            ("video loader / decode+process limit, GRPO-4", "grpo.mmstore_over_limit", "better"),
            (
                "video loader / naive whole-clip Dataset, GRPO-4",
                "grpo.mmstore_over_naive",
                "better",
            ),
            (
                "video loader / decode+process limit, distinct clips",
                "distinct.mmstore_over_limit",
                "better",
            ),
            (
                "video loader / naive whole-clip Dataset, distinct clips",
                "distinct.mmstore_over_naive",
                "better",
            ),
            (
                "dense fp32 pixel_values_videos / mmstore bytes, GRPO-4",
                "grpo.dense_fp32_over_mmstore",
                "better",
            ),
            (
                "dense bf16 pixel_values_videos / mmstore bytes, GRPO-4",
                "grpo.dense_bf16_over_mmstore",
                "better",
            ),
            (
                "dense fp32 pixel_values_videos / mmstore bytes, distinct clips",
                "distinct.dense_fp32_over_mmstore",
                "better",
            ),
            (
                "dense bf16 pixel_values_videos / mmstore bytes, distinct clips",
                "distinct.dense_bf16_over_mmstore",
                "better",
            ),
        ],
    ),
    # The live loader (asynchronous RL) against a RolloutLoader built per step.
    "live": (
        "benchmarks.bench_live",
        [
            row
            for backend in ("pil", "torchvision")
            for row in (
                (
                    f"live step start p50 ({backend}): per-step loader / LiveLoader",
                    f"{backend}.per_step_over_live_p50",
                    "better",
                ),
                (
                    f"live step start p99 ({backend}): per-step loader / LiveLoader",
                    f"{backend}.per_step_over_live_p99",
                    "better",
                ),
                (
                    f"live step start p50 ({backend}) / decode+process floor",
                    f"{backend}.live_p50_over_floor",
                    "lower",
                ),
            )
        ],
    ),
}


def _get(result: dict[str, Any], path: str) -> Any:
    value: Any = result
    for part in path.split("."):
        value = value[part]
    return value


def headline(name: str, result: dict[str, Any]) -> list[tuple[str, float]]:
    """The ratios to tabulate: declared above, or a module's own ``HEADLINE`` list."""
    module = importlib.import_module(SUITE[name][0])
    rows = SUITE[name][1] or [(label, path, "") for label, path in getattr(module, "HEADLINE", [])]
    out = []
    for label, path, _ in rows:
        try:
            out.append((label, float(_get(result, path))))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _direction(name: str, label: str) -> str:
    """How to read a ratio: "higher = mmstore better" unless its SUITE entry says otherwise."""
    for row_label, _, direction in SUITE[name][1]:
        if row_label == label:
            return {
                "better": "higher = mmstore better",
                "lower": "lower = mmstore better",
                "flat": "1 = flat",
            }.get(direction, direction)
    return "see the benchmark's docstring"


def run_all(scale: float, reps: int, only: list[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (module_name, _) in SUITE.items():
        if only and name not in only:
            continue
        fn = importlib.import_module(module_name).run
        kwargs = {"reps": reps} if "reps" in inspect.signature(fn).parameters else {}
        start = time.perf_counter()
        results[name] = fn(scale, **kwargs)
        results[name]["_seconds"] = round(time.perf_counter() - start, 1)
        print(f"[bench] {name}: {results[name]['_seconds']} s", flush=True)
    return results


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"# mmstore benchmarks, {meta['date']}",
        "",
        f"scale {meta['scale']}, {meta['reps']} repetitions, {meta['cores']} cores, "
        f"{meta['machine']}. Ratios of two measurements taken in the same run.",
        "",
        "| benchmark | ratio | direction |",
        "|---|---:|---|",
    ]
    for name, result in results.items():
        for label, value in headline(name, result):
            lines.append(f"| {label} | {value:.3g} | {_direction(name, label)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(label, v) for name, r in results.items() for label, v in headline(name, r)]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    ax.barh([label for label, _ in rows], [v for _, v in rows], color="#4a7ebb")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("ratio (log scale; 1 = parity)")
    ax.set_title("mmstore: measured side by side with the baselines")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=float(os.environ.get("BENCH_SCALE", 1)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--out",
        default=None,
        help="default: benchmarks/results at full scale (>= 1), a scratch folder below it, "
        "so a small run never overwrites committed full-scale results",
    )
    parser.add_argument("--only", nargs="*", choices=list(SUITE))
    args = parser.parse_args(argv)
    if args.out is None:
        full = args.scale >= 1
        results_dir = os.path.join(os.path.dirname(__file__), "results")
        args.out = results_dir if full else tempfile.mkdtemp(prefix="mmstore-bench-")
    meta = {
        "date": datetime.date.today().isoformat(),
        "scale": args.scale,
        "reps": args.reps,
        "cores": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.python_implementation()} "
        f"{platform.python_version()}",
    }
    results = run_all(args.scale, args.reps, args.only)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, meta["date"])
    if args.only and os.path.exists(f"{stem}.json"):  # a partial rerun updates the day's file
        with open(f"{stem}.json") as f:
            results = {**json.load(f)["results"], **results}
    with open(f"{stem}.json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2, default=str)
    with open(f"{stem}.md", "w") as f:
        f.write(markdown(results, meta))
    plot(results, f"{stem}.png")
    print(markdown(results, meta))
    return results


if __name__ == "__main__":
    main()
