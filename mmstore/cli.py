"""The ``mmstore`` command line. It parses, calls the library and prints; nothing else.

Every subcommand prints a human-readable table or summary, or with ``--json`` one JSON
document on stdout. Errors print one line on stderr: exit status 2 for a usage error, 1 for a
failure (a store that is not there, a problem that ``verify`` found). Progress bars go to
stderr and are off when ``MMSTORE_PROGRESS=0`` or stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl
import pyarrow as pa

from mmstore import __version__, debug
from mmstore import _demo as demo
from mmstore._exceptions import MmstoreError, NoMatchError, NotAStoreError
from mmstore._lifecycle.export import export
from mmstore._lifecycle.gc import gc, release_run
from mmstore._lifecycle.pins import list_pins, pin_rows, unpin
from mmstore._lifecycle.upgrade import upgrade
from mmstore._lifecycle.verify import verify
from mmstore._rows.store import Store
from mmstore._storage.store import CREATE_REMEDY

PROG = "mmstore"
TEXT_WIDTH = 96  # lines of prose; tables fit 100 columns for the usual run and sample ids
GRACE_HELP = (
    "keep unreferenced media younger than this many seconds (default 3600, one hour): "
    "rows still being written may be about to reference it"
)
# Columns of `stats`, renamed so a row fits a 100-column terminal.
STATS_COLUMNS = {
    "run_id": "run",
    "step": "step",
    "samples": "rows",
    "images": "images",
    "unique_images": "unique",
    "dedup_ratio": "dedup",
    "parquet_bytes": "parquet",
    "media_bytes": "media",
    "dense_fp32_bytes": "dense fp32",
    "reward": "reward ± std",
    "missing_media": "missing",
}
BYTE_COLUMNS = ("parquet_bytes", "media_bytes", "disk_bytes", "dense_fp32_bytes")
# Integer options of the demo, handed to mmstore._demo.main only when given.
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
        parser.error("inspect --view needs --sample ID")
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
        if not exc.message.endswith(CREATE_REMEDY):
            raise
        remedy = "check the path (a store's root holds mmstore.json)"
        raise NotAStoreError(exc.message.removesuffix(CREATE_REMEDY) + remedy) from None


def _inspect(args: argparse.Namespace) -> int:
    store = _open(args.root)
    if args.sample is not None:
        row = debug.sample(store, args.sample, run_id=args.run, step=args.step)
        if args.view:
            debug.sample_view(store, args.sample, run_id=row["run_id"], step=row["step"]).save(
                args.view
            )
        if args.json:
            _print_json(row)
        else:
            print(_describe_sample(row))
        if args.view:
            print(f"wrote {args.view}", file=sys.stderr)
        return 0
    frame = debug.scan(store)
    if args.run is not None:
        frame = frame.filter(pl.col("run_id") == args.run)
    if args.step is not None:
        frame = frame.filter(pl.col("step") == args.step)
    total = frame.select(pl.len()).collect().item()
    listing = frame.select(
        "run_id",
        "step",
        "sample_id",
        "group_id",
        pl.col("tokens").list.len().alias("tokens"),
        "prompt_len",
        pl.col("images").list.len().alias("images"),
        "reward",
        "advantage",
    )
    rows = (listing.head(args.limit) if args.limit > 0 else listing).collect()
    if args.json:
        _print_json({"total": total, "rows": rows.to_dicts()})
        return 0
    if total == 0:
        where = _where(args)
        if where:
            raise NoMatchError(f"no rollouts match {where}", root=args.root)
        print("the store holds no rollouts")
        return 0
    _print_table(rows)
    shown = rows.height
    print(f"{shown} of {total} rollouts" + ("" if shown == total else " (--limit 0 shows all)"))
    return 0


def _stats(args: argparse.Namespace) -> int:
    store = _open(args.root)
    by = {"step": ("run_id", "step"), "run": ("run_id",), "store": ()}[args.by]
    table = debug.summary(store, by=by)
    total = debug.summary(store, by=()) if by else table
    if args.json:
        _print_json({"rows": table.to_dicts(), "total": total.row(0, named=True)})
        return 0
    if table.height == 0 or total["samples"].item() == 0:
        print("the store holds no rollouts")
        return 0
    _print_table(_stats_view(table))
    if by:
        print()
        print("whole store (media shared between steps counted once):")
        _print_table(_stats_view(total))
    return 0


def _stats_view(frame: pl.DataFrame) -> pl.DataFrame:
    """Human units and short headers; ``disk_bytes`` is parquet + media, so it is left out."""
    frame = _human_bytes_columns(frame).with_columns(
        pl.Series(
            "reward",
            [
                _mean_std(m, s)
                for m, s in zip(frame["reward_mean"], frame["reward_std"], strict=True)
            ],
            dtype=pl.String,
        )
    )
    shown = [c for c in STATS_COLUMNS if c in frame.columns]
    return frame.select(shown).rename({c: STATS_COLUMNS[c] for c in shown})


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f}" + ("" if std is None else f" ± {std:.3f}")


def _verify(args: argparse.Namespace) -> int:
    store = _open(args.root)
    report = verify(store, check_hashes=not args.no_hash)
    if args.json:
        _print_json(report.to_dict())
    else:
        checked = (
            f"{report.files_checked} rollout files, {report.refs_checked} image refs, "
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
    for path in report.deleted:
        print(f"{verb} {path}")
    print(
        f"{verb} {len(report.deleted)} media files ({_human_bytes(report.bytes_freed)}), "
        f"kept {report.kept} ({_human_bytes(report.bytes_kept)}); "
        f"{report.referenced} hashes referenced; "
        f"{len(report.staging_cleared)} staging files "
        + ("would be cleared" if report.dry_run else "cleared")
    )
    return 0


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
    report = release_run(
        store, args.run_id, grace_seconds=args.grace, dry_run=args.dry_run, force=args.force
    )
    if args.json:
        _print_json(report.to_dict())
        return 0
    removed = "would remove" if args.dry_run else "removed"
    deleted = "would delete" if args.dry_run else "deleted"
    for path in report.removed_files:
        print(f"{removed} {path}")
    for path in report.gc.deleted:
        print(f"{deleted} {path}")
    print(
        f"run {args.run_id}: {removed} {len(report.removed_files)} rollout files; gc "
        f"{deleted} {len(report.gc.deleted)} media files ({_human_bytes(report.gc.bytes_freed)}),"
        f" kept {report.gc.kept}"
    )
    return 0


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
    for name, help in DEMO_OPTIONS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N", help=help)

    p = command("inspect", _inspect, "list rollouts, or show one sample")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--run", help="only this run_id")
    p.add_argument("--step", type=int, help="only this step")
    p.add_argument("--sample", metavar="ID", help="show this sample in detail")
    p.add_argument("--limit", type=int, default=20, help="rows to list (0: all; default 20)")
    p.add_argument("--view", metavar="PNG", help="with --sample: render the sample to a PNG")

    p = command("stats", _stats, "per run/step counts, dedup, bytes, rewards, missing media")
    p.add_argument("root", help="store path or s3://bucket/prefix")
    p.add_argument("--by", choices=("step", "run", "store"), default="step")

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
    p.add_argument("run_id")
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"grace must be >= 0, got {text!r}")
    return value


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


def _print_table(frame: pl.DataFrame) -> None:
    print(_table_text(frame))


def _human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _human_bytes_columns(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns(
        pl.Series(c, [_human_bytes(v) for v in frame[c]], dtype=pl.String) for c in BYTE_COLUMNS
    )


def _describe_sample(row: dict[str, Any]) -> str:
    tokens, prompt = row["tokens"], row["prompt_len"]
    lines = [
        f"sample {row['sample_id']}  run {row['run_id']}  step {row['step']}  "
        f"group {row['group_id']}",
        f"tokens {len(tokens)}: prompt {prompt}, completion {len(tokens) - prompt}, "
        f"in loss {sum(row['loss_mask'])}",
        f"reward {row['reward']}  advantage {row['advantage']}",
        *_wrap_parts(_spans(row), prefix="spans  "),
    ]
    if row["metadata"]:
        lines.append(f"metadata {row['metadata']}")
    lines.append(f"images ({len(row['images'])}):")
    if row["images"]:
        refs = pl.DataFrame(
            [
                {
                    "index": i,
                    "tokens": f"[{ref['offset']}, {ref['offset'] + ref['length']})",
                    "length": ref["length"],
                    "size": f"{ref['width']}x{ref['height']}",
                    "bytes": _human_bytes(ref["nbytes"]),
                    # A store URI names the hash; the hash column is only for other URIs.
                    **({} if ref["hash"] in ref["uri"] else {"hash": ref["hash"]}),
                    "uri": ref["uri"],
                }
                for i, ref in enumerate(row["images"])
            ]
        )
        lines.append(_table_text(refs))
    return "\n".join(lines)


def _table_text(frame: pl.DataFrame) -> str:
    """A plain, aligned table of every row and column: numbers right, text left, two spaces
    between columns, no trailing blanks, floats to 3 decimals, nulls as ``-``."""
    header = list(frame.columns)
    numeric = [frame.schema[c].is_numeric() for c in header]
    cells = [[_cell(v) for v in row] for row in frame.iter_rows()]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]

    def line(values: list[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(header), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _wrap_parts(parts: list[str], *, prefix: str) -> list[str]:
    """``parts`` joined by `` | ``, wrapped at TEXT_WIDTH between parts, never inside one."""
    lines: list[str] = []
    current: list[str] = []
    for part in parts:
        if current and len(prefix) + len(" | ".join([*current, part])) > TEXT_WIDTH:
            lines.append(" | ".join(current) + " |")
            current = []
        current.append(part)
    lines.append(" | ".join(current))
    return [(prefix if i == 0 else " " * len(prefix)) + line for i, line in enumerate(lines)]


def _spans(row: dict[str, Any]) -> list[str]:
    """``text [0,14)``, ``image#0 [14,91)``, ..., ``completion [200,344)``: the token layout."""
    parts, cursor, prompt = [], 0, row["prompt_len"]
    for index, ref in enumerate(row["images"]):
        if ref["offset"] > cursor:
            parts.append(f"text [{cursor},{ref['offset']})")
        cursor = ref["offset"] + ref["length"]
        parts.append(f"image#{index} [{ref['offset']},{cursor})")
    if prompt > cursor:
        parts.append(f"text [{cursor},{prompt})")
    parts.append(f"completion [{prompt},{len(row['tokens'])})")
    return parts


def _describe_problem(problem: Any) -> str:
    where = ", ".join(
        f"{key}={value}"
        for key in ("file", "run_id", "step", "sample_id", "image_index", "uri")
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
