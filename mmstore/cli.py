"""The ``mmstore`` command line. It parses, calls the library and prints; nothing else.

Every subcommand prints a human-readable table or summary, or with ``--json`` one JSON
document on stdout. Errors print one line on stderr: exit status 2 for a usage error, 1 for a
failure (a store that is not there, a problem that ``verify`` found). Progress bars go to
stderr and are off when ``MMSTORE_PROGRESS=0`` or stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs

from mmstore import __version__, debug
from mmstore import _demo as demo
from mmstore._arguments import seconds
from mmstore._format.paths import partition_of
from mmstore._lifecycle.export import export
from mmstore._lifecycle.gc import DiskUsage, GcReport, disk_usage, gc, release_run
from mmstore._lifecycle.pins import list_pins, pin_rows, readable_versions, unpin
from mmstore._lifecycle.upgrade import upgrade
from mmstore._lifecycle.verify import verify
from mmstore._rows.entries import LogEntry, producer_of
from mmstore._rows.files import holdings
from mmstore._rows.store import Store
from mmstore._storage.backends import s3_filesystem
from mmstore._storage.store import CREATE_REMEDY
from mmstore.errors import (
    InvalidArgumentError,
    MmstoreError,
    NotAStoreError,
    PinnedRowsError,
    RunNotFoundError,
    StepNotCommittedError,
    TableVersionError,
)

PROG = "mmstore"
# Output fits the terminal (COLUMNS, else the terminal's width, else this many columns);
# prose wraps at this many columns at most, however wide the terminal.
DEFAULT_WIDTH = 80
GRACE_HELP = (
    "keep unreferenced media younger than this many seconds (default 3600, one hour): "
    "rows still being written may be about to reference it"
)
# Columns of `stats`, renamed so that a row fits 80 columns (`--json` has them all, and
# `unique_images`: the dedup ratio is images over it).
STATS_COLUMNS = {
    "run_id": "run",
    "step": "step",
    "samples": "rows",
    "images": "images",
    "dedup_ratio": "dedup",
    "videos": "videos",
    "video_frames": "frames",
    "parquet_bytes": "parquet",
    "media_bytes": "media",
    "dense_fp32_bytes": "dense fp32",
    "reward": "reward",
    "missing_media": "missing",
}
IMAGE_COLUMNS = ("images", "dedup_ratio", "dense_fp32_bytes")
VIDEO_COLUMNS = ("videos", "video_frames")
BYTE_COLUMNS = ("parquet_bytes", "media_bytes", "disk_bytes", "dense_fp32_bytes")
# Columns of the `inspect` listing, renamed likewise (`--json` keeps the names).
LISTING_COLUMNS = {
    "run_id": "run",
    "step": "step",
    "sample_id": "sample",
    "group_id": "group",
    "tokens": "tokens",
    "prompt_len": "prompt",
    "images": "images",
    "videos": "videos",
    "reward": "reward",
    "advantage": "advantage",
    "policy": "policy",
}
LOG_TEXT_COLUMNS = ("time (UTC)", "operation", "run/step", "producer/seq", "rows", "readable")
# Integer options of the demo, handed to mmstore._demo.main only when given (its own
# defaults are shown in --help).
DEMO_OPTIONS = {
    "groups": "GRPO groups per step",
    "group_size": "samples per group (they share their screenshots)",
    "turns": "screenshots per sample",
    "steps": "steps to write",
    "batch_size": "loader batch size",
    "num_workers": "DataLoader workers",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status.

    Called without ``argv``, as the ``mmstore`` program, it ends the process itself once the
    output is flushed: Arrow's native thread pools can abort the interpreter's teardown right
    after a scan ("terminate called without an active exception", apache/arrow#34314 and
    #39862), which would turn a finished command's status into SIGABRT. Pass ``argv`` to call
    it in-process and get the status back.
    """
    code = _run(argv)
    if argv is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "view", None) and args.sample is None:
        args.usage_error("--view needs --sample ID (the sample to draw)")
    if getattr(args, "tokenizer", None) and args.sample is None:
        args.usage_error("--tokenizer needs --sample ID (the sample to decode)")
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        # The reader went away (`mmstore inspect ROOT | head`): stop quietly, like cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (MmstoreError, OSError, pa.ArrowException, pl.exceptions.PolarsError) as exc:
        # User errors (a wrong path, an unreadable file): one line, no traceback.
        print(f"{PROG} {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


# -- subcommands -------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    options = {k: v for k in DEMO_OPTIONS if (v := getattr(args, k)) is not None}
    if args.json:
        # The demo prints its own report; with --json stdout carries only the JSON document.
        with contextlib.redirect_stdout(sys.stderr):
            summary = demo.main(args.root, tmp=args.tmp, **options)
        _print_json(summary)
    else:
        demo.main(args.root, tmp=args.tmp, **options)
    return 0


def _open(root: str) -> Store:
    try:
        return Store.open(root)
    except NotAStoreError as exc:
        bucket = _missing_bucket(root)
        if bucket is not None:
            raise NotAStoreError(
                f"no mmstore store at {root!r}: the bucket {bucket!r} does not exist (check "
                "its name, and AWS_ENDPOINT_URL for an S3-protocol server)",
                bucket=bucket,
            ) from None
        if not exc.message.endswith(CREATE_REMEDY):
            raise
        remedy = "check the path (a store's root holds mmstore.json)"
        raise NotAStoreError(exc.message.removesuffix(CREATE_REMEDY) + remedy) from None


def _missing_bucket(root: str) -> str | None:
    """The bucket of an ``s3://`` root when the object store says it does not exist; None
    for a local root, an existing bucket, or a store that cannot be asked."""
    if not root.startswith("s3://"):
        return None
    bucket = root[len("s3://") :].split("/", 1)[0]
    try:
        info = s3_filesystem().get_file_info(bucket)
    except (OSError, pa.ArrowException):
        return None
    return bucket if info.type == pafs.FileType.NotFound else None


def _inspect(args: argparse.Namespace) -> int:
    store = _open(args.root)
    if args.version is not None:
        _check_readable(store, args.version)
    if args.sample is not None:
        return _inspect_sample(store, args)
    frame = debug.scan(store, version=args.version)
    if args.run is not None:
        frame = frame.filter(pl.col("run_id") == args.run)
    if args.step is not None:
        frame = frame.filter(pl.col("step") == args.step)
    total = frame.select(pl.len()).collect().item()
    listing = _listing(frame)
    rows = (listing.head(args.limit) if args.limit > 0 else listing).collect()
    if args.json:
        _print_json({"total": total, "rows": rows.to_dicts()})
        return 0
    if total == 0:
        where = _where(args)
        if where:
            _no_match(store, args, where)
        at = "" if args.version is None else f" at version {args.version}"
        print(f"the store holds no rollouts{at}")
        return 0
    _print_table(_listing_view(rows), keys=("run", "step", "sample"))
    shown = rows.height
    print(f"{shown} of {total} rollouts" + ("" if shown == total else " (--limit 0 shows all)"))
    return 0


def _inspect_sample(store: Store, args: argparse.Namespace) -> int:
    tokenizer = None if args.tokenizer is None else _load_tokenizer(args.tokenizer)
    where = {"run_id": args.run, "step": args.step, "version": args.version}
    row = debug.sample(store, args.sample, **where)
    if tokenizer is not None:
        row["text"] = _decoded(row, tokenizer)
    if args.view:
        where.update(run_id=row["run_id"], step=row["step"])
        debug.sample_view(store, args.sample, **where).save(args.view)
    if args.json:
        _print_json(row)
    else:
        print(_describe_sample(row))
    if args.view:
        print(f"wrote {args.view}", file=sys.stderr)
    return 0


def _listing(frame: pl.LazyFrame) -> pl.LazyFrame:
    """One line per rollout: its keys and counts (``inspect``'s listing, and its JSON)."""
    return frame.select(
        "run_id",
        "step",
        "sample_id",
        "group_id",
        pl.col("tokens").list.len().alias("tokens"),
        "prompt_len",
        pl.col("images").list.len().alias("images"),
        pl.col("n_videos").alias("videos"),
        "reward",
        "advantage",
        pl.col("policy_version").alias("policy"),
    )


def _listing_view(rows: pl.DataFrame) -> pl.DataFrame:
    """Short headers, and only the columns that say something: ``videos`` where a listed
    row has videos, ``images`` unless only videos are listed, ``policy`` where known."""
    videos = bool((rows["videos"].fill_null(0) > 0).any())
    images = bool((rows["images"].fill_null(0) > 0).any())
    hidden = set()
    if not videos:
        hidden.add("videos")
    elif not images:
        hidden.add("images")
    if rows["policy"].null_count() == rows.height:
        hidden.add("policy")
    rows = rows.drop(hidden)
    return rows.rename({c: LISTING_COLUMNS[c] for c in rows.columns})


def _check_readable(store: Store, version: int) -> None:
    """Refuse, with :class:`TableVersionError`, a version that cannot be read (any more)."""
    latest = store.table.latest_version()
    if version > latest:
        raise TableVersionError(
            f"the rollouts table has no version {version} (latest is {latest})", version=version
        )
    readable = readable_versions(store)
    if version not in readable:
        raise TableVersionError(
            f"version {version} can no longer be read: gc collected files it lists (or its "
            f"log entry); the readable versions are {_ranges(readable)} (`mmstore log` "
            "lists them)",
            version=version,
        )


def _load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)``; transformers is imported only here."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"--tokenizer {path}: no tokenizer loads from there ({_one_line(exc)})"
        ) from None


