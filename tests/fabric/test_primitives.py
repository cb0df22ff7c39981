"""Engine primitives for fences and peer removal: discard(imm), Transfer.posted, disconnect."""

import threading

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import ClosedError, InvalidArgumentError, PeerError


@pytest.fixture
def pair(provider):
    a = kvxfer.Engine(provider, "127.0.0.1")
    b = kvxfer.Engine(provider, "127.0.0.1")
    src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
    dst = np.zeros(len(src), np.uint8)
    ms, md = a.register(src), b.register(dst)
    try:
        yield a, b, ms, a.connect(b.address), a.remote(md.descriptor()), src, dst
    finally:
        a.close()
        b.close()


def _until(pred, timeout=10.0):
    """Poll `pred` (arrival is asynchronous at the target); True once it holds."""
    ev = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if pred():
            return True
        ev.wait(0.01)
    return pred()


def test_discard_drops_banked_arrivals(pair):
    a, b, ms, peer, rr, *_ = pair
    for i in range(5):
        a.write(ms, i * 64, peer, rr, i * 64, 64, imm=7).wait(10)
    assert _until(lambda: b.banked(7) == 5)
    assert b.discard(7) == 5
    assert b.banked(7) == 0
    assert b.discard(7) == 0          # idempotent: nothing left to drop
    c = b.expect(7, 1)
    assert not c.done                 # nothing stale is credited
    a.write(ms, 0, peer, rr, 0, 64, imm=7).wait(10)
    c.wait(10)
    assert c.state == "done" and c.arrived == 1


def test_discard_withdraws_an_unfinished_expectation(pair):
    a, b, ms, peer, rr, *_ = pair
    c = b.expect(8, 10)
    for i in range(3):
        a.write(ms, i * 64, peer, rr, i * 64, 64, imm=8).wait(10)
    assert _until(lambda: c.arrived == 3)
    assert c.state == "pending"
    assert b.discard(8) == 3
    assert c.done and c.state == "discarded"
    with pytest.raises(ClosedError, match="discarded"):
        c.wait(1)
    c2 = b.expect(8, 2)               # a fresh expectation starts from zero
    assert c2.arrived == 0
    for i in range(2):
        a.write(ms, 0, peer, rr, 0, 64, imm=8).wait(10)
    c2.wait(10)
    assert c2.arrived == 2 and b.banked(8) == 0
    del c                             # dropping a discarded counter is harmless
    assert b.discard(8) == 0


def test_discard_runs_no_callback(pair):
    a, b, ms, peer, rr, *_ = pair
    called = []
    c = b.expect(9, 2, callback=called.append)
    a.write(ms, 0, peer, rr, 0, 64, imm=9).wait(10)
    assert _until(lambda: c.arrived == 1)
    assert b.discard(9) == 1
    assert not b._callbacks           # the engine forgot the withdrawn counter
    a.write(ms, 0, peer, rr, 0, 64, imm=9).wait(10)
    assert _until(lambda: b.banked(9) == 1)
    assert called == []


def test_discard_checks_its_argument(engine):
    for bad in (-1, 2**32, 1.5, None, True, "3"):
        with pytest.raises(InvalidArgumentError):
            engine.discard(bad)
    assert engine.discard(12345) == 0
    engine.close()
    with pytest.raises(ClosedError):
        engine.discard(1)


def test_posted_counts_every_write(pair):
    a, b, ms, peer, rr, *_ = pair
    pages = np.arange(0, 256, 2)              # not contiguous: one message per page or so
    t = a.write_pages(ms, pages, peer, rr, pages, 1024, imm=3)
    c = b.expect(3, t.num_writes)
    t.wait(10)
    assert t.posted == t.num_writes
    c.wait(10)


def test_fence_after_cancel(pair):
    """Cancel mid-transfer, learn the final posted count, drain exactly that, retire the imm:
    no stale arrival is credited to the next expectation of the same imm."""
    a, b, ms, peer, rr, src, dst = pair
    a.write(ms, 0, peer, rr, 0, 64).wait(10)      # connected: the first posts go out at once
    pages = np.arange(0, 8192, 2)                 # 64-byte pieces travel one per message
    ts = [a.write_pages(ms, pages, peer, rr, pages, 64, imm=11) for _ in range(8)]
    for t in ts:
        t.cancel()
    for t in ts:
        assert _until(lambda: t.done)
    posted = sum(t.posted for t in ts)
    assert 0 <= posted <= sum(t.num_writes for t in ts)
    dropped = b.discard(11)
    if dropped < posted:
        b.expect(11, posted - dropped).wait(20)
        assert b.discard(11) == 0            # the expectation consumed exactly the rest
    assert b.banked(11) == 0
    c = b.expect(11, 1)
    assert not c.done
    a.write(ms, 0, peer, rr, 0, 64, imm=11).wait(10)
    c.wait(10)
    assert b.banked(11) == 0


def test_connect_returns_the_same_live_peer(pair):
    a, b, ms, peer, rr, *_ = pair
    peers = {id(a.connect(b.address)) for _ in range(300)}
    assert peers == {id(peer)}
    a.write(ms, 0, peer, rr, 0, 64).wait(10)


def test_disconnect_refuses_later_posts(pair):
    a, b, ms, peer, rr, src, dst = pair
    a.write(ms, 0, peer, rr, 0, 4096).wait(10)
    a.disconnect(peer)
    assert peer.closed
    a.disconnect(peer)                        # idempotent
    peer.close()
    with pytest.raises(PeerError):
        a.write(ms, 0, peer, rr, 0, 64)
    with pytest.raises(PeerError):
        a.write_pages(ms, [0], peer, rr, [0], 64)
    with pytest.raises(PeerError):
        a.send(peer, b"x")
    again = a.connect(b.address)              # a new, live peer
    assert again is not peer and not again.closed
    dst[:] = 0
    a.write(ms, 0, again, rr, 0, 4096).wait(10)
    assert _until(lambda: bytes(dst[:4096]) == bytes(src[:4096]))
    a.send(again, b"hello")
    assert b.recv(10) == b"hello"


def test_disconnect_cancels_pending_transfers(pair):
    a, b, ms, peer, rr, *_ = pair
    a.write(ms, 0, peer, rr, 0, 64).wait(10)
    pages = np.arange(0, 8192, 2)
    ts = [a.write_pages(ms, pages, peer, rr, pages, 64) for _ in range(20)]
    a.disconnect(peer, timeout=20)
    for t in ts:
        assert t.done                         # nothing of it is still posting or in flight
        assert t.posted <= t.num_writes
        if t.posted < t.num_writes:
            with pytest.raises(PeerError):
                t.wait(1)
    for r in a._rails:
        assert r.stats()["outstanding"] == 0


def test_disconnect_checks_its_argument(pair):
    a, b, *_ = pair
    for bad in (None, "peer", b.connect(a.address)):
        with pytest.raises(InvalidArgumentError):
            a.disconnect(bad)
