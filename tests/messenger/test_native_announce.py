"""A decoder leg's ANNOUNCE armed by the engine (src/announce.c, decode.Decoder._adopt) through the
messenger, on both providers, in node and per-rank mode: a waiting caller's request completes
from the engine (bytes and context exact, every ANNOUNCE still read and accepted once, no drop);
the same without it (``KVXFER_NATIVE_ANNOUNCE=0``); an abort while an armed count is pending
fences as before; and a replayed ANNOUNCE for a reused imm arms nothing."""

from __future__ import annotations

import threading
import time

import pytest

from kvxfer.messenger import _codec as C

from _data import until
from _api import Cluster
from _pair import open_pair

DROPS = ("drop_unknown_request", "drop_duplicate_announce", "drop_late_announce", "drop_replayed",
         "drop_unexpected_announce", "drop_bad_count")


def _until(pred, timeout=10.0):
    assert until(pred, timeout), "timed out"


def _serve(cl, stop, ctx=b"context!"):
    """Every prefill messenger answers each request as it comes: its pages, then the context."""
    def run(p):
        while not stop.is_set():
            for q in p.requests(timeout=0.05):
                n = len(q.dst_pages)
                p.send(q, list(range(16, 16 + n))).finish(ctx if q.slot >= 0 else None)
    ts = [threading.Thread(target=run, args=(p,), daemon=True) for p in cl.pre]
    for t in ts:
        t.start()
    return ts


@pytest.mark.parametrize("native", [True, False], ids=["native", "messenger_thread"])
@pytest.mark.parametrize("per_rank", [False, True], ids=["node", "per_rank"])
def test_waiting_callers_complete_from_the_engine(provider, per_rank, native, monkeypatch):
    if not native:
        monkeypatch.setenv("KVXFER_NATIVE_ANNOUNCE", "0")
    cl = Cluster(provider, per_rank)
    stop = threading.Event()
    ts = _serve(cl, stop)
    try:
        n = 40
        for i in range(n):
            pages = [i % 16, 16 + i % 8] if i % 2 else [i % 16]
            r = cl.d.receive(cl.peer, f"r{i}", pages, 4 * len(pages))
            assert r.wait(10) == "done"
            assert bytes(r.context) == b"context!"
            assert r.t_start <= r.t_landed <= r.t_done
            cl.check(pages, list(range(16, 16 + len(pages))))
            r.release()
        dec = cl.d._decode
        legs = n * len(cl.pre)
        # the quiet ANNOUNCEs are read once a messenger thread's slice passes
        _until(lambda: cl.d.stats().get("recv_ANNOUNCE", 0) == legs and not dec.armed_seqs)
        stats = cl.d.stats()
        armed = stats.get("announces_armed", 0)
        if native:
            # the caller waits on every leg's arm (the later ones held while it waits on the
            # first): the engine arms them all but for an ANNOUNCE in a gap between slices
            assert armed >= legs * 3 // 4, stats
        else:
            assert armed == 0 and cl.d._node.engine.stats()["armed"] == 0
        assert not any(stats.get(k) for k in DROPS), stats
        assert not dec.receives and not dec.rids and not dec.busy_pages.any()
    finally:
        stop.set()
        for t in ts:
            t.join(5)
        cl.close()


@pytest.mark.parametrize("per_rank", [False, True], ids=["node", "per_rank"])
def test_an_abort_while_an_armed_count_is_pending_fences(provider, per_rank):
    """The ANNOUNCE arms the count while the caller waits; the context write never comes
    (no finish); the decoder aborts: the prefillers report what they posted, the fence
    counts on the adopted counter, the pages are free again."""
    cl = Cluster(provider, per_rank)
    try:
        r = cl.d.receive(cl.peer, "a", [3, 4], 8)
        waited = []
        t = threading.Thread(target=lambda: waited.append(r.wait(20)))
        t.start()
        _until(lambda: all(leg.arm is not None and leg.arm.waiting for leg in r.legs[:1]))
        qs = cl.requests(1)
        sends = [p.send(q[0], [20, 21]) for p, q in zip(cl.pre, qs)]       # no finish: no context
        _until(lambda: cl.d._node.engine.stats()["armed"] >= 1)
        assert r.state in ("pending", "transferring")
        assert r.abort(10) is True
        t.join(10)
        assert waited == ["aborted"] and r.state == "aborted" and r.fenced
        assert cl.d.stats().get("announces_armed", 0) >= 1
        for s in sends:
            s.finish()
        r2 = cl.d.receive(cl.peer, "b", [3, 4], 8)            # the pages are free again
        q2 = cl.requests(1)
        for p, q in zip(cl.pre, q2):
            p.send(q[0], [5, 6]).finish(b"x")
        assert r2.wait(10) == "done"
        cl.check([3, 4], [5, 6])
    finally:
        cl.close()


def test_a_replayed_announce_for_a_reused_imm_arms_nothing(provider):
    """The prefiller's engine replays request 1's ANNOUNCE (its real bytes: tag, seq) after the
    decoder reused request 1's imm for request 2: the engine's arm refuses it (its seq is not
    above the floor), the messenger drops it as a replay, and request 2 completes with its
    own count and bytes."""
    x = open_pair(provider)
    sent = []
    eng = x.p._node.engine
    real_send = eng.send

    def record(peer, data, *a, **kw):
        sent.append(bytes(data))
        return real_send(peer, data, *a, **kw)

    eng.send = record
    try:
        r1 = x.d.receive(x.pg, "one", [0, 1], 8)
        (q1,) = x.p.requests(timeout=5)
        s1 = x.p.send(q1, [2, 3]).finish(b"first")
        assert r1.wait(10) == "done"
        # the prefiller forgets request 1 (its imm) once its Send is reaped: only then can the
        # decoder's reuse of the imm reach it as a new request
        _until(lambda: s1.state == "done" and not x.p._requests)
        ann = [m for m in sent if C.Control.decode(m, x.d.secret).type == C.ANNOUNCE]
        assert len(ann) == 1
        old = C.Control.decode(ann[0], x.d.secret)
        assert old.imm == r1.imm
        r1.release()
        _until(lambda: not x.d._decode.armed_seqs)
        with x.d._node.lock:
            x.d._decode._next_imm = r1.imm           # the decoder's imm comes round again
        r2 = x.d.receive(x.pg, "two", [4], 4)
        assert r2.imm == r1.imm
        arm = r2.legs[0].arm
        assert arm is not None and arm.state == "open"
        (q2,) = x.p.requests(timeout=5)
        waited = []
        t = threading.Thread(target=lambda: waited.append(r2.wait(20)))
        t.start()
        _until(lambda: arm.waiting)                  # the caller waits on the arm
        real_send(x.back.peer, ann[0])               # the replay
        _until(lambda: x.d.stats().get("drop_replayed", 0) == 1)
        assert arm.state == "open" and r2.state == "pending" and not waited
        x.p.send(q2, [5]).finish(b"second")
        t.join(10)
        ann = [C.Control.decode(m, x.d.secret) for m in sent]
        ann = [m for m in ann if m.type == C.ANNOUNCE]
        assert len(ann) == 2 and ann[1].seq > old.seq
        assert waited == ["done"] and r2.expected == ann[1].count and bytes(r2.context) == b"second"
        # pages 0, 1 and 4 of 32 hold the source's bytes (7), every other byte is untouched
        total = sum(len(d) for d in x.dst)
        assert sum(int((d == 7).sum()) for d in x.dst) == 3 * total // 32
        assert sum(int((d == 0xEE).sum()) for d in x.dst) == 29 * total // 32
    finally:
        eng.send = real_send
        x.close()
