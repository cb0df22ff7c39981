import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    """Small matrices, many calls: a second BLAS thread only contends on a 2-core machine."""
    from kvxfer.demo._blas import limit_blas_threads

    limit_blas_threads(1)
