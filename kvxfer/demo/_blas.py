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

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def limit_blas_threads(n: int = 1) -> bool:
    """Set the loaded OpenBLAS's thread count; False when no OpenBLAS is loaded (e.g. MKL)."""
    import numpy  # noqa: F401  (make sure the BLAS is loaded)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn(int(n))
                return True
    return False
