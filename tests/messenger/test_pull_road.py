"""The pull road through ``Messenger`` on both providers: ``receive(..., pull=True)`` from
prefillers made with ``offer_pull=True``; each prefill peer exposes the request's pages (EXPOSE),
the decoder reads them with the push road's plan and completes when its reads complete, then
tells every peer DONE, which alone (or the decoder's death) releases the prefiller's pages.

Byte-exact (token by token against the prefiller's logical cache, independent of the planner)
in node and per-rank mode, TP 2->1, 1->2, 4->2 with GQA and MLA, differing page sizes; poll()
reports pull receives and sends; refusals before anything is sent; bad EXPOSEs fail the
Receive with nothing read; an aborted pull (either side) releases the prefiller's pages only
once the decoder's reads are drained; kill -9 of either side during a pull."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, PeerError, RejectedError, UnsupportedError
from kvxfer.messenger import _codec as C

from _nodes import SENTINEL
from _pull_procs import big_layout, check_tokens, ctx_for, decode_proc, kill, open_set, prefill_proc, src_for, start

DEADLINE = 60.0

CASES = {
    # name: (src layout, src sharding, dst layout, dst sharding)
    "tp2to1": (KVLayout.vllm(2, 4, 8, 16, 12, "float16"), Sharding(2),
               KVLayout.vllm(2, 4, 8, 16, 12, "float16"), Sharding(1)),
    "tp1to2-nhd": (KVLayout.flash_attn(2, 4, 8, 16, 12, "float16"), Sharding(1),
                   KVLayout.vllm(2, 4, 8, 16, 12, "float16"), Sharding(2)),
    "tp4to2-gqa": (KVLayout.vllm(2, 2, 8, 16, 12, "float16"), Sharding(4),
                   KVLayout.layer_major(2, 2, 8, 16, 12, "float16", order="NHD"), Sharding(2)),
    "mla-tp2to1": (KVLayout.mla(2, 40, 16, 12, "float16"), Sharding(2, replicated=True),
                   KVLayout.mla(2, 40, 16, 12, "float16"), Sharding(1, replicated=True)),
    "mla-tp1to2": (KVLayout.mla(2, 40, 16, 12, "float16"), Sharding(1, replicated=True),
                   KVLayout.mla(2, 40, 16, 12, "float16"), Sharding(2, replicated=True)),
    "pages16to32-tp2to1": (KVLayout.vllm(2, 4, 8, 16, 12, "float16"), Sharding(2),
                           KVLayout.vllm(2, 4, 8, 32, 8, "float16"), Sharding(1)),
    "pages32to16-gqa-tp4to2": (KVLayout.vllm(2, 2, 8, 32, 8, "float16", order="NHD"), Sharding(4),
                               KVLayout.vllm(2, 2, 8, 16, 16, "float16"), Sharding(2)),
    "mla-pages8to5": (KVLayout.mla(2, 40, 8, 16, "float16"), Sharding(1, replicated=True),
                      KVLayout.mla(2, 40, 5, 24, "float16"), Sharding(2, replicated=True)),
}
#: per-rank mode runs the TP mismatches both ways and a page-size case (every messenger is a
#: set of threads: the six of 4->2 per-rank are the most these 2 cores run at once)
PER_RANK = ["tp2to1", "tp1to2-nhd", "tp4to2-gqa", "mla-tp1to2", "pages32to16-gqa-tp4to2"]


def _wait_fenced(objs, timeout=DEADLINE) -> None:
    t0 = time.monotonic()
    while not all(getattr(o, "fenced", o.done) for o in objs) and time.monotonic() - t0 < timeout:
        time.sleep(0.005)


@pytest.mark.parametrize("mode,case", [("node", c) for c in CASES] + [("per-rank", c) for c in PER_RANK])
def test_pull_byte_exact(provider, mode, case):
    sl, ss, dl, ds = CASES[case]
    ns = open_set(provider, sl, ss, dl, ds, mode)
    try:
        for m in ns.prefill + ns.decode:
            m.poll()                                  # reporting on
        rng = np.random.default_rng(3)
        free = list(rng.permutation(dl.num_pages))
        for n, tokens in enumerate([1, dl.page_size, sl.page_size + 3, 47]):
            nd = -(-tokens // dl.page_size)
            if nd > len(free) or -(-tokens // sl.page_size) > sl.num_pages:
                continue
            dp = np.array([free.pop() for _ in range(nd)], np.int64)
            rid = f"{case}-{n}"
            rs = [d.receive(pgs, rid, dp, tokens, pull=True) for d, pgs in zip(ns.decode, ns.pgs)]
            for r in rs:
                assert r.pull
                assert r.wait(DEADLINE) == "done"
                assert r.fenced                       # done: every read completed, none in flight
                assert bytes(r.context) == ctx_for(rid)
            for d in ns.decode:
                check_tokens(d.mems, ns.cache, sl, src_for(rid, tokens, sl), dl, dp, tokens,
                             tail=sl.page_size != dl.page_size)
            for r in rs:
                r.release()
        assert not ns.errors, ns.errors[0]
        # every Send is released by its decoder's DONE: done, none held
        _wait_fenced(ns.sends)
        assert ns.sends and all(s.state == "done" for s in ns.sends), [s.state for s in ns.sends]
        assert all(type(s).__name__ == "PullSend" for s in ns.sends)
        # poll() reports the pull receives (done and fenced at once) and the sends
        got_r = [x for d in ns.decode for x in d.poll()]
        got_s = [x for p in ns.prefill for x in p.poll()]
        assert {id(x) for x in got_s} == {id(s) for s in ns.sends}
        assert len(got_r) == sum(d.stats()["receives_pull"] for d in ns.decode) and all(x.pull for x in got_r)
        for d in ns.decode:
            t0 = time.monotonic()           # a DONE is counted once its send returned, maybe after it landed
            while d.stats().get("sent_DONE", 0) < d.stats()["recv_EXPOSE"] and time.monotonic() - t0 < DEADLINE:
                time.sleep(0.005)
            st = d.stats()
            assert st["receive_done"] == st["receives_pull"] and st.get("recv_ANNOUNCE", 0) == 0
            assert st["sent_DONE"] == st["recv_EXPOSE"] and st["pull_reads"] > 0
            assert d.metrics()["receives"]["done"] == st["receives_pull"]
        for p in ns.prefill:
            assert p.stats().get("send_bytes", 0) <= p.stats()["sends_pull"] * 64     # only contexts were written
    finally:
        ns.close()


def test_pull_from_a_prefiller_without_offer_pull_is_refused_before_sending(provider):
    sl, ss, dl, ds = CASES["tp2to1"]
    ns = open_set(provider, sl, ss, dl, ds, "node", offer_pull=False)
    try:
        d, pgs = ns.decode[0], ns.pgs[0]
        with pytest.raises(UnsupportedError, match="offers no pull"):
            d.receive(pgs, "no", [0], 5, pull=True)
        assert d.stats().get("sent_REQUEST", 0) == 0 and d.stats().get("receives", 0) == 0
        # a decoder that skips its own check (a crafted REQUEST) is rejected by the prefiller
        from kvxfer.messenger.decode import Leg, Receive

        r = Receive(d._decode, [Leg(pgs[0], 2**31 - 9, -1, True)], "crafted", np.array([0]), 5, -1, None)
        with d._lock:
            d._decode.receives[2**31 - 9] = r
        d._send(pgs[0], C.REQUEST, imm=2**31 - 9, num_tokens=5, slot=-1, request_id="crafted", pages=np.array([0]),
                flags=C.P.REQUEST_PULL)
        with pytest.raises(RejectedError, match="offers no pull"):
            r.wait(DEADLINE)
        # push from the same prefiller still works
        assert d.receive(pgs, "push", [1], 5).wait(DEADLINE) == "done"
    finally:
        ns.close()


def _one_pull(provider, **kw):
    sl = KVLayout.vllm(2, 4, 8, 16, 12, "float16")
    return open_set(provider, sl, Sharding(1), sl, Sharding(1), "node", **kw)


def test_a_bad_expose_fails_the_receive_and_reads_nothing(provider):
    """EXPOSEs a buggy or hostile prefiller could send: pages outside its pool, the wrong
    count, another request's id; each fails its Receive with DescriptorError, no byte of the
    decoder's pages changes, and the prefiller is told DONE (aborted). An EXPOSE of no
    request is answered DONE(aborted, unknown)."""
    ns = _one_pull(provider, serve=False)
    try:
        p, d, pg = ns.prefill[0], ns.decode[0], ns.pgs[0][0]
        back = p._peers[d.uid]
        lay = p.layout
        bad = {
            "outside": dict(pages=np.array([0, lay.num_pages]), count=1),
            "count": dict(pages=np.array([0]), count=1),              # 20 tokens need 2 pages
            "context": dict(pages=np.array([0, 1]), count=0),         # the leg holds the slot: 1
        }
        for i, (what, kw) in enumerate(bad.items()):
            r = d.receive(pg, f"bad-{what}", [2 * i, 2 * i + 1], 20, pull=True)
            req = p.requests(timeout=DEADLINE)[0]
            p._send(back, C.EXPOSE, imm=req.imm, num_tokens=20, request_id=req.request_id, **kw)
            with pytest.raises(DescriptorError, match="EXPOSE .* refused"):
                r.wait(DEADLINE)
            _wait_fenced([r])
            assert r.fenced and r.state == "failed"
        r = d.receive(pg, "bad-id", [8, 9], 20, pull=True)
        req = p.requests(timeout=DEADLINE)[0]
        p._send(back, C.EXPOSE, imm=req.imm, num_tokens=20, request_id="another", pages=np.array([0, 1]), count=1)
        with pytest.raises(DescriptorError, match="names request 'another'"):
            r.wait(DEADLINE)
        _wait_fenced([r])
        assert all((reg == SENTINEL).all() for mem in d.mems.values() for reg in mem.regions), "a bad EXPOSE was read"
        # each failed Receive tells the prefiller DONE (aborted) once fenced, from the outbox's
        # thread: wait until the four have gone out, so the count below is the unknown
        # EXPOSE's answer alone
        t0 = time.monotonic()
        while d.stats().get("sent_DONE", 0) < 4 and time.monotonic() - t0 < DEADLINE:
            time.sleep(0.01)
        before = d.stats().get("sent_DONE", 0)
        assert before == 4, d.stats()
        p._send(back, C.EXPOSE, imm=2**31 - 3, num_tokens=20, request_id="nobody", pages=np.array([0, 1]), count=0)
        t0 = time.monotonic()
        while d.stats().get("sent_DONE", 0) == before and time.monotonic() - t0 < DEADLINE:
            time.sleep(0.01)
        assert d.stats()["sent_DONE"] == before + 1 and d.stats()["drop_unknown_request"] >= 1
        # the pair still works
        r = d.receive(pg, "good", [10, 11], 20, pull=True)
        s = p.send(p.requests(timeout=DEADLINE)[0], [3, 4], context=b"x")
        assert r.wait(DEADLINE) == "done" and s.wait(DEADLINE) == "done"
    finally:
        ns.close()


def _abort_round(provider, side: str, delays) -> None:
    """A pull of a large request aborted by ``side`` at several points; the prefiller's Send
    turns final (its pages are released: rewritten here at once, in its callback) only once
    every read of the decoder's is done, and no byte of the rewrite reaches the decoder."""
    lay = KVLayout.vllm(2, 8, 64, 16, 256, "float16")            # 2 x 2 x 16 KiB a page
    sh = Sharding(1)
    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src = [np.full(s, 0x11, np.uint8) for s in lay.region_sizes(sh)]
    dst = [np.full(s, SENTINEL, np.uint8) for s in lay.region_sizes(sh)]
    p = kvxfer.Messenger(ea, lay, sh, {0: src}, peer_timeout=10, offer_pull=True)
    d = kvxfer.Messenger(eb, lay, sh, {0: dst}, peer_timeout=10)
    try:
        pg = d.connect(p.handshake(), timeout=30)
        pages = np.arange(lay.num_pages)
        mid, outcomes = 0, []
        for k, delay in enumerate(delays):
            for a in src:
                a[:] = 0x11
            for a in dst:
                a[:] = SENTINEL
            r = d.receive(pg, f"{side}{k}", pages, lay.num_pages * lay.page_size, pull=True)
            req = p.requests(timeout=DEADLINE)[0]
            seen = {}

            def released(s, r=r, seen=seen):
                seen["reads_done"] = all(t.done for leg in r.legs for t in leg.reads)
                seen["fenced"] = r.fenced
                for a in src:
                    a[:] = 0x77                       # the prefiller reuses its pages
                seen["at"] = time.monotonic()

            s = p.send(req, pages[::-1])
            s.add_done_callback(released)
            t0 = time.monotonic()
            while not any(leg.reads for leg in r.legs) and not r.done and time.monotonic() - t0 < DEADLINE:
                time.sleep(0.0001)                     # the reads are posted
            time.sleep(delay)
            in_flight = any(not t.done for leg in r.legs for t in leg.reads)
            if side == "decoder":
                ok = r.abort(timeout=DEADLINE)
                assert ok or r.state == "done", (r.state, r.error)
            elif side == "prefiller":
                s.abort(timeout=0)
            else:
                try:
                    req.reject("preempted")
                except InvalidArgumentError:          # too late: every read was done, and DONE in
                    assert s.state == "done", s.state  # before the reject (a slow round on 2 cores)
            try:
                r.wait(DEADLINE)
            except KvxferError:
                assert side != "decoder", r.error
            s.finish()                                 # too late: no context goes, nothing raises
            assert s.wait(DEADLINE) in ("done", "aborted")
            _wait_fenced([r])
            t1 = time.monotonic()
            while "at" not in seen and time.monotonic() - t1 < DEADLINE:
                time.sleep(0.001)
            assert seen["reads_done"] and seen["fenced"], f"{side} round {k}: pages released with reads in flight"
            assert s.state == ("done" if r.state == "done" else "aborted")
            if side == "reject" and r.state != "done":
                assert isinstance(r.error, RejectedError)
            elif side == "prefiller" and r.state != "done":
                assert isinstance(r.error, PeerError)
            snap = [a.copy() for a in dst]
            assert all(set(np.unique(a).tolist()) <= {0x11, SENTINEL} for a in snap), "a byte of the reuse was read"
            time.sleep(0.2)
            assert all(np.array_equal(a, b) for a, b in zip(dst, snap)), "a read landed after the release"
            mid += in_flight and r.state != "done"
            outcomes.append((delay, in_flight, r.state))
        assert p.stats().get("drop_unexpected_done", 0) == 0
        # the decoder's own abort cancels its reads at once: at least one round stopped reads in
        # flight (else the rule was never at stake); the prefiller's abort travels first, and
        # 16 MiB of reads may complete before it lands (then done, and released by DONE)
        if side == "decoder":
            assert mid, f"no round aborted with reads in flight: {outcomes}"
    finally:
        d.close()
        p.close()
        eb.close()
        ea.close()