def _decoded(row: dict[str, Any], tokenizer: Any) -> dict[str, str]:
    """The sample's prompt and completion as text: text spans decoded (special tokens kept),
    each image or video span one ``[image#0: 322 tokens]`` marker."""
    tokens = row["tokens"]

    def text(start: int, stop: int) -> str:
        ids = tokens[start:stop]
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    prompt = [
        text(start, stop) if label == "text" else f"[{label}: {stop - start} tokens]"
        for label, start, stop in _layout(row)
        if label != "completion"
    ]
    return {"prompt": "".join(prompt), "completion": text(row["prompt_len"], len(tokens))}


def _no_match(store: Store, args: argparse.Namespace, where: str) -> None:
    """Raise the error for an ``inspect`` selection that matched nothing, naming what the
    store holds: a run it never held, or a step of a run it holds."""
    held: dict[str, set[int]] = {}
    for file in store.files(args.version):
        held.setdefault(file.run_id, set()).add(file.step)
    message = f"no rollouts match {where}; the store holds {holdings(held)}"
    if args.run is not None and args.run not in held:
        raise RunNotFoundError(message, root=args.root, missing_runs=[args.run])
    raise StepNotCommittedError(message, root=args.root)


def _stats(args: argparse.Namespace) -> int:
    store = _open(args.root)
    by = {"step": ("run_id", "step"), "run": ("run_id",), "store": ()}[args.by]
    table = debug.summary(store, by=by)
    total = debug.summary(store, by=()) if by else table
    usage = disk_usage(store, grace_seconds=args.grace)
    if args.json:
        _print_json(
            {"rows": table.to_dicts(), "total": total.row(0, named=True), "disk": usage.to_dict()}
        )
        return 0
    if table.height == 0 or total["samples"].item() == 0:
        print("the store holds no rollouts")
    else:
        _print_stats(table, total, whole=bool(by))
    print()
    print("\n".join(_disk_lines(usage)))
    return 0


