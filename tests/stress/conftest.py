"""Stress suite (issue 12). Reduced counts under `make test`; `make stress` sets
KVXFER_STRESS=1 for the full counts (see docs/reliability.md)."""

import os
import sys

import pytest

kvxfer = pytest.importorskip("kvxfer")
try:
    from kvxfer import _fabric  # noqa: F401
except ImportError as exc:  # pragma: no cover
    pytest.skip(f"kvxfer._fabric not built: {exc}", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STRESS = os.environ.get("KVXFER_STRESS", "") not in ("", "0")
PROVIDERS = ["tcp;ofi_rxm", "shm"]


def _available(p: str) -> bool:
    try:
        kvxfer.Engine(p, "127.0.0.1").close()
        return True
    except kvxfer.errors.KvxferError:
        return False


_AVAIL = {p: _available(p) for p in PROVIDERS}


@pytest.fixture(params=PROVIDERS)
def provider(request):
    if not _AVAIL[request.param]:
        pytest.skip(f"provider {request.param} is not available here")
    return request.param
