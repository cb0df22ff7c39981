"""The one integer-argument check that every layer uses (a leaf: numpy and kvxfer.errors only).

A count, index or size must be a Python int or a numpy integer, never a bool (an ``int``
subclass that is never meant as a number) and never a float. The value comes back as a plain
Python int, because numpy scalars wrap around in arithmetic and would defeat bounds checks.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from kvxfer.errors import InvalidArgumentError

__all__ = ["is_int", "as_int"]


def is_int(value: Any) -> bool:
    """True for a Python int or numpy integer scalar; False for bools and everything else."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def as_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    error: type[Exception] = InvalidArgumentError,
) -> int:
    """``value`` as a plain int, or ``error`` naming ``name`` when it is not an int or is below
    ``minimum``."""
    if not is_int(value):
        raise error(f"{name} must be an int, got {value!r}")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise error(f"{name} must be >= {minimum}, got {v}")
    return v