def _print_stats(table: pl.DataFrame, total: pl.DataFrame, *, whole: bool) -> None:
    """``stats``' table, then the whole store's (``whole``), then what the tables leave out."""
    shown = _stats_columns(total.row(0, named=True))
    sizes = ("parquet", "media", "dense fp32", "reward")
    _print_table(_stats_view(table, shown), keys=("run", "step"), right=sizes)
    if whole:
        print()
        print("\n".join(_wrap(["whole store (media shared between steps counted once):"])))
        _print_table(_stats_view(total, shown), right=sizes)
    notes = [] if "missing_media" in shown else ["missing media: none"]
    if "images" in shown and "videos" in shown:
        notes.append("dense fp32: the images' pixel_values (videos not counted)")
    print("\n".join(_wrap(notes)))


def _stats_columns(total: dict[str, Any]) -> list[str]:
    """The summary columns ``stats`` shows: the video columns where the store holds video
    refs, the image columns unless it holds videos and no image, ``missing_media`` where
    media is missing (else a line says none is)."""
    videos, images = total["videos"] > 0, total["images"] > 0
    hidden = (() if videos else VIDEO_COLUMNS) + (IMAGE_COLUMNS if videos and not images else ())
    hidden += () if total["missing_media"] else ("missing_media",)
    return [c for c in STATS_COLUMNS if c not in hidden]


def _disk_lines(usage: DiskUsage) -> list[str]:
    """Where the bytes on disk are, and what gc would free, now and after the grace."""
    pinned = f" ({usage.media_pinned_only} held by pins alone)" if usage.media_pinned_only else ""
    parts = [
        ("rollout files", usage.rollout_files, usage.rollout_bytes, ""),
        ("media, referenced", usage.media_referenced, usage.media_referenced_bytes, pinned),
        ("media, unreferenced", usage.media_unreferenced, usage.media_unreferenced_bytes, ""),
        ("table log", usage.log_files, usage.log_bytes, _log_clause(usage)),
    ]
    lines = [f"on disk: {_human_bytes(usage.total_bytes)}"]
    lines += [f"  {name:<20}{n:>7} files  {_human_bytes(b):>10}{why}" for name, n, b, why in parts]
    if usage.staging_bytes:
        lines.append(f"  (and {_human_bytes(usage.staging_bytes)} of in-flight writes in _staging)")
    lines.append(
        f"gc --grace {usage.grace_seconds:g} would free {_human_bytes(usage.free_now_bytes)} "
        f"now ({usage.free_now_files} files)"
        + _grace_clause(usage.grace_files, usage.grace_bytes, usage.free_by, usage.grace_seconds)
    )
    return _wrap(lines)


def _log_clause(usage: DiskUsage) -> str:
    if not usage.log_free_now_files:
        return ""
    return f" (gc frees {_human_bytes(usage.log_free_now_bytes)}: versions nobody opens)"


def _grace_clause(files: int, nbytes: int, free_by: float | None, grace: float) -> str:
    """``; it keeps 3 files (1.2 MiB) for the grace period (3600 s), until 01:50 UTC``."""
    if not files:
        return ""
    until = "" if free_by is None else f", until {_when(free_by)}"
    return (
        f"; keeps {files} files ({_human_bytes(nbytes)}) for the grace period "
        f"({grace:g} s: released rows, unreferenced media not yet that old){until}"
    )


