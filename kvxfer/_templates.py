"""Per-page templates: a request's writes as one page's writes shifted per page, a replica choice as a permutation.

The messenger's fast road past :func:`kvxfer.planner.plan`. A page's writes do not depend on
the other pages: planning source page 0 -> destination page 0 once per peer and shifting it by
each page's offset (``page * page_stride`` on both sides) gives the writes ``plan`` gives, in
its order within a region pair (layer, then source page, then entry); the engine coalesces
contiguous pages as ``plan`` would have (the property tests in tests/unit/test_planner_templates.py
coalesce both and compare them write for write).

Where sources hold replicas (a replicated sharding, or fewer heads than source ranks) ``plan``
cuts each segment's page list into ``r`` contiguous chunks and deals them to a permutation of
the ``r`` candidates drawn from ``numpy.random.default_rng(seed)``. Every candidate of a segment
holds the segment's heads at the same place (one geometry per sharding), so its writes to the
destination are the same template: a request only draws the permutation (``assign``, the same
draws in the same order as ``plan``) and shifts the template over each owner's chunk. Nothing is
planned per request. A prefill rank process builds the template of its own source ranks; a
decoder learns from ``writing_ranks`` which source ranks write to its ranks, without planning
pages. ``plan_layers`` gives a plan's writes (the token path, where page sizes differ) in the
same per-region-pair form as ``PageTemplate.pair_layers``, for arming.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np

from kvxfer._plan import TransferPlan
from kvxfer.layout import KVLayout, Sharding
from kvxfer.planner import _inner, _pair_template, _segments, plan

_fabric: Any
try:                        # the native template shift (pair_writes); numpy's where it is absent
    from kvxfer import _fabric
except ImportError:
    _fabric = None

__all__ = ["PageTemplate", "chooses_replicas", "plan_layers", "request_seed", "writing_ranks"]

#: one region pair's writes of several layers, for ``Watcher.arm_groups``: ``(src rank, dst
#: rank, src region, dst region, layers, so, do, ln, starts)``, layer ``layers[g]``'s triples
#: at ``[starts[g], starts[g + 1])``; layers and triples uint64, starts int64 (the arrays the
#: watcher's native pass takes as they are)
ArmBatch = tuple


#: Elements (int64 or uint64) that a ``PageTemplate`` keeps of per-page-count work (orders,
#: lengths, group starts) before it starts over: 32 MiB.
_SHAPE_BUDGET = 1 << 22


def request_seed(request_id: bytes) -> int:
    """The replica seed of a request: a hash of its encoded id, so load spreads over the
    replicas and every process (each prefill rank, the decoder) draws the same owners."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(bytes(request_id), digest_size=8).digest(), "little")


def chooses_replicas(src_layout: KVLayout, src_sharding: Sharding) -> bool:
    """Whether a plan from this source draws owners per request (replicated or GQA/MLA with
    fewer heads than ranks): then which rank writes a page depends on the seed."""
    return bool(src_sharding.replicated or src_layout.kv_heads < src_sharding.tp_size)


def _draws(src_layout: KVLayout, src_sharding: Sharding, dst_sharding: Sharding) -> list[tuple[int, list[int]]]:
    """``(destination rank, candidate source ranks)`` per segment, in ``plan``'s draw order."""
    kv_heads = src_layout.kv_heads
    return [(d, [int(c) for c in cands]) for d in range(dst_sharding.tp_size)
            for _, _, cands, _ in _segments(dst_sharding.heads(d, kv_heads), src_sharding, kv_heads)]


def _owners(rng: np.random.Generator, cands: list[int]) -> list[int]:
    """One segment's owners, chunk j to ``owners[j]``: ``plan``'s draw (a permutation when
    there is more than one candidate, nothing drawn otherwise)."""
    return [int(c) for c in rng.permutation(np.asarray(cands))] if len(cands) > 1 else cands


