"""The sharding-ratio planner, checked by executing plans as byte copies against an
independent reference (tests/unit/_planner_ref.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import LayoutError, PlanError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import TransferPlan, plan

from _planner_ref import RankMemory, dense_strides, execute, ref_heads
from _strategies import side_shape

ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float32": 4}
HEADS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]
FORMS = ("fused", "stacked", "separate", "packed", "packed_rows")


@st.composite
def side(draw, kv_heads: int, mla: bool, num_layers: int, page_size: int, head_dim: int, dtype: str,
         min_pages: int = 1):
    """One side (prefill or decode): layout and sharding, at least ``min_pages`` pages."""
    replicated, tp, kv, placement, order = draw(side_shape(kv_heads, mla, range(1, 9), FORMS))
    num_pages = draw(st.integers(max(min_pages, 1), max(min_pages, 1) + 7))
    lh = kv_heads if replicated else max(kv_heads // tp, 1)
    page, layer = dense_strides(kv, lh, page_size, head_dim, ITEMSIZE[dtype], num_pages)
    page_pad = draw(st.sampled_from([0, 0, 0, 1, 8]))
    page_stride = None if page_pad == 0 else page + page_pad
    layer_stride = None
    if placement == "layer_major" and draw(st.booleans()):
        if kv != "stacked" and draw(st.booleans()):
            # one storage, pages outer: every layer's page inside one page stride (vLLM's
            # kv_cache_config can place a packed cache so)
            layer_stride = page + draw(st.sampled_from([0, 2, 5]))
            page_stride = num_layers * layer_stride + draw(st.sampled_from([0, 0, 7]))
        else:
            layer_stride = num_pages * (page + page_pad) * (2 if kv == "stacked" else 1) + draw(st.sampled_from([3, 64]))
    layout = KVLayout(num_layers, kv_heads, head_dim, page_size, num_pages, dtype, order, kv, placement,
                      page_stride=page_stride, layer_stride=layer_stride)
    return layout, Sharding(tp, replicated)


@st.composite
def configs(draw):
    mla = draw(st.sampled_from([False, False, False, True]))
    kv_heads = 1 if mla else draw(st.sampled_from(HEADS))
    num_layers = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    head_dim = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(["uint8", "bfloat16", "float32"]))  # 1, 2, 4 bytes
    src = draw(side(kv_heads, mla, num_layers, page_size, head_dim, dtype))
    dst = draw(side(kv_heads, mla, num_layers, page_size, head_dim, dtype))
    n = draw(st.integers(1, min(src[0].num_pages, dst[0].num_pages)))  # empty lists: a test below
    src_pages = draw(st.lists(st.integers(0, src[0].num_pages - 1), min_size=n, max_size=n))
    if draw(st.booleans()):  # consecutive pages exercise coalescing across pages
        start = draw(st.integers(0, dst[0].num_pages - n))
        dst_pages = list(range(start, start + n))
        if draw(st.booleans()) and n <= src[0].num_pages:
            s0 = draw(st.integers(0, src[0].num_pages - n))
            src_pages = list(range(s0, s0 + n))
    else:
        dst_pages = draw(st.permutations(range(dst[0].num_pages)))[:n]
    layers = None
    if draw(st.booleans()):
        layers = draw(st.permutations(range(num_layers)))[: draw(st.integers(1, num_layers))]
    seed = draw(st.integers(0, 2**32 - 1))
    return src, dst, src_pages, dst_pages, layers, seed


def _check_roundtrip(src, dst, src_pages, dst_pages, layers, seed) -> TransferPlan:
    (sl, ss), (dl, ds) = src, dst
    p = plan(sl, ss, dl, ds, src_pages, dst_pages, layers=layers, seed=seed)
    rng = np.random.default_rng(seed)
    planes = 1 if sl.kv == "mla" else 2
    H, n = sl.kv_heads, len(src_pages)
    cb = sl.head_dim * sl.np_dtype.itemsize
    logical = rng.integers(0, 256, (sl.num_layers, planes, n, H, sl.page_size, cb), dtype=np.uint8)
    for i, page in enumerate(src_pages):  # a repeated source page carries the same data
        logical[:, :, i] = logical[:, :, src_pages.index(page)]

    src_mem = [RankMemory(sl, ss, r, rng=rng) for r in range(ss.tp_size)]
    for m in src_mem:
        assert tuple(m.sizes) == sl.region_sizes(ss)
        for layer in range(sl.num_layers):
            for k in range(planes):
                view = m.page_view(layer, k)
                for i, page in enumerate(src_pages):
                    view[page] = logical[layer, k, i, m.heads]
    dst_mem = [RankMemory(dl, ds, r, fill=0xEE) for r in range(ds.tp_size)]
    for m in dst_mem:
        assert tuple(m.sizes) == dl.region_sizes(ds)
    counts = execute(p, src_mem, dst_mem)

    planned = list(range(sl.num_layers)) if layers is None else layers
    assert p.layers == tuple(planned)
    for d, m in enumerate(dst_mem):
        # every byte of the planned pages written exactly once, nothing else touched
        want = RankMemory(dl, ds, d, fill=0)
        for layer in planned:
            for k in range(planes):
                want.page_view(layer, k)[dst_pages] = 1
        for r, c in enumerate(counts[d]):
            np.testing.assert_array_equal(c, want.regions[r])
            assert (m.regions[r][c == 0] == 0xEE).all()
        for layer in planned:
            for k in range(planes):
                got = m.page_view(layer, k)[dst_pages]
                np.testing.assert_array_equal(got, logical[layer, k][:, m.heads])
        arrived = sum(len(p.writes(s, d)) for s in range(ss.tp_size))
        assert p.expected_writes[d] == arrived
    assert p.num_triples == int(p.expected_writes.sum())
    assert p.num_bytes == len(planned) * planes * n * sl.page_size * cb * sum(len(m.heads) for m in dst_mem)
    return p


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_plan_moves_every_byte_once(cfg):
    _check_roundtrip(*cfg)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_groups_and_layers_are_views_of_writes(cfg):
    (sl, ss), (dl, ds), src_pages, dst_pages, layers, seed = cfg
    p = plan(sl, ss, dl, ds, src_pages, dst_pages, layers=layers, seed=seed)
    for s in range(ss.tp_size):
        for d in range(ds.tp_size):
            w = p.writes(s, d)
            per_layer = [p.layer(layer).writes(s, d) for layer in p.layers]
            g = list(p.groups(s, d))
            for name in ("src_region", "src_offset", "dst_region", "dst_offset", "length", "layer"):
                cat = np.concatenate([getattr(x, name) for x in per_layer]) if per_layer else []
                np.testing.assert_array_equal(getattr(w, name), cat)
            if g:
                np.testing.assert_array_equal(w.src_offset, np.concatenate([x[2] for x in g]))
                np.testing.assert_array_equal(w.dst_offset, np.concatenate([x[3] for x in g]))
                np.testing.assert_array_equal(w.length, np.concatenate([x[4] for x in g]))
                np.testing.assert_array_equal(w.src_region, np.concatenate([np.full(len(x[4]), x[0]) for x in g]))
                np.testing.assert_array_equal(w.dst_region, np.concatenate([np.full(len(x[4]), x[1]) for x in g]))
            # no two writes of a pair could have been one
            if len(w):
                joinable = ((w.src_region[1:] == w.src_region[:-1]) & (w.dst_region[1:] == w.dst_region[:-1])
                            & (w.layer[1:] == w.layer[:-1])
                            & (w.src_offset[:-1] + w.length[:-1] == w.src_offset[1:])
                            & (w.dst_offset[:-1] + w.length[:-1] == w.dst_offset[1:]))
                assert not joinable.any()
    assert sum(p.layer(layer).num_triples for layer in p.layers) == p.num_triples


# -- a few configurations spelled out ---------------------------------------------------------

def _llama(order: str, num_pages: int = 64, **kw) -> KVLayout:
    return KVLayout.vllm(num_layers=2, kv_heads=8, head_dim=8, page_size=16, num_pages=num_pages,
                         dtype="bfloat16", order=order, **kw)


@pytest.mark.parametrize("src_tp,dst_tp", [(8, 4), (4, 8), (8, 2), (2, 8), (1, 8), (8, 1)])
def test_hnd_is_one_write_per_head_slice_nhd_one_per_token(src_tp, dst_tp):
    rng = np.random.default_rng(0)
    sp, dp = rng.permutation(64)[:40], rng.permutation(64)[:40]
    hnd = plan(_llama("HND"), Sharding(src_tp), _llama("HND"), Sharding(dst_tp), sp, dp, seed=0)
    nhd = plan(_llama("NHD"), Sharding(src_tp), _llama("NHD"), Sharding(dst_tp), sp, dp, seed=0)
    slices = max(src_tp, dst_tp)  # (src, dst) pairs whose head ranges meet
    assert hnd.num_triples == 2 * 40 * 2 * slices  # layers * pages * K/V * slices
    assert nhd.num_triples == 16 * hnd.num_triples  # one write per token
    assert hnd.num_bytes == nhd.num_bytes
    assert (hnd.expected_writes == hnd.num_triples // dst_tp).all()


def test_same_sharding_contiguous_pages_coalesce_to_one_write_per_layer():
    for order in ("HND", "NHD"):
        lay = _llama(order)
        p = plan(lay, Sharding(4), lay, Sharding(4), range(10, 30), range(0, 20))
        assert p.pairs == [(r, r) for r in range(4)]
        assert (p.writes_per_pair.diagonal() == 2).all()  # one per layer: K and V pages interleave
        w = p.writes(1, 1)
        assert list(w.length) == [20 * 2 * 2 * 16 * 8 * 2] * 2


def test_layer_major_never_coalesces_across_layers():
    lay = KVLayout.layer_major(num_layers=5, kv_heads=2, head_dim=4, page_size=4, num_pages=6, dtype="float32")
    p = plan(lay, Sharding(1), lay, Sharding(1), range(6), range(6))
    w = p.writes(0, 0)
    assert len(w) == 5 and list(w.layer) == list(range(5))
    assert (w.length == lay.region_sizes(Sharding(1))[0] // 5).all()


def test_groups_split_by_region_pair():
    src = _llama("HND")
    dst = KVLayout.sglang(num_layers=2, kv_heads=8, head_dim=8, page_size=16, num_pages=64, dtype="bfloat16")
    p = plan(src, Sharding(2), dst, Sharding(2), [3, 4, 5], [7, 8, 9])
    groups = list(p.groups(0, 0))
    assert [(g[0], g[1]) for g in groups] == [(0, 0), (0, 1), (1, 2), (1, 3)]  # (layer region, K/V pool)
    # HND into NHD transposes the page: one write per (head, token) vector, 4 heads x 16 tokens
    assert all(len(g[4]) == 3 * 4 * 16 for g in groups)
    assert all((g[4] == 8 * 2).all() for g in groups)


def test_mla_replicas_balanced_and_seeded():
    lay = KVLayout.mla(num_layers=3, latent_dim=576, page_size=16, num_pages=1000, dtype="bfloat16")
    sp, dp = np.arange(1000), np.random.default_rng(1).permutation(1000)
    p = plan(lay, Sharding(8, replicated=True), lay, Sharding(2, replicated=True), sp, dp, seed=7)
    page_bytes = 16 * 576 * 2 * 3
    for d in range(2):
        col = p.bytes_per_pair[:, d]
        assert col.sum() == 1000 * page_bytes
        assert col.max() - col.min() <= page_bytes  # within one page per destination
    q = plan(lay, Sharding(8, replicated=True), lay, Sharding(2, replicated=True), sp, dp, seed=7)
    r = plan(lay, Sharding(8, replicated=True), lay, Sharding(2, replicated=True), sp, dp, seed=8)
    assert all(np.array_equal(p.writes(s, d).src_offset, q.writes(s, d).src_offset)
               for s in range(8) for d in range(2))
    assert any(not np.array_equal(p.writes(s, d).src_offset, r.writes(s, d).src_offset)
               for s in range(8) for d in range(2))


def test_gqa_replicated_heads_balanced_over_holders():
    lay = KVLayout.vllm(num_layers=1, kv_heads=2, head_dim=4, page_size=4, num_pages=100, dtype="uint8")
    p = plan(lay, Sharding(8), lay, Sharding(1), range(100), range(100), seed=3)
    for head in range(2):
        holders = list(Sharding(8).holders(head, 2))
        assert holders == list(range(4 * head, 4 * head + 4))
        sent = p.bytes_per_pair[holders, 0]
        assert sent.sum() == 100 * 2 * 4 * 4 and sent.max() - sent.min() <= 2 * 4 * 4


def test_replicated_destinations_each_get_a_copy():
    lay = KVLayout.vllm(num_layers=1, kv_heads=2, head_dim=4, page_size=4, num_pages=8, dtype="uint8")
    p = plan(lay, Sharding(2), lay, Sharding(8), range(8), range(8))
    for d in range(8):
        assert p.expected_bytes[d] == 8 * 2 * 4 * 4  # one head, K and V, every page
        (src,) = [s for s in range(2) if p.writes_per_pair[s, d]]
        assert ref_heads(src, 2, 2, False) == ref_heads(d, 8, 2, False)


def test_empty_page_list_plans_nothing():
    p = plan(_llama("HND"), Sharding(8), _llama("HND"), Sharding(4), [], [])
    assert p.num_triples == 0 and p.pairs == [] and list(p.groups(0, 0)) == []
    assert len(p.writes(0, 0)) == 0


def test_summary_shows_cost():
    p = plan(_llama("NHD"), Sharding(8), _llama("NHD"), Sharding(4), range(4), range(4))
    text = str(p)
    assert "TP8 NHD -> TP4 NHD" in text and str(p.num_triples) in text and "expected_writes" in text
    assert repr(p).startswith("TransferPlan(")


# -- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("change", [dict(head_dim=16), dict(dtype="float16"), dict(num_layers=3),
                                    dict(page_size=8), dict(kv_heads=4)])
def test_incompatible_layouts(change):
    base = dict(num_layers=2, kv_heads=8, head_dim=8, page_size=16, num_pages=64, dtype="bfloat16")
    with pytest.raises(LayoutError):
        plan(KVLayout.vllm(**base), Sharding(2), KVLayout.vllm(**{**base, **change}), Sharding(2), [0], [0])


def test_mla_and_mha_do_not_meet():
    mla = KVLayout.mla(num_layers=2, latent_dim=8, page_size=16, num_pages=8)
    mha = KVLayout.vllm(num_layers=2, kv_heads=1, head_dim=8, page_size=16, num_pages=8)
    with pytest.raises(LayoutError, match="MLA"):
        plan(mla, Sharding(1), mha, Sharding(1), [0], [0])


def test_sharding_that_does_not_divide_heads():
    lay = _llama("HND")
    with pytest.raises(LayoutError):
        plan(lay, Sharding(3), lay, Sharding(2), [0], [0])
    with pytest.raises(LayoutError):
        plan(lay, Sharding(2), lay, 2, [0], [0])


@pytest.mark.parametrize("src_pages,dst_pages,match", [
    ([0, 1], [0], "dst_pages has 1"),
    ([64], [0], "outside"),
    ([0], [64], "outside"),
    ([-1], [0], "negative"),
    ([0.0], [0], "integers"),
    ([True], [0], "integers"),
    ([[0]], [[0]], "1-D"),
    ([0, 1], [3, 3], "repeat"),
])
def test_bad_pages(src_pages, dst_pages, match):
    lay = _llama("HND")
    with pytest.raises(PlanError, match=match):
        plan(lay, Sharding(2), lay, Sharding(2), src_pages, dst_pages)


@pytest.mark.parametrize("layers", [[2], [-1], [0, 0], ["0"]])
def test_bad_layers(layers):
    lay = _llama("HND")
    with pytest.raises(PlanError):
        plan(lay, Sharding(2), lay, Sharding(2), [0], [0], layers=layers)


def test_layer_not_in_plan_and_ranks_outside():
    lay = _llama("HND")
    p = plan(lay, Sharding(2), lay, Sharding(2), [0], [0], layers=[1])
    with pytest.raises(PlanError):
        p.layer(0)
    with pytest.raises(PlanError):
        p.writes(2, 0)


def test_planner_imports_without_libfabric():
    code = (
        "import sys\n"
        "sys.modules['kvxfer._fabric'] = None\n"  # make the native module unimportable
        "sys.modules['kvxfer.engine'] = None\n"
        "import kvxfer\n"
        "lay = kvxfer.KVLayout.vllm(2, 8, 8, 16, 4)\n"
        "p = kvxfer.plan(lay, kvxfer.Sharding(8), lay, kvxfer.Sharding(4), [0, 1], [2, 3])\n"
        "assert p.num_triples == 2 * 2 * 2 * 8, p\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
