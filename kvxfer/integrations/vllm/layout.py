"""The ``KVLayout`` of the KV cache vLLM allocated, read from the tensors it hands to
``register_kv_caches`` and checked against them (the CPU backend's packed form, or the GPU
backends' K|V rows in the order ``KVCacheLayout`` names): one region for the whole storage
when every layer is a view into one allocation, else one region per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvxfer.errors import LayoutError, UnsupportedError
from kvxfer.layout import KVLayout, Sharding


@dataclass
class CacheRegions:
    """What to register: ``layout`` for ``sharding``, and the ``(pointer, nbytes)`` regions in the
    layout's region order; ``layer_names`` in layer order; ``owner`` keeps the memory alive."""

    layout: KVLayout
    sharding: Sharding
    regions: list[tuple[int, int]]
    layer_names: list[str]
    owner: Any


def _layer_order(kv_caches: dict, kv_cache_config: Any) -> list[str]:
    names: list[str] = []
    for t in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        names += [n for n in t.layers if n in kv_caches and n not in names]
    if not names:
        for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            names += [n for n in g.layer_names if n in kv_caches and n not in names]
    names += [n for n in kv_caches if n not in names]
    return names


def _order(t: Any) -> str:
    """HND or NHD from a layer tensor's strides over the logical ``[blocks, kv_heads,
    block_size, 2*head_size]`` (a size-1 axis's stride says nothing)."""
    _, lh, bs, two_d = t.shape
    _, sh, sn, sc = t.stride()
    if sc == 1 and (bs == 1 or sn == two_d) and (lh == 1 or sh == bs * two_d):
        return "HND"
    if sc == 1 and (lh == 1 or sh == two_d) and (bs == 1 or sn == lh * two_d):
        return "NHD"
    raise UnsupportedError(f"a layer of shape {tuple(t.shape)} has strides {tuple(t.stride())}: not a block of "
                           "HND [kv_heads, block_size, 2*head_size] or NHD [block_size, kv_heads, 2*head_size] "
                           "rows (a KVCacheLayout with the heads outside the blocks, LHBNC or BHLNC, is not "
                           "described by kvxfer's layouts)")


def cache_regions(kv_caches: dict, kv_cache_config: Any, total_kv_heads: int, tp_size: int,
                  rows: Optional[bool] = None) -> CacheRegions:
    """The layout and regions of vLLM 0.32's KV cache: per layer the logical ``[blocks,
    kv_heads, block_size, 2 * head_size]``, stored as ``KVCacheLayout`` places it (blocks HND
    or NHD inside; every layer its own allocation, or one storage with the layers outer or
    inside each block). ``rows``: the GPU backends' K|V in each (token, head) row
    (``packed_rows``); False, the CPU backend's kernel view (HND only: ``packed``); None, by
    the tensors' device. Raises ``UnsupportedError`` for anything else, naming what it found."""
    import torch

    names = _layer_order(kv_caches, kv_cache_config)
    ts = [kv_caches[n] for n in names]
    t0 = ts[0]
    if any(not isinstance(t, torch.Tensor) for t in ts) or t0.dim() != 4:
        raise UnsupportedError("kvxfer's vLLM connector expects one 4-D tensor per layer "
                               f"[blocks, kv_heads, block_size, 2*head_size], got {tuple(t0.shape)}")
    nblocks, lh, bs, two_d = t0.shape
    if two_d % 2:
        raise UnsupportedError(f"last dimension {two_d} is not 2 * head_size")
    if rows is None:
        rows = t0.device.type != "cpu"
    order = _order(t0)
    if not rows and order != "HND":
        raise UnsupportedError(f"vLLM's CPU backend keeps its blocks HND; this cache is {order} "
                               f"(strides {tuple(t0.stride())})")
    e = t0.element_size()
    for n, t in zip(names, ts):
        if t.shape != t0.shape or t.dtype != t0.dtype or t.stride() != t0.stride() \
                or t.device != t0.device:
            raise UnsupportedError(f"layer {n}: shape {tuple(t.shape)} strides {tuple(t.stride())} {t.dtype} "
                                   f"on {t.device} is not the form of the first layer ({tuple(t0.shape)}, "
                                   f"{tuple(t0.stride())}, {t0.device})")
    block_stride = t0.stride(0) * e
    sharding = Sharding(tp_size)
    if sharding.local_heads(total_kv_heads) != lh:
        raise UnsupportedError(f"the cache holds {lh} KV heads per rank, but {total_kv_heads} heads over "
                               f"TP{tp_size} give {sharding.local_heads(total_kv_heads)}")
    dtype = str(t0.dtype)
    make = KVLayout.vllm_packed_rows if rows else KVLayout.vllm_packed
    st = t0.untyped_storage()
    base, size = st.data_ptr(), st.nbytes()
    offs = [t.data_ptr() - base for t in ts]
    one_storage = all(t.untyped_storage().data_ptr() == base for t in ts)
    L = len(ts)
    try:
        if one_storage and L > 1:
            # layer-major (LBxNC: a layer's blocks, then the next layer's) or block-major
            # (BLxNC: each block stride holds every layer's block); resolve() tells them apart
            stride = offs[1] - offs[0]
            if stride <= 0 or any(offs[i] - offs[0] != i * stride for i in range(L)):
                raise UnsupportedError(f"layers sit at offsets {offs[:4]}... in their storage, not one layer_stride "
                                       "apart")
            layout = make(L, total_kv_heads, two_d // 2, bs, nblocks, dtype, order,
                          layer_regions="layer_major", layer_stride=stride, page_stride=block_stride)
            (need,) = layout.region_sizes(sharding)
            if offs[0] + need > size:
                raise UnsupportedError(f"the layout needs {need} bytes from offset {offs[0]}, the storage has {size}")
            regions = [(base + offs[0], need)]
        else:
            layout = make(L, total_kv_heads, two_d // 2, bs, nblocks, dtype, order, page_stride=block_stride)
            need = layout.region_sizes(sharding)[0]
            regions = [(t.data_ptr(), need) for t in ts]
            for n, t in zip(names, ts):
                if t.data_ptr() + need > t.untyped_storage().data_ptr() + t.untyped_storage().nbytes():
                    raise UnsupportedError(f"layer {n} is smaller than its {need} bytes")
    except LayoutError as exc:
        raise UnsupportedError(f"vLLM's cache ({tuple(t0.shape)}, strides {tuple(t0.stride())}, layers at "
                               f"{offs[:4]}...) is no kvxfer layout: {exc}") from exc
    return CacheRegions(layout, sharding, regions, names, ts)
