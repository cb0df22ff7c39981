"""Races and lost messages of the messenger (review 3): each test forces one interleaving
(by wrapping a lock or a method, or refusing one control message at the Engine API) over
real engines on both providers, and checks the request settles as the protocol says."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.errors import InvalidArgumentError, PeerError, RejectedError
from kvxfer.errors import TimeoutError as KTimeoutError
from kvxfer.messenger import _codec as C
from _data import wait_for as _until

LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")       # 2 layers, pages of 4 tokens
SH = Sharding(1)
SECRET = b"test-secret-0123456789"


def _regions(fill):
    return [np.full(s, fill, np.uint8) for s in LAYOUT.region_sizes(SH)]


def _messenger(engine, kv, **kw):
    return kvxfer.Messenger(engine, LAYOUT, SH, {0: kv}, peer_timeout=5, secret=SECRET, **kw)


@pytest.fixture
def pair(provider):
    """A prefill and a decode messenger, each on its own engine; ``extra`` holds more
    messengers and engines a test makes (closed first)."""
    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src, dst = _regions(7), _regions(0xEE)
    p = _messenger(ea, src)
    d = _messenger(eb, dst, context_slots=4, context_bytes=16)
    pg = d.connect(p.handshake())
    extra: list = []
    yield p, d, pg, src, dst, extra
    for o in reversed(extra):
        o.close()
    d.close()
    p.close()
    eb.close()
    ea.close()


def _requests(p, n):
    """The prefiller's next ``n`` requests by id (bounded wait)."""
    out = {}
    deadline = time.monotonic() + 20
    while len(out) < n and time.monotonic() < deadline:
        out.update({q.request_id: q for q in p.requests(timeout=1)})
    assert len(out) == n, out
    return out


# -- finding 1: abandoning a pass scheduled ahead ----------------------------------------------

@pytest.mark.parametrize("bump", ["cpu", "kernel"])
def test_abandon_pass_scheduled_ahead_keeps_running_pass(pair, bump):
    """Pass B is scheduled ahead while pass A runs, then abandoned after A's first layer:
    A's second layer still posts only once the model computed it (its new bytes land), B's
    request fails fenced, and the next pass takes B's base and runs byte-exact. ``kernel``
    bumps the counter natively, as a CUDA kernel does (no Python): the messenger thread
    applies B's skip."""
    p, d, pg, src, dst, _ = pair
    ra = d.receive(pg, "a", [1], 4)
    rb = d.receive(pg, "b", [2], 4)
    qs = _requests(p, 2)
    lc = p.layer_counter
    step = lc.bump if bump == "cpu" else (lambda: lc._w.bump(1))
    sa, sb = p.stream(qs["a"], [5]), p.stream(qs["b"], [6])
    sa.finish(b"A")
    sb.finish(b"B")
    pa = p.schedule([(sa, 0, 4)])
    pb = p.schedule([(sb, 0, 4)])
    assert pb.base == pa.end and lc.num_layers == 2
    step()                                          # the model computed A's layer 0
    for e in sa.entries:
        if e.threshold == pa.base + 1:
            e.wait(10)
    assert pb.abandon() > 0                         # the scheduler drops B (never started)
    assert lc.value == pa.base + 1                  # A's layer 1 is not computed: not skipped past
    later = [e.state for e in sa.entries if e.threshold > pa.base + 1]       # layer 1, the context
    assert later and set(later) == {"armed"}
    with pytest.raises(PeerError):
        rb.wait(10)
    assert rb.fenced
    for r in src:
        r[:] = 0x42                                 # A's layer 1 computed: new bytes in the source
    step()
    assert ra.wait(10) == "done" and bytes(ra.context) == b"A"
    got = np.concatenate(dst)
    n7, n42 = int((got == 7).sum()), int((got == 0x42).sum())
    assert n7 > 0 and n42 == n7                     # layer 0 before, layer 1 after the model computed it
    assert int((got != 0xEE).sum()) == n7 + n42     # nothing of B landed
    rc = d.receive(pg, "c", [3], 4)
    sc = p.stream(_requests(p, 1)["c"], [7])
    sc.finish(b"C")
    pc = p.schedule([(sc, 0, 4)])
    assert pc.base == pb.end                        # the next pass runs where B would have
    for _ in range(lc.num_layers):
        step()
    assert rc.wait(10) == "done" and bytes(rc.context) == b"C"
    assert lc.value == pc.end and lc.pending_skips == []   # B's layers skipped exactly once
    assert sa.wait(10) == "done" and sc.wait(10) == "done"


