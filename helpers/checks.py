"""Argument checks that refuse bad numbers in the helper, with a message, before torch sees them."""

from __future__ import annotations

import math
import numbers


def positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is a whole number >= ``minimum`` (a bool or 3.0 is refused), else a clear error.

    Introduced in notebooks/10-model-parallel.ipynb.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_number(name: str, value) -> float:
    """``value`` if it is a finite number > 0 (a learning rate, seconds), else a clear error.

    Machinery behind the helpers' argument checks; no notebook calls it directly.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)
