"""The naming rule of rollout files: where a committed file lies and what its path says.

A rollout file lies at ``rollouts/run_id=<run>/step=<step>/part-<writer>-<seq>.parquet``:
one hive partition directory per run and step (the partition values of its Delta add
action), the file directly inside it. A run id names a directory as it is written (no
escaping), so it is a short plain name (:data:`RUN_ID_PATTERN`); a step is a non-negative
int32 (Delta's partition column type). Producers (exactly-once commits) are non-empty
names of at most :data:`MAX_PRODUCER_CHARS` characters with seqs from 0 to :data:`MAX_SEQ`.

The writer names files by this rule, the table checks what it commits against it, readers,
gc, upgrade and export parse paths back with it; nothing else spells it out.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from mmstore.errors import CorruptFileError, InvalidArgumentError, InvalidRolloutError

# The store's folder of rollout files (the Delta table's root).
ROLLOUTS = "rollouts"
# A run id names its partition directory unescaped: a plain name, so that a Delta path is
# the file's own path and every engine reads the same run back.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_DIR_PREFIX = "run_id="
INT32_MAX = 2**31 - 1
MAX_PRODUCER_CHARS = 256
# A seq is a Delta txn version: a signed 64-bit int in every Delta reader (delta-rs fails
# to read a log holding a larger one: no checkpoint again, producer_seq raises).
MAX_SEQ = 2**63 - 1

# A URI's scheme (``s3:``, ``file:``, ``abfss:``): a log path that has one names a file
# anywhere, not one inside the table.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


# A hive partition value pyarrow, DuckDB and Spark read as null.
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
# A step as Arrow parses an int32 partition value (no sign but '-', no spaces, no '_').
_STEP_VALUE = re.compile(r"-?[0-9]+")


# -- names ---------------------------------------------------------------------------------


def is_run_id(value: Any) -> bool:
    """Whether ``value`` is a run id mmstore writes (and reads)."""
    return isinstance(value, str) and RUN_ID_PATTERN.match(value) is not None


def is_step(value: Any) -> bool:
    """Whether ``value`` is a step: a non-negative int32 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= INT32_MAX


def partition_dir(run_id: str, step: int) -> str:
    """``rollouts/run_id=<run>/step=<step>``: the directory of a run's step."""
    return f"{ROLLOUTS}/{RUN_DIR_PREFIX}{run_id}/step={step}"


def part_path(run_id: str, step: int, writer_id: str, seq: int) -> str:
    """Where a writer's ``seq``-th file of ``(run_id, step)`` lies (unique per writer id)."""
    return f"{partition_dir(run_id, step)}/part-{writer_id}-{seq:05d}.parquet"


def table_path(path: str) -> str:
    """A store-relative path under ``rollouts/`` as the Delta log names it (relative to
    the table's root)."""
    return path[len(ROLLOUTS) + 1 :]


def store_path(logged: Any) -> str:
    """A path the Delta log names (relative to the table's root) as a store-relative one.

    Every path read from the log comes through here, and must name a file inside the table:
    relative, no URI scheme, no ``.``, ``..`` or empty segment (as written, nor once its
    percent escapes are decoded, as other engines decode them). A path outside (another
    store's rows, ``../../elsewhere``, ``s3://other/…``) raises :class:`CorruptFileError`:
    every reader would read, verify would check and export would write that other place."""
    if not is_table_path(logged):
        raise CorruptFileError(
            "the table's log names a file outside the rollouts table (an absolute path, a "
            "URI, or a '..' segment): mmstore reads only files under its own table's root. "
            "Another tool wrote this entry: restore the log from a copy of the store",
            file=repr(logged)[:300],
        )
    return f"{ROLLOUTS}/{logged}"


def is_table_path(logged: Any) -> bool:
    """Whether a path from the log stays inside the table's root (see :func:`store_path`)."""
    if not isinstance(logged, str) or not logged or "\0" in logged or "\\" in logged:
        return False
    if logged.startswith("/") or _SCHEME.match(logged):
        return False
    return all(
        segment not in ("", ".", "..")
        for form in {logged, unquote(logged)}
        for segment in form.split("/")
    )


# -- parsing a path back -------------------------------------------------------------------


