"""vLLM 0.32's packed K|V form (``kv="packed"``) through the planner: byte-exact against the
independent reference under TP mismatch both ways, GQA replication, one-storage placements,
and to and from the other forms; and how its writes coalesce."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import plan

from test_planner import _check_roundtrip

L, D, P, N = 2, 4, 4, 6


def _packed(kv_heads: int, order: str = "HND", **kw) -> KVLayout:
    return KVLayout.vllm_packed(L, kv_heads, D, P, N, dtype="bfloat16", order=order, **kw)


def _cpu_storage(kv_heads: int, tp: int) -> KVLayout:
    """vLLM's CPU cache: one storage, each layer's block inside one block stride."""
    page = 2 * max(kv_heads // tp, 1) * P * D * 2
    return _packed(kv_heads, layer_regions="layer_major", layer_stride=page + 16, page_stride=L * (page + 16))


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", [
    (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 8),   # TP mismatch both ways
    (2, 4, 1), (2, 1, 4), (2, 8, 2), (1, 2, 4),   # GQA: fewer KV heads than ranks
])
def test_packed_tp_mismatch_and_gqa_byte_exact(order, kv_heads, src_tp, dst_tp):
    sp, dp = [4, 0, 5, 1], [1, 2, 3, 0]
    for dst in (_packed(kv_heads, order), _cpu_storage(kv_heads, dst_tp)):
        _check_roundtrip((_packed(kv_heads, order), Sharding(src_tp)), (dst, Sharding(dst_tp)), sp, dp, None, 7)


@pytest.mark.parametrize("other", ["vllm", "flash_attn", "sglang", "layer_major"])
def test_packed_to_and_from_other_forms(other):
    make = getattr(KVLayout, other)
    lay = make(L, 4, D, P, N, dtype="bfloat16")
    for a, b in ((_packed(4), lay), (lay, _packed(4, "NHD"))):
        _check_roundtrip((a, Sharding(2)), (b, Sharding(1)), [0, 3, 2], [5, 4, 1], None, 3)


def test_same_packed_shape_coalesces_whole_page_runs():
    """K and V of a row are neighbours on both sides, and so are rows and pages: contiguous
    pages go as one write per layer, as for the fused form."""
    for order in ("HND", "NHD"):
        lay = _packed(8, order)
        p = plan(lay, Sharding(2), lay, Sharding(2), [1, 2, 3], [2, 3, 4])
        assert (p.writes_per_pair.diagonal() == L).all() and p.num_triples == 2 * L
        assert list(p.writes(0, 0).length) == [3 * 2 * 4 * P * D * 2] * L


def test_packed_tp_mismatch_write_shapes():
    """TP2 -> TP1: under HND a source rank's heads are one contiguous run on both sides (one
    write per layer); under NHD one write per token (its 4 heads' rows, K|V each); HND into NHD
    transposes, one write per (head, token, plane) vector: an HND head keeps its K rows apart
    from its V rows (vLLM's CPU view), NHD puts them side by side."""
    hnd = plan(_packed(8), Sharding(2), _packed(8), Sharding(1), [0], [0])
    assert hnd.num_triples == L * 2 and (hnd.writes(0, 0).length == 4 * P * 2 * D * 2).all()
    nhd = plan(_packed(8, "NHD"), Sharding(2), _packed(8, "NHD"), Sharding(1), [0], [0])
    assert nhd.num_triples == L * 2 * P and (nhd.writes(0, 0).length == 4 * 2 * D * 2).all()
    mixed = plan(_packed(8), Sharding(2), _packed(8, "NHD"), Sharding(1), [0], [0])
    assert mixed.num_triples == L * 2 * 4 * P * 2 and (mixed.writes(1, 0).length == D * 2).all()


# -- the GPU backends' rows (kv="packed_rows"): K|V in each (token, head) row, HND or NHD ---------

def _rows(kv_heads: int, order: str = "NHD", **kw) -> KVLayout:
    return KVLayout.vllm_packed_rows(L, kv_heads, D, P, N, dtype="bfloat16", order=order, **kw)


def _rows_storage(kv_heads: int, tp: int, order: str, block_major: bool) -> KVLayout:
    """One storage for every layer, as ``KVCacheLayout`` places it: layers outer (LBxNC) or
    each block holding every layer's block (BLxNC)."""
    page = 2 * max(kv_heads // tp, 1) * P * D * 2
    if block_major:
        return _rows(kv_heads, order, layer_regions="layer_major", layer_stride=page, page_stride=L * page)
    return _rows(kv_heads, order, layer_regions="layer_major", layer_stride=N * page)


@pytest.mark.parametrize("src_order,dst_order", [("NHD", "NHD"), ("HND", "HND"), ("NHD", "HND"), ("HND", "NHD")])
@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", [
    (8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 8),   # TP mismatch both ways
    (2, 4, 1), (2, 1, 4), (1, 2, 4),              # GQA: fewer KV heads than ranks
])
def test_packed_rows_tp_mismatch_and_gqa_byte_exact(src_order, dst_order, kv_heads, src_tp, dst_tp):
    sp, dp = [4, 0, 5, 1], [1, 2, 3, 0]
    dsts = (_rows(kv_heads, dst_order), _rows_storage(kv_heads, dst_tp, dst_order, False),
            _rows_storage(kv_heads, dst_tp, dst_order, True))
    for dst in dsts:
        for src in (_rows(kv_heads, src_order), _rows_storage(kv_heads, src_tp, src_order, True)):
            _check_roundtrip((src, Sharding(src_tp)), (dst, Sharding(dst_tp)), sp, dp, None, 11)


@pytest.mark.parametrize("other", ["packed_nhd", "packed_cpu", "vllm", "flash_attn", "sglang"])
def test_packed_rows_to_and_from_other_forms(other):
    lay = {"packed_nhd": lambda: _packed(4, "NHD"), "packed_cpu": lambda: _packed(4)}.get(
        other, lambda: getattr(KVLayout, other)(L, 4, D, P, N, dtype="bfloat16"))()
    for a, b in ((_rows(4, "HND"), lay), (lay, _rows(4, "NHD"))):
        _check_roundtrip((a, Sharding(2)), (b, Sharding(1)), [0, 3, 2], [5, 4, 1], None, 5)


def test_packed_rows_geometry_is_a_row_per_token_and_head():
    """HND rows: a head's block is ``page`` rows of ``2 * dim`` (K|V side by side), unlike the
    CPU kernel's K rows then V rows; NHD rows are the packed NHD form's; both coalesce a
    same-shape TP2 -> TP1 the way that form allows."""
    e = 2
    g = _rows(8, "HND").resolve(Sharding(2))
    assert (g.head_stride, g.token_stride, g.plane_base) == (P * 2 * D * e, 2 * D * e, (0, D * e)) and g.packed
    cpu = _packed(8).resolve(Sharding(2))
    assert (cpu.token_stride, cpu.plane_base) == (D * e, (0, P * D * e))
    n = _rows(8, "NHD").resolve(Sharding(2))
    assert (n.head_stride, n.token_stride, n.plane_base) == (2 * D * e, 4 * 2 * D * e, (0, D * e))
    assert n == _packed(8, "NHD").resolve(Sharding(2))
    hnd = plan(_rows(8, "HND"), Sharding(2), _rows(8, "HND"), Sharding(1), [0], [0])
    assert hnd.num_triples == L * 2 and (hnd.writes(0, 0).length == 4 * P * 2 * D * e).all()
