"""The planner between layouts whose page sizes differ (either direction, any ratio, sizes that
do not divide each other), at token granularity, checked by executing plans as byte copies
against the independent reference (tests/unit/_planner_ref.py) over every layout form, HND and
NHD, TP mismatch and GQA/MLA replication; coalescing, counts and the replica balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvxfer import planner as P
from kvxfer.errors import LayoutError, PlanError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import TransferPlan, plan
from kvxfer.wire import count_writes

from _planner_ref import RankMemory, execute
from test_planner import HEADS, side

PAGE_SIZES = [1, 2, 3, 4, 5, 7, 8, 16]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def token_configs(draw, equal_sizes: bool = False):
    mla = draw(st.sampled_from([False, False, False, True]))
    kv_heads = 1 if mla else draw(st.sampled_from(HEADS))
    num_layers = draw(st.integers(1, 3))
    ps = draw(st.sampled_from(PAGE_SIZES))
    pd = ps if equal_sizes else draw(st.sampled_from(PAGE_SIZES))
    head_dim = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(["uint8", "bfloat16", "float32"]))
    tokens = draw(st.integers(1, 40))
    ns, nd = _ceil(tokens, ps), _ceil(tokens, pd)
    src = draw(side(kv_heads, mla, num_layers, ps, head_dim, dtype, min_pages=ns))
    dst = draw(side(kv_heads, mla, num_layers, pd, head_dim, dtype, min_pages=nd))
    if draw(st.booleans()):  # runs of consecutive pages on both sides exercise coalescing
        s0 = draw(st.integers(0, src[0].num_pages - ns))
        d0 = draw(st.integers(0, dst[0].num_pages - nd))
        src_pages, dst_pages = list(range(s0, s0 + ns)), list(range(d0, d0 + nd))
    else:  # repeated source pages are allowed: they read the same bytes twice
        src_pages = draw(st.lists(st.integers(0, src[0].num_pages - 1), min_size=ns, max_size=ns))
        dst_pages = draw(st.permutations(range(dst[0].num_pages)))[:nd]
    layers = None
    if draw(st.booleans()):
        layers = draw(st.permutations(range(num_layers)))[: draw(st.integers(1, num_layers))]
    seed = draw(st.integers(0, 2**32 - 1))
    return src, dst, src_pages, dst_pages, tokens, layers, seed


def check_tokens(src, dst, src_pages, dst_pages, tokens, layers, seed, first=0) -> TransferPlan:
    """Plan tokens ``[first, tokens)``, run it as byte copies, and check token ``t`` of every
    planned (layer, plane) and head landed at slot ``t % page_size`` of ``dst_pages[t //
    page_size]`` on every destination rank holding that head, once, and nothing else was
    touched."""
    (sl, ss), (dl, ds) = src, dst
    p = plan(sl, ss, dl, ds, src_pages, dst_pages, layers=layers, seed=seed, num_tokens=tokens, first_token=first)
    rng = np.random.default_rng(seed)
    planes = 1 if sl.kv == "mla" else 2
    H, cb = sl.kv_heads, sl.head_dim * sl.np_dtype.itemsize
    tok = np.arange(first, tokens)
    sp, dp = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
    s_page, s_slot = sp[tok // sl.page_size], tok % sl.page_size
    d_page, d_slot = dp[tok // dl.page_size], tok % dl.page_size
    logical = rng.integers(0, 256, (sl.num_layers, planes, tok.shape[0], H, cb), dtype=np.uint8)
    # tokens read from one source slot (a repeated source page) carry that slot's bytes
    _, once, inverse = np.unique(s_page * sl.page_size + s_slot, return_index=True, return_inverse=True)
    logical = logical[:, :, once[inverse.ravel()]]

    src_mem = [RankMemory(sl, ss, r, rng=rng) for r in range(ss.tp_size)]
    for m in src_mem:
        assert tuple(m.sizes) == sl.region_sizes(ss)
        for layer in range(sl.num_layers):
            for k in range(planes):
                m.page_view(layer, k)[s_page, :, s_slot] = logical[layer, k][:, m.heads]
    dst_mem = [RankMemory(dl, ds, r, fill=0xEE) for r in range(ds.tp_size)]
    counts = execute(p, src_mem, dst_mem)

    planned = list(range(sl.num_layers)) if layers is None else list(layers)
    assert p.layers == tuple(planned) and p.num_tokens == tokens and p.first_token == first
    for d, m in enumerate(dst_mem):
        want = RankMemory(dl, ds, d, fill=0)
        for layer in planned:
            for k in range(planes):
                want.page_view(layer, k)[d_page, :, d_slot] = 1
        for r, c in enumerate(counts[d]):
            np.testing.assert_array_equal(c, want.regions[r])
            assert (m.regions[r][c == 0] == 0xEE).all()
        for layer in planned:
            for k in range(planes):
                np.testing.assert_array_equal(m.page_view(layer, k)[d_page, :, d_slot], logical[layer, k][:, m.heads])
        assert p.expected_writes[d] == sum(len(p.writes(s, d)) for s in range(ss.tp_size))
    assert p.num_bytes == len(planned) * planes * (tokens - first) * cb * sum(len(m.heads) for m in dst_mem)
    _check_coalesced(p)
    return p


def _check_coalesced(p: TransferPlan) -> None:
    """No two writes of a pair could have been one, and the engine's message rule (one iovec,
    no size limit) counts exactly the planned writes, group by group."""
    for s in range(p.src_tp):
        for d in range(p.dst_tp):
            w = p.writes(s, d)
            if len(w):
                joinable = ((w.src_region[1:] == w.src_region[:-1]) & (w.dst_region[1:] == w.dst_region[:-1])
                            & (w.layer[1:] == w.layer[:-1])
                            & (w.src_offset[:-1] + w.length[:-1] == w.src_offset[1:])
                            & (w.dst_offset[:-1] + w.length[:-1] == w.dst_offset[1:]))
                assert not joinable.any()
            msgs = sum(count_writes(g[2], g[3], g[4], iov=1, max_write=2**40) for g in p.groups(s, d))
            assert msgs == len(w)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_configs())
def test_differing_page_sizes_move_every_token_once(cfg):
    check_tokens(*cfg)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_configs(), st.data())
def test_a_plan_from_a_first_token_moves_the_rest(cfg, data):
    """A chunk of a streamed prefill: tokens [first, num_tokens), the first page in part."""
    first = data.draw(st.integers(0, cfg[4]))
    check_tokens(*cfg, first=first)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_configs(), st.data())
def test_chunks_move_every_token_once(cfg, data):
    """Consecutive chunks [0, c1), [c1, c2), ... planned apart (each with the pages known so
    far) together write every destination byte of the request exactly once."""
    (sl, ss), (dl, ds), src_pages, dst_pages, tokens, layers, seed = cfg
    cuts = sorted(set(data.draw(st.lists(st.integers(1, tokens - 1), max_size=4)) if tokens > 1 else []))
    bounds = [0, *cuts, tokens]
    rng = np.random.default_rng(seed)
    src_mem = [RankMemory(sl, ss, r, rng=rng) for r in range(ss.tp_size)]
    dst_mem = [RankMemory(dl, ds, r, fill=0) for r in range(ds.tp_size)]
    total = [[np.zeros(len(r), np.int64) for r in m.regions] for m in dst_mem]
    for a, b in zip(bounds[:-1], bounds[1:]):
        sp, dp = src_pages[:_ceil(b, sl.page_size)], dst_pages[:_ceil(b, dl.page_size)]
        p = plan(sl, ss, dl, ds, sp, dp, layers=layers, seed=seed, num_tokens=b, first_token=a)
        for d, c in enumerate(execute(p, src_mem, dst_mem)):
            for r in range(len(c)):
                total[d][r] += c[r]
    whole = plan(sl, ss, dl, ds, src_pages, dst_pages, layers=layers, seed=seed, num_tokens=tokens)
    for d, c in enumerate(execute(whole, src_mem, [RankMemory(dl, ds, r, fill=0) for r in range(ds.tp_size)])):
        for r in range(len(c)):
            np.testing.assert_array_equal(total[d][r], c[r])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_configs(equal_sizes=True))
def test_equal_page_sizes_with_a_partial_last_page(cfg):
    """num_tokens with equal sizes moves exactly those tokens (the last page in part)."""
    check_tokens(*cfg)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_configs(equal_sizes=True))
def test_token_path_equals_page_path_on_whole_pages(cfg):
    """Planned at token granularity, whole aligned pages give the page path's writes exactly
    (one rule, two speeds). A repeated source page is left out: its ties in source order
    may be broken apart differently (both valid, never fewer writes on the page path)."""
    (sl, ss), (dl, ds), src_pages, dst_pages, tokens, layers, seed = cfg
    assume(len(set(src_pages)) == len(src_pages))
    n = len(src_pages)
    pages = plan(sl, ss, dl, ds, src_pages, dst_pages, layers=layers, seed=seed)
    toks = P._plan_pieces(sl.resolve(ss), dl.resolve(ds), ss, ds, sl, dl, np.asarray(src_pages, np.int64),
                          np.asarray(dst_pages, np.int64), 0, n * sl.page_size, pages.layers,
                          np.random.default_rng(seed))
    for s in range(ss.tp_size):
        for d in range(ds.tp_size):
            a, b = pages.writes(s, d), toks.writes(s, d)
            for name in ("src_region", "src_offset", "dst_region", "dst_offset", "length", "layer"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


# -- spelled out ------------------------------------------------------------------------------

def _vllm(page_size: int, num_pages: int = 64, order: str = "HND", **kw) -> KVLayout:
    return KVLayout.vllm(2, 8, 8, page_size, num_pages, dtype="bfloat16", order=order, **kw)


@pytest.mark.parametrize("ps,pd", [(16, 32), (32, 16), (16, 48), (48, 16), (12, 20), (20, 12), (1, 7)])
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 8), (8, 2)])
def test_ratios_and_tp_mismatch(ps, pd, src_tp, dst_tp):
    tokens = 150
    rng = np.random.default_rng(ps * 100 + pd)
    sp = rng.permutation(160)[:_ceil(tokens, ps)]
    dp = rng.permutation(160)[:_ceil(tokens, pd)]
    for order in ("HND", "NHD"):
        check_tokens((_vllm(ps, 160, order=order), Sharding(src_tp)), (_vllm(pd, 160), Sharding(dst_tp)),
                     list(sp), list(dp), tokens, None, 1)


def test_hnd_writes_one_per_piece_and_head():
    """16-token source pages into 32-token destination pages, HND, same TP: each source page
    is one run per head on both sides (the destination's head stride is 32 tokens)."""
    p = plan(_vllm(16), Sharding(2), _vllm(32), Sharding(2), [5, 9, 2, 7], [3, 1], num_tokens=64)
    assert p.num_triples == 2 * 2 * (4 * 4 * 2)  # layers x ranks x (pages x heads x K/V)
    assert (p.writes(0, 0).length == 16 * 8 * 2).all()
    # the other way the pieces are the same tokens: as many writes
    q = plan(_vllm(32), Sharding(2), _vllm(16), Sharding(2), [3, 1], [5, 9, 2, 7], num_tokens=64)
    assert q.num_triples == p.num_triples


def test_contiguous_pages_coalesce_across_piece_boundaries():
    """Consecutive pages on both sides, NHD with every head: a layer's K plane is one run on
    each side whatever the page sizes, so the pieces join into one write per plane."""
    for ps, pd in ((16, 32), (12, 20), (5, 3)):
        src = KVLayout.flash_attn(2, 8, 8, ps, 64, dtype="bfloat16")
        dst = KVLayout.flash_attn(2, 8, 8, pd, 64, dtype="bfloat16")
        tokens = 120
        p = plan(src, Sharding(2), dst, Sharding(2), range(_ceil(tokens, ps)), range(_ceil(tokens, pd)),
                 num_tokens=tokens)
        assert (p.writes_per_pair.diagonal() == 2 * 2).all()  # layers x K/V
        assert (p.writes(0, 0).length == tokens * 4 * 8 * 2).all()


def test_mla_replicas_balanced_within_a_source_page():
    src = KVLayout.mla(2, 576, 16, 200, dtype="bfloat16")
    dst = KVLayout.mla(2, 576, 48, 100, dtype="bfloat16")
    tokens = 16 * 150 - 5
    p = plan(src, Sharding(8, replicated=True), dst, Sharding(2, replicated=True), range(150),
             np.random.default_rng(0).permutation(100)[:_ceil(tokens, 48)], num_tokens=tokens, seed=4)
    token_bytes = 576 * 2 * 2  # both layers
    for d in range(2):
        col = p.bytes_per_pair[:, d]
        assert col.sum() == tokens * token_bytes
        # chunks of the source page list differ by at most one page, plus the partial last page
        assert col.max() - col.min() < 2 * 16 * token_bytes


def test_gqa_replicated_sources_with_differing_pages():
    src = KVLayout.vllm(1, 2, 4, 5, 40, dtype="uint8")
    dst = KVLayout.vllm(1, 2, 4, 3, 60, dtype="uint8", order="NHD")
    check_tokens((src, Sharding(8)), (dst, Sharding(4)), list(range(20)), list(range(59, 59 - 34, -1)), 100, None, 9)


@pytest.mark.parametrize("kw,err,match", [
    (dict(), LayoutError, "page_size.*num_tokens"),
    (dict(num_tokens=65), PlanError, "src_pages has 4 pages but 65 tokens"),
    (dict(num_tokens=48), PlanError, "src_pages has 4 pages but 48 tokens"),
    (dict(num_tokens=-1), PlanError, "num_tokens"),
    (dict(num_tokens=64.0), PlanError, "num_tokens"),
    (dict(num_tokens=True), PlanError, "num_tokens"),
    (dict(num_tokens=64, first_token=65), PlanError, "first_token"),
    (dict(num_tokens=64, first_token=-1), PlanError, "first_token"),
    (dict(first_token=3), LayoutError, "num_tokens"),
])
def test_token_counts_checked(kw, err, match):
    with pytest.raises(err, match=match):
        plan(_vllm(16), Sharding(2), _vllm(32), Sharding(2), [0, 1, 2, 3], [0, 1], **kw)
    with pytest.raises(PlanError, match="dst_pages has 3 pages but 64 tokens"):
        plan(_vllm(16), Sharding(2), _vllm(32), Sharding(2), [0, 1, 2, 3], [0, 1, 2], num_tokens=64)


def test_zero_tokens_plan_nothing():
    p = plan(_vllm(16), Sharding(2), _vllm(32), Sharding(1), [], [], num_tokens=0)
    assert p.num_triples == 0 and p.pairs == []