def test_abandon_running_pass_then_pass_ahead(pair):
    """Abandoning the pass ahead, then the running one: the counter ends after both, once."""
    p, d, pg, src, dst, _ = pair
    ra = d.receive(pg, "a", [1], 4)
    rb = d.receive(pg, "b", [2], 4)
    qs = _requests(p, 2)
    lc = p.layer_counter
    sa, sb = p.stream(qs["a"], [5]), p.stream(qs["b"], [6])
    pa = p.schedule([(sa, 0, 4)])
    pb = p.schedule([(sb, 0, 4)])
    lc.bump()
    pb.abandon()
    assert lc.value == pa.base + 1 and lc.pending_skips == [(pb.base, pb.end)]
    pa.abandon()                                    # the model gave A up too
    assert lc.value == pb.end and lc.pending_skips == []
    for r in (ra, rb):
        with pytest.raises(PeerError):
            r.wait(10)
        assert r.fenced


# -- finding 2: the decoder's ABORT racing the prefiller's send() --------------------------------

class _PausingLock:
    """The messenger's RLock; the thread leaving ``function``'s critical section waits for
    ``resume`` (bounded) right after releasing it: a preemption at that point."""

    def __init__(self, lock, function):
        self._l = lock
        self._fn = function
        self.paused = threading.Event()
        self.resume = threading.Event()

    def acquire(self, *a, **k):
        return self._l.acquire(*a, **k)

    def release(self):
        return self._l.release()

    def __enter__(self):
        return self._l.__enter__()

    def __exit__(self, *a):
        r = self._l.__exit__(*a)
        if sys._getframe(1).f_code.co_name == self._fn and not self.paused.is_set():
            self.paused.set()
            self.resume.wait(20)
        return r


def test_abort_racing_send_is_answered(pair):
    """ABORT arrives before the application's send(); send() runs right after the messenger
    thread withdrew the request: the Send is "aborted" and the decoder still gets ABORTED."""
    p, d, pg, src, dst, _ = pair
    r = d.receive(pg, "req", [1], 3)
    (q,) = _requests(p, 1).values()
    lock = _PausingLock(p._node.lock, "on_abort")
    p._node.lock = lock
    try:
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("abort", r.abort(timeout=15)))
        t.start()
        assert lock.paused.wait(20)
        s = p.send(q, [2])                          # the scheduler sends it right then
        lock.resume.set()
        assert s.state == "aborted"
        t.join(30)
    finally:
        lock.resume.set()
        p._node.lock = lock._l
    assert res["abort"] is True and r.state == "aborted" and r.fenced
    # counted by the prefiller's sender thread once Engine.send returned: maybe after the decoder read it
    _until(lambda: p.stats().get("sent_ABORTED", 0) >= 1, "the prefiller counted its ABORTED")
    assert p.stats().get("sent_ABORTED") == 1
    assert (np.concatenate(dst) == 0xEE).all()


# -- finding 3: receive() racing the peer's death --------------------------------------------------

def test_receive_racing_peer_death_is_refused(pair):
    """The peer dies (BYE) while receive() converts its page list, and the decoder's
    messenger thread is preempted between marking it dead and disconnecting it: receive
    raises PeerError and nothing is left pending."""
    p, d, pg, src, dst, _ = pair
    returned = threading.Event()
    forget = d._peers_room.disconnect

    def slow_forget(peer):                           # the teardown waits for receive() to return
        returned.wait(20)
        forget(peer)

    d._peers_room.disconnect = slow_forget

    class SlowPages:                                 # the caller's thread preempted in receive()
        def __array__(self, dtype=None, copy=None):
            p.close()
            _until(lambda: not pg.alive, "the decoder saw the BYE")
            return np.array([1, 2], np.int64)

    try:
        with pytest.raises(PeerError, match="dead"):
            d.receive(pg, "late", SlowPages(), 5, timeout=1.0)
    finally:
        returned.set()
    assert d.stats().get("receives", 0) == 0
    d.close()
    assert d.stats().get("receives", 0) == 0


# -- finding 4: one-shot control messages the engine refuses once -----------------------------------

def _refuse_once(monkeypatch, engine, mtype):
    """``engine`` refuses its first control message of type ``mtype`` as a full provider queue
    does (Engine.send's TimeoutError); the message is not sent."""
    orig = kvxfer.Engine.send
    state = {"armed": True}

    def send(self, peer, data, timeout=30.0):
        if self is engine and state["armed"] and bytes(data[:2]) == b"KC" and data[3] == mtype:
            state["armed"] = False
            raise KTimeoutError("control message not accepted by the provider within 1.0 s")
        return orig(self, peer, data, timeout)

    monkeypatch.setattr(kvxfer.Engine, "send", send)
    return state


def _resent(m, name):
    """``m`` resent one ``name`` (counted right after the send returned: waited for)."""
    _until(lambda: m.stats().get("resent_" + name, 0) >= 1, f"{name} was resent")
    assert m.stats()["resent_" + name] == 1


