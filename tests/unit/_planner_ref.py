"""An independent reference for the planner tests.

Nothing here uses the planner's or the geometry's offset arithmetic: each rank's memory is
viewed through numpy reshapes of the tensor shapes the engines document (vLLM
``[pages, 2, heads, page, dim]``, flash-attn ``[2, pages, page, heads, dim]``, SGLang
``[tokens, heads, dim]`` per K/V pool, layer-major ``[layers, ...]``, vLLM 0.32's packed
``[pages, heads, page, 2 * dim]`` (read as ``[pages, heads, 2, page, dim]``, vLLM's CPU kernel's
view) / ``[pages, page, heads, 2, dim]``, and its GPU rows ``[pages, heads, page, 2, dim]`` /
``[pages, page, heads, 2, dim]``, with its layers outer or
inside each page of one storage), the sharding is re-derived from the GQA rule, and a plan is
executed as byte copies between numpy arrays.
"""

from __future__ import annotations

import numpy as np

from kvxfer.layout import KVLayout, Sharding


def ref_heads(rank: int, tp: int, kv_heads: int, replicated: bool) -> list[int]:
    """Global heads a rank holds, straight from the rule in the issue."""
    if replicated:
        return list(range(kv_heads))
    if kv_heads >= tp:
        per = kv_heads // tp
        return list(range(rank * per, rank * per + per))
    return [rank // (tp // kv_heads)]


def dense_strides(kv: str, local_heads: int, page_size: int, head_dim: int, itemsize: int,
                  num_pages: int) -> tuple[int, int]:
    """(page bytes, layer bytes) of a dense layout, from the tensor shapes."""
    pb = local_heads * page_size * head_dim * itemsize
    page = 2 * pb if kv in ("fused", "packed", "packed_rows") else pb
    layer = 2 * num_pages * page if kv == "stacked" else num_pages * page
    return page, layer


def _view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reshape that refuses to copy, so writes through the view land in rank memory."""
    return np.reshape(a, shape, copy=False)


class RankMemory:
    """One rank's registered regions, and views ``page_view(layer, plane)`` of shape
    ``[pages, local_heads, page_size, head_dim * itemsize]`` (bytes, heads first)."""

    def __init__(self, layout: KVLayout, sharding: Sharding, rank: int, fill: int | None = None,
                 rng: np.random.Generator | None = None) -> None:
        self.layout = layout
        self.heads = ref_heads(rank, sharding.tp_size, layout.kv_heads, sharding.replicated)
        lh = len(self.heads)
        L, P, pages = layout.num_layers, layout.page_size, layout.num_pages
        cb = layout.head_dim * layout.np_dtype.itemsize
        self.block = (lh, P, cb) if layout.order == "HND" else (P, lh, cb)
        pb = lh * P * cb  # one (plane, page) block
        planes = 1 if layout.kv == "mla" else 2
        in_page = planes if layout.kv in ("fused", "packed", "packed_rows") else 1
        self.page_stride = in_page * pb if layout.page_stride is None else layout.page_stride
        pool = pages * self.page_stride
        per_layer = 2 * pool if layout.kv == "stacked" else pool
        pools = 2 if layout.kv == "separate" else 1
        self.pages_outer = False
        if layout.layer_regions == "per_layer":
            nregions, size = L * pools, per_layer
        else:
            self.layer_stride = per_layer if layout.layer_stride is None else layout.layer_stride
            nregions, size = pools, L * self.layer_stride
            if self.layer_stride < per_layer:  # each page of the storage holds every layer's page
                self.pages_outer = True
                size = pages * self.page_stride
        self.sizes = [size] * nregions
        if fill is None:
            self.regions = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(nregions)]
        else:
            self.regions = [np.full(size, fill, np.uint8) for _ in range(nregions)]
        self.pb, self.in_page, self.pool, self.per_layer, self.pools = pb, in_page, pool, per_layer, pools
        self.planes = planes

    def _layer_bytes(self, layer: int, pool: int) -> np.ndarray:
        """The bytes of one layer of one K/V pool (the whole layer for fused/stacked)."""
        if self.layout.layer_regions == "per_layer":
            return self.regions[layer * self.pools + pool]
        return _view(self.regions[pool], (self.layout.num_layers, self.layer_stride))[layer, : self.per_layer]

    def _layer_pages(self, layer: int, pool: int, nbytes: int) -> np.ndarray:
        """``[pages, nbytes]``: the first ``nbytes`` of each of one layer's pages (one pool)."""
        pages = self.layout.num_pages
        if self.pages_outer:  # vLLM's one storage, block-major: [pages, page_stride], layers inside
            per_page = _view(self.regions[pool], (pages, self.page_stride))
            return per_page[:, layer * self.layer_stride: layer * self.layer_stride + nbytes]
        return _view(self._layer_bytes(layer, pool), (pages, self.page_stride))[:, :nbytes]

    def page_view(self, layer: int, plane: int) -> np.ndarray:
        lay, pages = self.layout, self.layout.num_pages
        if lay.kv == "separate":
            raw = self._layer_pages(layer, plane, self.pb)
        elif lay.kv == "stacked":
            raw = _view(self._layer_bytes(layer, 0), (2, pages, self.page_stride))[plane, :, : self.pb]
        elif lay.kv == "fused":
            raw = _view(self._layer_pages(layer, 0, 2 * self.pb), (pages, 2, self.pb))[:, plane]
        elif lay.kv in ("packed", "packed_rows"):
            raw = self._layer_pages(layer, 0, 2 * self.pb)
            if lay.kv == "packed" and lay.order == "HND":  # vLLM's CPU view: [pages, heads, 2 * page, dim]
                return _view(raw, (pages, self.block[0], 2, *self.block[1:]))[:, :, plane]
            rows = _view(raw, (pages, *self.block[:2], 2, self.block[2]))   # [pages, a, b, 2, dim]: K|V rows
            v = rows[:, :, :, plane]
            return v if lay.order == "HND" else v.transpose(0, 2, 1, 3)
        else:  # mla
            raw = self._layer_pages(layer, 0, self.pb)
        v = _view(raw, (pages, *self.block))
        return v if lay.order == "HND" else v.transpose(0, 2, 1, 3)


def execute(plan, src_mem: list[RankMemory], dst_mem: list[RankMemory]) -> list[list[np.ndarray]]:
    """Run every write as a byte copy; check each lies inside its regions. Returns, per
    destination rank and region, how many times each byte was written."""
    counts = [[np.zeros(len(r), np.int64) for r in m.regions] for m in dst_mem]
    for s, sm in enumerate(src_mem):
        for d, dm in enumerate(dst_mem):
            w = plan.writes(s, d)
            if not len(w):
                continue
            assert (w.length > 0).all()
            assert ((w.src_region >= 0) & (w.src_region < len(sm.regions))).all()
            assert ((w.dst_region >= 0) & (w.dst_region < len(dm.regions))).all()
            assert (w.src_offset >= 0).all() and (w.dst_offset >= 0).all()
            assert (w.src_offset + w.length <= np.asarray(sm.sizes)[w.src_region]).all()
            assert (w.dst_offset + w.length <= np.asarray(dm.sizes)[w.dst_region]).all()
            # byte-wise gather/scatter over the concatenation of each side's regions
            sbase = np.concatenate(([0], np.cumsum(sm.sizes)))
            dbase = np.concatenate(([0], np.cumsum(dm.sizes)))
            sflat = np.concatenate(sm.regions)
            total = int(w.length.sum())
            run_start = np.concatenate(([0], np.cumsum(w.length)[:-1]))
            step = np.arange(total) - np.repeat(run_start, w.length)
            sidx = np.repeat(sbase[w.src_region] + w.src_offset, w.length) + step
            didx = np.repeat(dbase[w.dst_region] + w.dst_offset, w.length) + step
            data = sflat[sidx]
            hits = np.bincount(didx, minlength=int(dbase[-1]))
            for r in range(len(dm.regions)):
                lo, hi = dbase[r], dbase[r + 1]
                sel = (didx >= lo) & (didx < hi)
                dm.regions[r][didx[sel] - lo] = data[sel]
                counts[d][r] += hits[lo:hi]
    return counts
