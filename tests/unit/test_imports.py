"""The package face: lazy names and submodules, ``__all__``, the leaf int check, and the libfabric block of tests/unit."""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvxfer
from kvxfer._check import as_int, is_int
from kvxfer.errors import InvalidArgumentError, LayoutError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_unit_tests_run_without_libfabric():
    """tests/unit/conftest.py's block is in force: neither the native module nor the engine imports."""
    with pytest.raises(ImportError):
        importlib.import_module("kvxfer._fabric")
    with pytest.raises(ImportError):
        kvxfer.Engine  # noqa: B018


def test_every_public_submodule_is_reachable_from_the_package():
    found = {m.name for m in pkgutil.iter_modules(kvxfer.__path__) if not m.name.startswith("_")}
    assert found == set(kvxfer._SUBMODULES), "add new public submodules to kvxfer._SUBMODULES"
    for name in found - {"engine"}:
        assert getattr(kvxfer, name) is importlib.import_module(f"kvxfer.{name}")
    assert set(kvxfer.__all__) == {*kvxfer._LAZY, *kvxfer._SUBMODULES, "__version__"}
    assert callable(kvxfer.share.send_handles)  # was an AttributeError: share was not exported


def test_public_names_resolve_in_a_fresh_interpreter_without_libfabric():
    code = (
        "import sys\n"
        "sys.modules['kvxfer._fabric'] = None\n"
        "import kvxfer\n"
        "names = [n for n in kvxfer.__all__ if n not in ('Engine', 'Peer', 'MemoryRegion', 'RemoteRegion',"
        " 'Transfer', 'Counter', 'providers', 'engine')]\n"
        "missing = [n for n in names if getattr(kvxfer, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert 'kvxfer._fabric' not in sys.modules or sys.modules['kvxfer._fabric'] is None\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@given(st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=3), st.none()))
def test_is_int_takes_ints_and_numpy_ints_only(v):
    assert is_int(v) == (isinstance(v, int) and not isinstance(v, bool))
    if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63:
        assert is_int(np.int64(v))


def test_as_int_returns_plain_ints_and_names_the_argument():
    v = as_int(np.uint64(5), "pages", minimum=1)
    assert v == 5 and type(v) is int
    with pytest.raises(InvalidArgumentError, match="pages must be an int"):
        as_int(True, "pages")
    with pytest.raises(InvalidArgumentError, match="pages must be >= 1"):
        as_int(0, "pages", minimum=1)
    with pytest.raises(LayoutError):
        as_int(2.0, "kv_heads", error=LayoutError)


def test_one_timeout_parser_with_one_meaning_of_inf():
    """``kvxfer._check.as_timeout`` (issue 22): None and inf both mean no deadline where a call
    may wait for ever; a call that must end refuses both; NaN, negatives, bools, strings and
    finite waits past MAX_TIMEOUT are refused."""
    import math

    import numpy as np
    import pytest

    from kvxfer._check import MAX_TIMEOUT, as_timeout
    from kvxfer.errors import ArgumentTypeError, InvalidArgumentError

    assert as_timeout(None) is None and as_timeout(math.inf) is None and as_timeout(np.float64("inf")) is None
    assert as_timeout(0) == 0.0 and as_timeout(np.int32(3)) == 3.0 and as_timeout(MAX_TIMEOUT) == MAX_TIMEOUT
    for bad in (math.nan, -1, -math.inf, MAX_TIMEOUT * 2, 2**70):
        with pytest.raises(InvalidArgumentError):
            as_timeout(bad)
    for bad in (True, "1", [1]):
        with pytest.raises(ArgumentTypeError):
            as_timeout(bad)
    for bad in (None, math.inf):
        with pytest.raises(InvalidArgumentError):
            as_timeout(bad, forever=False)


def test_one_bounds_check_for_triples():
    import numpy as np
    import pytest

    from kvxfer._check import check_triples
    from kvxfer.errors import InvalidArgumentError, OutOfBoundsError

    u = lambda *v: np.array(v, np.uint64)  # noqa: E731
    check_triples(u(0, 8), u(8, 0), u(8, 8), 16, 16)
    check_triples(u(), u(), u(), 0, 0)
    with pytest.raises(OutOfBoundsError, match="source write 1 ends at byte 17"):
        check_triples(u(0, 9), u(0, 0), u(8, 8), 16, 16)
    with pytest.raises(OutOfBoundsError, match="destination write 0 ends at byte 24"):
        check_triples(u(0), u(16), u(8), 16, 16)
    with pytest.raises(InvalidArgumentError, match="triples differ in length"):
        check_triples(u(0), u(0, 1), u(8), 16, 16)


def test_as_int_bounds_and_types():
    import numpy as np
    import pytest

    from kvxfer._check import as_int
    from kvxfer.errors import ArgumentTypeError, InvalidArgumentError, LayoutError

    assert as_int(np.uint8(5), "n", minimum=0, maximum=5) == 5 and type(as_int(np.int64(2), "n")) is int
    with pytest.raises(ArgumentTypeError):
        as_int(np.bool_(True), "n")
    with pytest.raises(InvalidArgumentError, match="n must be <= 4"):
        as_int(5, "n", maximum=4)
    with pytest.raises(LayoutError):             # a caller's own error class, for types too
        as_int(1.0, "n", error=LayoutError)
