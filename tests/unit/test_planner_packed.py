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
