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
from _providers import provider  # noqa: E402,F401  (the shared fixture)
