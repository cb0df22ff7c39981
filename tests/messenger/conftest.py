

import pytest

kvxfer = pytest.importorskip("kvxfer")
try:
    from kvxfer import _fabric  # noqa: F401
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"kvxfer._fabric not built: {exc}", allow_module_level=True)

from _providers import provider  # noqa: E402,F401  (the shared fixture)


@pytest.fixture
def nodes():
    """Node processes started by a test; every one is stopped (bounded) at teardown."""
    started = []
    yield started
    for n in started:
        n.close(timeout=15)
