"""Deterministic test bytes and fd counts, shared by the buffer tests and bench/gpu_check.py."""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np


def pattern(seed: int, n: int) -> bytes:
    """``n`` pseudo-random bytes, the same for the same seed in every process."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def pattern_array(n: int, seed: int, low: int = 0) -> np.ndarray:
    """``n`` pseudo-random uint8 values in [low, 256) (low=1: a landed write is never zero)."""
    return np.random.default_rng(seed).integers(low, 256, n, dtype=np.uint8)


def open_fds() -> int:
    """How many fds this process has open (leak checks compare two counts)."""
    return len(os.listdir("/proc/self/fd"))


def until(cond: Callable[[], object], timeout: float = 20.0) -> bool:
    """Poll ``cond`` every 2 ms until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def wait_for(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` every 5 ms; fail the test naming ``what`` if it does not hold in time."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
