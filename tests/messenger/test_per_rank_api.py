"""Per-rank messengers in one process over real engines: the decoder's prefill instance checked
up front, the context written by exactly one rank, per-rank streaming (each rank's own layer
counter), replicas spread per request id; the planner twins the messenger relies on
(``writing_ranks``, ``PageTemplate``) against ``plan``; and issue 26's item 6 (what a restarted
peer's connect raises, ``recv_*`` counting only accepted messages)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer import KVLayout, Sharding
from kvxfer.errors import DescriptorError, InvalidArgumentError, LayoutError, PeerError
from kvxfer.messenger import _codec as C
from kvxfer.planner import PageTemplate, chooses_replicas, plan, writing_ranks

from _nodes import context_for, logical, scatter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
import _planner_ref as ref  # noqa: E402
from test_planner import configs  # noqa: E402


class Instance:
    """A per-rank prefill instance (one engine and messenger per rank) and a decoder, in one
    process; every byte of the source from ``logical``; ``close()`` closes all."""

    def __init__(self, provider, sl, ss, dl, ds, *, decode_ranks=None, **dkw):
        self.sl, self.dl = sl, dl
        self.cache = logical(sl, 5)
        self.engines, self.pre, self.src = [], [], []
        for r in range(ss.tp_size):
            e = kvxfer.Engine(provider, "127.0.0.1")
            mem = ref.RankMemory(sl, ss, r, fill=0)
            scatter(mem, self.cache)
            self.engines.append(e)
            self.src.append(mem)
            self.pre.append(kvxfer.Messenger(e, sl, ss, {r: mem.regions}, peer_timeout=5))
        e = kvxfer.Engine(provider, "127.0.0.1")
        self.engines.append(e)
        ranks = decode_ranks or list(range(ds.tp_size))
        self.mems = {r: ref.RankMemory(dl, ds, r, fill=0xEE) for r in ranks}
        self.d = kvxfer.Messenger(e, dl, ds, {r: m.regions for r, m in self.mems.items()}, peer_timeout=5, **dkw)
        self.pgs = [self.d.connect(p.handshake()) for p in self.pre]

    def check(self, dst_pages, src_pages):
        for mem in self.mems.values():
            for layer in range(self.cache.shape[0]):
                for plane in range(self.cache.shape[1]):
                    got = mem.page_view(layer, plane)[dst_pages]
                    want = self.cache[layer, plane][src_pages][:, mem.heads]
                    assert np.array_equal(got, want), (layer, plane, mem.heads)

    def requests(self, n, ranks=None, timeout=10):
        """The requests each of ``ranks`` (default all) received, ``n`` each, by rank."""
        out = {}
        deadline = time.monotonic() + timeout
        for i in ranks if ranks is not None else range(len(self.pre)):
            p = self.pre[i]
            got = []
            while len(got) < n and time.monotonic() < deadline:
                got += p.requests(timeout=0.05)
            out[i] = got
        return out

    def close(self):
        self.d.close()
        for p in self.pre:
            p.close()
        for e in self.engines:
            e.close()


L4 = KVLayout.vllm(2, 4, 8, 4, 32, "float16")


def test_receive_refuses_bad_instances_up_front(provider):
    """A sequence that misses a needed source rank, names a peer twice, holds a rank twice, is
    empty, or mixes layouts is refused before anything is sent."""
    inst = Instance(provider, L4, Sharding(2), L4, Sharding(1))
    e2 = kvxfer.Engine(provider, "127.0.0.1")
    other = kvxfer.Messenger(e2, KVLayout.vllm(2, 4, 8, 4, 48, "float16"), Sharding(2),
                             {1: ref.RankMemory(KVLayout.vllm(2, 4, 8, 4, 48, "float16"), Sharding(2), 1, fill=0).regions},
                             peer_timeout=5)
    e3 = kvxfer.Engine(provider, "127.0.0.1")
    node = kvxfer.Messenger(e3, L4, Sharding(2), {r: ref.RankMemory(L4, Sharding(2), r, fill=0).regions for r in (0, 1)},
                            peer_timeout=5)
    try:
        d, (pg0, pg1) = inst.d, inst.pgs
        pgo, pgn = d.connect(other.handshake()), d.connect(node.handshake())
        with pytest.raises(LayoutError, match=r"source rank\(s\) \[1\]"):
            d.receive(pg0, "a", [0], 1)
        with pytest.raises(LayoutError, match=r"\[0\]"):
            d.receive([pg1], "a", [0], 1)
        with pytest.raises(InvalidArgumentError, match="twice"):
            d.receive([pg0, pg0], "a", [0], 1)
        with pytest.raises(InvalidArgumentError, match="held by two"):
            d.receive([pgn, pg1], "a", [0], 1)
        with pytest.raises(InvalidArgumentError):
            d.receive([], "a", [0], 1)
        with pytest.raises(InvalidArgumentError):
            d.receive([pg0, "pg1"], "a", [0], 1)
        with pytest.raises(LayoutError, match="not one prefill instance"):
            d.receive([pg0, pgo], "a", [0], 1)
        assert d.stats().get("sent_REQUEST", 0) == 0 and not d._busy_pages.any() and not d._rids
        r = d.receive([pg1, pg0], "ok", [0], 1)           # any order: legs by lowest rank
        assert [leg.peer for leg in r.legs] == [pg0, pg1]
        qs = inst.requests(1)
        inst.pre[0].send(qs[0][0], [3]).finish()
        inst.pre[1].send(qs[1][0], [3]).finish()
        assert r.wait(10) == "done"
        inst.check(np.array([0]), np.array([3]))
    finally:
        node.close()
        other.close()
        e3.close()
        e2.close()
        inst.close()


def test_context_from_one_rank_and_per_rank_streaming(provider):
    """TP2 per-rank -> TP1: the context slot goes to the leg of the lowest writing rank only
    (its count has the context's +1, the other's not); each rank announces its own exact
    count; then a streamed request, each rank bumping its own layer counter."""
    inst = Instance(provider, L4, Sharding(2), L4, Sharding(1), context_slots=4, context_bytes=32)
    try:
        d, pgs = inst.d, inst.pgs
        r = d.receive(pgs, "ctx", [1, 2], 7)
        qs = inst.requests(1)
        q0, q1 = qs[0][0], qs[1][0]
        assert q0.slot >= 0 and q1.slot == -1
        ctx = context_for("ctx", 32)
        s1 = inst.pre[1].send(q1, [4, 5]).finish(ctx)       # ignored: rank 0 writes the context
        s0 = inst.pre[0].send(q0, [4, 5]).finish(ctx)
        assert r.wait(10) == "done"
        assert [leg.announced for leg in r.legs] == [s0.num_writes, s1.num_writes]
        assert r.expected == s0.num_writes + s1.num_writes == r.arrived
        assert bytes(r.context) == ctx
        inst.check(np.array([1, 2]), np.array([4, 5]))
        r.release()
        # streaming: every rank process has its own counter and watcher, bumped by its own model
        r = d.receive(pgs, "stream", [5, 6, 7], 10)
        qs = inst.requests(1)
        sends = [inst.pre[i].stream(qs[i][0], [0, 1, 2]) for i in (0, 1)]
        for s in sends:
            s.finish(b"streamed")
        passes = [inst.pre[i].schedule([(sends[i], 0, 10)]) for i in (0, 1)]
        for i in (0, 1):
            lc = inst.pre[i].layer_counter
            assert lc is not inst.pre[1 - i].layer_counter
            for _ in range(L4.num_layers):
                lc.bump()
        assert r.wait(10) == "done" and all(s.wait(10) == "done" for s in sends)
        assert all(p.layers_done == L4.num_layers for p in passes)
        assert bytes(r.context) == b"streamed"
        inst.check(np.array([5, 6, 7]), np.array([0, 1, 2]))
    finally:
        inst.close()


def test_replicas_spread_per_request(provider):
    """MLA TP2 (replicated) per-rank -> TP1: every one-page request is written by exactly one
    rank, chosen per request id, and over many requests both ranks write; byte-exact."""
    sl = KVLayout.mla(2, 16, 4, 64, "float16")
    inst = Instance(provider, sl, Sharding(2, replicated=True), KVLayout.mla(2, 16, 4, 96, "float16"), Sharding(1))
    try:
        d, pgs = inst.d, inst.pgs
        writers = []
        for i in range(24):
            r = d.receive(pgs, f"m{i}", [i], 3)
            assert len(r.legs) == 1
            k = pgs.index(r.legs[0].peer)
            writers.append(k)
            (q,) = inst.requests(1, [k])[k]
            # the public seed an engine routing requests to ranks itself draws owners with
            assert q.replica_seed == kvxfer.planner.request_seed(C.encode_request_id(f"m{i}"))
            inst.pre[k].send(q, [i % 8]).finish()
            assert r.wait(10) == "done"
            inst.check(np.array([i]), np.array([i % 8]))
            again = writing_ranks(sl, Sharding(2, replicated=True), inst.dl, Sharding(1), [0], 1,
                                  seed=kvxfer.planner.request_seed(C.encode_request_id(f"m{i}")))
            assert again == (k,)                          # deterministic per request id
        assert 0 < sum(writers) < len(writers), writers
    finally:
        inst.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_writing_ranks_and_page_template_twin_plan(cfg, data):
    """``writing_ranks`` names exactly the source ranks ``plan`` has write to the given
    destination ranks; a ``PageTemplate`` of some source ranks moves the same bytes from the
    same places as ``plan``'s writes of those ranks."""
    (sl, ss), (dl, ds), sp, dp, _, seed = cfg
    p = plan(sl, ss, dl, ds, sp, dp, seed=seed)
    dranks = data.draw(st.sets(st.integers(0, ds.tp_size - 1), min_size=1))
    assert writing_ranks(sl, ss, dl, ds, dranks, len(sp), seed=seed) == tuple(sorted(
        {s for s, d in p.pairs if d in dranks}))
    if chooses_replicas(sl, ss):
        return
    sranks = data.draw(st.sets(st.integers(0, ss.tp_size - 1), min_size=1))
    t = PageTemplate(sl, ss, dl, ds, sranks, dranks)
    a, b = t.by_source(np.asarray(sp, np.int64), np.asarray(dp, np.int64))

    def runs(rows):       # (src region, dst region, src - dst) -> merged src intervals
        out = {}
        for sr, dr, so, do, ln in rows:
            out.setdefault((sr, dr, so - do), []).append((so, so + ln))
        for k, iv in out.items():
            iv.sort()
            merged = [list(iv[0])]
            for x, y in iv[1:]:
                if x <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], y)
                else:
                    merged.append([x, y])
            out[k] = merged
        return out

    got = []
    for i, (s, d, regs, *_) in enumerate(t.pairs):
        so, do, ln, counts = t.pair_writes(i, a, b)
        j = np.repeat(np.arange(len(regs)), counts)
        got += [(regs[x][0], regs[x][1], int(u), int(v), int(w)) for x, u, v, w in zip(j, so, do, ln)]
    want = []
    for s, d in p.pairs:
        if s in sranks and d in dranks:
            w = p.writes(s, d)
            want += list(zip(w.src_region.tolist(), w.dst_region.tolist(), w.src_offset.tolist(),
                             w.dst_offset.tolist(), w.length.tolist()))
    assert runs(got) == runs(want)


