"""The ``KVLayout`` of the KV cache vLLM allocated, read from the tensors it hands to
``register_kv_caches`` and checked against them: one region for the whole storage when every
layer is a view into one allocation (vLLM's CPU backend), else one region per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.errors import UnsupportedError
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


def cache_regions(kv_caches: dict, kv_cache_config: Any, total_kv_heads: int, tp_size: int) -> CacheRegions:
    """The layout and regions of vLLM's KV cache (the packed K|V form of vLLM 0.32's CPU
    backend: per layer ``[blocks, kv_heads, block_size, 2 * head_size]``, head-major blocks).
    Raises ``UnsupportedError`` for anything else, naming what it found."""
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
    e = t0.element_size()
    interior = (bs * two_d, two_d, 1)
    for n, t in zip(names, ts):
        if t.shape != t0.shape or t.dtype != t0.dtype or tuple(t.stride()[1:]) != interior \
                or t.stride(0) != t0.stride(0) or t.device.type != t0.device.type:
            raise UnsupportedError(f"layer {n}: shape {tuple(t.shape)} strides {tuple(t.stride())} {t.dtype} is not "
                                   f"the head-major packed form of the first layer ({tuple(t0.shape)}, "
                                   f"{tuple(t0.stride())})")
    if t0.device.type != "cpu":
        raise UnsupportedError(f"KV cache on {t0.device}: this connector is tested on vLLM's CPU backend only")
    block_stride = t0.stride(0) * e
    sharding = Sharding(tp_size)
    if sharding.local_heads(total_kv_heads) != lh:
        raise UnsupportedError(f"the cache holds {lh} KV heads per rank, but {total_kv_heads} heads over "
                               f"TP{tp_size} give {sharding.local_heads(total_kv_heads)}")
    dtype = str(t0.dtype)
    st = t0.untyped_storage()
    base, size = st.data_ptr(), st.nbytes()
    offs = [t.data_ptr() - base for t in ts]
    one_storage = all(t.untyped_storage().data_ptr() == base for t in ts)
    L = len(ts)
    if one_storage and L > 1:
        stride = offs[1] - offs[0]
        if stride <= 0 or any(offs[i] - offs[0] != i * stride for i in range(L)):
            raise UnsupportedError(f"layers sit at offsets {offs[:4]}... in their storage, not one layer_stride apart")
        layout = KVLayout.vllm_packed(L, total_kv_heads, two_d // 2, bs, nblocks, dtype, "HND",
                                      layer_regions="layer_major", layer_stride=stride, page_stride=block_stride)
        (need,) = layout.region_sizes(sharding)
        if offs[0] + need > size:
            raise UnsupportedError(f"the layout needs {need} bytes from offset {offs[0]}, the storage has {size}")
        regions = [(base + offs[0], need)]
    else:
        layout = KVLayout.vllm_packed(L, total_kv_heads, two_d // 2, bs, nblocks, dtype, "HND",
                                      page_stride=block_stride)
        need = layout.region_sizes(sharding)[0]
        regions = [(t.data_ptr(), need) for t in ts]
        for n, t in zip(names, ts):
            if t.data_ptr() + need > t.untyped_storage().data_ptr() + t.untyped_storage().nbytes():
                raise UnsupportedError(f"layer {n} is smaller than its {need} bytes")
    return CacheRegions(layout, sharding, regions, names, ts)