def _chunk(j: int, r: int, n: int) -> tuple[int, int]:
    """Chunk ``j`` of ``r`` of a page list of ``n``, contiguous in list order (``plan``'s cut)."""
    return -(-j * n // r), -(-(j + 1) * n // r)


def writing_ranks(src_layout: KVLayout, src_sharding: Sharding, dst_layout: KVLayout, dst_sharding: Sharding,
                  dst_ranks: Iterable[int], num_pages: int, seed: int | None = None) -> tuple[int, ...]:
    """The source ranks that ``plan(..., seed=seed)`` of ``num_pages`` pages has write to any
    of ``dst_ranks``: the same draw as ``plan`` (candidates per segment, chunk j of r to the
    j-th of a permutation), without building a template. Twin of ``plan``'s owner rule."""
    n = int(num_pages)
    want = set(int(d) for d in dst_ranks)
    segs = _draws(src_layout, src_sharding, dst_sharding)
    out: set[int] = set()
    if all(len(c) <= n for _, c in segs):          # every chunk has a page: every candidate writes
        for d, cands in segs:
            if d in want:
                out.update(cands)
        return tuple(sorted(out))
    rng = np.random.default_rng(seed)
    for d, cands in segs:
        owners = _owners(rng, cands)
        if d in want:
            r = len(cands)
            out.update(s for j, s in enumerate(owners) if _chunk(j, r, n)[0] < _chunk(j, r, n)[1])
    return tuple(sorted(out))


class PageTemplate:
    """The writes of source page 0 -> destination page 0 from ``src_ranks`` to ``dst_ranks``
    (every candidate of every segment), shifted per page: ``rows`` per (rank pair, region pair)
    as ``(s, d, src region, dst region, so, do, ln, layer)``; ``pairs`` per rank pair as ``(s,
    d, [(src region, dst region)], so, do, ln, counts, key)`` with the region pairs' writes
    concatenated (``counts`` per region pair) and ``key`` = region pair index x layers + layer.
    ``assign`` says which pair writes which pages for one request (the replica draw)."""

    def __init__(self, src_layout: KVLayout, src_sharding: Sharding, dst_layout: KVLayout,
                 dst_sharding: Sharding, src_ranks: Iterable[int], dst_ranks: Iterable[int]) -> None:
        plan(src_layout, src_sharding, dst_layout, dst_sharding, [], [])    # every check plan makes
        sg, dg = src_layout.resolve(src_sharding), dst_layout.resolve(dst_sharding)
        self.src_stride, self.dst_stride = sg.page_stride, dg.page_stride
        self.replicas = chooses_replicas(src_layout, src_sharding)
        self.num_layers = nl = max(1, src_layout.num_layers)
        srcs, dsts = set(int(s) for s in src_ranks), set(int(d) for d in dst_ranks)
        kv_heads, one = src_layout.kv_heads, np.zeros(1, np.int64)
        templates = {}
        for d in sorted(dsts):
            dheads = dst_sharding.heads(d, kv_heads)
            for h0, nh, cands, src_h0 in _segments(dheads, src_sharding, kv_heads):
                mine = [int(c) for c in cands if int(c) in srcs]
                if mine:       # the same writes whichever candidate owns the page
                    t = _pair_template(one, one, sg, dg, *_inner(sg, dg, nh, src_h0, h0 - dheads.start))
                    templates.update(((c, d), t) for c in mine)
        p1 = TransferPlan(src_tp=src_sharding.tp_size, dst_tp=dst_sharding.tp_size,
                          layers=tuple(range(src_layout.num_layers)), num_pages=1, src_geometry=sg,
                          dst_geometry=dg, src_order=src_layout.order, dst_order=dst_layout.order,
                          templates=templates)
        rows = []
        for s, d in p1.pairs:
            w = p1.writes(s, d)
            key = w.src_region.astype(np.int64) * (1 << 32) + w.dst_region
            for k in dict.fromkeys(key.tolist()):
                sel = key == k
                rows.append((s, d, k >> 32, k & 0xFFFFFFFF, w.src_offset[sel], w.dst_offset[sel], w.length[sel],
                             w.layer[sel]))
        self.rows = rows
        by_pair: dict[tuple[int, int], list] = {}
        for row in rows:
            by_pair.setdefault((row[0], row[1]), []).append(row)
        self.pairs = []
        self._keys = []            # per pair: (keys present, sorted; writes per key; key range per region pair)
        for (s, d), rs in by_pair.items():
            key = np.concatenate([i * nl + r[7].astype(np.int64) for i, r in enumerate(rs)])
            self.pairs.append((s, d, [(r[2], r[3]) for r in rs],
                               np.concatenate([r[4] for r in rs]).astype(np.uint64),
                               np.concatenate([r[5] for r in rs]).astype(np.uint64),
                               np.concatenate([r[6] for r in rs]).astype(np.uint64),
                               np.array([len(r[6]) for r in rs], np.int64), key))
            ukey, kcount = np.unique(key, return_counts=True)
            bounds = np.searchsorted(ukey // nl, np.arange(len(rs) + 1))
            # compact: each (region pair, layer)'s writes of one page lie within one page stride,
            # so (page, entry) order is source-offset order; else (K and V planes stacked in one
            # region) the writes are sorted by source offset per request, as plan sorts them
            so, ln = self.pairs[-1][3], self.pairs[-1][5]
            first = np.searchsorted(key, ukey)
            lo = np.minimum.reduceat(so, first) if len(so) else so
            hi = np.maximum.reduceat(so + ln, first) if len(so) else so
            self._keys.append((ukey, kcount.astype(np.int64), bounds.tolist(),
                               bool((hi - lo <= np.uint64(self.src_stride)).all())))
        self._index = {(p[0], p[1]): i for i, p in enumerate(self.pairs)}
        self._draw = _draws(src_layout, src_sharding, dst_sharding) if self.replicas else []
        # (pair, pages) -> what depends on the page count only (compact pairs: the planner's
        # order and the lengths in it; every pair: each region pair's slice, layers and group
        # starts), read-only and shared; dropped whole past _SHAPE_BUDGET elements
        self._orders: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._shapes: dict[tuple[int, int], list[tuple[int, int, np.ndarray, np.ndarray]]] = {}
        self._cached = 0

    @staticmethod
    def by_source(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Both page lists ordered by source page (as ``plan`` orders them): the same arrays
        where the source pages already ascend."""
        if len(src_pages) > 1 and not (_fabric is not None and _fabric.pages_ascending(src_pages)):
            order = np.argsort(src_pages, kind="stable")
            return src_pages[order], dst_pages[order]
        return src_pages, dst_pages

    def assign(self, src_pages: np.ndarray, dst_pages: np.ndarray,
               seed: Optional[int] = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Which rank pair writes which pages of one request: ``(pair index, source pages,
        destination pages)``, each pair's pages ordered by ``by_source``. Without replicas every
        pair moves every page; with them each segment's chunk j goes to the j-th owner of
        ``plan``'s draw for ``seed`` (a permutation of the candidates), pairs with no page left out."""
        dp = np.asarray(dst_pages, np.int64)
        return self.assign_part(src_pages, dp, np.arange(len(dp)), seed)

    def assign_part(self, src_pages: np.ndarray, dst_pages: np.ndarray, part: np.ndarray,
                    seed: Optional[int] = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``assign`` of some pages of a request only (a chunk): ``part`` are their positions
        in the request's ``dst_pages`` (ascending), ``src_pages`` their source pages. Each page
        goes to the pair the whole request's draw gives it (the owners a chunk's own draw would
        pick could be ranks the request never asked)."""
        dp_all = np.asarray(dst_pages, np.int64)
        part = np.asarray(part, np.int64)
        sp = np.asarray(src_pages, np.int64)
        if len(part) == 0:
            return []
        dp = dp_all if len(part) == len(dp_all) else dp_all[part]      # every page: part is 0..n-1
        if not self.replicas:
            a, b = self.by_source(sp, dp)
            return [(i, a, b) for i in range(len(self.pairs))]
        n = len(dp_all)
        rng = np.random.default_rng(seed)
        # part ascends, so chunk j's pages are one slice of it (its _chunk bounds searched
        # once per candidate count); already in source order where the source pages ascend
        ordered = len(sp) < 2 or bool((sp[1:] >= sp[:-1]).all())
        cuts: dict[int, list[int]] = {}
        out = []
        for d, cands in self._draw:
            r = len(cands)
            cut = cuts.get(r)
            if cut is None:
                cut = cuts[r] = np.searchsorted(part, [_chunk(j, r, n)[0] for j in range(r)] + [n]).tolist()
            for j, s in enumerate(_owners(rng, cands)):
                i = self._index.get((s, d))
                lo, hi = cut[j], cut[j + 1]
                if i is not None and hi > lo:
                    out.append((i, sp[lo:hi], dp[lo:hi]) if ordered else (i, *self.by_source(sp[lo:hi], dp[lo:hi])))
        return out

    def pair_writes(self, i: int, sp: np.ndarray, dp: np.ndarray) -> tuple[np.ndarray, ...]:
        """Rank pair ``i``'s writes for pages ordered by ``by_source``: ``(so, do, ln, counts)``
        in the planner's order within each region pair (region pair, layer, source offset:
        page then entry where a page's writes lie within its page stride)."""
        _, _, _, so, do, ln, counts, key = self.pairs[i]
        n = len(sp)
        if n == 1:
            return so + int(sp[0]) * self.src_stride, do + int(dp[0]) * self.dst_stride, ln, counts
        if self._keys[i][3]:
            hit = self._orders.get((i, n))
            if hit is None:
                m = len(so)
                idx = np.lexsort((np.tile(np.arange(m), n), np.repeat(np.arange(n), m), np.tile(key, n)))
                hit = self._keep(self._orders, (i, n), (idx, np.tile(ln, n)[idx], counts * n), 2 * len(idx))
            idx, ln_n, counts_n = hit
            # page p's entry e is (page, entry) pair p * m + e: shifted and ordered in one pass
            ab = None if _fabric is None else _fabric.shift_pages(so, do, sp, dp, self.src_stride, self.dst_stride,
                                                                  idx)
            if ab is not None:
                return ab[0], ab[1], ln_n, counts_n
        a = (so[None, :] + (sp * self.src_stride)[:, None].astype(np.uint64)).ravel()
        b = (do[None, :] + (dp * self.dst_stride)[:, None].astype(np.uint64)).ravel()
        if self._keys[i][3]:
            return a[idx], b[idx], ln_n, counts_n
        idx = np.lexsort((a, np.tile(key, n)))       # stable: ties keep (page, entry) order
        return a[idx], b[idx], np.tile(ln, n)[idx], counts * n

    def _keep(self, cache: dict, key: tuple[int, int], value: Any, size: int) -> Any:
        """Store ``value`` (arrays, made read-only) in one of the page-count caches, emptying
        both first once ``size`` more elements would pass the budget."""
        if self._cached + size > _SHAPE_BUDGET:
            self._orders.clear()
            self._shapes.clear()
            self._cached = 0
        for v in (value if isinstance(value, tuple) else ()):
            v.setflags(write=False)
        cache[key] = value
        self._cached += size
        return value

    def _shape(self, i: int, n: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """Rank pair ``i``'s region pairs for ``n`` pages: ``(a, b, layers, starts)``, their
        triples ``[a, b)`` of ``pair_writes``, the layer of each group and the groups' starts."""
        hit = self._shapes.get((i, n))
        if hit is None:
            ukey, kcount, bounds, _ = self._keys[i]
            cum = np.zeros(len(ukey) + 1, np.int64)
            np.cumsum(kcount * n, out=cum[1:])
            hit = []
            for r in range(len(bounds) - 1):
                ka, kb = bounds[r], bounds[r + 1]
                a, b = int(cum[ka]), int(cum[kb])
                lay, st = (ukey[ka:kb] % self.num_layers).astype(np.uint64), cum[ka:kb + 1] - a
                lay.setflags(write=False)
                st.setflags(write=False)
                hit.append((a, b, lay, st))
            self._keep(self._shapes, (i, n), hit, 2 * len(ukey) + 1)
        return hit

    def pair_layers(self, i: int, sp: np.ndarray, dp: np.ndarray) -> list[ArmBatch]:
        """``pair_writes`` split for arming: one ``ArmBatch`` per region pair, its layers as
        groups (layer ``layers[g]`` = triples ``[starts[g], starts[g + 1])``)."""
        s, d, regs = self.pairs[i][:3]
        so, do, ln, _ = self.pair_writes(i, sp, dp)
        return [(s, d, sr, dr, lay, so[a:b], do[a:b], ln[a:b], st)
                for (sr, dr), (a, b, lay, st) in zip(regs, self._shape(i, len(sp)))]


def plan_layers(p: TransferPlan, src_ranks: Any, dst_ranks: Any) -> list[ArmBatch]:
    """A plan's writes from ``src_ranks`` to ``dst_ranks`` as ``ArmBatch`` es, one per region
    pair: every layer of a template group in one batch where regions do not move per layer,
    else one batch per (group, layer) (then every layer is its own region pair)."""
    sg, dg = p.src_geometry, p.dst_geometry
    lay = np.asarray(p.layers, np.int64)
    lay_u = lay.astype(np.uint64)
    nl = len(lay)
    out = []
    for s, d in p.pairs:
        if s not in src_ranks or d not in dst_ranks:
            continue
        t = p._t[(s, d)]
        for sr, dr, a, b in t.groups:
            m = b - a
            # offsets are never negative: as uint64, the form the watcher's native pass takes
            so = (t.src_offset[a:b][None, :] + (lay * sg.layer_stride)[:, None]).ravel().astype(np.uint64)
            do = (t.dst_offset[a:b][None, :] + (lay * dg.layer_stride)[:, None]).ravel().astype(np.uint64)
            ln = np.tile(t.length[a:b], nl).astype(np.uint64)
            if sg.regions_per_layer == 0 and dg.regions_per_layer == 0:
                out.append((s, d, sr, dr, lay_u, so, do, ln, np.arange(nl + 1, dtype=np.int64) * m))
                continue
            for k, layer in enumerate(p.layers):
                out.append((s, d, sr + layer * sg.regions_per_layer, dr + layer * dg.regions_per_layer,
                            lay_u[k:k + 1], so[k * m:(k + 1) * m], do[k * m:(k + 1) * m], ln[k * m:(k + 1) * m],
                            np.array([0, m], np.int64)))
    return out

