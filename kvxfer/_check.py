"""Every argument check the layers share (a leaf: numpy and kvxfer.errors only): one int check,
one timeout parser, one bounds check for (src offset, dst offset, length) triples.

A count, index or size must be a Python int or a numpy integer, never a bool (an ``int``
subclass that is never meant as a number) and never a float. The value comes back as a plain
Python int, because numpy scalars wrap around in arithmetic and would defeat bounds checks.

A timeout is a number of seconds: ``None`` and ``inf`` both mean no deadline (where a call may
wait for ever; a call that must end refuses both), NaN and negative numbers are refused, and so
is a finite wait beyond ``MAX_TIMEOUT`` (the native deadline would overflow).
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any, Optional

import numpy as np

from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, OutOfBoundsError

__all__ = ["is_int", "as_int", "MAX_TIMEOUT", "as_timeout", "check_triples", "as_cpus"]


def is_int(value: Any) -> bool:
    """True for a Python int or numpy integer scalar; False for bools and everything else."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def as_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[Exception] = InvalidArgumentError,
) -> int:
    """``value`` as a plain int, or ``error`` naming ``name`` when it is not an int or lies
    outside ``[minimum, maximum]``. With the default ``error``, a value of the wrong type raises
    ``ArgumentTypeError`` (an ``InvalidArgumentError`` that is also a ``TypeError``)."""
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value         # the common case first: a small write's checks are much of its latency
    if not is_int(value):
        raise (ArgumentTypeError if error is InvalidArgumentError else error)(f"{name} must be an int, got {value!r}")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise error(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}")
    return v


#: Longest finite wait accepted (about 31 years); beyond it the native deadline would overflow.
MAX_TIMEOUT = 1e9


def as_timeout(t: Any, name: str = "timeout", *, forever: bool = True) -> Optional[float]:
    """``t`` seconds as a float, or None for no deadline (``None`` or ``inf``; refused with
    ``forever=False``, for calls that must end). NaN, negative numbers and finite waits past
    ``MAX_TIMEOUT`` raise ``InvalidArgumentError``, other types ``ArgumentTypeError``."""
    if (type(t) is float or type(t) is int) and 0 <= t <= MAX_TIMEOUT:
        return float(t)      # the common case first (NaN and inf fail the comparison: below)
    if t is None:
        if not forever:
            raise ArgumentTypeError(f"{name} must be a number of seconds, got None")
        return None
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name} must be a number of seconds or None, got {type(t).__name__}")
    if isinstance(t, (int, np.integer)) and abs(int(t)) >= 2**63:
        v = math.copysign(math.inf, int(t))        # float() of a huge int would overflow
    else:
        v = float(t)
    if v != v:
        raise InvalidArgumentError(f"{name} must be a number of seconds, got NaN")
    if v < 0:
        raise InvalidArgumentError(f"{name} must be non-negative, got {t!r}")
    if v == math.inf and not isinstance(t, (int, np.integer)):
        if not forever:
            raise InvalidArgumentError(f"{name} must be finite: this call must end")
        return None
    if v > MAX_TIMEOUT:
        raise InvalidArgumentError(f"{name} {t!r} is too long; pass None to wait without a deadline")
    return v


def check_triples(src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray, src_size: int,
                  dst_size: int) -> None:
    """Triples of equal count (``InvalidArgumentError``) whose every source range ends within
    ``src_size`` bytes and destination range within ``dst_size`` (``OutOfBoundsError`` naming
    the write that ends furthest). The arrays are uint64 offsets already checked below 2**62,
    so ``offset + length`` cannot wrap."""
    so, do, ln = src_offsets, dst_offsets, lengths
    if not (len(so) == len(do) == len(ln)):
        raise InvalidArgumentError(f"triples differ in length: {len(so)}, {len(do)}, {len(ln)}")
    if len(ln):
        se, de = so + ln, do + ln
        i, j = int(se.argmax()), int(de.argmax())
        if int(se[i]) > src_size:
            raise OutOfBoundsError(f"source write {i} ends at byte {int(se[i])}, beyond the {src_size}-byte region")
        if int(de[j]) > dst_size:
            raise OutOfBoundsError(f"destination write {j} ends at byte {int(de[j])}, beyond the {dst_size}-byte "
                                   "remote region")


def as_cpus(cpus: Any) -> tuple[int, ...]:
    """CPU numbers this process may run on (a thread's pinning), as plain ints; ``None``
    means none (unpinned): ``()``."""
    if cpus is None:
        return ()
    try:
        cpus = tuple(cpus)
    except TypeError:
        raise InvalidArgumentError(f"cpus must list CPU numbers, got {cpus!r}") from None
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cpus if not is_int(c) or c not in allowed]
    if bad:
        raise InvalidArgumentError(f"cpus {bad} are not CPUs this process may run on {sorted(allowed)}")
    return tuple(int(c) for c in cpus)
