"""The providers the fabric-level suites run on, probed once per process, and the ``provider`` fixture they share."""

import functools

import pytest

PROVIDERS = ["tcp;ofi_rxm", "shm"]


@functools.cache
def available(p: str) -> bool:
    """Whether an engine opens on provider ``p`` here (once per process)."""
    import kvxfer

    try:
        kvxfer.Engine(p, "127.0.0.1").close()
        return True
    except kvxfer.errors.KvxferError:
        return False


@pytest.fixture(params=PROVIDERS)
def provider(request):
    """One test body per provider; skips cleanly where it does not open."""
    if not available(request.param):
        pytest.skip(f"provider {request.param} is not available here")
    return request.param
