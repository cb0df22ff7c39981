"""The ``memmove`` baseline: one process copying between two prefaulted arrays, timed like a transfer."""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from kvxfer.cli._cases import Case, pattern
from kvxfer.cli._results import CaseResult

__all__ = ["memmove", "iterations"]


def iterations(budget: float, wall: float, lo: int, hi: int) -> int:
    """How many measured iterations fit ``budget`` seconds at ``wall`` each, within [lo, hi]."""
    if wall <= 0:
        return lo
    return int(max(lo, min(hi, budget / wall)))


def memmove(case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float, min_iters: int,
             max_iters: int, progress: Callable[[int, int], None]) -> CaseResult:
    """The baseline: one process copying between two preallocated, prefaulted arrays."""
    res = CaseResult(case, warmup=warmup, num_writes=0)
    a = pattern(seed, case.nbytes)
    b = np.zeros_like(a)
    wall = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        np.copyto(b, a)
        wall = time.perf_counter() - t0
    n = iters if iters is not None else iterations(budget, wall, min_iters, max_iters)
    for k in range(n):
        t0 = time.perf_counter()
        np.copyto(b, a)
        res.landed.append(time.perf_counter() - t0)
        progress(k + 1, n)
    res.iterations = n
    if not np.array_equal(a, b):
        res.bad_iterations = 1
        res.problems.append("copy differs from the source")
    return res
