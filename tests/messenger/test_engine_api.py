"""The engine-facing messenger API (issue 23), on both providers, in node and per-rank mode,
byte for byte: ``Messenger.poll()`` (what became final, and when pages became reusable) and
``Request.reject`` (the decoder fails with ``RejectedError``, fenced)."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import InvalidArgumentError, PeerError, RejectedError

from _api import Cluster, drain


@pytest.fixture(params=[False, True], ids=["node", "per_rank"])
def cl(request, provider):
    c = Cluster(provider, request.param)
    yield c
    c.close()


def _fenced(*rs):
    return lambda seen: all(any(x is r for x in seen) for r in rs) and all(r.fenced for r in rs)


# -- poll -------------------------------------------------------------------------------------
def test_poll_reports_receives_and_sends_once_final(cl):
    """The first poll turns reporting on; then every Receive and Send that became final
    comes back from poll() (no callbacks, no waits), each once, fenced, bytes exact."""
    d = cl.d
    assert d.poll() == [] and all(p.poll() == [] for p in cl.pre)
    dsts = {f"r{i}": np.array([2 * i, 2 * i + 1]) for i in range(6)}
    recvs = {rid: d.receive(cl.peer, rid, pages, 8) for rid, pages in dsts.items()}
    sends = []
    for rid, qs in cl.by_id().items():
        for p, q in zip(cl.pre, qs):
            sends.append(p.send(q, [20 + int(rid[1:]), 30 - int(rid[1:])]))
    for s in sends:
        s.finish()
    seen = drain(d, _fenced(*recvs.values()))
    assert len(seen) == len({id(x) for x in seen}) == len(recvs)      # final and fenced at once: once each
    for r in seen:
        assert r.state == "done" and r.t_fenced is not None and r.t_fenced >= r.t_done
    for rid, r in recvs.items():
        i = int(rid[1:])
        cl.check(dsts[rid], [20 + i, 30 - i])
    polled_sends = [x for p in cl.pre for x in drain(p, lambda s, p=p: len(s) == len(recvs))]
    assert sorted(id(x) for x in polled_sends) == sorted(id(s) for s in sends)
    assert all(s.state == "done" for s in polled_sends)
    assert d.poll() == [] and all(p.poll() == [] for p in cl.pre)


def test_poll_reports_an_abort_and_its_fence(cl):
    """A Receive aborted without waiting (``abort(timeout=0)``) comes back from poll() aborted,
    and (again, if it was not yet) once fenced; the prefiller's Send comes back aborted."""
    d = cl.d
    d.poll(), [p.poll() for p in cl.pre]
    r = d.receive(cl.peer, "ab", [4, 5], 8)
    qs = cl.requests(1)
    assert r.abort(timeout=0) in (True, False)
    seen = drain(d, _fenced(r))
    assert r.state == "aborted" and r.fenced and all(x is r for x in seen) and 1 <= len(seen) <= 2
    for p, q in zip(cl.pre, qs):
        s = p.send(q[0], [1, 2])
        s.finish()
        assert s.wait(10) == "aborted"
        assert drain(p, lambda got: len(got) == 1) == [s]
    assert cl.untouched([4, 5])
    r2 = d.receive(cl.peer, "again", [4, 5], 8)          # the pages are free again
    for p, q in zip(cl.pre, cl.requests(1)):
        p.send(q[0], [6, 7]).finish()
    assert r2.wait(10) == "done"
    cl.check([4, 5], [6, 7])


# -- reject -----------------------------------------------------------------------------------
def test_reject_before_send_fails_rejected_and_frees_the_pages(cl):
    """A request rejected before anything was sent: the Receive fails with RejectedError (not
    PeerError), carrying the reason, fenced at once; its pages take the next request."""
    d = cl.d
    d.poll()
    r = d.receive(cl.peer, "gone", [9, 10], 7)
    qs = cl.requests(1)
    qs[0][0].reject("kv evicted")
    with pytest.raises(RejectedError, match="kv evicted") as ei:
        r.wait(10)
    assert not isinstance(ei.value, PeerError)
    drain(d, _fenced(r))
    assert r.state == "failed" and cl.untouched([9, 10])
    assert qs[0][0].rejected == "kv evicted"
    for p, q in zip(cl.pre, qs):                          # too late for the others: aborted
        s = p.send(q[0], [0, 1])
        assert s.wait(10) == "aborted"
    r2 = d.receive(cl.peer, "gone-2", [9, 10], 7)
    for p, q in zip(cl.pre, cl.requests(1)):
        p.send(q[0], [3, 4]).finish()
    assert r2.wait(10) == "done"
    cl.check([9, 10], [3, 4])
    assert d.peers and all(pg.alive for pg in cl.pgs)   # a rejection is not a dead peer


def test_reject_after_posting_fences_on_what_was_posted(cl):
    """Rejected after its writes were posted (``send`` without ``finish``): the Send stops
    (aborted), the decoder fails with RejectedError and fences on the posted count; then its
    pages are reused byte for byte."""
    d = cl.d
    d.poll()
    r = d.receive(cl.peer, "late", [12, 13], 8)
    qs = cl.requests(1)
    sends = [p.send(q[0], [14, 15]) for p, q in zip(cl.pre, qs)]
    qs[0][0].reject("preempted")
    with pytest.raises(RejectedError, match="rejected"):
        r.wait(10)
    assert sends[0].wait(10) == "aborted"
    for s in sends[1:]:
        s.finish()
        assert s.wait(10) in ("aborted", "done")
    drain(d, _fenced(r))
    with pytest.raises(InvalidArgumentError, match="too late"):
        qs[0][0].reject("again")
    r2 = d.receive(cl.peer, "late-2", [12, 13], 8)
    for p, q in zip(cl.pre, cl.requests(1)):
        p.send(q[0], [16, 17]).finish()
    assert r2.wait(10) == "done"
    cl.check([12, 13], [16, 17])


def test_reject_checks_its_reason(cl):
    r = cl.d.receive(cl.peer, "why", [1], 2)
    q = cl.requests(1)[0][0]
    with pytest.raises(InvalidArgumentError):
        q.reject(b"bytes")                                   # type: ignore[arg-type]
    q.reject("")
    with pytest.raises(RejectedError):
        r.wait(10)
