import pytest


@pytest.fixture(autouse=True, scope="package")
def _one_blas_thread():
    """Small matrices, many calls: a second BLAS thread only contends on a 2-core machine.
    The previous count is restored for the rest of the suite."""
    from kvxfer.demo._blas import limit_blas_threads

    prev = limit_blas_threads(1)
    yield
    if prev is not None:
        limit_blas_threads(prev)
