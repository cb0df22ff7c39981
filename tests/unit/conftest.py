"""Unit tests need no libfabric: every test here runs with ``kvxfer._fabric`` and the engine made unimportable.

The block is per test (``pytest tests`` runs tests/fabric in the same process, with the engine
already loaded), so it also hides a native module that an earlier test imported. ``no_leaks`` is the
fd-leak guard of the buffer tests.
"""

from __future__ import annotations

import gc
import multiprocessing.resource_tracker
import os
import sys

import pytest

import kvxfer
from _data import open_fds


#: what the block hides: the native module and the engine that wraps it
BLOCKED = ("kvxfer._fabric", "kvxfer.engine")


@pytest.fixture(autouse=True)
def _no_libfabric(monkeypatch):
    """``import kvxfer._fabric`` and ``import kvxfer.engine`` raise ImportError for the test's
    duration, and kvxfer's lazily cached engine names are hidden; all is restored after."""
    cached = vars(kvxfer)  # (hasattr would run kvxfer.__getattr__, which imports)
    for mod in BLOCKED:
        monkeypatch.setitem(sys.modules, mod, None)
        if mod.rsplit(".", 1)[1] in cached:
            monkeypatch.delattr(kvxfer, mod.rsplit(".", 1)[1])
    for name, mod in kvxfer._LAZY.items():
        if mod in BLOCKED and name in cached:
            monkeypatch.delattr(kvxfer, name)
    yield


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves fds open or memfds mapped."""
    multiprocessing.resource_tracker.ensure_running()  # spawn keeps this fd for the process life
    gc.collect()
    before = open_fds()
    yield
    gc.collect()
    assert open_fds() == before, f"fd leak: {before} -> {open_fds()}: {os.listdir('/proc/self/fd')}"
