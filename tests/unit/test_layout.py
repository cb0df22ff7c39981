"""KVLayout and Sharding: byte offsets checked against numpy index arrays of the documented
tensor shapes, and the GQA sharding rule."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout import KVLayout, Sharding


def _element_offsets(shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    """Byte offset of every element of a C-contiguous tensor of ``shape``."""
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * itemsize


# -- Sharding ---------------------------------------------------------------------------------

def test_heads_split_evenly():
    s = Sharding(4)
    assert [list(s.heads(r, 8)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.local_heads(8) == 2
    assert list(s.holders(5, 8)) == [2]


def test_fewer_heads_than_ranks_replicates_each_head():
    s = Sharding(8)
    assert [s.heads(r, 2)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert s.local_heads(2) == 1
    assert list(s.holders(1, 2)) == [4, 5, 6, 7]


def test_replicated_every_rank_holds_everything():
    s = Sharding(4, replicated=True)
    assert all(list(s.heads(r, 3)) == [0, 1, 2] for r in range(4))
    assert list(s.holders(2, 3)) == [0, 1, 2, 3]
    assert s.local_heads(3) == 3


@pytest.mark.parametrize("kv_heads,tp", [(6, 4), (4, 6), (3, 2), (2, 3)])
def test_uneven_sharding_rejected(kv_heads, tp):
    with pytest.raises(LayoutError):
        Sharding(tp).local_heads(kv_heads)


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_bad_tp_size(tp):
    with pytest.raises(LayoutError):
        Sharding(tp)


def test_rank_and_head_range_checked():
    with pytest.raises(LayoutError):
        Sharding(2).heads(2, 8)
    with pytest.raises(LayoutError):
        Sharding(2).holders(8, 8)


# -- offsets against the engines' tensor shapes ------------------------------------------------

L, H, D, P, N = 3, 8, 4, 16, 5


def _check(layout: KVLayout, sharding: Sharding, region_of, tensor_offset) -> None:
    """For every (layer, plane, page, local head, token): region and offset equal the reference."""
    g = layout.resolve(sharding)
    lh = sharding.local_heads(layout.kv_heads)
    for layer in range(layout.num_layers):
        for plane in range(layout.planes):
            assert g.region(layer, plane) == region_of(layer, plane)
            for page in range(layout.num_pages):
                for h in range(lh):
                    for t in range(layout.page_size):
                        assert g.offset(layer, plane, page, h, t) == tensor_offset(layer, plane, page, h, t)


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_vllm_flashinfer_hnd_and_nhd(tp):
    lh = max(H // tp, 1)
    lay = KVLayout.vllm(L, H, D, P, N, dtype="bfloat16", order="HND")
    hnd = _element_offsets((N, 2, lh, P, D), 2)
    _check(lay, Sharding(tp), lambda l, k: l, lambda l, k, p, h, t: hnd[p, k, h, t, 0])
    lay = KVLayout.vllm(L, H, D, P, N, dtype="bfloat16", order="NHD")
    nhd = _element_offsets((N, 2, P, lh, D), 2)
    _check(lay, Sharding(tp), lambda l, k: l, lambda l, k, p, h, t: nhd[p, k, t, h, 0])
    assert lay.region_sizes(Sharding(tp)) == (hnd.size * 2,) * L


def test_flash_attn_stacked():
    lay = KVLayout.flash_attn(L, H, D, P, N, dtype="float32")
    ref = _element_offsets((2, N, P, H // 2, D), 4)
    _check(lay, Sharding(2), lambda l, k: l, lambda l, k, p, h, t: ref[k, p, t, h, 0])


def test_sglang_token_pools():
    lay = KVLayout.sglang(L, H, D, P, N, dtype="bfloat16")
    assert lay.order == "NHD" and lay.num_regions == 2 * L
    pool = _element_offsets((N * P, H // 4, D), 2)  # [tokens, heads, dim]
    _check(lay, Sharding(4), lambda l, k: 2 * l + k, lambda l, k, p, h, t: pool[p * P + t, h, 0])
    assert lay.region_sizes(Sharding(4)) == (pool.size * 2,) * (2 * L)


def test_layer_major_single_region():
    lay = KVLayout.layer_major(L, H, D, P, N, dtype="uint8")
    ref = _element_offsets((L, N, 2, H, P, D), 1)
    _check(lay, Sharding(1), lambda l, k: 0, lambda l, k, p, h, t: ref[l, p, k, h, t, 0])
    assert lay.region_sizes(Sharding(1)) == (ref.size,)


def test_layer_major_separate_pools():
    lay = KVLayout.layer_major(L, H, D, P, N, dtype="uint8", kv="separate", order="NHD")
    ref = _element_offsets((L, N, P, H, D), 1)
    _check(lay, Sharding(1), lambda l, k: k, lambda l, k, p, h, t: ref[l, p, t, h, 0])
    assert lay.region_sizes(Sharding(1)) == (ref.size, ref.size)


def test_mla_latent():
    lay = KVLayout.mla(L, 576, P, N, dtype="bfloat16")
    assert lay.planes == 1 and lay.kv_heads == 1
    ref = _element_offsets((N, P, 576), 2)
    _check(lay, Sharding(8, replicated=True), lambda l, k: l, lambda l, k, p, h, t: ref[p, t, 0])


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_vllm_packed_hnd_and_nhd(tp):
    """vLLM 0.32: per layer [blocks, heads, block, 2*dim] (HND) / [blocks, block, heads, 2*dim]
    (NHD). HND as vLLM's CPU kernel reads it: a head's [block, 2*dim] viewed as [2*block, dim],
    its block K rows then its block V rows; NHD: K in the first dim elements of a row, V in the
    second."""
    lh = max(H // tp, 1)
    lay = KVLayout.vllm_packed(L, H, D, P, N, dtype="bfloat16", order="HND")
    hnd = _element_offsets((N, lh, 2, P, D), 2)     # the CPU kernel's view, chunked on dim 2
    _check(lay, Sharding(tp), lambda l, k: l, lambda l, k, p, h, t: hnd[p, h, k, t, 0])
    assert lay.region_sizes(Sharding(tp)) == (hnd.size * 2,) * L
    lay = KVLayout.vllm_packed(L, H, D, P, N, dtype="bfloat16", order="NHD")
    nhd = _element_offsets((N, P, lh, 2 * D), 2)
    _check(lay, Sharding(tp), lambda l, k: l, lambda l, k, p, h, t: nhd[p, t, h, k * D])


def test_vllm_packed_one_storage_layers_outer_and_pages_outer():
    """vLLM's CPU cache: every layer a view into one storage, at the layer_stride and block
    stride its kv_cache_config gives, layers outer or inside each block."""
    lh, isz = H // 2, 4
    page = lh * P * 2 * D * isz
    outer = _element_offsets((L, N, lh, 2, P, D), isz)  # [layers, blocks, heads, K|V, block, dim]
    lay = KVLayout.vllm_packed(L, H, D, P, N, dtype="float32", layer_regions="layer_major")
    _check(lay, Sharding(2), lambda l, k: 0, lambda l, k, p, h, t: outer[l, p, h, k, t, 0])
    assert lay.region_sizes(Sharding(2)) == (outer.size * isz,)
    inner = _element_offsets((N, L, lh, 2, P, D), isz)  # [blocks, layers, heads, K|V, block, dim]
    lay = KVLayout.vllm_packed(L, H, D, P, N, dtype="float32", layer_regions="layer_major",
                               layer_stride=page, page_stride=L * page)
    _check(lay, Sharding(2), lambda l, k: 0, lambda l, k, p, h, t: inner[p, l, h, k, t, 0])
    assert lay.region_sizes(Sharding(2)) == (inner.size * isz,)
    with pytest.raises(LayoutError, match="inside a page"):  # layers would overlap
        KVLayout.vllm_packed(L, H, D, P, N, dtype="float32", layer_regions="layer_major",
                             layer_stride=page, page_stride=L * page - 1).resolve(Sharding(2))
    with pytest.raises(LayoutError, match="stacked"):  # a stacked V pool cannot sit inside a page
        KVLayout.layer_major(L, H, D, P, N, kv="stacked", layer_stride=page // 2,
                             page_stride=L * page).resolve(Sharding(2))


def test_explicit_strides_pad_pages_and_layers():
    dense_page = 2 * 2 * P * D * 2  # K and V, 2 local heads, bf16
    lay = KVLayout.layer_major(L, H, D, P, N, order="HND", page_stride=dense_page + 64,
                               layer_stride=N * (dense_page + 64) + 4096)
    g = lay.resolve(Sharding(4))
    assert g.page_stride == dense_page + 64 and g.layer_stride == N * (dense_page + 64) + 4096
    assert g.offset(2, 1, 3, 1, 5) == 2 * g.layer_stride + 3 * g.page_stride + dense_page // 2 + (P + 5) * D * 2
    with pytest.raises(LayoutError, match="page_stride"):
        KVLayout.vllm(L, H, D, P, N, page_stride=dense_page - 1).resolve(Sharding(4))
    with pytest.raises(LayoutError, match="layer_stride"):
        KVLayout.layer_major(L, H, D, P, N, layer_stride=8).resolve(Sharding(4))
    with pytest.raises(LayoutError, match="layer_major"):
        KVLayout.vllm(L, H, D, P, N, layer_stride=1 << 20)


# -- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(order="HDN"), "order"),
    (dict(kv="interleaved"), "kv"),
    (dict(layer_regions="page_major"), "layer_regions"),
    (dict(kv="mla"), "MLA"),
    (dict(num_pages=0), "num_pages"),
    (dict(head_dim=2.0), "head_dim"),
    (dict(dtype="float99"), "dtype"),
])
def test_bad_layouts(kw, match):
    base = dict(num_layers=2, kv_heads=8, head_dim=4, page_size=16, num_pages=4)
    with pytest.raises(LayoutError, match=match):
        KVLayout(**{**base, **kw})


def test_dtype_aliases_keep_size_and_identity():
    assert KVLayout.vllm(1, 1, 1, 1, 1, dtype="bfloat16").itemsize == 2
    assert KVLayout.vllm(1, 1, 1, 1, 1, dtype="torch.bfloat16").itemsize == 2
    assert KVLayout.vllm(1, 1, 1, 1, 1, dtype="fp8").itemsize == 1
    assert KVLayout.vllm(1, 1, 1, 1, 1, dtype=np.float32).itemsize == 4
    bf16 = KVLayout.vllm(1, 1, 1, 1, 1, dtype="bfloat16").np_dtype
    assert bf16 != KVLayout.vllm(1, 1, 1, 1, 1, dtype="float16").np_dtype


@pytest.mark.parametrize("a, b, same", [
    ("float8_e4m3fn", "float8_e5m2", False),          # one byte each, other numbers
    ("torch.float8_e4m3fn", "torch.float8_e5m2fnuz", False),
    ("bfloat16", np.uint16, False),
    ("bfloat16", "float16", False),
    ("bf16", "torch.bfloat16", True),
    ("fp16", np.float16, True),
    ("half", "float16", True),
    ("fp8", "float8_e4m3fn", True),                    # generic fp8: the caller did not say which
    (np.float32, "float32", True),
])
def test_plans_join_layouts_of_one_number_format_only(a, b, same):
    """The element size decides offsets, but the format decides what the bytes mean: a plan
    between layouts of one size and two formats would land valid bytes read as wrong numbers."""
    from kvxfer import plan

    la, lb = KVLayout.vllm(2, 2, 4, 4, 4, dtype=a), KVLayout.vllm(2, 2, 4, 4, 4, dtype=b)
    if same:
        assert plan(la, Sharding(1), lb, Sharding(1), [0], [1]).num_triples > 0
    else:
        with pytest.raises(LayoutError, match="dtype"):
            plan(la, Sharding(1), lb, Sharding(1), [0], [1])


def test_resolve_needs_a_sharding():
    with pytest.raises(LayoutError):
        KVLayout.vllm(1, 1, 1, 1, 1).resolve(4)
