"""The ``server`` fixture: each backend of tests/rendezvous/_backends.py that runs here, one
server per test module, always closed; ``store``: a client of it, emptied first."""

from __future__ import annotations

import pytest

import kvxfer.rendezvous as R

from _backends import BACKENDS, make_server, why_not


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    why = why_not(request.param)
    if why:
        pytest.skip(why)
    srv = make_server(request.param)
    srv.kind = request.param
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def store(server):
    s = R.open(server.url, op_timeout=1.0)
    for k in s.list(""):
        s.delete(k)
    yield s
    s.close()