def _when(moment: float) -> str:
    minutes = max(0, round((moment - time.time()) / 60))
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(moment)) + f" (in {minutes} min)"


def _stats_view(frame: pl.DataFrame, columns: Sequence[str]) -> pl.DataFrame:
    """Human units and short headers; ``disk_bytes`` is parquet + media, so it is left out."""
    frame = frame.with_columns(
        pl.Series(c, [_short_bytes(v) for v in frame[c]], dtype=pl.String) for c in BYTE_COLUMNS
    ).with_columns(
        pl.Series(
            "reward",
            [
                _mean_std(m, s)
                for m, s in zip(frame["reward_mean"], frame["reward_std"], strict=True)
            ],
            dtype=pl.String,
        )
    )
    shown = [c for c in columns if c in frame.columns]
    return frame.select(shown).rename({c: STATS_COLUMNS[c] for c in shown})


def _mean_std(mean: float | None, std: float | None) -> str:
    """``0.50±0.58``: two decimals keep the column narrow."""
    if mean is None:
        return "-"
    return f"{mean:.2f}" + ("" if std is None else f"±{std:.2f}")


def _verify(args: argparse.Namespace) -> int:
    store = _open(args.root)
    report = verify(store, check_hashes=not args.no_hash)
    if args.json:
        _print_json(report.to_dict())
    else:
        checked = (
            f"{report.files_checked} rollout files, {report.refs_checked} media refs, "
            f"{report.media_checked} media files"
            + (" (sizes only, --no-hash)" if args.no_hash else "")
        )
        print(f"checked {checked}")
        for problem in report.problems:
            print(_describe_problem(problem))
        print("ok" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    store = _open(args.root)
    report = gc(store, grace_seconds=args.grace, dry_run=args.dry_run)
    if args.json:
        _print_json(report.to_dict())
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    for path in [*report.rollout_files_deleted, *report.deleted]:
        print(f"{verb} {path}")
    print("\n".join(_gc_lines(report, disk_usage(store, grace_seconds=args.grace))))
    return 0


def _gc_lines(report: GcReport, usage: DiskUsage) -> list[str]:
    """What a gc deleted and why it kept the rest: referenced, pinned, or in the grace."""
    verb = "would delete" if report.dry_run else "deleted"
    cleared = "would clear" if report.dry_run else "cleared"
    referenced = min(report.kept, usage.media_referenced)
    pinned = f", {usage.media_pinned_only} of them by pins alone" if usage.media_pinned_only else ""
    young = report.kept - referenced
    until = "" if usage.free_by is None else f", until {_when(usage.free_by)}"
    lines = [
        f"{verb} {len(report.deleted)} media files ({_human_bytes(report.bytes_freed)}) and "
        f"{len(report.rollout_files_deleted)} rollout files "
        f"({_human_bytes(report.rollout_bytes_freed)}); {cleared} "
        f"{len(report.staging_cleared)} staging files; {report.log_files_deleted} "
        f"files of the table's log ({_human_bytes(report.log_bytes_freed)}: versions before "
        "the grace period and pins)",
        f"kept {report.kept} media files ({_human_bytes(report.bytes_kept)}): {referenced} "
        f"referenced by rows of the latest version or pins{pinned}"
        + (
            f"; {young} only for the grace period ({report.grace_seconds:g} s){until}"
            if young
            else ""
        ),
        f"kept {report.rollout_files_kept} rollout files (a version a reader may still read, "
        "or pinned, lists them; or younger than the grace period)",
    ]
    return _wrap(lines)


def _export(args: argparse.Namespace) -> int:
    store = _open(args.root)
    dest = export(store, args.dest, runs=args.run, steps=args.steps)
    rows = debug.scan(dest).select(pl.len()).collect().item()
    result = {
        "dest": dest.root,
        "rollout_files": len(dest.files()),
        "rows": rows,
        "media_files": len(dest.backend.list("media")),
    }
    if args.json:
        _print_json(result)
    else:
        print(
            f"exported {rows} rollouts ({result['rollout_files']} files) and "
            f"{result['media_files']} media files to {dest.root}"
        )
    return 0


def _release(args: argparse.Namespace) -> int:
    store = _open(args.root)
    try:
        report = release_run(
            store, args.run_id, grace_seconds=args.grace, dry_run=args.dry_run, force=args.force
        )
    except PinnedRowsError as exc:  # the API's remedy, in this command's words
        raise PinnedRowsError(exc.message.replace("force=True", "--force"), **exc.context) from None
    if args.json:
        _print_json(report.to_dict())
        return 0
    removed = "would remove" if args.dry_run else "removed"
    deleted = "would delete" if args.dry_run else "deleted"
    for path in report.removed_files:
        print(f"{removed} {path}")
    for path in [*report.gc.rollout_files_deleted, *report.gc.deleted]:
        print(f"{deleted} {path}")
    done = f"run {args.run_id}: {removed} {len(report.removed_files)} rollout files from the "
    print("\n".join(_wrap([done + "latest version"])))
    print("\n".join(_gc_lines(report.gc, disk_usage(store, grace_seconds=args.grace))))
    return 0


def _log(args: argparse.Namespace) -> int:
    store = _open(args.root)
    table = store.table
    latest, first = table.latest_version(), table.first_version()
    stop = first - 1 if args.limit <= 0 else max(first - 1, latest - args.limit)
    entries = [table.log_entry(v, check_cleaned=False) for v in range(latest, stop, -1)]
    readable = readable_versions(store)
    records = [_log_record(store, e, e.version in readable) for e in entries if e is not None]
    if args.json:
        _print_json({"latest": latest, "readable_versions": readable, "versions": records})
        return 0
    _print_table(_log_view(records), keys=("version",), right=("rows",))
    total = latest - first + 1
    shown = f"{len(records)} of {total} versions"
    print(shown + ("" if len(records) == total else " (--limit 0 shows all)"))
    note = f"readable: {_ranges(readable)} (gc collected files the others list)"
    print("\n".join(_wrap([note if len(readable) < total else "every version is readable"])))
    return 0


def _log_record(store: Store, entry: LogEntry, readable: bool) -> dict[str, Any]:
    """One commit of the table's log, as ``log --json`` prints it."""
    paths = [f.path for f in entry.added] + list(entry.removed)
    return {
        "version": entry.version,
        "timestamp_ms": entry.timestamp_ms,
        "operation": entry.operation,
        "partitions": sorted(p for p in {_partition(path) for path in paths} if p is not None),
        "producers": [
            {"producer": producer_of(app) or app, "seq": seq} for app, seq in entry.producers
        ],
        "files_added": len(entry.added),
        "files_removed": len(entry.removed),
        "rows_added": sum(f.rows or 0 for f in entry.added),
        "rows_removed": _removed_rows(store, entry),
        "readable": readable,
    }


def _partition(path: str) -> tuple[str, int] | None:
    try:
        return partition_of(path)
    except MmstoreError:  # a file another engine put outside the partitions
        return None


def _removed_rows(store: Store, entry: LogEntry) -> int | None:
    """Rows of the files ``entry`` removed, from the version before it (None where that
    version can no longer be opened)."""
    if not entry.removed:
        return 0
    try:
        before = {f.path: f.rows or 0 for f in store.files(entry.version - 1)}
    except MmstoreError:
        return None
    return sum(before.get(path, 0) for path in entry.removed)


def _log_view(records: list[dict[str, Any]]) -> pl.DataFrame:
    """``log``'s table: a row per version, newest first, every cell short."""
    return pl.DataFrame(
        [
            {
                "version": r["version"],
                "time (UTC)": _utc(r["timestamp_ms"]),
                "operation": _operation(r["operation"]),
                "run/step": _partitions_text(r["partitions"]),
                "producer/seq": _producers_text(r["producers"]),
                "rows": _rows_text(r),
                "readable": "yes" if r["readable"] else "no",
            }
            for r in records
        ],
        schema={"version": pl.Int64, **dict.fromkeys(LOG_TEXT_COLUMNS, pl.String)},
    )


def _utc(ms: int | None) -> str:
    return "-" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def _operation(name: str | None) -> str:
    """Delta's operation, lower case (``CREATE TABLE`` is ``create``)."""
    if name is None:
        return "-"
    return {"CREATE TABLE": "create"}.get(name, name.lower())


def _partitions_text(pairs: Sequence[tuple[str, int]]) -> str:
    """``r1/3``; ``r1/0-5`` for several steps of one run; ``3 runs``."""
    runs = sorted({run for run, _ in pairs})
    if len(runs) != 1:
        return f"{len(runs)} runs" if runs else "-"
    steps = sorted(step for _, step in pairs)
    return f"{runs[0]}/{steps[0]}" + ("" if steps[0] == steps[-1] else f"-{steps[-1]}")


def _producers_text(producers: Sequence[dict[str, Any]]) -> str:
    if not producers:
        return "-"
    first = f"{producers[0]['producer']}/{producers[0]['seq']}"
    return first + (f" +{len(producers) - 1}" if len(producers) > 1 else "")


def _rows_text(record: dict[str, Any]) -> str:
    """``+4`` added, ``-8`` removed (``-?`` where unknown), ``0`` for neither."""
    parts = [f"+{record['rows_added']}"] if record["files_added"] else []
    if record["files_removed"]:
        removed = record["rows_removed"]
        parts.append(f"-{'?' if removed is None else removed}")
    return " ".join(parts) or "0"


def _upgrade(args: argparse.Namespace) -> int:
    report = upgrade(args.root)
    if args.json:
        _print_json(report.to_dict())
    elif not report.upgraded:
        print(f"{args.root} is a format-2 store already (table version {report.table_version})")
    else:
        print(
            f"upgraded {args.root} to format 2: committed {report.files_committed} rollout "
            f"files ({report.files_already_committed} by an earlier run) to the table, now at "
            f"version {report.table_version}"
        )
    return 0


def _pin(args: argparse.Namespace) -> int:
    store = _open(args.root)
    if args.name is None:
        pins = list_pins(store)
        if args.json:
            _print_json(pins)
        elif pins:
            for name, count in sorted(pins.items()):
                print(f"{name}\t{count} media")
        else:
            print("no pins")
        return 0
    if args.remove:
        unpin(store, args.name)
        result = {"pin": args.name, "removed": True}
    else:
        path = pin_rows(store, args.name, runs=args.run, steps=args.steps)
        result = {"pin": args.name, "path": path, "hashes": list_pins(store)[args.name]}
    if args.json:
        _print_json(result)
    elif args.remove:
        print(f"removed pin {args.name}")
    else:
        print(f"pinned {result['hashes']} media as {args.name} ({result['path']})")
    return 0


# -- parsing -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect and maintain an mmstore rollout store."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(handler=handler)
        return p

    p = command("demo", _demo, "write synthetic screenshot rollouts, then train-read them")
    p.add_argument(
        "--root", help="where to write the store, which is kept (default ./mmstore-demo)"
    )
    p.add_argument("--tmp", action="store_true", help="use a temporary store, deleted at the end")
    defaults = inspect.signature(demo.main).parameters
    for name, help in DEMO_OPTIONS.items():
        default = defaults[name].default
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, metavar="N", help=f"{help} (default {default})"
        )

    p = command("inspect", _inspect, "list rollouts, or show one sample")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--run", help="only this run_id")
    p.add_argument("--step", type=int, help="only this step")
    p.add_argument("--sample", metavar="ID", help="show this sample in detail")
    p.add_argument("--limit", type=int, default=20, help="rows to list (0: all; default 20)")
    p.add_argument("--view", metavar="PNG", help="with --sample: render the sample to a PNG")
    p.add_argument(
        "--version",
        type=_version,
        metavar="N",
        help="read table version N (time travel; `mmstore log` lists them; default latest)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="with --sample: decode its tokens to text with this tokenizer "
        "(AutoTokenizer.from_pretrained(PATH): a directory or a model id)",
    )
    p.set_defaults(usage_error=p.error)  # a usage error names this subcommand's usage

    p = command("log", _log, "the table's versions, newest first: what each commit did")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--limit", type=int, default=20, help="versions to list (0: all; default 20)")

    p = command("stats", _stats, "per run/step counts, dedup, bytes, rewards, missing media")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument(
        "--by",
        choices=("step", "run", "store"),
        default="step",
        help="one table row per run and step, per run, or one for the store (default step)",
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=3600,
        metavar="SECONDS",
        help="the grace period to say what gc would free with (default 3600)",
    )

    p = command("verify", _verify, "check that every ref resolves and every hash matches")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--no-hash", action="store_true", help="check presence only, not hashes")

    p = command("gc", _gc, "delete rollout files and media no needed version or pin references")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--grace", type=_seconds, default=3600, metavar="SECONDS", help=GRACE_HELP)
    p.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")

    p = command("export", _export, "copy rows and exactly their media to a new store")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("dest", help="new store path or s3://bucket/prefix (must be empty)")
    p.add_argument("--run", action="append", help="a run_id to export (repeatable)")
    p.add_argument("--steps", type=_steps, metavar="A:B", help="steps A to B-1, or one step")

    p = command("pin", _pin, "keep the media of chosen rows alive; list or remove pins")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("name", nargs="?", help="pin name (omit to list the pins)")
    p.add_argument("--run", action="append", help="a run_id whose rows to pin (repeatable)")
    p.add_argument("--steps", type=_steps, metavar="A:B", help="steps A to B-1, or one step")
    p.add_argument("--remove", action="store_true", help="remove the pin NAME")

    p = command("upgrade", _upgrade, "turn a format-1 store into format 2, in place")
    p.add_argument("root", help="store path or s3://bucket/prefix")

    p = command("release", _release, "drop a run's rollouts from the latest version, then gc")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("run_id", metavar="RUN_ID", help="the run whose rows to release")
    p.add_argument("--grace", type=_seconds, default=3600, metavar="SECONDS", help=GRACE_HELP)
    p.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    p.add_argument(
        "--force", action="store_true", help="release rows a pin holds (the pin keeps its copy)"
    )

    return parser