@pytest.mark.parametrize("side", ["decoder", "prefiller", "reject"])
def test_an_aborted_pull_releases_the_pages_only_once_the_reads_are_drained(provider, side):
    _abort_round(provider, side, [0.0, 0.0, 0.0002, 0.0005, 0.002])


def test_kill_9_of_the_prefiller_during_a_pull(provider):
    """The decoder's pulls fail (never done without their bytes) and are fenced within a
    deadline; the pages of those done are byte-exact."""
    p, conn = start(prefill_proc, provider, 4.0, 0x42)
    try:
        assert conn.poll(DEADLINE), "prefiller did not start"
        st, blob, pid = conn.recv()
        assert st == "ready", blob
        lay = big_layout()
        with kvxfer.Engine(provider, "127.0.0.1") as eng:
            regions = [np.zeros(s, np.uint8) for s in lay.region_sizes(Sharding(1))]
            d = kvxfer.Messenger(eng, lay, Sharding(1), {0: regions}, peer_timeout=4.0)
            try:
                pg = d.connect(blob, timeout=30)
                n = 8
                per = lay.num_pages // n
                rs = [d.receive(pg, f"k{i}", np.arange(i * per, (i + 1) * per), per * lay.page_size, pull=True)
                      for i in range(n)]
                t0 = time.monotonic()
                while rs[0].state == "pending" and time.monotonic() - t0 < DEADLINE:
                    time.sleep(0.0002)
                kill(p)
                for r in rs:
                    try:
                        r.wait(DEADLINE)
                    except KvxferError:
                        pass
                _wait_fenced(rs)
                assert time.monotonic() - t0 < DEADLINE + 10
                states = [r.state for r in rs]
                assert all(r.done and r.fenced for r in rs), states
                assert "failed" in states, f"every pull finished before the kill: {states}"
                view = regions[0].reshape(lay.num_pages, -1)
                for i, r in enumerate(rs):
                    if r.state == "done":
                        assert (view[i * per:(i + 1) * per] == 0x42).all()
                    else:
                        assert r.error is not None
            finally:
                d.close()
    finally:
        kill(p)


