"""Best-effort limit on the BLAS thread pool of this process.

The demo's matrices are small and its calls many: on a 2-core machine a second BLAS thread
only contends (measured: the colocated reference ran 4x slower with 2 OpenBLAS threads than
with 1). The thread count never changes results here (OpenBLAS splits rows and columns, not
the summed dimension), only speed. Worker processes get ``OPENBLAS_NUM_THREADS=1`` in their
environment; a process that has already loaded numpy calls this.
"""

from __future__ import annotations

import ctypes

__all__ = ["limit_blas_threads"]

_PREFIXES = ("scipy_openblas_", "scipy_openblas64_", "openblas_")
_SUFFIXES = ("64_", "")


def _fn(lib: ctypes.CDLL, verb: str):
    for pre in _PREFIXES:
        for suf in _SUFFIXES:
            f = getattr(lib, f"{pre}{verb}_num_threads{suf}", None)
            if f is not None:
                return f
    return None


def limit_blas_threads(n: int = 1) -> int | None:
    """Set the loaded OpenBLAS's thread count; return the previous count, or None when no
    OpenBLAS is loaded (e.g. MKL) and nothing changed."""
    import numpy  # noqa: F401  (make sure the BLAS is loaded)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        set_, get = _fn(lib, "set"), _fn(lib, "get")
        if set_ is not None:
            prev = int(get()) if get is not None else None
            set_.argtypes = [ctypes.c_int]
            set_(int(n))
            return prev if prev is not None else int(n)
    return None