def _steps(text: str) -> range:
    """``A:B`` (half-open, like a Python slice) or a single step ``S``."""
    try:
        if ":" not in text:
            return range(int(text), int(text) + 1)
        start, stop = text.split(":")
        steps = range(int(start), int(stop))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B or S, got {text!r}") from None
    if steps.start < 0 or not steps:
        raise argparse.ArgumentTypeError(f"{text!r} selects no steps")
    return steps


def _version(text: str) -> int:
    """A table version: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a table version (0 or more), got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A duration (``--grace``), as the API checks it: nan, inf and negatives refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    try:
        return seconds("--grace", value)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


# -- printing ----------------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(_json_text(value))


def _json_text(value: Any, indent: str = "") -> str:
    """Indented JSON whose lists of plain values stay on one line: a sample's thousands of
    tokens make one line, not thousands."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_json_text(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list | tuple) and any(isinstance(v, dict | list | tuple) for v in value):
        items = [f"{inner}{_json_text(v, inner)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{indent}]"
    return json.dumps(value, default=str)


def _print_table(frame: pl.DataFrame, keys: Sequence[str] = (), right: Sequence[str] = ()) -> None:
    print(_table_text(frame, keys=keys, right=right))


def _width() -> int:
    """The terminal's columns (``COLUMNS`` first, as ``shutil`` reads it)."""
    return max(40, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def _prose_width() -> int:
    """Where prose wraps: the terminal's width, at most ``DEFAULT_WIDTH``."""
    return min(_width(), DEFAULT_WIDTH)


def _wrap(lines: list[str]) -> list[str]:
    """Each line wrapped at :func:`_prose_width`, continuations indented."""
    width = _prose_width()
    return [
        part
        for line in lines
        for part in textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False)
        or [""]
    ]


def _human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _short_bytes(n: float | None) -> str:
    """``8.1 KiB``, ``23 MiB``: a table's bytes, whole units from 10 up (7 columns)."""
    text = _human_bytes(n)
    number, _, unit = text.partition(" ")
    if unit in ("", "B") or float(number) < 10:
        return text
    return f"{float(number):.0f} {unit}"


def _unknown(value: Any) -> Any:
    return "unknown" if value is None else value


def _describe_sample(row: dict[str, Any]) -> str:
    tokens, prompt = row["tokens"], row["prompt_len"]
    lines = [
        f"sample {row['sample_id']}  run {row['run_id']}  step {row['step']}  "
        f"group {row['group_id']}",
        f"tokens {len(tokens)}: prompt {prompt}, completion {len(tokens) - prompt}, "
        f"in loss {sum(row['loss_mask'])}",
        f"reward {row['reward']}  advantage {row['advantage']}  "
        f"policy version {_unknown(row.get('policy_version'))}",
    ]
    if row["metadata"]:
        lines.append(f"metadata {row['metadata']}")
    lines = [*_wrap(lines), *_wrap_parts(_spans(row), prefix="spans  ")]
    if "text" in row:
        lines += _text_lines(row["text"])
    lines += _refs_lines("image", row["images"], _image_table)
    clips = row.get("videos") or []
    if clips:  # a row without videos reads as before
        lines += _refs_lines("video", clips, _video_table)
    return "\n".join(lines)


def _refs_lines(
    kind: str,
    refs: list[dict[str, Any]],
    table: Callable[[list[dict[str, Any]]], pl.DataFrame],
) -> list[str]:
    """A table of the refs, then each one's URI whole, on a line of its own (to copy)."""
    lines = [f"{kind}s ({len(refs)}):"]
    if refs:
        lines.append(_table_text(table(refs), keys=("index",)))
        lines += [f"  {kind}#{i}  {ref['uri']}" for i, ref in enumerate(refs)]
    return lines


def _image_table(images: list[dict[str, Any]]) -> pl.DataFrame:
    """One line per image ref: its span, size and bytes (the hash too where the URI does
    not name it)."""
    return pl.DataFrame(
        [
            {
                "index": i,
                "tokens": f"[{ref['offset']}, {ref['offset'] + ref['length']})",
                "length": ref["length"],
                "size": f"{ref['width']}x{ref['height']}",
                "bytes": _human_bytes(ref["nbytes"]),
                # A store URI names the hash; the hash column is only for other URIs.
                **({} if ref["hash"] in ref["uri"] else {"hash": ref["hash"]}),
            }
            for i, ref in enumerate(images)
        ]
    )


def _video_table(clips: list[dict[str, Any]]) -> pl.DataFrame:
    """One line per video ref: its span, clip size, the frames it samples of the clip's
    and at what rate, and bytes (the hash too where the URI does not name it)."""
    return pl.DataFrame(
        [
            {
                "index": i,
                "tokens": f"[{ref['offset']}, {ref['offset'] + ref['length']})",
                "length": ref["length"],
                "size": f"{ref['width']}x{ref['height']}",
                "frames": f"{len(ref['frames'])} of {ref['num_frames']}",
                "fps": ref["fps"],
                "bytes": _human_bytes(ref["nbytes"]),
                **({} if ref["hash"] in ref["uri"] else {"hash": ref["hash"]}),
            }
            for i, ref in enumerate(clips)
        ]
    )


def _table_text(frame: pl.DataFrame, keys: Sequence[str] = (), right: Sequence[str] = ()) -> str:
    """A plain, aligned table of every row and column that fits the terminal: numbers (and
    the ``right`` columns: sizes) right, other text left, two spaces between columns, no
    trailing blanks, floats to 3 decimals, nulls as ``-``. Where it is too wide, the widest
    text cells are cut in the middle (a URI keeps its hash's start and its extension), and
    columns that still do not fit go on to a second table below, which repeats the ``keys``
    columns so that its rows read on their own."""
    width = _width()
    header = list(frame.columns)
    numeric = [frame.schema[c].is_numeric() or c in right for c in header]
    cells = [[_cell(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    _shrink_text_columns(widths, numeric, width)
    cells = [[v if len(v) <= widths[i] else _cut(v, widths[i]) for i, v in enumerate(r)]
             for r in cells]  # fmt: skip

    def table(columns: list[int]) -> str:
        def line(values: list[str]) -> str:
            parts = [values[i].rjust(widths[i]) if numeric[i] else values[i].ljust(widths[i])
                     for i in columns]  # fmt: skip
            return "  ".join(parts).rstrip()

        return "\n".join([line(header), *(line(r) for r in cells)])

    key_index = [i for i, h in enumerate(header) if h in keys]
    return "\n\n".join(table(group) for group in _column_groups(widths, key_index, width))


def _shrink_text_columns(widths: list[int], numeric: list[bool], width: int) -> None:
    """Narrow the widest text columns (to no less than 16) until a line fits ``width``."""
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    while excess > 0:
        wide = [i for i, w in enumerate(widths) if not numeric[i] and w > 16]
        if not wide:
            return
        i = max(wide, key=lambda c: widths[c])
        cut = min(excess, widths[i] - 16)
        widths[i] -= cut
        excess -= cut


def _column_groups(widths: list[int], keys: list[int], width: int) -> list[list[int]]:
    """Columns in groups whose lines fit ``width``; every group starts with the keys."""
    groups: list[list[int]] = []
    current = list(keys)
    for i in range(len(widths)):
        if i in keys:
            continue
        wider = [*current, i]
        if len(current) > len(keys) and sum(widths[c] for c in wider) + 2 * len(current) > width:
            groups.append(current)
            wider = [*keys, i]
        current = wider
    groups.append(current)
    return groups


def _cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters, cut in the middle with an ellipsis."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _wrap_parts(parts: list[str], *, prefix: str) -> list[str]:
    """``parts`` joined by `` | ``, wrapped at :func:`_prose_width` between parts, never
    inside one."""
    width = _prose_width()
    lines: list[str] = []
    current: list[str] = []
    for part in parts:
        if current and len(prefix) + len(" | ".join([*current, part])) + 2 > width:
            lines.append(" | ".join(current) + " |")
            current = []
        current.append(part)
    lines.append(" | ".join(current))
    return [(prefix if i == 0 else " " * len(prefix)) + line for i, line in enumerate(lines)]


def _spans(row: dict[str, Any]) -> list[str]:
    """``text [0,14)``, ``image#0 [14,91)``, ``video#0 [95,520)``, ...,
    ``completion [200,344)``: the token layout, image and video spans in token order."""
    return [f"{label} [{start},{stop})" for label, start, stop in _layout(row)]


def _layout(row: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``(label, start, stop)`` of each part of the row's tokens, in order: ``text``,
    ``image#0``, ``video#0``, ..., then ``completion``."""
    parts, cursor, prompt = [], 0, row["prompt_len"]
    spans = [("image", i, ref) for i, ref in enumerate(row["images"])]
    spans += [("video", i, ref) for i, ref in enumerate(row.get("videos") or [])]
    for kind, index, ref in sorted(spans, key=lambda span: span[2]["offset"]):
        if ref["offset"] > cursor:
            parts.append(("text", cursor, ref["offset"]))
        cursor = ref["offset"] + ref["length"]
        parts.append((f"{kind}#{index}", ref["offset"], cursor))
    if prompt > cursor:
        parts.append(("text", cursor, prompt))
    parts.append(("completion", prompt, len(row["tokens"])))
    return parts


def _text_lines(text: dict[str, str]) -> list[str]:
    """The decoded prompt and completion under their labels, wrapped, newlines kept."""
    width, indent = _prose_width(), " " * 14
    lines = ["text (--tokenizer):"]
    for label in ("prompt", "completion"):
        first = f"  {label + ':':<12}"
        for paragraph in text[label].split("\n"):
            wrapped = textwrap.wrap(paragraph, width - len(indent), drop_whitespace=False)
            for part in wrapped or [""]:
                lines.append((first or indent) + part)
                first = ""
    return [line.rstrip() for line in lines]


def _ranges(values: Sequence[int]) -> str:
    """``0-2, 5``: sorted integers as runs."""
    runs: list[list[int]] = []
    for value in sorted(values):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _describe_problem(problem: Any) -> str:
    where = ", ".join(
        f"{key}={value}"
        for key in ("file", "run_id", "step", "sample_id", "image_index", "video_index", "uri")
        if (value := getattr(problem, key, None)) is not None
    )
    return f"{problem.kind}: {problem.message}" + (f" ({where})" if where else "")


def _where(args: argparse.Namespace) -> str:
    return " ".join(
        f"--{name} {value}"
        for name, value in (("run", args.run), ("step", args.step))
        if value is not None
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
