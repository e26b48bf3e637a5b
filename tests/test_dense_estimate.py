"""``debug.summary``'s dense fp32 figure, computed without transformers (issue 42.2): for
every family mmstore ships, at every size the contract suite checks and each of its
published layouts, the torch-free count of ``pixel_values`` elements equals the family's own
``pixel_shape`` (transformers' resize math)."""

from __future__ import annotations

import math

import pytest

import mmstore
from mmstore.debug import _dense_elements
from tests.family_cases import CASES, FamilyCase

LAYOUTS = [(case, name) for case in CASES.values() for name in ("", *case.published_layouts)]


@pytest.mark.parametrize(
    ("case", "layout"), LAYOUTS, ids=[f"{c}-{name or 'small'}" for c, name in LAYOUTS]
)
def test_the_dense_size_equals_the_familys_pixel_shape(case: FamilyCase, layout: str) -> None:
    adapter = mmstore.adapter_for(case.published(layout) if layout else case.small())
    checked = 0
    for width, height in case.sizes:
        try:
            shape = adapter.pixel_shape(width, height)
        except mmstore.ImageSizeError:  # a size the family refuses: never in a store
            continue
        length = adapter.num_tokens(width, height)
        assert _dense_elements(adapter.layout, width, height, length) == math.prod(shape), (
            f"{width}x{height}"
        )
        checked += 1
    assert checked >= 15


def test_a_family_of_a_third_party_is_asked_itself(monkeypatch) -> None:
    """A family mmstore does not ship has no torch-free formula here: its own
    ``pixel_shape`` answers."""
    case = CASES["gemma3"]
    adapter = mmstore.adapter_for(case.small())
    monkeypatch.setattr("mmstore.debug._DENSE_ESTIMATES", {})
    expected = math.prod(adapter.pixel_shape(640, 480))
    assert _dense_elements(adapter.layout, 640, 480, adapter.num_tokens(640, 480)) == expected