@pytest.mark.parametrize("lost", ["ABORT", "ABORTED", "REJECT", "ANNOUNCE", "REQUEST", "HELLO_ACK", "HELLO"])
def test_refused_one_shot_message_is_resent(pair, monkeypatch, provider, lost):
    """Every control message goes through its peer's outbox: one the engine refuses stays
    first and the sender thread sends it again; the request settles as if none was refused."""
    p, d, pg, src, dst, extra = pair
    mtype = {v: k for k, v in C.MSG_TYPES.items()}[lost]
    if lost == "ABORT":                              # the request's timeout sends it
        state = _refuse_once(monkeypatch, d.engine, mtype)
        r = d.receive(pg, "req", [1], 3, timeout=0.2)
        _requests(p, 1)                              # taken, never sent
        with pytest.raises(KTimeoutError, match="within its timeout"):
            r.wait(20)
        assert r.fenced
        _resent(d, "ABORT")
    elif lost == "ABORTED":
        state = _refuse_once(monkeypatch, p.engine, mtype)
        r = d.receive(pg, "req", [1], 3)
        _requests(p, 1)
        assert r.abort(20) is True and r.state == "aborted" and r.fenced
        _resent(p, "ABORTED")
    elif lost == "REJECT":
        from _nodes import hostile_request

        state = _refuse_once(monkeypatch, p.engine, mtype)
        r = hostile_request(d, pg)
        with pytest.raises(RejectedError, match="rejected"):
            r.wait(20)
        _resent(p, "REJECT")
    elif lost == "ANNOUNCE":                         # posted: the sender thread tries it again
        state = _refuse_once(monkeypatch, p.engine, mtype)
        r = d.receive(pg, "req", [1], 3)
        (q,) = _requests(p, 1).values()
        s = p.send(q, [2], context=b"x")
        assert s.state == "transferring"             # queued, not refused: the caller did not wait
        assert r.wait(20) == "done" and bytes(r.context) == b"x"
        assert s.wait(20) == "done"
        page = sum(n // LAYOUT.num_pages for n in LAYOUT.region_sizes(SH))
        assert np.count_nonzero(np.concatenate(dst) == 7) == page     # one page, the source's
        _resent(p, "ANNOUNCE")
    elif lost == "REQUEST":                          # receive() returned; the REQUEST went later
        state = _refuse_once(monkeypatch, d.engine, mtype)
        r = d.receive(pg, "req", [1], 3)
        assert r.state == "pending"
        p.send(_requests(p, 1)["req"], [2], context=b"r")
        assert r.wait(20) == "done" and bytes(r.context) == b"r"
        _resent(d, "REQUEST")
    else:                                            # HELLO(_ACK): a new decoder connects
        e2 = kvxfer.Engine(provider, "127.0.0.1")
        extra.append(e2)
        state = _refuse_once(monkeypatch, e2 if lost == "HELLO" else p.engine, mtype)
        d2 = _messenger(e2, _regions(0))
        extra.append(d2)
        pg2 = d2.connect(p.handshake(), timeout=20)
        assert pg2.alive
        _resent(d2 if lost == "HELLO" else p, lost)
    assert not state["armed"]                        # the message was refused once
    assert pg.alive


# -- finding 5: a retried connect; a dead peer's HELLO -----------------------------------------------

def test_connect_retry_after_timeout(pair, provider):
    """The prefiller answers a HELLO only after the decoder's connect timed out: connecting
    again succeeds (its HELLO is newer than the first) and requests flow."""
    p, d, pg, src, dst, extra = pair
    e2 = kvxfer.Engine(provider, "127.0.0.1")
    extra.append(e2)
    d2 = _messenger(e2, _regions(0xEE))
    extra.append(d2)
    timed_out = threading.Event()
    orig = p._peers_room.on_hello

    def late_hello(m, g):                            # the prefiller is slow to read the HELLO
        if m.src == d2.uid and not timed_out.is_set():
            timed_out.wait(20)
        return orig(m, g)

    p._peers_room.on_hello = late_hello
    with pytest.raises(PeerError, match="did not answer"):
        d2.connect(p.handshake(), timeout=0.2)
    timed_out.set()
    # the answer to the first HELLO came after the timeout: the decoder dropped it
    _until(lambda: d2.stats().get("drop_unknown_peer", 0) >= 1, "the late HELLO_ACK arrived")
    pg2 = d2.connect(p.handshake(), timeout=20)
    assert pg2.alive
    r = d2.receive(pg2, "x", [0], 4)
    p.send(_requests(p, 1)["x"], [3]).finish()
    assert r.wait(20) == "done"


def test_hello_of_dead_peer_is_dropped(pair):
    """A HELLO from a peer declared dead (here: it closed) does not bring it back up."""
    p, d, pg, src, dst, _ = pair
    blob, uid = d.handshake(), d.uid
    d.close()                                        # BYE: the prefiller declares it dead
    _until(lambda: all(g.uid != uid for g in p.peers), "the prefiller saw the BYE")
    to_p = d.engine.connect(p.engine.address)
    hello = C.Control(C.HELLO, uid, p.uid, 10**6, blob=blob)
    d.engine.send(to_p, hello.encode(SECRET))
    _until(lambda: (p.stats().get("drop_dead_peer", 0) >= 1 or any(g.uid == uid for g in p.peers)),
           "the prefiller handled the HELLO")
    assert all(g.uid != uid for g in p.peers)
    assert p.stats().get("drop_dead_peer") == 1
    assert p.stats().get("sent_HELLO_ACK") == 1      # the first connect's only


# -- finding 6: a streaming ANNOUNCE and the ABORTED of the same request -----------------------------

class _WatchedLock:
    """A Send's lock: ``contended`` is set when another thread waits for it while held."""

    def __init__(self, lock):
        self._l = lock
        self.contended = threading.Event()

    def __enter__(self):
        if self._l.locked():
            self.contended.set()
        return self._l.__enter__()

    def __exit__(self, *a):
        return self._l.__exit__(*a)


def test_stream_announce_precedes_aborted(pair):
    """Send.abort() from another thread while the last chunk's ANNOUNCE is being posted, and
    the ABORTED posted while that ANNOUNCE still waits in the outbox (the sender thread held
    back): the ANNOUNCE still goes before the ABORTED (one outbox per peer, posted in order),
    and the decoder fences on what was posted."""
    p, d, pg, src, dst, _ = pair
    r = d.receive(pg, "s", [1, 2], 8)
    (q,) = _requests(p, 1).values()
    lc = p.layer_counter
    s = p.stream(q, [5, 6])
    lock = _WatchedLock(s._lock)
    s._lock = lock
    p.schedule([(s, 0, 4)])                         # page 0, no ANNOUNCE yet
    for _ in range(lc.num_layers):
        lc.bump()
    for e in s.entries:
        e.wait(10)
    order = []
    aborted_posted = threading.Event()
    room = p._peers_room
    post, send_locked = room.post, room._send_locked
    aborter = threading.Thread(target=lambda: s.abort(20))

    def posting(g, t, **fields):
        if t == C.ANNOUNCE and not aborter.is_alive() and not aborted_posted.is_set():
            aborter.start()                          # the application aborts right then
            _until(lock.contended.is_set, "the abort waits for the Send's lock")
        if t == C.ABORTED:
            aborted_posted.set()
        return post(g, t, **fields)

    def sending(g, t, timeout, fields):              # the sender thread
        if t == C.ANNOUNCE:
            aborted_posted.wait(20)                  # the ABORTED is queued behind it by now
        send_locked(g, t, timeout, fields)
        order.append(C.MSG_TYPES[t])

    room.post, room._send_locked = posting, sending
    try:
        p.schedule([(s, 4, 8)])                      # the last chunk: ANNOUNCE
        aborter.join(30)
        assert s.wait(20) == "aborted"
        assert aborted_posted.is_set()
        _until(lambda: "ABORTED" in order, "the ABORTED went")
    finally:
        room.post, room._send_locked = post, send_locked
    assert order.index("ANNOUNCE") < order.index("ABORTED"), order
    with pytest.raises(PeerError):
        r.wait(20)
    assert r.fenced
    r2 = d.receive(pg, "t", [1, 2], 8)               # the pages are free again
    s2 = p.send(_requests(p, 1)["t"], [3, 4])
    s2.finish(b"t")
    assert r2.wait(20) == "done"


def test_late_announce_after_aborted_is_ignored(pair):
    """An ANNOUNCE that arrives after the ABORTED of its request, while the fence still waits
    for posted writes, is dropped: the fence goes on, and the teardown fences the request."""
    p, d, pg, src, dst, _ = pair
    r = d.receive(pg, "late", [4], 1)
    _requests(p, 1)                                   # taken, never sent
    (to_d,) = p.peers
    p._send(to_d, C.ABORTED, imm=r.imm, count=3, flags=C.ABORTED_BY_PREFILLER)   # 3 writes "posted"
    p._send(to_d, C.ANNOUNCE, imm=r.imm, count=5)
    _until(lambda: d.stats().get("recv_ANNOUNCE", 0) >= 1, "the decoder read the ANNOUNCE")
    assert not r.done                                 # still fencing: 3 writes never came
    assert d.stats().get("drop_late_announce") == 1
    p.close()                                         # the prefiller leaves: torn down, fenced
    with pytest.raises(PeerError):
        r.wait(20)
    assert r.fenced
