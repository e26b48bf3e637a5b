"""Checks of arguments that several stages take (a leaf: the lifecycle, the loaders and the
command line share them). Each refusal is an :class:`InvalidArgumentError` naming the
argument and what it got, raised before anything is done."""

from __future__ import annotations

import contextlib
import math
from numbers import Real
from typing import Any

import numpy as np

from mmstore.errors import InvalidArgumentError


def seconds(name: str, value: Any) -> float:
    """``value`` as a duration: a finite number of seconds ``>= 0``. A bool (``True`` is
    not 1 s), a string, NaN (which no comparison catches: a wait on it never ends, a
    cutoff of it keeps everything) and an infinity are refused."""
    number = math.nan
    if isinstance(value, Real) and not isinstance(value, bool | np.bool_):
        with contextlib.suppress(OverflowError):  # an int beyond any float
            number = float(value)
    if not 0 <= number < math.inf:
        raise InvalidArgumentError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return number
