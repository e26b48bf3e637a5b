"""Row schema v1: the committed language-neutral description matches the Arrow schema, and
the schema version in Parquet key-value metadata is checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._format.models import rollouts_to_table
from mmstore._format.schema import (
    META_SCHEMA_VERSION,
    PARTITION_FIELDS,
    ROLLOUT_SCHEMA,
    SCHEMA_VERSION,
    check_schema_version,
    describe,
    file_metadata,
)
from mmstore._storage.manifest import FORMAT_VERSION

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "schemas" / f"rollout.v{SCHEMA_VERSION}.json"
REGENERATE = (
    '.venv/bin/python -c "import json; from mmstore._format.schema import describe; '
    f"open('schemas/{SCHEMA_FILE.name}', 'w').write(json.dumps(describe(), indent=2, "
    "sort_keys=True) + '\\n')\""
)

# What a reader in another language would map the neutral type names to.
NEUTRAL_TYPES = {
    "string": pa.string(),
    "bool": pa.bool_(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


def _arrow_type(desc: Any) -> pa.DataType:
    if isinstance(desc, str):
        return NEUTRAL_TYPES[desc]
    if "list" in desc:
        return pa.list_(pa.field("item", _arrow_type(desc["list"]), desc["item_nullable"]))
    return pa.struct([_arrow_field(f) for f in desc["struct"]])


def _arrow_field(desc: dict[str, Any]) -> pa.Field:
    return pa.field(desc["name"], _arrow_type(desc["type"]), nullable=desc["nullable"])


def test_committed_json_equals_the_arrow_schema():
    committed = json.loads(SCHEMA_FILE.read_text())
    assert committed == describe(ROLLOUT_SCHEMA), f"schema drifted; regenerate: {REGENERATE}"


def test_json_alone_rebuilds_the_arrow_schema():
    # The description is complete: a reader without mmstore rebuilds the exact schema from it.
    committed = json.loads(SCHEMA_FILE.read_text())
    rebuilt = pa.schema([_arrow_field(f) for f in committed["fields"]])
    assert rebuilt.equals(ROLLOUT_SCHEMA, check_metadata=False)
    partitions = [_arrow_field(f) for f in committed["partitioning"]["fields"]]
    assert partitions == list(PARTITION_FIELDS)
    assert committed["version"] == SCHEMA_VERSION
    assert set(committed["key_value_metadata"]) == {k.decode() for k in file_metadata("r", 0, {})}


def test_description_changes_when_the_schema_does():
    changed = ROLLOUT_SCHEMA.set(
        ROLLOUT_SCHEMA.get_field_index("reward"), pa.field("reward", pa.int64())
    )
    assert describe(changed) != describe(ROLLOUT_SCHEMA)
    with pytest.raises(TypeError, match="no language-neutral name"):
        describe(pa.schema([pa.field("when", pa.timestamp("ms"))]))


def test_schema_carries_design_columns():
    names = set(ROLLOUT_SCHEMA.names)
    assert {
        "sample_id",
        "group_id",
        "tokens",
        "prompt_len",
        "loss_mask",
        "logprobs",
        "reward",
        "advantage",
        "images",
        "metadata",
    } <= names
    assert "run_id" not in names and "step" not in names  # hive partition directories only
    ref_fields = {f.name for f in ROLLOUT_SCHEMA.field("images").type.value_type}
    assert {
        "uri",
        "hash",
        "width",
        "height",
        "offset",
        "length",
        "family",
        "layout_fingerprint",
        "payload",
    } <= ref_fields


def _write(path: Path, metadata: dict[bytes, bytes]) -> Path:
    table = rollouts_to_table(
        [mmstore.Rollout(sample_id="s", tokens=[1], prompt_len=1, loss_mask=[True])]
    )
    pq.write_table(table.replace_schema_metadata(metadata), path)
    return path


def test_version_written_to_parquet_is_accepted(tmp_path):
    path = _write(tmp_path / "ok.parquet", file_metadata("run-1", 7, {"fp": {"patch_size": 14}}))
    meta = pq.read_metadata(path).metadata
    assert meta[META_SCHEMA_VERSION] == str(SCHEMA_VERSION).encode()
    assert meta[b"mmstore.run_id"] == b"run-1"
    assert meta[b"mmstore.step"] == b"7"
    assert json.loads(meta[b"mmstore.layouts"]) == {"fp": {"patch_size": 14}}
    assert check_schema_version(meta, where=str(path)) == SCHEMA_VERSION
    # Key-value metadata as polars returns it (str keys and values) is read the same way.
    as_text = {k.decode(): v.decode() for k, v in meta.items()}
    assert check_schema_version(as_text, where=str(path)) == SCHEMA_VERSION


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"2", "version 2 is not supported"),
        (b"0", "version 0 is not supported"),
        (b"999", "version 999 is not supported"),
        (b"one", "unreadable"),
        (b"", "unreadable"),
        (b" 1", "unreadable"),
        (b"+1", "unreadable"),
        (b"1.0", "unreadable"),
        (b"\xff", "unreadable"),
    ],
)
def test_unknown_version_in_a_file_is_refused(tmp_path, raw, match):
    path = _write(tmp_path / "v.parquet", {**file_metadata("r", 0, {}), META_SCHEMA_VERSION: raw})
    meta = pq.read_metadata(path).metadata
    with pytest.raises(mmstore.SchemaVersionError, match=match) as info:
        check_schema_version(meta, where=str(path))
    assert info.value.file == str(path)


@pytest.mark.parametrize("metadata", [None, {}, {b"other": b"1"}])
def test_missing_version_is_refused(metadata):
    with pytest.raises(mmstore.SchemaVersionError, match=r"no mmstore\.schema_version") as info:
        check_schema_version(metadata, where="part-0.parquet")
    assert info.value.file == "part-0.parquet"


def test_file_without_mmstore_metadata_is_refused(tmp_path):
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), path)
    with pytest.raises(mmstore.SchemaVersionError):
        check_schema_version(pq.read_metadata(path).metadata, where=str(path))


def test_format_md_names_every_column_ref_field_and_footer_key():
    """FORMAT.md documents what the schema holds: nothing added here goes undocumented."""
    text = (Path(__file__).resolve().parents[1] / "FORMAT.md").read_text()
    described = describe()
    refs = next(f for f in described["fields"] if f["name"] == "images")["type"]["list"]
    names = [f["name"] for f in described["fields"]] + [f["name"] for f in refs["struct"]]
    names += [f["name"] for f in described["partitioning"]["fields"]]
    missing = [n for n in [*names, *described["key_value_metadata"]] if f"`{n}`" not in text]
    assert not missing, f"FORMAT.md does not mention {missing}"
    assert f'`mmstore.schema_version` | `"{SCHEMA_VERSION}"`' in text
    assert f"`format_version` | integer | `{FORMAT_VERSION}`" in text
