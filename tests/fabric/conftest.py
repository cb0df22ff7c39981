"""Fixtures of the fabric tests: which providers open here (probed once), an engine, a pair of engines.

Every test that takes ``provider`` runs once per provider and skips cleanly where it does not
open. Teardowns close engines, whose ``close()`` has its own deadlines.
"""

import pytest

kvxfer = pytest.importorskip("kvxfer")
try:
    from kvxfer import _fabric  # noqa: F401
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"kvxfer._fabric not built: {exc}", allow_module_level=True)

from _providers import available, provider  # noqa: E402,F401  (the shared fixture)


@pytest.fixture
def shm():
    """For tests of shm-only paths (direct writes, doorbells, permits): skip where shm is missing."""
    if not available("shm"):
        pytest.skip("provider shm is not available here")


@pytest.fixture
def engine(provider):
    with kvxfer.Engine(provider, "127.0.0.1") as e:
        yield e


@pytest.fixture
def pair(provider):
    """Two engines on ``provider`` in this process: (a, b)."""
    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
