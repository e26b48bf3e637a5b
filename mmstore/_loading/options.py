"""Checks of the dataset's and loader's arguments: each refusal names the argument and what
it got, so a typo or a wrong type fails at construction rather than in a worker later."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from mmstore._arguments import seconds as seconds  # durations: shared with the lifecycle
from mmstore.errors import InvalidArgumentError


def whole(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int (numpy ints too, never a bool), of at least ``minimum`` if given."""
    wanted = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool | np.bool_) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{name} must be {wanted}, got {value!r}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise InvalidArgumentError(f"{name} must be {wanted}, got {number}")
    return number


def optional_whole(name: str, value: Any, *, minimum: int) -> int | None:
    """``None``, or ``value`` as :func:`whole` checks it."""
    return None if value is None else whole(name, value, minimum=minimum)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool; anything else (``"false"``, ``None``, 0) is refused, since its
    truth would decide silently."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)