def test_kill_9_of_the_decoder_during_a_pull(provider):
    """The prefiller's Sends hold their pages until the decoder is declared dead, then fail
    (released); it then serves the next decoder byte-exact."""
    lay = big_layout()
    sh = Sharding(1)
    ea = kvxfer.Engine(provider, "127.0.0.1")
    src = [np.full(s, 0x24, np.uint8) for s in lay.region_sizes(sh)]
    sends = []
    holder = []
    p = kvxfer.Messenger(ea, lay, sh, {0: src}, peer_timeout=4.0, offer_pull=True,
                         on_request=lambda req: sends.append(holder[0].send(req, np.arange(len(req.dst_pages)),
                                                                          context=None)))
    holder.append(p)
    proc = None
    try:
        proc, conn = start(decode_proc, provider, 4.0, p.handshake(), 8)
        assert conn.poll(DEADLINE), "decoder did not start reading"
        assert conn.recv() == "reading"
        kill(proc)
        held = [s for s in sends if not s.done]
        assert held, "every Send was released before the kill"
        t0 = time.monotonic()
        for s in sends:
            try:
                s.wait(DEADLINE)
            except KvxferError:
                pass
        assert time.monotonic() - t0 < DEADLINE
        assert all(s.state == "failed" and isinstance(s.error, PeerError) for s in held), [s.state for s in held]
        if provider == "shm":
            # seen 1 of 1 on shm 1.17: a fresh engine's HELLO to this exposer, whose reader was
            # killed mid-read, never completes its fi_send and the connect hangs past its timeout
            # (docs/reliability.md, finding 24's family; the engine's, not the messenger's)
            return
        with kvxfer.Engine(provider, "127.0.0.1") as eb:
            dst = [np.zeros(s, np.uint8) for s in lay.region_sizes(sh)]
            d = kvxfer.Messenger(eb, lay, sh, {0: dst}, peer_timeout=4.0)
            try:
                pg = d.connect(p.handshake(), timeout=30)
                r = d.receive(pg, "after", np.arange(lay.num_pages), lay.num_pages * lay.page_size, pull=True)
                assert r.wait(DEADLINE) == "done"
                assert all((a == 0x24).all() for a in dst)
            finally:
                d.close()
    finally:
        if proc is not None:
            kill(proc)
        p.close()
        ea.close()


