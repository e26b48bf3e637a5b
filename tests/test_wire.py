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
from mmstore._format.models import MAX_REF_FRAMES

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


# -- video refs: ``mmvid:`` + JSON ---------------------------------------------------------

GOOD_VIDEO: dict[str, Any] = {
    "uri": "media/ab/cd/abcd0123456789abcdef0123456789ab.mp4",
    "hash": "abcd0123456789abcdef0123456789ab",
    "width": 168,
    "height": 112,
    "nbytes": 40960,
    "num_frames": 24,
    "fps": 12.0,
    "frames": [0, 6, 12, 18],
    "offset": 5,
    "length": 48,
    "family": "qwen-vl",
    "layout_fingerprint": "0f1e2d3c4b5a6978",
}


@st.composite
def video_refs(draw: st.DrawFn) -> mmstore.VideoRef:
    num_frames = draw(st.integers(1, INT32_MAX))
    frames = draw(
        st.lists(st.integers(0, min(num_frames, 10**6) - 1), min_size=1, max_size=40, unique=True)
        | st.just([num_frames - 1])
    )
    return mmstore.VideoRef(
        uri=draw(st.text(min_size=1, max_size=80)),
        hash=draw(st.text("0123456789abcdef", min_size=32, max_size=32)),
        width=draw(st.integers(1, INT32_MAX)),
        height=draw(st.integers(1, INT32_MAX)),
        nbytes=draw(st.none() | st.integers(0, 2**62)),
        num_frames=num_frames,
        fps=draw(st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)),
        frames=sorted(frames),
        offset=draw(st.integers(0, INT32_MAX)),
        length=draw(st.integers(1, INT32_MAX)),
        family=draw(st.text(min_size=1, max_size=12)),
        layout_fingerprint=draw(st.text(min_size=1, max_size=20)),
    )


def _video_wire(fields: dict[str, Any]) -> str:
    return wire.VIDEO_PREFIX + json.dumps(fields)


@SETTINGS
@given(video_refs())
def test_video_round_trip(ref):
    text = wire.encode(ref)
    assert text.startswith(wire.VIDEO_PREFIX)
    decoded = wire.decode(text)
    assert isinstance(decoded, mmstore.VideoRef) and decoded == ref
    fields = json.loads(text[len(wire.VIDEO_PREFIX) :])
    assert None not in fields.values()
    assert fields["frames"] == list(ref.frames)


def test_video_encoding_is_compact_and_readable():
    ref = mmstore.VideoRef(**GOOD_VIDEO)
    text = wire.encode(ref)
    assert text == wire.VIDEO_PREFIX + json.dumps(GOOD_VIDEO, separators=(",", ":"))
    assert isinstance(wire.decode(text), mmstore.VideoRef)
    assert isinstance(wire.decode(wire.encode(mmstore.ImageRef(**GOOD))), mmstore.ImageRef)


def test_the_longest_frames_list_fits_the_video_bound():
    # 4096 frames, each index the widest an int32 allows, behind a long uri: still a ref.
    top = INT32_MAX
    ref = mmstore.VideoRef(
        **{
            **GOOD_VIDEO,
            "uri": "media/" + "u" * 2000,
            "num_frames": top,
            "frames": list(range(top - MAX_REF_FRAMES, top)),
        }
    )
    text = wire.encode(ref)
    assert wire.MAX_WIRE_CHARS < len(text) <= wire.MAX_VIDEO_WIRE_CHARS
    assert wire.decode(text) == ref


def test_oversize_video_input_is_refused_before_parsing():
    over = wire.VIDEO_PREFIX + "[" * (wire.MAX_VIDEO_WIRE_CHARS + 1)
    err = _refused(over, "exceeds")
    assert str(wire.MAX_VIDEO_WIRE_CHARS) in str(err)
    # The image bound is unchanged: a video-sized text behind the image prefix is refused.
    _refused(wire.PREFIX + " " * wire.MAX_WIRE_CHARS, "exceeds")


def test_kinds_do_not_mix():
    # A video ref's JSON behind the image prefix, an image ref's behind the video prefix.
    _refused(wire.PREFIX + json.dumps(GOOD_VIDEO), "xtra")
    _refused(_video_wire(GOOD), "num_frames")
    _refused("MMVID:" + json.dumps(GOOD_VIDEO), "must start with")


def test_encode_takes_refs_only():
    with pytest.raises(TypeError):
        wire.encode(GOOD_VIDEO)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frames", 5),
        ("frames", None),
        ("frames", "0"),
        ("frames", {"0": 1}),
        ("frames", []),
        ("frames", [0.0, 6]),
        ("frames", [True]),
        ("frames", ["0"]),
        ("frames", [[0]]),
        ("frames", [6, 0]),
        ("frames", [0, 0]),
        ("frames", [-1, 6]),
        ("frames", [0, 24]),
        ("frames", list(range(MAX_REF_FRAMES + 1))),
        ("frames", [2**31]),
        ("num_frames", 0),
        ("num_frames", 24.0),
        ("num_frames", "24"),
        ("fps", 0),
        ("fps", -12.0),
        ("fps", "12"),
        ("fps", None),
        ("fps", [12.0]),
        ("width", 0),
        ("length", "48"),
    ],
)
def test_malformed_video_fields_are_refused(field, value):
    fields = {**GOOD_VIDEO, field: value}
    if field == "frames" and value == list(range(MAX_REF_FRAMES + 1)):
        fields["num_frames"] = MAX_REF_FRAMES + 1
    _refused(_video_wire(fields), "invalid wire video ref")


@pytest.mark.parametrize("fps", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_rates_are_refused(fps):
    text = _video_wire(GOOD_VIDEO).replace('"fps": 12.0', f'"fps": {fps}')
    assert fps in text
    _refused(text, "fps")


@pytest.mark.parametrize("field", sorted(set(GOOD_VIDEO) - {"nbytes"}))
def test_missing_video_fields_are_refused(field):
    _refused(_video_wire({k: v for k, v in GOOD_VIDEO.items() if k != field}), field)


@pytest.mark.parametrize("extra", [{"pixel_values_videos": [1.0]}, {"payload": "x"}, {"": 0}])
def test_extra_video_fields_are_refused(extra):
    _refused(_video_wire({**GOOD_VIDEO, **extra}), "xtra")


@SETTINGS
@given(st.text())
def test_random_text_behind_the_video_prefix_is_only_ever_a_wire_format_error(text):
    with pytest.raises(mmstore.WireFormatError):
        wire.decode(wire.VIDEO_PREFIX + text)


@SETTINGS
@given(json_values)
def test_random_json_behind_the_video_prefix_is_only_ever_a_wire_format_error(value):
    with pytest.raises(mmstore.WireFormatError):
        wire.decode(_video_wire(value))  # type: ignore[arg-type]


@SETTINGS
@given(st.sampled_from(sorted(GOOD_VIDEO)), json_values)
def test_one_video_field_replaced_decodes_exactly_or_is_refused(field, value):
    try:
        ref = wire.decode(_video_wire({**GOOD_VIDEO, field: value}))
    except mmstore.WireFormatError:
        return
    got = getattr(ref, field)
    if field == "frames":
        assert list(got) == value
    elif field == "fps":  # a JSON integer is a valid rate, read as a float
        assert got == value and isinstance(got, float)
    else:
        assert got == value and type(got) is type(value)
