"""``partition_of`` reads a rollout file's path as pyarrow's hive partitioning does.

mmstore parses ``run_id=…/step=…`` itself (``pyarrow.dataset`` costs the CLI 0.2 s of
imports); pyarrow's ``HivePartitioning``, as DuckDB and Spark read these paths, is the oracle:
the same ``(run_id, step)`` where it finds both, a ``CorruptFileError`` where it does not.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore._format.paths import partition_of
from mmstore._format.schema import PARTITION_FIELDS
from mmstore.errors import CorruptFileError

HIVE = pads.HivePartitioning(pa.schema(PARTITION_FIELDS), segment_encoding="none")

values = st.one_of(
    st.integers(-(2**32), 2**32).map(str),
    st.sampled_from(
        ["", "+5", " 5", "05", "-0", "1_0", "a=b", "%2F", "__HIVE_DEFAULT_PARTITION__"]
    ),
    st.text("ab1-=._%", max_size=6),
)
segments = st.one_of(
    st.builds(lambda key, value: f"{key}={value}", st.sampled_from(["run_id", "step"]), values),
    st.sampled_from(["rollouts", "x", "", "run_id", "step", "part-0.parquet"]),
)


def pyarrow_reads(path: str) -> tuple[str, int] | None:
    try:
        keys = pads.get_partition_keys(HIVE.parse(path))
    except pa.ArrowInvalid:
        return None
    if keys.get("run_id") is None or keys.get("step") is None:
        return None
    return keys["run_id"], int(keys["step"])


def mmstore_reads(path: str) -> tuple[str, int] | None:
    try:
        return partition_of(path)
    except CorruptFileError:
        return None


@settings(max_examples=400, deadline=None)
@given(st.lists(segments, min_size=1, max_size=6))
def test_partition_of_reads_paths_as_pyarrow_does(parts: list[str]) -> None:
    path = "/".join(parts)
    assert mmstore_reads(path) == pyarrow_reads(path), path


@pytest.mark.parametrize(
    "path",
    [
        "rollouts/run_id=r1/step=3/part-0.parquet",
        "rollouts/run_id=a=b/step=05/part-0.parquet",
        "rollouts/run_id=r1/run_id=r2/step=1/step=2/part-0.parquet",
        "rollouts/run_id=r1/step=2147483648/part-0.parquet",
        "rollouts/run_id=r1/step=+5/part-0.parquet",
        "rollouts/run_id=__HIVE_DEFAULT_PARTITION__/step=1/part-0.parquet",
        "rollouts/run_id=r1/step=4",
    ],
)
def test_partition_of_edge_cases(path: str) -> None:
    assert mmstore_reads(path) == pyarrow_reads(path)


def test_a_path_outside_partitions_is_named() -> None:
    with pytest.raises(CorruptFileError, match="outside run_id=…/step=…") as err:
        partition_of("rollouts/run_id=r1/part-0.parquet")
    assert "rollouts/run_id=r1/part-0.parquet" in str(err.value)
