"""The engine-facing messenger API (issue 23), on both providers, in node and per-rank mode,
byte for byte: ``Messenger.poll()`` (what became final, and when pages became reusable) and
``Request.reject`` (the decoder fails with ``RejectedError``, fenced)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import KVLayout, Sharding
from kvxfer.errors import InvalidArgumentError, PeerError, RejectedError

from _api import LAYOUT, Cluster, drain


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
    assert all(r.t_landed is None for r in recvs.values())       # nothing sent yet
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
        # the engine's stamp of the last leg's last write: after the request began, before
        # the messenger saw it done
        assert r.t_landed is not None and r.t_start <= r.t_landed <= r.t_done
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


def test_poll_with_a_timeout_waits_for_the_first_report(cl):
    """``poll(timeout)`` with nothing to report waits, and returns the Receive the moment it
    is final and fenced (well inside a 30 s timeout, bytes exact); with nothing coming it
    returns ``[]`` after the timeout; a bad timeout is refused before anything is taken."""
    d = cl.d
    d.poll()
    t0 = time.monotonic()
    assert d.poll(0.05) == [] and time.monotonic() - t0 >= 0.05
    r = d.receive(cl.peer, "w", [3, 9], 8)
    qs = cl.requests(1)
    for p, q in zip(cl.pre, qs):
        p.send(q[0], [11, 12]).finish()
    seen: list = []
    t0 = time.monotonic()
    while not (r in seen and r.fenced) and time.monotonic() - t0 < 30:
        seen += d.poll(30)
    assert r in seen and r.state == "done" and r.fenced and time.monotonic() - t0 < 30
    cl.check([3, 9], [11, 12])
    for bad in (-1, float("nan"), float("inf"), 1e12):
        with pytest.raises(InvalidArgumentError):
            d.poll(bad)
    for bad in (None, "1", True):
        with pytest.raises(TypeError):
            d.poll(bad)


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
    with pytest.raises(RejectedError, match=r"rejected .* after posting .*: preempted$"):   # the reason travels
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


# -- prefix hits and meta ---------------------------------------------------------------------
@pytest.mark.parametrize("first", [8, 9, 3, 21])
def test_prefix_hit_moves_only_the_tokens_asked(cl, first):
    """``first_token`` aligned (8) and not (9, 3, 21: inside the last page): the decoder's
    pages cover ``[first, 22)``, get exactly those tokens, and the prefix's part of the first
    page stays untouched; ``meta`` reaches every prefill rank as ``Request.meta``."""
    n, ps = 22, 4
    dst = np.arange(10, 10 + (-(-n // ps) - first // ps))
    src = np.array([25, 3, 17, 8, 30, 1])
    r = cl.d.receive(cl.peer, f"pfx{first}", dst, n, first_token=first, meta=b"engine-req-7\x00")
    assert r.first_token == first and r.meta == b"engine-req-7\x00"
    for p, q in zip(cl.pre, cl.requests(1)):
        assert q[0].first_token == first and q[0].meta == b"engine-req-7\x00" and q[0].num_tokens == n
        p.send(q[0], src).finish()
    assert r.wait(10) == "done"
    cl.check(dst, src, num_tokens=n, first_token=first)


def test_receive_checks_tokens_pages_and_meta(cl):
    """Too few or too many pages for ``num_tokens`` (from ``first_token``), a bad prefix
    range, and bad ``meta`` (bytes, at most MAX_META) are refused before anything is sent."""
    from kvxfer.messenger import _codec as C

    d = cl.d
    bad = [dict(dst_pages=[0, 1], num_tokens=9), dict(dst_pages=[0, 1], num_tokens=9, first_token=3),
           dict(dst_pages=[0], num_tokens=0), dict(dst_pages=[0], num_tokens=4, first_token=4),
           dict(dst_pages=[0, 1], num_tokens=13, first_token=4), dict(dst_pages=[0], num_tokens=4, first_token=-1),
           dict(dst_pages=[0], num_tokens=4, meta="str"), dict(dst_pages=[0], num_tokens=4, meta=b"x" * (C.MAX_META + 1)),
           dict(dst_pages=[0], num_tokens=4, first_token=1.0), dict(dst_pages=[0, 1, 2], num_tokens=8),
           dict(dst_pages=[0, 1], num_tokens=8, first_token=4), dict(dst_pages=[0, 1], num_tokens=3)]
    for kw in bad:
        with pytest.raises(InvalidArgumentError):
            d.receive(cl.peer, "bad", **kw)
    assert d.stats().get("sent_REQUEST", 0) == 0 and not d._busy_pages.any()
    r = d.receive(cl.peer, "ok", [0, 1], 5, meta=bytearray(b"m" * C.MAX_META))
    for p, q in zip(cl.pre, cl.requests(1)):
        assert q[0].meta == b"m" * C.MAX_META
        p.send(q[0], [2, 3]).finish()
    assert r.wait(10) == "done"


@pytest.mark.parametrize("first", [0, 4, 5])
def test_send_refuses_other_source_page_counts(cl, first):
    """The prefiller's send() takes exactly the pages the request's tokens fill
    (``ceil(num_tokens / page_size)``, also with a prefix hit): more or fewer is a PlanError
    before anything is posted (the request stays open), and the right count then serves."""
    from kvxfer.errors import PlanError

    n = 8
    dst = [6, 7][first // 4:]
    r = cl.d.receive(cl.peer, f"src{first}", dst, n, first_token=first)
    for p, q in zip(cl.pre, cl.requests(1)):
        for bad in ([1, 2, 3], [1]):
            with pytest.raises(PlanError, match="fill exactly 2"):
                p.send(q[0], bad)
            assert q[0].send is None
        chunked = p.send(q[0], chunked=True)
        with pytest.raises(PlanError, match="the request has 2"):
            chunked.add([1, 2, 3], n)
        chunked.add([1, 2], n).finish()
    assert r.wait(10) == "done"
    cl.check(dst, [1, 2], num_tokens=n, first_token=first)


# -- non-blocking connect ---------------------------------------------------------------------
def test_connect_without_waiting_queues_requests_until_up(provider):
    """``connect(wait=False)`` returns a connecting group at once; a receive() on it queues
    the REQUEST, sent once the group is up; bytes exact, in node and per-rank mode (a fresh
    decoder connecting to the instance)."""
    import kvxfer
    from _api import DST_SH, FILL, LAYOUT, ref

    for per_rank in (False, True):
        cl = Cluster(provider, per_rank)
        e = kvxfer.Engine(provider, "127.0.0.1")
        mem = ref.RankMemory(LAYOUT, DST_SH, 0, fill=FILL)
        d2 = kvxfer.Messenger(e, LAYOUT, DST_SH, {0: mem.regions}, peer_timeout=5)
        try:
            pgs = [d2.connect(p.handshake(), wait=False) for p in cl.pre]
            assert all(pg.state in ("connecting", "up") for pg in pgs)
            r = d2.receive(pgs if per_rank else pgs[0], "nb", [3, 4], 8, meta=b"q")
            for p, q in zip(cl.pre, cl.requests(1)):
                assert q[0].meta == b"q"
                p.send(q[0], [7, 9]).finish()
            assert r.wait(10) == "done" and all(pg.state == "up" for pg in pgs)
            cl.mem = mem
            cl.check([3, 4], [7, 9])
        finally:
            d2.close()
            e.close()
            cl.close()


def test_connect_without_waiting_fails_queued_requests(provider):
    """A connect(wait=False) nobody answers turns ``failed`` after its timeout; the Receive
    queued on it fails with the connect's PeerError, fenced (nothing was sent), its pages free;
    an abort of a queued Receive is fenced at once."""
    import kvxfer
    from _api import DST_SH, FILL, LAYOUT, SRC_SH, ref

    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src = kvxfer.Messenger(ea, LAYOUT, SRC_SH, {r: ref.RankMemory(LAYOUT, SRC_SH, r, fill=1).regions for r in (0, 1)},
                           peer_timeout=5)
    blob = src.handshake()
    src.close()                                   # its engine stays: HELLOs go nowhere
    d = kvxfer.Messenger(eb, LAYOUT, DST_SH, {0: ref.RankMemory(LAYOUT, DST_SH, 0, fill=FILL).regions},
                         peer_timeout=5)
    try:
        d.poll()
        pg = d.connect(blob, timeout=0.5, wait=False)
        assert pg.state == "connecting"
        r = d.receive(pg, "never", [1, 2], 8)
        r2 = d.receive(pg, "abort-me", [5], 4)
        assert r2.abort(timeout=0) is True and r2.fenced and r2.state == "aborted"
        with pytest.raises(PeerError, match="did not answer"):
            r.wait(10)
        assert pg.state == "failed" and r.fenced and isinstance(pg.error, PeerError)
        assert d.stats().get("sent_REQUEST", 0) == 0
        with pytest.raises(PeerError, match="did not answer"):
            d.receive(pg, "after", [1, 2], 8)
        seen = drain(d, _fenced(r, r2))
        assert len(seen) == 2
    finally:
        d.close()
        eb.close()
        ea.close()


# -- one-shot and chunked sends ---------------------------------------------------------------
def test_one_shot_send_finishes(cl):
    """``send(request, src_pages, context=...)`` posts and finishes in one call; context and
    pages arrive exact; too much context is refused before anything is posted."""
    r = cl.d.receive(cl.peer, "one", [6, 7, 8], 10)
    qs = cl.requests(1)
    for p, q in zip(cl.pre, qs):
        with pytest.raises(InvalidArgumentError, match="exceeds"):
            p.send(q[0], [1, 2, 3], context=b"x" * 33)
        assert q[0].send is None                     # nothing posted, the request still open
        s = p.send(q[0], [1, 2, 3], context=b"ctx-one")
        assert s.wait(10) == "done"
    assert r.wait(10) == "done" and bytes(r.context) == b"ctx-one"
    cl.check([6, 7, 8], [1, 2, 3])
    r2 = cl.d.receive(cl.peer, "none", [9], 4)
    for p, q in zip(cl.pre, cl.requests(1)):
        assert p.send(q[0], [5], context=None).wait(10) == "done"
    assert r2.wait(10) == "done" and bytes(r2.context) == b""


@pytest.mark.parametrize("first", [0, 4, 6])
def test_chunked_adds_post_as_computed(cl, first):
    """``send(request)`` then ``add(src_pages so far, end_token)`` per chunk (chunk ends on
    and off page boundaries, a prefix hit aligned or not): the pages a chunk completes land
    before the last chunk is added; the last announces the total; bytes exact."""
    n = 23
    npages = -(-n // 4)
    dst = np.arange(12, 12 + npages - first // 4)
    src = np.array([30, 2, 28, 4, 26, 6])
    r = cl.d.receive(cl.peer, f"chunks{first}", dst, n, first_token=first)
    qs = cl.requests(1)
    sends = [p.send(q[0], chunked=True) for p, q in zip(cl.pre, qs)]
    ends = [5, 8, 13, 20, 23]
    for i, end in enumerate(ends):
        known = src[:-(-end // 4)]
        for s in sends:
            assert s.add(known, end) is s
        if i == 2:                # tokens [first, 12) land before the last chunk is added
            with pytest.raises(InvalidArgumentError, match="last chunk"):
                sends[0].finish()
            deadline = time.monotonic() + 10
            while True:
                try:
                    cl.check(dst, src, num_tokens=12, first_token=first)
                    break
                except AssertionError:
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
    for s in sends:
        with pytest.raises(InvalidArgumentError, match="last chunk"):
            s.add(src, n)
        s.finish(b"c")
    assert r.wait(10) == "done"
    cl.check(dst, src, num_tokens=n, first_token=first)
    assert all(s.wait(10) == "done" for s in sends)


def test_chunked_add_refusals_and_abort(cl):
    """add() on a Send with pages, a chunk not starting where the last ended, or changed
    source pages is refused before posting; the decoder's abort between chunks stops the
    Send (aborted) and fences on what was posted; its pages then serve byte-exact."""
    from kvxfer.errors import PlanError

    r = cl.d.receive(cl.peer, "ab-chunks", [0, 1, 2, 3], 16)
    qs = cl.requests(1)
    sends = [p.send(q[0], chunked=True) for p, q in zip(cl.pre, qs)]
    s = sends[0]
    with pytest.raises(InvalidArgumentError):
        s.add([1, 2], 0)
    with pytest.raises(InvalidArgumentError):
        s.add([1, 2], 17)
    for x in sends:
        x.add([5, 6], 8)
    with pytest.raises(PlanError, match="changed"):
        s.add([9, 6, 7], 12)
    with pytest.raises(PlanError):
        s.add([5], 12)
    with pytest.raises(InvalidArgumentError, match="chunked"):
        cl.pre[0].send(qs[0][0], chunked=True, context=b"")
    with pytest.raises(PlanError, match="src_pages"):
        cl.pre[0].send(qs[0][0])
    assert r.abort(10) is True and r.state == "aborted" and r.fenced
    for x in sends:
        assert x.wait(10) == "aborted"
        assert x.add([5, 6, 7, 8], 16) is x and x.state == "aborted"     # stopped: nothing posted
    r2 = cl.d.receive(cl.peer, "ab-chunks-2", [0, 1, 2, 3], 16)
    for p, q in zip(cl.pre, cl.requests(1)):
        p.send(q[0], [10, 11, 12, 13], context=b"")
    assert r2.wait(10) == "done"
    cl.check([0, 1, 2, 3], [10, 11, 12, 13])
    r3 = cl.d.receive(cl.peer, "full", [20], 4)             # a Send with its pages takes no add()
    full = [p.send(q[0], [21]) for p, q in zip(cl.pre, cl.requests(1))]
    with pytest.raises(InvalidArgumentError, match="without src_pages"):
        full[0].add([21], 4)
    for x in full:
        x.finish()
    assert r3.wait(10) == "done"


@pytest.mark.parametrize("n, first, pages", [(9, 0, [1, 2]), (13, 4, [1, 2]), (4, 4, [1]), (0, 0, [1]),
                                             (4, 0, [1, 2]), (8, 5, [1, 2])])
def test_prefiller_checks_tokens_against_pages_too(provider, n, first, pages):
    """A REQUEST crafted past receive()'s checks (9 tokens into 2 pages of 4, a prefix range
    that needs more pages, an empty range, and more pages than the tokens fill: 4 tokens into
    2 pages, [5, 8) into 2) is refused by the prefiller: RejectedError, nothing written."""
    from kvxfer.messenger import _codec as C
    from kvxfer.messenger.decode import Leg, Receive

    cl = Cluster(provider, False)
    try:
        d, pg = cl.d, cl.pgs[0]
        imm = 2**31 - 7
        r = Receive(d._decode, [Leg(pg, imm, -1)], "crafted", np.array(pages), max(n, 1), -1, None)
        with d._lock:
            d._decode.receives[imm] = r
        d._send(pg, C.REQUEST, imm=imm, num_tokens=n, slot=-1, request_id="crafted", pages=np.array(pages),
                first_token=first)
        with pytest.raises(RejectedError, match="do not fill exactly"):
            r.wait(10)
        assert cl.untouched(pages)
        assert cl.pre[0].stats().get("drop_bad_request") == 1 and cl.pre[0].requests(timeout=0.1) == []
    finally:
        cl.close()


@pytest.mark.parametrize("first", [4, 6])
def test_streamed_prefix_hit_moves_only_the_tokens_asked(cl, first):
    """A prefix request streamed layer by layer (stream + schedule, two chunks, each rank's
    own counter): only tokens [first, num_tokens) are written, aligned or not."""
    n = 18
    dst = np.arange(20, 20 + (-(-n // 4) - first // 4))
    src = np.array([9, 8, 7, 6, 5])
    r = cl.d.receive(cl.peer, f"spfx{first}", dst, n, first_token=first)
    qs = cl.requests(1)
    sends = [p.stream(q[0], src[:2]) for p, q in zip(cl.pre, qs)]
    for a, b in ((0, 8), (8, n)):
        for p, s in zip(cl.pre, sends):
            p.schedule([(s, a, b, src[:-(-b // 4)])])
            for _ in range(LAYOUT.num_layers):
                p.layer_counter.bump()
    for s in sends:
        s.finish(b"s")
    assert r.wait(10) == "done" and all(s.wait(10) == "done" for s in sends)
    cl.check(dst, src, num_tokens=n, first_token=first)


# -- replicated (MLA) sources ------------------------------------------------------------------
MLA = KVLayout.mla(2, 16, 4, 32, "float16")


@pytest.mark.parametrize("per_rank", [False, True], ids=["node", "per_rank"])
@pytest.mark.parametrize("n, ends", [(24, (5, 8, 17, 24)), (7, (3, 7)), (4, (1, 4)), (9, (9,))])
def test_chunked_adds_from_replicated_mla_sources(provider, per_rank, n, ends):
    """Chunked ``add()`` from an MLA source replicated over TP2 (the latent is the same on
    both ranks; the owners of a request's pages are drawn per request): every token exact on
    the decoder, each leg's count exact (done, nothing fenced late), in node and per-rank mode
    (per-rank: only the ranks the draw picks get the REQUEST and post)."""
    cl = Cluster(provider, per_rank, layout=MLA, src_sharding=Sharding(2, replicated=True),
                 dst_sharding=Sharding(1, replicated=True))
    try:
        dst = np.arange(3, 3 + -(-n // 4))
        src = np.array([30, 1, 29, 2, 28, 3, 27][:len(dst)])
        r = cl.d.receive(cl.peer, f"mla{n}", dst, n)
        got = cl.by_id()
        (qs,) = got.values()
        sends = [(p, q) for p, q in zip(cl.pre, qs) if q is not None]
        assert len(sends) == len(r.legs) >= 1
        chunked = [p.send(q, chunked=True) for p, q in sends]
        for end in ends:
            for s in chunked:
                s.add(src[:-(-end // 4)], end)
        for s in chunked:
            s.finish(b"mla")
        assert r.wait(10) == "done" and bytes(r.context) == b"mla"
        assert all(s.wait(10) == "done" for s in chunked)
        cl.check(dst, src)
    finally:
        cl.close()


def test_chunked_adds_from_tp8_replicated_mla_per_rank(provider):
    """TP8 replicated MLA prefill, per-rank (DeepSeek's shape) -> TP1: 3 pages, chunks
    completing 2 pages then 1. The request's draw over 3 pages picks 3 of the 8 candidates;
    a draw over the first chunk's 2 pages alone would pick owners {0, 4} of the same
    permutation, and candidate 4 never got the REQUEST: each chunk's pages go to the owners
    of the whole request's draw (PageTemplate.assign_part)."""
    cl = Cluster(provider, True, layout=MLA, src_sharding=Sharding(8, replicated=True),
                 dst_sharding=Sharding(1, replicated=True))
    try:
        n, dst, src = 12, np.array([3, 4, 5]), np.array([30, 1, 29])
        r = cl.d.receive(cl.peer, "mla-tp8", dst, n)
        (qs,) = cl.by_id().values()
        chunked = [p.send(q, chunked=True) for p, q in zip(cl.pre, qs) if q is not None]
        for end in (8, 12):
            for s in chunked:
                s.add(src[:-(-end // 4)], end)
        for s in chunked:
            s.finish(b"tp8")
        assert r.wait(10) == "done"                # was PeerError: "announced 1 writes ... not 2 to 769"
        cl.check(dst, src)
    finally:
        cl.close()


@pytest.mark.parametrize("tp", [4, 8])
def test_chunked_adds_with_a_prefix_hit_from_replicated_mla_per_rank(provider, tp):
    """TP4 / TP8 replicated MLA per-rank -> TP1 with a prefix hit (the token path): chunks
    ending at tokens 9, 17 and 24 of a 24-token request whose first 4-6 tokens the decoder
    holds. Each chunk's plan deals replicas over the whole request's pages (plan's
    ``replica_span``): before, a chunk's own draw gave pages to ranks the request never asked
    and the decoder tore the peer down (it announced fewer writes). Byte-exact."""
    cl = Cluster(provider, True, layout=MLA, src_sharding=Sharding(tp, replicated=True),
                 dst_sharding=Sharding(1, replicated=True))
    try:
        ps = MLA.page_size
        for k, first in enumerate((4, 5, 6)):
            n = 24
            src = np.array([30, 1, 29, 7, 8, 9])
            dst = np.arange(10, 10 + len(src) - first // ps) + 8 * k
            r = cl.d.receive(cl.peer, f"pfx-tp{tp}-{first}", dst, n, first_token=first)
            (qs,) = cl.by_id().values()
            chunked = [p.send(q, chunked=True) for p, q in zip(cl.pre, qs) if q is not None]
            for end in (9, 17, 24):
                for s in chunked:
                    s.add(src[:-(-end // ps)], end)
            for s in chunked:
                s.finish(b"pfx")
            assert r.wait(10) == "done"
            cl.check(dst, src, num_tokens=n, first_token=first)
            r.release()
    finally:
        cl.close()