# -- issue 26, item 6: docs and code agree ---------------------------------------------------------

def test_restarted_peer_connect_raises_what_the_docs_say(provider):
    """A peer restarted at an address the other side still knows under an older messenger
    (no BYE): the restarted side's connect() raises PeerError (its HELLO is dropped as
    ``drop_bad_handshake``), the surviving side's connect() of the new blob raises
    DescriptorError, as docs/messenger.md says."""
    with kvxfer.Engine(provider, "127.0.0.1") as ea, kvxfer.Engine(provider, "127.0.0.1") as eb:
        lay = L4
        d = kvxfer.Messenger(eb, lay, Sharding(1), {0: ref.RankMemory(lay, Sharding(1), 0, fill=0).regions}, peer_timeout=5)
        p = kvxfer.Messenger(ea, lay, Sharding(1), {0: ref.RankMemory(lay, Sharding(1), 0, fill=0).regions}, peer_timeout=5)
        p2 = None
        try:
            d.connect(p.handshake())
            p2 = kvxfer.Messenger(ea, lay, Sharding(1), {0: ref.RankMemory(lay, Sharding(1), 0, fill=0).regions},
                                  peer_timeout=5)
            with pytest.raises(PeerError, match="did not answer the handshake"):
                p2.connect(d.handshake(), timeout=0.5)
            assert d.stats().get("drop_bad_handshake", 0) >= 1
            with pytest.raises(DescriptorError, match="address of peer"):
                d.connect(p2.handshake())
        finally:
            if p2 is not None:
                p2.close()
            p.close()
            d.close()


