"""Messenger.drop_peer: a peer declared dead by something other than heartbeat silence (a
rendezvous lease that expired, kvxfer/rendezvous/directory.py) fails its requests on the spot,
fenced by the teardown, exactly as silence for peer_timeout would; idempotent, any thread."""

from __future__ import annotations

import threading

import pytest

from kvxfer.errors import ClosedError, InvalidArgumentError, PeerError
from _pair import open_pair


@pytest.fixture
def pair(provider):
    t = open_pair(provider)
    yield t
    t.close()


def test_drop_peer_fails_its_receives_fenced_and_refuses_new_ones(pair):
    r = pair.d.receive(pair.pg, "dropped-1", [0, 1], 8, timeout=30)
    t = threading.Thread(target=pair.d.drop_peer, args=(pair.pg, PeerError("lease expired")))
    t.start()                                   # from another thread than the caller's
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(PeerError, match="lease expired"):
        r.wait(timeout=10)
    assert r.state == "failed" and r.fenced     # torn down: nothing of that peer lands any more
    assert not pair.pg.alive
    pair.d.drop_peer(pair.pg)                   # idempotent: a dead group stays as it died
    assert "lease expired" in str(pair.pg.error)
    with pytest.raises(PeerError):
        pair.d.receive(pair.pg, "dropped-2", [2], 4)
    assert pair.d.stats()["peers_dead"] >= 1


def test_drop_peer_refuses_what_is_not_its_group(pair):
    with pytest.raises(InvalidArgumentError):
        pair.d.drop_peer("not a group")
    with pytest.raises(InvalidArgumentError):
        pair.p.drop_peer(pair.pg)               # the decoder's group, not the prefiller's
    with pytest.raises(InvalidArgumentError):
        pair.d.drop_peer(pair.pg, "not an error")


def test_drop_peer_after_close_is_closed(pair):
    pair.d.close()
    with pytest.raises(ClosedError):
        pair.d.drop_peer(pair.pg)
