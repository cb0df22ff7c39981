"""The outbox flushed by its poster: a decoder's REQUEST goes from ``receive()``'s thread and a
prefiller's ANNOUNCE from ``send()``'s (the messenger thread's with ``inline_requests``), one
engine try each, with no hand-off to the sender thread; an outbox another thread is sending
waits its turn, in order (kvxfer/messenger/peers.py, ``flush``).

Real engines on both providers; the Engine API is wrapped only to see which thread sent what.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.messenger import _codec as C
from _data import wait_for as _until

LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")       # 2 layers, pages of 4 tokens
SH = Sharding(1)


def _regions(fill):
    return [np.full(s, fill, np.uint8) for s in LAYOUT.region_sizes(SH)]


@pytest.fixture
def engines(provider):
    es = [kvxfer.Engine(provider, "127.0.0.1") for _ in range(2)]
    yield es
    for e in es:
        e.close()


def _record_sends(monkeypatch):
    """Every control message an Engine sends: (engine, type name, sending thread's name)."""
    orig = kvxfer.Engine.send
    seen: list = []

    def send(self, peer, data, timeout=30.0):
        if bytes(data[:2]) == b"KC":
            seen.append((self, C.MSG_TYPES[data[3]], threading.current_thread().name))
        return orig(self, peer, data, timeout)

    monkeypatch.setattr(kvxfer.Engine, "send", send)
    return seen


def _one_page_landed(dst):
    """Exactly one page's bytes of ``dst`` hold the source's 7s."""
    page = sum(n // LAYOUT.num_pages for n in LAYOUT.region_sizes(SH))
    return np.count_nonzero(np.concatenate(dst) == 7) == page


@pytest.mark.parametrize("inline", [False, True])
def test_request_and_announce_go_from_the_posting_thread(engines, monkeypatch, inline):
    ea, eb = engines
    src, dst = _regions(7), _regions(0)
    p = d = None
    try:
        p = kvxfer.Messenger(ea, LAYOUT, SH, {0: src}, peer_timeout=10, inline_requests=inline,
                             on_request=(lambda q: p.send(q, [2], context=b"in")) if inline else None)
        d = kvxfer.Messenger(eb, LAYOUT, SH, {0: dst}, context_slots=4, context_bytes=16, peer_timeout=10)
        pg = d.connect(p.handshake())
        seen = _record_sends(monkeypatch)
        me = threading.current_thread().name
        r = d.receive(pg, "req", [1], 3)
        assert (eb, "REQUEST", me) in seen                  # sent before receive() returned
        if not inline:
            (q,) = p.requests(timeout=20)
            s = p.send(q, [2], context=b"ctx")
            assert (ea, "ANNOUNCE", me) in seen             # sent before send() returned
            assert s.wait(20) == "done"
        assert r.wait(20) == "done" and bytes(r.context) == (b"in" if inline else b"ctx")
        assert _one_page_landed(dst)
        if inline:
            assert (ea, "ANNOUNCE", "kvxfer-msg") in seen   # the messenger thread that read the REQUEST
        assert not [x for x in seen if x[1] in ("REQUEST", "ANNOUNCE") and x[2] == "kvxfer-msg-send"]
        assert d.stats().get("send_failed", 0) == 0 and p.stats().get("send_failed", 0) == 0
    finally:
        for m in (d, p):
            if m is not None:
                m.close()


def test_an_outbox_being_sent_elsewhere_keeps_its_order(engines, monkeypatch):
    """While another thread holds the outbox (the sender thread mid-send, here the test),
    ``receive()`` leaves its REQUEST queued and returns; the sender thread sends every one,
    in the order posted, once the outbox is free."""
    ea, eb = engines
    p = kvxfer.Messenger(ea, LAYOUT, SH, {0: _regions(7)}, peer_timeout=10)
    d = kvxfer.Messenger(eb, LAYOUT, SH, {0: _regions(0)}, peer_timeout=10)
    try:
        pg = d.connect(p.handshake())
        seen = _record_sends(monkeypatch)
        with pg.send_lock:
            rs = [d.receive(pg, f"r{i}", [i], 4) for i in range(3)]
            assert not [x for x in seen if x[1] == "REQUEST"]        # nothing went meanwhile
            assert [r.state for r in rs] == ["pending"] * 3
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < 3 and time.monotonic() < deadline:
            got += p.requests(timeout=1)
        assert [q.request_id for q in got] == ["r0", "r1", "r2"]
        assert [x[2] for x in seen if x[1] == "REQUEST"] == ["kvxfer-msg-send"] * 3
        for q in got:
            p.send(q, [q.dst_pages[0] + 8], context=None)
        assert [r.wait(20) for r in rs] == ["done"] * 3
        _until(lambda: d.stats().get("sent_REQUEST", 0) == 3, "three REQUESTs counted")
    finally:
        d.close()
        p.close()


def test_a_one_try_engine_send_delivers(engines):
    """``Engine.send(timeout=0)``, the try ``flush`` makes: one native try (no 50 ms retry
    while the queue is full), and a message it took arrives."""
    ea, eb = engines
    peer = ea.connect(eb.address)
    for i in range(20):
        ea.send(peer, b"one-try-%d" % i, timeout=0)
    assert [eb.recv(10) for _ in range(20)] == [b"one-try-%d" % i for i in range(20)]
