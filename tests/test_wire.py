"""The wire form of one image ref: a lossless round trip, and strict decoding where anything
malformed is a WireFormatError and never another exception."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmstore
from mmstore import wire

SETTINGS = settings(max_examples=150, deadline=None)
INT32_MAX = 2**31 - 1

GOOD: dict[str, Any] = {
    "uri": "media/ab/cd/abcd0123456789abcdef0123456789ab.png",
    "hash": "abcd0123456789abcdef0123456789ab",
    "width": 1920,
    "height": 1080,
    "nbytes": 123456,
    "offset": 17,
    "length": 2691,
    "family": "qwen-vl",
    "layout_fingerprint": "e67b02d6e1613ce8",
    "payload": None,
}

refs = st.builds(
    mmstore.ImageRef,
    uri=st.text(min_size=1, max_size=80),
    hash=st.text("0123456789abcdef", min_size=32, max_size=32),
    width=st.integers(1, INT32_MAX),
    height=st.integers(1, INT32_MAX),
    nbytes=st.none() | st.integers(0, 2**62),
    offset=st.integers(0, INT32_MAX),
    length=st.integers(1, INT32_MAX),
    family=st.text(min_size=1, max_size=12),
    layout_fingerprint=st.text(min_size=1, max_size=20),
    payload=st.none() | st.text(max_size=40),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def _wire(fields: dict[str, Any]) -> str:
    return wire.PREFIX + json.dumps(fields)


def _refused(text: Any, match: str | None = None) -> mmstore.WireFormatError:
    with pytest.raises(mmstore.WireFormatError, match=match) as info:
        wire.decode(text)
    return info.value


@SETTINGS
@given(refs)
def test_round_trip(ref):
    text = wire.encode(ref)
    assert text.startswith(wire.PREFIX)
    assert wire.decode(text) == ref
    fields = json.loads(text[len(wire.PREFIX) :])
    assert None not in fields.values()  # nulls are left out


def test_encoding_is_compact_and_readable():
    ref = mmstore.ImageRef(**GOOD)
    text = wire.encode(ref)
    assert text == wire.PREFIX + json.dumps(
        {k: v for k, v in GOOD.items() if v is not None}, separators=(",", ":")
    )
    assert len(text) < 300


@pytest.mark.parametrize("value", [None, 5, b"mmraw:{}", ["mmraw:{}"], {"uri": "x"}])
def test_non_strings_are_refused(value):
    _refused(value, "is a str")


@pytest.mark.parametrize(
    "text",
    ["", "{}", json.dumps(GOOD), "MMRAW:" + json.dumps(GOOD), " mmraw:" + json.dumps(GOOD)],
)
def test_missing_prefix_is_refused(text):
    _refused(text, "must start with")


@pytest.mark.parametrize(
    "body",
    ["", "{", "{'uri': 'x'}", "nope", "{" * 5000, "1" * 5000, json.dumps(GOOD)[:-1], "\ud800"],
)
def test_bad_json_is_refused(body):
    _refused(wire.PREFIX + body)


@pytest.mark.parametrize("body", ["[]", "[1, 2]", "1", "null", "true", '"text"', "1.5"])
def test_json_that_is_not_an_object_is_refused(body):
    _refused(wire.PREFIX + body)


@pytest.mark.parametrize("field", sorted(set(GOOD) - {"nbytes", "payload"}))
def test_missing_fields_are_refused(field):
    _refused(_wire({k: v for k, v in GOOD.items() if k != field}), field)


def test_optional_fields_may_be_absent():
    ref = wire.decode(_wire({k: v for k, v in GOOD.items() if k not in ("nbytes", "payload")}))
    assert (ref.nbytes, ref.payload) == (None, None)


@pytest.mark.parametrize("extra", [{"pixel_values": [1.0]}, {"Uri": "x"}, {"": 0}])
def test_extra_fields_are_refused(extra):
    _refused(_wire({**GOOD, **extra}), "xtra")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("width", "5"),  # strict: a string of digits is not an int
        ("width", 5.0),
        ("width", True),
        ("height", None),
        ("offset", "17"),
        ("length", [1]),
        ("nbytes", "99"),
        ("uri", 5),
        ("hash", 0),
        ("family", None),
        ("layout_fingerprint", {"a": 1}),
        ("payload", 3),
    ],
)
def test_wrong_types_are_refused(field, value):
    _refused(_wire({**GOOD, field: value}), field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("width", -1),
        ("width", 0),
        ("height", -1080),
        ("offset", -1),
        ("length", 0),
        ("length", -5),
        ("nbytes", -1),
        ("width", 2**31),
        ("offset", 2**63),
    ],
)
def test_out_of_range_numbers_are_refused(field, value):
    _refused(_wire({**GOOD, field: value}), field)


@pytest.mark.parametrize(
    "value",
    ["", "abc", "A" * 32, "g" * 32, "0" * 31, "0" * 33, "0" * 64, " " + "0" * 31, "0" * 32 + "\n"],
)
def test_bad_hashes_are_refused(value):
    _refused(_wire({**GOOD, "hash": value}), "hash")


def test_empty_strings_are_refused():
    for field in ("uri", "family", "layout_fingerprint"):
        _refused(_wire({**GOOD, field: ""}), field)


def test_oversize_input_is_refused_before_parsing():
    huge = _wire({**GOOD, "payload": "x" * wire.MAX_WIRE_CHARS})
    err = _refused(huge, "exceeds")
    assert str(wire.MAX_WIRE_CHARS) in str(err)
    _refused(wire.PREFIX + "[" * 100_000, "exceeds")


@SETTINGS
@given(st.text())
def test_random_text_is_only_ever_a_wire_format_error(text):
    for candidate in (text, wire.PREFIX + text):
        with pytest.raises(mmstore.WireFormatError):
            wire.decode(candidate)


@SETTINGS
@given(json_values)
def test_random_json_is_only_ever_a_wire_format_error(value):
    with pytest.raises(mmstore.WireFormatError):
        wire.decode(wire.PREFIX + json.dumps(value))


@SETTINGS
@given(st.sampled_from(sorted(GOOD)), json_values)
def test_one_field_replaced_decodes_exactly_or_is_refused(field, value):
    text = wire.PREFIX + json.dumps({**GOOD, field: value})
    try:
        ref = wire.decode(text)
    except mmstore.WireFormatError:
        return
    # Accepted only when the value is a valid one for that field, and then kept as is.
    assert getattr(ref, field) == value
    assert type(getattr(ref, field)) is type(value)