def partition_of(path: str) -> tuple[str, int]:
    """``(run_id, step)`` from ``rollouts/run_id=<r>/step=<s>/part-….parquet``.

    Read as the hive partitioning pyarrow, DuckDB and Spark apply to these paths (a test
    holds it to pyarrow's ``HivePartitioning``): the folders' ``key=value`` segments, the
    first of each key, taken as written (a foreign ``run_id=a%2Fb`` is not the run
    ``a/b``). Parsed here rather than by ``pyarrow.dataset``, whose import (pandas with it,
    0.2 s) the CLI's read-only commands would otherwise pay.
    """
    keys: dict[str, str] = {}
    for segment in path.split("/")[:-1]:  # the last is the file's name
        name, equals, value = segment.partition("=")
        if equals and name in ("run_id", "step"):
            if name == "step" and not _is_step(value):  # pyarrow parses every step segment
                keys["step"] = _HIVE_NULL
            keys.setdefault(name, value)
    run_id, step = keys.get("run_id", _HIVE_NULL), keys.get("step", _HIVE_NULL)
    if _HIVE_NULL in (run_id, step):
        raise CorruptFileError("rollout file outside run_id=…/step=… partitions", file=path)
    return run_id, int(step)


def _is_step(value: str) -> bool:
    """An int32 as Arrow parses one, or the hive null."""
    if value == _HIVE_NULL:
        return True
    return bool(_STEP_VALUE.fullmatch(value)) and -(2**31) <= int(value) <= INT32_MAX


def run_of(path: str) -> str:
    """The run of ``rollouts/run_id=<run>/step=<step>/<name>`` (no check)."""
    return path.split("/")[1].removeprefix(RUN_DIR_PREFIX)


def is_placed(path: str) -> bool:
    """Whether ``path`` lies directly in the directory of its own partition, spelt as
    mmstore spells it (a run id it writes, the step as an int, no escapes in the name)."""
    parts = path.split("/")
    if len(parts) != 4 or "%" in parts[3]:
        return False
    try:
        run_id, step = partition_of(path)
    except CorruptFileError:
        return False
    return is_run_id(run_id) and parts[1:3] == [f"{RUN_DIR_PREFIX}{run_id}", f"step={step}"]


def is_partition_dir(path: str) -> bool:
    """Whether ``path`` is a run's directory or one of its steps' (gc removes them empty)."""
    return path.startswith(f"{ROLLOUTS}/{RUN_DIR_PREFIX}")


# -- checks --------------------------------------------------------------------------------


def check_partition(run_id: Any, step: Any) -> None:
    """Refuse a run id or step that cannot name a hive partition directory."""
    if not is_run_id(run_id):
        raise InvalidRolloutError(
            f"run_id {run_id!r} must match {RUN_ID_PATTERN.pattern} (it names a directory)",
            run_id=run_id,
        )
    if not is_step(step):
        raise InvalidRolloutError(
            f"step {step!r} must be a non-negative int32", run_id=run_id, step=step
        )


def check_producer(producer: Any, seq: Any) -> None:
    """Refuse a producer without a seq (or the other way round) or malformed ones."""
    if producer is None and seq is None:
        return
    if producer is None or seq is None:
        raise InvalidArgumentError(
            f"producer and seq go together: give both or neither (producer={producer!r}, "
            f"seq={seq!r})"
        )
    if not isinstance(producer, str) or not producer or len(producer) > MAX_PRODUCER_CHARS:
        raise InvalidArgumentError(f"producer must be a non-empty string, got {producer!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise InvalidArgumentError(
            f"seq must be an int in [0, 2**63 - 1] (a Delta txn version), got {seq!r}",
            producer=producer,
        )


def check_logged_run(path: str, run_id: str) -> None:
    """Refuse a committed file whose run id (as the log records it) the writer refuses
    (``rün``, ``exp 1``, ``a%2Fb``, 129 characters: another engine wrote and committed it),
    or whose path names another run."""
    segment, _ = partition_of(path)
    if is_run_id(run_id) and segment == run_id:
        return
    raise CorruptFileError(
        f"committed under run id {run_id!r}, which mmstore neither writes nor reads (a "
        f"run id matches {RUN_ID_PATTERN.pattern}, and names the file's run_id= directory); "
        "another engine wrote it: copy its rows into a run mmstore can name",
        file=path,
        run_id=run_id,
    )
