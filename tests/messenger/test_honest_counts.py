"""An honest prefiller never trips the decoder's protocol checks (docs/messenger.md, "Counts a
decoder will not believe"): whatever the supported layouts, shardings, engine options and
page lists, the count an honest ``Messenger.send`` or stream announces lies in
``[least, Decoder.most_writes]``, an ABORTED never claims more than was announced (or than
that bound), and its fence fills: the peer is never torn down
(``peers_broke_protocol``, ``drop_bad_count`` stay 0).

Real engines on both providers, both messengers in this process (each holds every rank of
its sharding). Cases drawn by hypothesis: TP a->b both ways (split and reassembled pages),
GQA head replication, MLA replicated latents, HND/NHD, fused/stacked/separate, per-layer and
layer-major placement, padded strides, 1-4 byte dtypes (fp8 included), repeated and
scattered source pages, ``num_tokens`` short of the last page, context slots or none,
``rails=2`` striped or pinned, ``max_write``/``iov``/``pack_min`` down to one byte per
message (the tightest counts: one message per byte), and on shm host-share destinations
written directly or over RMA (``direct=False``)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer import KVLayout, Sharding
from _data import wait_for as _wait
from _strategies import side_shape

FULL = bool(os.environ.get("KVXFER_FULL"))
HEADS = [1, 2, 3, 4, 8]
DTYPES = ["fp8", "float8_e5m2", "bfloat16", "float16", "float32"]
SECRET = b"test-secret-0123456789"
CTX_BYTES = 16


@st.composite
def _side(draw, kv_heads, mla, num_layers, page_size, head_dim, dtype):
    replicated, tp, kv, placement, order = draw(side_shape(kv_heads, mla, (1, 2, 4)))
    num_pages = draw(st.integers(2, 8))
    base = KVLayout(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, kv, placement)
    g = base.resolve(Sharding(tp, replicated))
    page_stride = None
    if draw(st.sampled_from([False, False, True])):
        page_stride = g.page_stride + draw(st.sampled_from([1, 8, 64]))
    layout = KVLayout(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, kv, placement,
                      page_stride=page_stride)
    return layout, Sharding(tp, replicated)


@st.composite
def cases(draw, provider):
    mla = draw(st.sampled_from([False, False, False, True]))
    kv_heads = 1 if mla else draw(st.sampled_from(HEADS))
    num_layers = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    head_dim = draw(st.sampled_from([1, 2, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    src = draw(_side(kv_heads, mla, num_layers, page_size, head_dim, dtype))
    dst = draw(_side(kv_heads, mla, num_layers, page_size, head_dim, dtype))
    n = draw(st.integers(1, min(src[0].num_pages, dst[0].num_pages)))
    if draw(st.booleans()):                   # contiguous pages coalesce across pages
        s0 = draw(st.integers(0, src[0].num_pages - n))
        d0 = draw(st.integers(0, dst[0].num_pages - n))
        src_pages, dst_pages = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:                                     # scattered, source pages may repeat (prefix sharing)
        src_pages = draw(st.lists(st.integers(0, src[0].num_pages - 1), min_size=n, max_size=n))
        dst_pages = draw(st.permutations(range(dst[0].num_pages)))[:n]
    num_tokens = draw(st.integers((n - 1) * page_size + 1, n * page_size))     # exactly n pages
    context = draw(st.booleans())
    # engine options that change the message count
    rails = draw(st.sampled_from([1, 1, 2]))
    pin = rails > 1 and draw(st.booleans())   # placements: each rank on one rail, else striped
    tiny = draw(st.sampled_from([False, False, True]))
    if tiny:        # one byte (or a few) per message: the count approaches the bytes written
        max_write = CTX_BYTES + 8 if context else draw(st.sampled_from([1, 2]))
        iov, pack_min = 1, draw(st.sampled_from([0, max_write]))
    else:
        max_write = draw(st.sampled_from([None, None, 64]))
        iov = draw(st.sampled_from([None, 1, 2]))
        pack_min = draw(st.sampled_from([None, None, 0]))
    direct = draw(st.booleans()) if provider == "shm" else None
    share = provider == "shm" and draw(st.booleans())   # decoder regions are memfd KVBuffers
    mode = draw(st.sampled_from(["send", "send", "stream", "stream", "abort", "prefiller_abort",
                                 "abort_stream", "abort_streamed", "abandon"]))
    chunks = None
    layers_done = 0
    if mode.startswith("abort_stream") or mode in ("stream", "abandon"):
        layers_done = draw(st.integers(0, num_layers - 1))   # of the last pass, before an abort
        cuts = sorted(set(draw(st.lists(st.integers(1, num_tokens - 1), max_size=3)))) if num_tokens > 1 else []
        chunks = list(zip([0] + cuts, cuts + [num_tokens]))
    return dict(src=src, dst=dst, src_pages=src_pages, dst_pages=dst_pages, num_tokens=num_tokens,
                context=context, rails=rails, pin=pin, max_write=max_write, iov=iov, pack_min=pack_min,
                direct=direct, share=share, mode=mode, chunks=chunks, layers_done=layers_done)


def _kv(layout, sharding, fill, share, keep):
    out = {}
    for r in range(sharding.tp_size):
        regs = []
        for s in layout.region_sizes(sharding):
            if share:
                b = kvxfer.KVBuffer.allocate(s)
                keep.append(b)
                b.numpy()[:] = fill
                regs.append(b)
            else:
                regs.append(np.full(s, fill, np.uint8))
        out[r] = regs
    return out


def _engine(provider, c):
    kw = dict(rails=c["rails"], max_write=c["max_write"], iov=c["iov"], pack_min=c["pack_min"])
    if c["direct"] is not None:
        kw["direct"] = c["direct"]
    return kvxfer.Engine(provider, "127.0.0.1", **{k: v for k, v in kw.items() if v is not None})


def run_case(provider, c):
    """One honest request of case ``c``; returns (announced, fence target, most, least)."""
    (sl, ss), (dl, ds) = c["src"], c["dst"]
    keep: list = []
    ea, eb = _engine(provider, c), _engine(provider, c)
    p = d = None
    try:
        placements = {r: r % c["rails"] for r in range(ss.tp_size)} if c["pin"] else None
        p = kvxfer.Messenger(ea, sl, ss, _kv(sl, ss, 7, False, keep), peer_timeout=5, secret=SECRET,
                             placements=placements)
        dkw = dict(context_slots=2, context_bytes=CTX_BYTES) if c["context"] else {}
        d = kvxfer.Messenger(eb, dl, ds, _kv(dl, ds, 0xEE, c["share"], keep), peer_timeout=5, secret=SECRET, **dkw)
        pg = d.connect(p.handshake())
        r = d.receive(pg, "req", c["dst_pages"], c["num_tokens"])
        (q,) = p.requests(timeout=10)
        mode = c["mode"]
        ctx = b"ctx" if c["context"] else None
        if mode in ("send", "abort", "prefiller_abort"):
            s = p.send(q, c["src_pages"])
            if mode == "abort":
                _wait(lambda: r.legs[0].announced is not None, "the ANNOUNCE")
                assert r.abort(10)               # before finish(): the context is never posted
                s.finish(ctx)
            elif mode == "prefiller_abort":
                assert s.abort(10)
            else:
                s.finish(ctx)
        else:
            s = p.stream(q, c["src_pages"])
            lc = p.layer_counter
            last = len(c["chunks"]) - 1
            for i, (a, b) in enumerate(c["chunks"]):
                if mode == "abort_stream" and i == last:
                    break                         # the last chunk never comes: nothing announced
                if i == last:
                    s.finish(ctx)
                ps = p.schedule([(s, a, b)])
                if i == last and mode in ("abort_streamed", "abandon"):
                    # the ANNOUNCE (every pass's writes and the context) went; the model
                    # stops inside the last pass: the abort's count is what was posted
                    _wait(lambda: r.legs[0].announced is not None, "the ANNOUNCE")
                    if c["layers_done"]:
                        lc.bump(c["layers_done"])
                    if mode == "abandon":
                        ps.abandon()
                    break
                lc.bump(sl.num_layers)
            if mode in ("abort_stream", "abort_streamed"):
                assert r.abort(10)
        if mode in ("send", "stream"):
            r.wait(20)
            assert r.state == "done", (r.state, r.error)
        else:
            _wait(lambda: r.done, "the fence")
            # (a request whose writes all landed before the abort took effect stays done)
            assert r.state in ("aborted", "failed", "done") and r.fenced, (r.state, r.error)
        st_ = d.stats()
        assert st_.get("peers_broke_protocol", 0) == 0 and st_.get("drop_bad_count", 0) == 0, st_
        assert pg.alive
        least = 2 if c["context"] else 1
        return r.legs[0].announced, r.legs[0].fence_target, d._decode.most_writes(r), least, s
    finally:
        for o in (d, p, eb, ea):
            if o is not None:
                o.close()
        for b in keep:
            b.close()


@settings(max_examples=300 if FULL else 40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_an_honest_prefiller_stays_within_the_bounds(provider, data):
    c = data.draw(cases(provider))
    announced, fence, most, least, s = run_case(provider, c)
    if announced is not None:
        assert least <= announced <= most, (announced, least, most)
        assert announced == s.num_writes
    if fence is not None:
        assert fence <= (announced if announced is not None else most), (fence, announced, most)


@pytest.mark.parametrize("share", [False, True], ids=["rma", "host-share"])
@pytest.mark.parametrize("mode", ["send", "abort"])
def test_the_largest_request_of_one_byte_pieces(provider, share, mode):
    """The bound is tight: 16,000 scattered pages of one byte per (layer, plane), each piece
    its own message (rule 3), plus the context, is exactly ``Decoder.most_writes``; an honest
    prefiller announces it (or, aborted, fences on what it posted) and stays up."""
    if share and provider != "shm":
        pytest.skip("host shares are shm's")
    layout = KVLayout(2, 1, 1, 1, 16384, "fp8", "HND", "separate")
    sh = Sharding(1)
    rng = np.random.default_rng(5)
    n = 16000
    c = dict(src=(layout, sh), dst=(layout, sh), src_pages=rng.permutation(16384)[:n].tolist(),
             dst_pages=rng.permutation(16384)[:n].tolist(), num_tokens=n, context=True, rails=1, pin=False,
             max_write=None, iov=None, pack_min=None, direct=None, share=share, mode=mode, chunks=None,
             layers_done=0)
    announced, fence, most, least, s = run_case(provider, c)
    assert least <= announced <= most
    if not share:            # one message per byte, and the context: the bound itself
        assert announced == most == 1 * n * 2 * 2 * 1 + 1
    if fence is not None:
        assert fence <= announced


@pytest.mark.parametrize("rails", [1, 2])
def test_a_large_request_aborted_mid_flight_fences_in_time(provider, rails):
    """A fence (ABORTED, then its writes land) of a large request aborted while it is being
    written, from either side, over one or two striped rails, fills long before the
    decoder's ``peer_timeout`` (1 s, the shortest the tests use): the prefiller answers
    only once its posted writes completed, and they travel ahead of the ABORTED (one
    connection) or beside it (another rail), so no honest peer is torn down."""
    layout = KVLayout.vllm(16, 8, 128, 16, 32, "bfloat16")        # 64 KiB per page and layer
    sh = Sharding(1)
    ea, eb = (kvxfer.Engine(provider, "127.0.0.1", rails=rails) for _ in range(2))
    src = [np.full(s, 7, np.uint8) for s in layout.region_sizes(sh)]
    dst = [np.full(s, 0xEE, np.uint8) for s in layout.region_sizes(sh)]
    p = kvxfer.Messenger(ea, layout, sh, {0: src}, peer_timeout=1, secret=SECRET)
    d = kvxfer.Messenger(eb, layout, sh, {0: dst}, context_slots=2, context_bytes=64, peer_timeout=1,
                         secret=SECRET)
    try:
        pg = d.connect(p.handshake())
        lags = []
        for i in range(8):
            r = d.receive(pg, f"r{i}", list(range(32)), 32 * 16)
            (q,) = p.requests(timeout=10)
            s = p.send(q, np.random.default_rng(i).permutation(32))
            _wait(lambda: r.legs[0].announced is not None, "the ANNOUNCE")
            assert (r.abort(10) if i % 2 else s.abort(10))
            s.finish(b"ctx")
            _wait(lambda: r.done, "the fence")
            assert r.fenced and r.state in ("aborted", "failed", "done"), (r.state, r.error)
            if r.legs[0].fence_target is not None:
                assert r.legs[0].fence_target <= r.legs[0].announced
                lags.append(time.monotonic() - r.legs[0].fence_since)
            r.release()
        st_ = d.stats()
        assert st_.get("peers_broke_protocol", 0) == 0 and st_.get("drop_bad_count", 0) == 0, st_
        assert pg.alive
    finally:
        for o in (d, p, eb, ea):
            o.close()