@pytest.mark.parametrize("case", ["tp2to1", "pages16to32-tp2to1", "pages32to16-gqa-tp4to2"])
def test_pull_of_a_prefix_hit_reads_only_the_tokens_after_it(provider, case):
    """``receive(..., first_token=a, pull=True)``: the decoder holds tokens [0, a); its pages
    start with a's page, and exactly tokens [a, num_tokens) are read (the prefix's part of the
    first page keeps its bytes)."""
    sl, ss, dl, ds = CASES[case]
    ns = open_set(provider, sl, ss, dl, ds, "node")
    try:
        d, pgs = ns.decode[0], ns.pgs[0]
        pd, ps = dl.page_size, sl.page_size
        for n, (a, tokens) in enumerate([(5, 40), (pd, 2 * pd + 1), (pd + 3, 3 * pd)]):
            if -(-tokens // ps) > sl.num_pages:
                continue
            dp = np.arange(-(-tokens // pd) - a // pd) + 2 * n
            rid = f"prefix-{case}-{n}"
            r = d.receive(pgs, rid, dp, tokens, first_token=a, pull=True)
            assert r.wait(DEADLINE) == "done" and r.fenced
            sp = src_for(rid, tokens, sl)
            t = np.arange(a, tokens)
            for mem in d.mems.values():
                for layer in range(ns.cache.shape[0]):
                    for plane in range(ns.cache.shape[1]):
                        view = mem.page_view(layer, plane)
                        got = view[dp[t // pd - a // pd], :, t % pd]
                        want = ns.cache[layer, plane][sp[t // ps], :, t % ps][:, mem.heads]
                        assert np.array_equal(got, want), f"{rid}: layer {layer} plane {plane} differs"
                        assert (view[dp[0], :, :a % pd] == SENTINEL).all(), "a token of the prefix was read"
            r.release()
            for mem in d.mems.values():
                for reg in mem.regions:
                    reg[:] = SENTINEL
    finally:
        ns.close()


def test_closing_the_decoder_mid_pull_drains_its_reads(provider):
    """``close()`` of the decoder with a pull in flight: the Receive fails (ClosedError) and is
    fenced once its cancelled reads drained, before close returns; the prefiller's Send is
    released (the decoder's BYE: failed) and nothing holds its pages."""
    lay = KVLayout.vllm(2, 8, 64, 16, 256, "float16")
    sh = Sharding(1)
    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src = [np.full(s, 0x31, np.uint8) for s in lay.region_sizes(sh)]
    dst = [np.full(s, SENTINEL, np.uint8) for s in lay.region_sizes(sh)]
    p = kvxfer.Messenger(ea, lay, sh, {0: src}, peer_timeout=10, offer_pull=True)
    d = kvxfer.Messenger(eb, lay, sh, {0: dst}, peer_timeout=10)
    try:
        pg = d.connect(p.handshake(), timeout=30)
        r = d.receive(pg, "closing", np.arange(lay.num_pages), lay.num_pages * lay.page_size, pull=True)
        s = p.send(p.requests(timeout=DEADLINE)[0], np.arange(lay.num_pages), context=None)
        t0 = time.monotonic()
        while r.state == "pending" and time.monotonic() - t0 < DEADLINE:
            time.sleep(0.0002)
        d.close()
        assert r.done and r.fenced and all(t.done for leg in r.legs for t in leg.reads), r
        assert r.state == "done" or type(r.error).__name__ == "ClosedError"
        _wait_fenced([s])
        # released either way: done (its DONE came before the BYE) or failed by the BYE
        assert s.state == ("done" if r.state == "done" else "failed"), (r.state, s.state, s.error)
    finally:
        d.close()
        p.close()
        eb.close()
        ea.close()


def test_per_rank_kill_9_of_one_prefill_rank_during_a_pull(provider):
    """Per-rank prefill (one process per rank of TP2) and a TP1 decoder pulling from both:
    kill -9 of rank 0 mid-pull fails the pulls in flight (fenced within a deadline) and the
    live rank's Sends are released (DONE aborted, or done) only by the decoder, none left held.
    On shm 1.17 this needs the dead rank's unanswered reads answered for it (src/unblock.c;
    docs/reliability.md, finding 24): else they block the decoder engine's traffic with the
    live rank too, which then declares the silent decoder dead and fails its Sends."""
    procs = [start(prefill_proc, provider, 4.0, 0x50 + r, 2, r) for r in range(2)]
    try:
        blobs = []
        for p, conn in procs:
            assert conn.poll(DEADLINE), "prefiller did not start"
            st, blob, pid = conn.recv()
            assert st == "ready", blob
            blobs.append((blob, pid))
        lay = big_layout()
        with kvxfer.Engine(provider, "127.0.0.1") as eng:
            regions = [np.zeros(s, np.uint8) for s in lay.region_sizes(Sharding(1))]
            d = kvxfer.Messenger(eng, lay, Sharding(1), {0: regions}, peer_timeout=4.0)
            try:
                pgs = [d.connect(b, timeout=30) for b, _ in blobs]
                n = 8
                per = lay.num_pages // n
                rs = [d.receive(pgs, f"k{i}", np.arange(i * per, (i + 1) * per), per * lay.page_size, pull=True)
                      for i in range(n)]
                t0 = time.monotonic()
                while rs[0].state == "pending" and time.monotonic() - t0 < DEADLINE:
                    time.sleep(0.0002)
                kill(procs[0][0])
                for r in rs:
                    try:
                        r.wait(DEADLINE)
                    except KvxferError:
                        pass
                _wait_fenced(rs)
                states = [r.state for r in rs]
                assert all(r.done and r.fenced for r in rs), states
                assert "failed" in states, f"every pull finished before the kill: {states}"
                # the live rank: every Send settled, released by the decoder's DONE
                conn = procs[1][1]
                t1 = time.monotonic()
                while True:
                    conn.send("stats")
                    assert conn.poll(DEADLINE)
                    _, st = conn.recv()
                    settled = sum(st.get(f"send_{k}", 0) for k in ("done", "aborted", "failed"))
                    if settled == st.get("sends", 0) or time.monotonic() - t1 > DEADLINE:
                        break
                    time.sleep(0.05)
                assert settled == st["sends"] == st["sends_pull"], st          # none left held
                assert st.get("send_failed", 0) == 0 and st["recv_DONE"] == st["sends"], st
            finally:
                d.close()
        procs[1][1].send("exit")
    finally:
        for p, _ in procs:
            kill(p)


def test_metrics_count_the_pull_road(provider):
    ns = _one_pull(provider)
    try:
        d, pgs = ns.decode[0], ns.pgs[0]
        for i in range(3):
            assert d.receive(pgs, f"m{i}", [2 * i, 2 * i + 1], 20, pull=True).wait(DEADLINE) == "done"
        _wait_fenced(ns.sends)
        t0 = time.monotonic()         # a message is counted sent once its send returned, maybe after it landed
        while (d.stats().get("sent_DONE", 0) < 3 or ns.prefill[0].stats().get("sent_EXPOSE", 0) < 3) and \
                time.monotonic() - t0 < DEADLINE:
            time.sleep(0.005)
        dm, pm = d.metrics(), ns.prefill[0].metrics()
        assert dm["requests"]["pulled"] == 3 and dm["receives"]["done"] == 3
        assert dm["bytes"]["read"] == dm["bytes"]["received"] > 0          # one layer's pages, whole
        assert pm["requests"]["exposed"] == 3 and pm["sends"]["done"] == 3
        assert dm["messages"]["sent"]["DONE"] == 3 and "EXPOSE" not in pm["messages"]["received"]
        assert pm["messages"]["sent"]["EXPOSE"] == 3 and dm["messages"]["received"]["EXPOSE"] == 3
    finally:
        ns.close()
