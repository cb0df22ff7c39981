"""The messenger's argument checks: one timeout rule, ints in bounds, callbacks, page lists.

Every public messenger call checks its arguments here, before anything is sent, posted or
armed, and raises a precise ``kvxfer.errors`` exception. A timeout is None (no deadline) or a
non-negative number of seconds; ``inf`` means None; NaN, bools and strings are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np

from kvxfer._check import as_cpus, as_timeout, is_int
from kvxfer.errors import InvalidArgumentError, OutOfBoundsError, PlanError

__all__ = ["timeout", "bounded_int", "callback", "dst_pages", "src_pages", "src_prefix", "cpus"]


def timeout(value: Any, name: str = "timeout") -> Optional[float]:
    """None (no deadline; also for ``inf``) or a non-negative float of seconds: the house's one
    timeout rule, ``kvxfer._check.as_timeout``."""
    return as_timeout(value, name)


def bounded_int(value: Any, name: str, lo: int, hi: int) -> int:
    """An int in ``[lo, hi]`` as a plain int."""
    if not is_int(value) or not lo <= int(value) <= hi:
        raise InvalidArgumentError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def callback(fn: Any, name: str = "callback") -> Any:
    if not callable(fn):
        raise InvalidArgumentError(f"{name} must be callable")
    return fn


def dst_pages(pages: Any, num_pages: int, max_pages: int) -> np.ndarray:
    """A decoder's destination pages: non-empty, 1-D, integers inside the layout, distinct."""
    if type(pages) is list and 0 < len(pages) <= 64 and all(type(x) is int for x in pages):
        lo, hi = min(pages), max(pages)          # the common small case, without numpy
        if lo < 0 or hi >= num_pages:
            raise OutOfBoundsError(f"page {lo if lo < 0 else hi} is outside this node's {num_pages} pages")
        if len(set(pages)) != len(pages):
            raise InvalidArgumentError("dst_pages names a page twice")
        return np.array(pages, np.int64)
    a = np.asarray(pages)
    if a.ndim != 1 or a.size == 0:
        raise InvalidArgumentError(f"dst_pages must be a non-empty 1-D list of page indices, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"dst_pages must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if int(a.min()) < 0 or int(a.max()) >= num_pages:
        bad = int(a[(a < 0) | (a >= num_pages)][0])
        raise OutOfBoundsError(f"page {bad} is outside this node's {num_pages} pages")
    if len(a) > max_pages:
        raise InvalidArgumentError(f"a request names at most {max_pages} pages, got {len(a)}")
    if len(a) > 1 and len(np.unique(a)) != len(a):
        raise InvalidArgumentError("dst_pages names a page twice")
    return a


def src_pages(pages: Any, n: int, num_pages: int) -> np.ndarray:
    """A prefiller's source pages: exactly ``n`` (``PlanError`` otherwise, more as fewer)."""
    a = np.asarray(pages)
    if a.ndim != 1:
        raise PlanError(f"src_pages must be a 1-D list of page indices, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise PlanError(f"src_pages must hold integers, got dtype {a.dtype}")
    if a.shape[0] != n:
        raise PlanError(f"src_pages has {a.shape[0]} pages but the request's tokens fill exactly {n}")
    a = a.astype(np.int64)
    if n and (int(a.min()) < 0 or int(a.max()) >= num_pages):
        bad = int(a[(a < 0) | (a >= num_pages)][0])
        raise PlanError(f"src page {bad} is outside the layout's {num_pages} pages")
    return a


def src_prefix(pages: Any, n: int, num_pages: int) -> np.ndarray:
    """A streaming request's source pages so far: a prefix of at most ``n`` pages."""
    a = np.asarray(pages)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise PlanError("src_pages must be a 1-D list of page indices")
    if a.shape[0] > n:
        raise PlanError(f"src_pages has {a.shape[0]} pages but the request has {n}")
    return src_pages(a, a.shape[0], num_pages)


def cpus(value: Optional[Iterable[int]]) -> Optional[tuple]:
    """CPUs a watcher may be pinned to: ones this process may run on (None: unpinned)."""
    return None if value is None else as_cpus(value)