def test_recv_counts_only_accepted_messages(provider):
    """A replayed authentic REQUEST is dropped (``drop_replayed``) and not counted as
    ``recv_REQUEST``, which counts only the messages acted on."""
    with kvxfer.Engine(provider, "127.0.0.1") as ea, kvxfer.Engine(provider, "127.0.0.1") as eb:
        lay = L4
        secret = b"test-secret-0123456789"
        p = kvxfer.Messenger(ea, lay, Sharding(1), {0: ref.RankMemory(lay, Sharding(1), 0, fill=0).regions},
                             peer_timeout=5, secret=secret)
        d = kvxfer.Messenger(eb, lay, Sharding(1), {0: ref.RankMemory(lay, Sharding(1), 0, fill=0).regions},
                             peer_timeout=5, secret=secret)
        try:
            pg = d.connect(p.handshake())
            r = d.receive(pg, "one", [0], 1)
            (q,) = p.requests(timeout=5)
            # authentic bytes with an old seq (1 was d's HELLO): a replay
            to_p = pg.peer
            raw = C.Control(C.REQUEST, d.uid, p.uid, 1, imm=r.imm, num_tokens=1, slot=-1, request_id="one",
                            pages=np.array([0])).encode(secret)
            eb.send(to_p, raw)
            deadline = time.monotonic() + 10
            while p.stats().get("drop_replayed", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            st = p.stats()
            assert st.get("drop_replayed") == 1 and st.get("recv_REQUEST") == 1, st
            p.send(q, [1]).finish()
            assert r.wait(10) == "done"
        finally:
            d.close()
            p.close()


def test_one_storage_with_layers_as_offsets(provider):
    """A rank whose layers are views into one storage (as vLLM allocates them, padded between
    layers) registers that storage once: a layer-major layout whose ``layer_stride`` is the
    distance between layers names each layer as an offset inside the one region. TP2
    per-rank -> TP1 one region per layer, byte-exact."""
    # a rank's layer: K and V of 8 pages x 2 heads x 4 tokens x 8 dims fp16 = 2 KiB, every 8 KiB
    sl = KVLayout(3, 4, 8, 4, 8, "float16", "HND", "stacked", "layer_major", layer_stride=8192)
    inst = Instance(provider, sl, Sharding(2), KVLayout.vllm(3, 4, 8, 4, 16, "float16"), Sharding(1))
    try:
        for r, p in enumerate(inst.pre):
            assert len(p._local[r].regions) == 1           # one registration for every layer
            assert len(inst.src[r].regions) == 1
        r = inst.d.receive(inst.pgs, "views", [3, 9], 8)
        qs = inst.requests(1)
        for i in (0, 1):
            inst.pre[i].send(qs[i][0], [6, 2]).finish()
        assert r.wait(10) == "done"
        inst.check(np.array([3, 9]), np.array([6, 2]))
    finally:
        inst.close()


def test_timeout_fences_every_leg(provider):
    """A per-rank request whose rank 1 never answers times out: rank 0's leg had completed (its
    count credited: fenced, not asked again), rank 1's leg gets ABORT and answers ABORTED(0);
    the Receive fails with TimeoutError, fenced, and its pages serve the next request
    byte-exact."""
    inst = Instance(provider, L4, Sharding(2), L4, Sharding(1))
    try:
        d, pgs = inst.d, inst.pgs
        r = d.receive(pgs, "slow", [4, 5], 8, timeout=0.5)
        qs = inst.requests(1)
        s0 = inst.pre[0].send(qs[0][0], [1, 2]).finish()
        assert s0.wait(10) == "done"
        with pytest.raises(kvxfer.errors.TimeoutError):
            r.wait(10)
        deadline = time.monotonic() + 10
        while not r.fenced and time.monotonic() < deadline:
            time.sleep(0.01)
        leg0, leg1 = r.legs
        assert r.fenced and r.state == "failed"
        assert leg0.complete and not leg0.abort_sent and leg0.announced == s0.num_writes
        assert leg1.abort_sent and leg1.fence_ok and leg1.fence_target == 0
        assert qs[1][0].aborted                       # rank 1 withdrew it: a late send posts nothing
        assert inst.pre[1].send(qs[1][0], [1, 2]).state == "aborted"
        r2 = d.receive(pgs, "next", [4, 5], 8)
        qs = inst.requests(1)
        for i in (0, 1):
            inst.pre[i].send(qs[i][0], [6, 7]).finish()
        assert r2.wait(10) == "done"
        inst.check(np.array([4, 5]), np.array([6, 7]))
    finally:
        inst.close()
