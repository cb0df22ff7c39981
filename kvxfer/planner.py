"""The sharding-ratio transfer planner: which bytes each prefill rank writes to each decode rank.

Pure numpy, a leaf over :mod:`kvxfer.layout` and :mod:`kvxfer.errors`; it never imports the
engine. The plan is built once for layer 0 as a per-(source rank, destination rank) template
and shifted per layer on demand, because every layer has the same structure and only its
region id and base offset move. That keeps planning a 128k-token prompt over 80 layers in a
few milliseconds and lets the messenger stream ``plan.layer(l)`` as each layer is computed.

How a page travels, in short (the full rules follow):

* For each destination rank and each run of its heads held by the same set of source ranks
  (a *segment*), one source rank is chosen per page: with replicated sources the page list is
  cut into as many contiguous chunks as there are candidate ranks and the chunks are dealt to
  a random permutation of them (``seed``), so each destination byte is written exactly once,
  the load is balanced to within one page per segment, and contiguous pages stay contiguous.
* A segment's slice of one (layer, plane, page) is ``heads x tokens`` vectors of ``head_dim``
  elements; head and token axes whose stride equals the current run on both sides are folded
  into the run. With HND a head slice folds into one write; with NHD and differing head
  counts it stays ``page_size`` writes.
* Writes are then ordered by (source region, destination region, source offset) and any
  write contiguous with the previous one on both sides is merged (never across layers).
* Where the two sides' page sizes differ, ``num_tokens=`` says how many tokens move, and a
  page's tokens are cut where the other side's pages end (below, "Page sizes that differ").

Planning, step by step
----------------------

`plan(src_layout, src_sharding, dst_layout, dst_sharding, src_pages, dst_pages, layers=None,
seed=None, num_tokens=None) -> TransferPlan`: `src_pages[i]` on the prefill side becomes
`dst_pages[i]` on the decode side, on every destination rank, for the heads that rank holds
(with `num_tokens`: token `t` of the request moves from slot `t % ps` of `src_pages[t // ps]`
to slot `t % pd` of `dst_pages[t // pd]`).

1. **Segments.** For each destination rank, its heads are split into runs held by the same set
   of source ranks: the intersection with each source rank's range (one candidate), a single
   head (`H < t_src`, `t_src/H` candidates), or all its heads (replicated source, every rank a
   candidate). A source rank is a candidate for at most one segment of a destination rank, so a
   (source, destination) pair always moves one head range.
2. **Replica choice.** With `r > 1` candidates the page list is cut into `r` contiguous chunks
   (in list order) and the chunks are dealt to a permutation of the candidates drawn from
   `numpy.random.default_rng(seed)`. Every destination byte comes from exactly one source, each
   source sends within one page of its share per segment, contiguous page runs stay runs (so
   they still coalesce), and the same seed gives the same plan. Destinations that hold replicas
   (decode `H < t`, or MLA) are planned independently: each gets its own copy, drawn from all
   candidate sources in parallel.
3. **Inside a page.** A segment's slice of one (layer, plane, page) is `heads × tokens` vectors
   of `c` bytes. The head and token axes whose stride equals the current run on *both* sides
   are folded into the run (repeatedly: tokens first under HND, heads first under NHD);
   the rest are enumerated. This is the whole HND/NHD story: under HND a head slice is one
   write; under NHD it is one write per token unless the slice is every local head on both
   sides; HND ↔ NHD transposes, one write per (head, token).
4. **Coalescing.** For each pair, blocks `(page, plane)` are ordered by (source region,
   destination region, source offset) — page lists are sorted once per chunk, so this is a
   merge of already sorted runs — and expanded by the in-page pattern; a write whose source
   *and* destination both start where the previous one ended, in the same regions, joins it
   (`np.flatnonzero` on the breaks, run lengths from `np.diff`). Never across layers, so
   `plan.layer(l)` streams layers independently.
5. **Layers.** Every layer has the same structure; only the region id (`+ layer *
   regions_per_layer`) and base offset (`+ layer * layer_stride`) move. So the plan is built once
   for layer 0 per pair and shifted on demand: `plan()` costs one layer, and `plan.layer(l)`
   materialises a layer when the messenger needs it.

The plan object, ``TransferPlan`` (``writes``, ``groups``, ``layer``, the counts), is in
kvxfer/_plan.py; the messenger's fast road, one page's writes shifted per page with a replica
choice as a permutation of the candidates (``PageTemplate``, ``writing_ranks``), in
kvxfer/_templates.py. Both sets of names are importable from here.

Page sizes that differ
----------------------

A prefill node and a decode node tuned apart have different page sizes (`ps` source, `pd`
destination tokens), in either direction and by any ratio. Then the page lists no longer fix
the last partial page on each side, so `plan(..., num_tokens=T)` is required: `T` tokens move,
exactly, each page list is `ceil(T / page_size)` of its own side's pages long (`PlanError`
otherwise), nothing past token `T` is read or written (the last page of each side in part).
Without `num_tokens` the sizes must be equal and whole pages move (`LayoutError` naming
`num_tokens` otherwise); `num_tokens` with equal sizes moves exactly `T` tokens too, and is the
page path when `T` fills the pages. `first_token=a` leaves tokens before `a` out: a chunk
`[a, b)` of a streamed prefill is `plan(..., src_pages[:ceil(b/ps)], dst_pages[:ceil(b/pd)],
num_tokens=b, first_token=a)`, and consecutive chunks write every byte once between them.

The token path keeps the page path's structure. Replicas get contiguous chunks of the *source*
page list (balanced within one source page per segment, plus the short last page). Blocks
(page, plane) are sorted by (group, src offset). A source page that starts `phase` tokens into a
destination page (`phase = (i * ps) % pd` for list position `i`) is cut into *pieces* where
destination pages end; its writes depend only on `(phase, length)` (`length` < `ps` for the
last page), so one pattern per class is built, at most `lcm(ps, pd) / ps` classes plus the
last page, with the same (head, token) folding as inside a page, and shifted to every block of
the class: writes come out sorted and coalesce with no sort over writes. Writes per layer and
pair are about `pieces × (heads not folded) × planes` for HND, `tokens × planes` for NHD with
differing head counts; a piece is at most `min(ps, pd)` tokens and there are
`ceil(T/ps) + ceil(T/pd) - ceil(T/lcm(ps, pd))` of them. Contiguous page runs on both sides
still merge across piece boundaries (one write per plane and layer with matching heads).
The per-pair templates, `layer(l)`, `groups`, `expected_writes` and `count_writes` are as on
the page path.

HND vs NHD write counts
-----------------------

Per layer, for `n` pages, `H` KV heads on `t_s` → `t_d` ranks, `H >= max(t_s, t_d)` and one TP
size dividing the other (so `max(t_s, t_d)` (source, destination) head slices meet per page and
plane):

| | HND | NHD |
|---|---|---|
| `t_s != t_d` | `2 · n · max(t_s, t_d)` writes of `H/max · page_size · c` bytes | `page_size ×` as many, `H/max · c` bytes each |
| `t_s == t_d`, fused pages | `n · t` (K and V of a page join), contiguous page runs join further | the same |
| HND on one side, NHD with more than one local head on the other | one write per (head, token) vector | |

Llama-3-70B (8 KV heads × 128, bf16, 16-token pages), 8192 pages, TP8 → TP4: 131,072 writes of
4 KiB per layer under HND against 2,097,152 writes of 256 B under NHD (10.5 M vs 168 M over 80
layers). That is why HND is preferred for disaggregation; see docs/benchmarks.md ("Planner").

Validation
----------

* `LayoutError`: layouts that differ in layer count, KV heads, head dim, page size (without
  `num_tokens`), dtype (the
  number format, `KVLayout.dtype_format`: fp8 e4m3 and e5m2 share a size, not a meaning; a
  generic `"fp8"` matches any fp8), or MLA vs K/V; a sharding that does not divide the heads; strides smaller than the data; an
  unknown order, KV form or placement.
* `PlanError`: page lists of different lengths (or not `ceil(num_tokens / page_size)` long),
  `num_tokens` not an int >= 0, page lists not 1-D, not integers (floats and bools
  refused), negative, beyond a layout's `num_pages`; a destination page listed twice (it would be
  written twice; a repeated *source* page is fine); layers out of range or repeated; a rank pair
  or layer not in the plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvxfer._check import is_int
from kvxfer._pieces import PagePattern, PieceChunk
from kvxfer._plan import _EMPTY_I32, _EMPTY_I64, TransferPlan, Writes, _PairTemplate
from kvxfer.errors import LayoutError, PlanError
from kvxfer.layout import KVLayout, RankGeometry, Sharding, same_format

__all__ = ["plan", "TransferPlan", "Writes", "PageTemplate", "chooses_replicas", "request_seed", "writing_ranks"]

#: The per-page templates and the replica draw live in kvxfer/_templates.py (they plan with
#: ``plan``); their names stay importable from here.
_TEMPLATE_NAMES = frozenset({"PageTemplate", "chooses_replicas", "request_seed", "writing_ranks"})


def __getattr__(name: str) -> Any:
    if name in _TEMPLATE_NAMES:
        from kvxfer import _templates

        return getattr(_templates, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- planning -----------------------------------------------------------------------------

def _pages(pages: Any, layout: KVLayout, name: str) -> np.ndarray:
    a = np.asarray(pages)
    if a.ndim != 1:
        raise PlanError(f"{name} must be a 1-D list of page indices, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    lo, hi = int(a.min()), int(a.max())
    if lo < 0:
        i = int(np.flatnonzero(a < 0)[0])
        raise PlanError(f"{name}[{i}] = {int(a[i])} is negative")
    if hi >= layout.num_pages:
        i = int(np.flatnonzero(a >= layout.num_pages)[0])
        raise PlanError(f"{name}[{i}] = {int(a[i])} is outside the layout's {layout.num_pages} pages")
    return a


def _layers(layers: Iterable[int] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    out = []
    for x in layers:
        if not is_int(x):
            raise PlanError(f"layers must be ints, got {x!r}")
        if not 0 <= x < num_layers:
            raise PlanError(f"layer {x} outside the layout's {num_layers} layers")
        out.append(int(x))
    if len(set(out)) != len(out):
        raise PlanError(f"layers repeat: {out}")
    return tuple(out)


def _check_compatible(src: KVLayout, dst: KVLayout) -> None:
    # one size is not one format: fp8 e4m3 bytes read as e5m2, or bf16 as uint16, are other numbers
    if not same_format(src.dtype_format, dst.dtype_format):
        raise LayoutError(f"source and destination layouts differ in dtype: {src.dtype_format} vs {dst.dtype_format}")
    for what, a, b in (
        ("num_layers", src.num_layers, dst.num_layers),
        ("kv_heads", src.kv_heads, dst.kv_heads),
        ("head_dim", src.head_dim, dst.head_dim),
        ("dtype", src.np_dtype, dst.np_dtype),
        ("KV planes (MLA latent vs K/V)", src.planes, dst.planes),
    ):
        if a != b:
            raise LayoutError(f"source and destination layouts differ in {what}: {a} vs {b}")


def _segments(dst_heads: range, sharding: Sharding, kv_heads: int) -> Iterator[tuple[int, int, Sequence[int], int]]:
    """Split a destination rank's heads into runs held by the same source ranks:
    ``(first global head, head count, candidate source ranks, first head's local index there)``."""
    if sharding.replicated:
        yield dst_heads.start, len(dst_heads), range(sharding.tp_size), dst_heads.start
    elif kv_heads >= sharding.tp_size:
        per = kv_heads // sharding.tp_size
        h = dst_heads.start
        while h < dst_heads.stop:
            s = h // per
            end = min((s + 1) * per, dst_heads.stop)
            yield h, end - h, (s,), h - s * per
            h = end
    else:
        for h in dst_heads:
            yield h, 1, sharding.holders(h, kv_heads), 0


def _inner(sg: RankGeometry, dg: RankGeometry, nh: int, src_h0: int, dst_h0: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The writes of one segment inside one page, relative to the page: fold every (head, token)
    axis whose stride equals the run length on both sides into the run, enumerate the rest."""
    run = sg.chunk
    dims = [(nh, sg.head_stride, dg.head_stride), (sg.page_size, sg.token_stride, dg.token_stride)]
    folded = True
    while folded:
        folded = False
        for i, (n, ss, ds) in enumerate(dims):
            if n == 1 or (ss == run and ds == run):
                run *= n
                del dims[i]
                folded = True
                break
    src = np.array([src_h0 * sg.head_stride], np.int64)
    dst = np.array([dst_h0 * dg.head_stride], np.int64)
    for n, ss, ds in dims:
        idx = np.arange(n, dtype=np.int64)
        src = (src[:, None] + idx * ss).ravel()
        dst = (dst[:, None] + idx * ds).ravel()
    order = np.argsort(src, kind="stable")
    return src[order], dst[order], run


def _pair_template(sp: np.ndarray, dp: np.ndarray, sg: RankGeometry, dg: RankGeometry,
                   inner_s: np.ndarray, inner_d: np.ndarray, run: int) -> _PairTemplate:
    """Layer-0 writes for one pair: blocks (page, plane) sorted by (regions, src offset), each
    expanded by the segment's inner pattern, then runs contiguous on both sides merged."""
    planes = sg.planes
    n = sp.shape[0]
    if n == 0:
        return _PairTemplate(_EMPTY_I32, _EMPTY_I64, _EMPTY_I32, _EMPTY_I64, _EMPTY_I64, [])
    sblk = np.empty(planes * n, np.int64)
    dblk = np.empty(planes * n, np.int64)
    grp = np.empty(planes * n, np.int64)
    for k in range(planes):
        sl = slice(k * n, (k + 1) * n)
        np.multiply(sp, sg.page_stride, out=sblk[sl])
        sblk[sl] += sg.plane_base[k]
        np.multiply(dp, dg.page_stride, out=dblk[sl])
        dblk[sl] += dg.plane_base[k]
        grp[sl] = sg.plane_region[k] * 2 + dg.plane_region[k]
    # Sort blocks by (group, src offset). Blocks of one pair never overlap at the source (but
    # for a packed page's K and V, sorted below), so expanding each by the sorted inner pattern
    # keeps the whole list sorted by src offset.
    if grp[0] == grp[-1] and (grp == grp[0]).all():
        order = np.argsort(sblk, kind="stable")
    else:
        order = np.argsort(grp * sg.region_size + sblk, kind="stable")
    sblk, dblk, grp = sblk[order], dblk[order], grp[order]
    m = inner_s.shape[0]
    if m == 1:
        so, do = sblk + inner_s[0], dblk + inner_d[0]
    else:
        so = (sblk[:, None] + inner_s[None, :]).ravel()
        do = (dblk[:, None] + inner_d[None, :]).ravel()
    if sg.packed and planes > 1:
        # a packed page's K and V blocks interleave row by row: sort the vectors themselves so
        # K|V of one row (and rows of a page) can join when the destination is packed alike
        return _sort_coalesce(so, do, np.repeat(grp, m), run, sg.region_size)
    gpos = np.concatenate(([0], np.flatnonzero(np.diff(grp)) + 1))  # blocks where the group changes
    return _coalesce(so, do, gpos * m, grp[gpos], run)


def _sort_coalesce(so: np.ndarray, do: np.ndarray, eg: np.ndarray, run: int | np.ndarray,
                   region_size: int) -> _PairTemplate:
    """``_coalesce`` of writes in any order: sort them by (group ``eg``, src offset) first."""
    o = np.argsort(eg * region_size + so, kind="stable")
    so, do, eg = so[o], do[o], eg[o]
    if isinstance(run, np.ndarray):
        run = run[o]
    gpos = np.concatenate(([0], np.flatnonzero(np.diff(eg)) + 1))
    return _coalesce(so, do, gpos, eg[gpos], run)


def _coalesce(so: np.ndarray, do: np.ndarray, gpos: np.ndarray, gval: np.ndarray,
              run: int | np.ndarray) -> _PairTemplate:
    """Merge writes sorted by (group, src offset) that are contiguous on both sides: ``so``,
    ``do`` the offsets; the group (``src plane region * 2 + dst plane region``) is ``gval[i]``
    from write ``gpos[i]`` on (``gpos[0] == 0``); ``run`` the length of each (one int, or one
    per write)."""
    e = so.shape[0]
    uniform = not isinstance(run, np.ndarray)
    step = run if uniform else run[:-1]
    brk = np.empty(e, bool)
    np.not_equal(so[1:], so[:-1] + step, out=brk[1:])
    brk[1:] |= do[1:] != do[:-1] + step
    brk[gpos] = True
    starts = np.flatnonzero(brk)
    length = np.diff(np.append(starts, e)) * run if uniform else np.add.reduceat(run, starts)
    src_off, dst_off = so[starts], do[starts]
    if gpos.shape[0] > 1:
        g = gval[np.searchsorted(gpos, starts, side="right") - 1]
    else:
        g = np.full(starts.shape[0], gval[0], np.int64)
    src_reg = (g // 2).astype(np.int32)
    dst_reg = (g % 2).astype(np.int32)
    gb = np.flatnonzero(np.diff(g)) + 1
    bounds = np.concatenate(([0], gb, [starts.shape[0]]))
    groups = [(int(src_reg[a]), int(dst_reg[a]), int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    return _PairTemplate(src_reg, src_off, dst_reg, dst_off, length.astype(np.int64), groups)


def _num_tokens(num_tokens: Any, sp: np.ndarray, dp: np.ndarray, src: KVLayout, dst: KVLayout) -> int | None:
    """The tokens to move, checked against both page lists; None for whole pages (equal sizes)."""
    if num_tokens is None:
        if src.page_size != dst.page_size:
            raise LayoutError(f"source and destination layouts differ in page_size (tokens): {src.page_size} vs "
                              f"{dst.page_size}; plan between them with num_tokens= (the tokens the pages hold)")
        if sp.shape[0] != dp.shape[0]:
            raise PlanError(f"src_pages has {sp.shape[0]} pages but dst_pages has {dp.shape[0]}")
        return None
    if not is_int(num_tokens) or num_tokens < 0:
        raise PlanError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    t = int(num_tokens)
    for name, pages, size in (("src_pages", sp, src.page_size), ("dst_pages", dp, dst.page_size)):
        if pages.shape[0] != -(-t // size):
            raise PlanError(f"{name} has {pages.shape[0]} pages but {t} tokens fill {-(-t // size)} "
                            f"pages of {size} tokens")
    return t


def _piece_template(ch: PieceChunk, pats: list[PagePattern], src_shift: int, dst_shift: int,
                    sg: RankGeometry) -> _PairTemplate:
    """Layer-0 writes for one pair when pages do not align: the chunk's blocks expanded by
    their classes' patterns (already sorted by (group, src offset) as on the page path, but
    for a packed source), then runs contiguous on both sides merged."""
    if ch.nb == 0:
        return _PairTemplate(_EMPTY_I32, _EMPTY_I64, _EMPTY_I32, _EMPTY_I64, _EMPTY_I64, [])
    so, do, runs, sizes = ch.expand(pats, src_shift, dst_shift)
    if sg.packed and sg.planes > 1:  # K and V rows interleave: sort the writes themselves
        return _sort_coalesce(so, do, np.repeat(ch.grp, sizes), runs, sg.region_size)
    return _coalesce(so, do, (np.cumsum(sizes) - sizes)[ch.gb], ch.gval, runs)


def plan(src_layout: KVLayout, src_sharding: Sharding, dst_layout: KVLayout, dst_sharding: Sharding,
         src_pages: Sequence[int] | np.ndarray, dst_pages: Sequence[int] | np.ndarray,
         layers: Iterable[int] | None = None, seed: int | np.random.Generator | None = None,
         num_tokens: int | None = None, first_token: int = 0,
         replica_span: tuple[int, int] | None = None) -> TransferPlan:
    """Plan the RDMA writes that move ``src_pages`` (prefill side) into ``dst_pages`` (decode
    side): ``src_pages[i]`` on every source rank becomes ``dst_pages[i]`` on every destination
    rank, each destination rank receiving exactly the heads its sharding gives it.

    ``layers`` restricts (and orders) the layers planned; ``seed`` picks which replica sends
    when several source ranks hold the same bytes. ``num_tokens`` (the tokens the pages hold;
    needed where the page sizes differ) moves exactly those tokens, token ``t`` from slot
    ``t % page_size`` of ``src_pages[t // page_size]`` to its place in each side's own pages,
    each page list ``ceil(num_tokens / page_size)`` long; without it whole pages move,
    ``src_pages[i]`` to ``dst_pages[i]``. ``first_token`` (with ``num_tokens``) leaves the
    tokens before it out: a chunk of a streamed prefill moves tokens ``[first_token,
    num_tokens)``, the page lists covering ``[0, num_tokens)``. ``replica_span=(a, b)`` (with
    ``num_tokens``): the positions in ``src_pages`` of the whole request's pages that hold tokens
    to move, over which replicas are dealt: a chunk of a request passes its request's span, so
    each of its pages goes to the replica the whole request's plan gives it (a draw over the
    chunk alone could pick ranks the request never asked). Raises :class:`LayoutError` for
    layouts or shardings that cannot meet, :class:`PlanError` for bad page or layer lists or
    token counts.
    """
    if not isinstance(src_layout, KVLayout) or not isinstance(dst_layout, KVLayout):
        raise LayoutError("src_layout and dst_layout must be KVLayout")
    _check_compatible(src_layout, dst_layout)
    sg = src_layout.resolve(src_sharding)
    dg = dst_layout.resolve(dst_sharding)
    sp = _pages(src_pages, src_layout, "src_pages")
    dp = _pages(dst_pages, dst_layout, "dst_pages")
    tokens = _num_tokens(num_tokens, sp, dp, src_layout, dst_layout)
    if first_token != 0 and (tokens is None or not is_int(first_token) or not 0 <= first_token <= tokens):
        raise PlanError(f"first_token must be an int in [0, num_tokens] and needs num_tokens, got {first_token!r}")
    first = int(first_token)
    if dp.shape[0] > 1 and np.unique(dp).shape[0] != dp.shape[0]:
        raise PlanError("dst_pages repeat a page: it would be written twice")
    lay = _layers(layers, src_layout.num_layers)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    kv_heads, n = src_layout.kv_heads, sp.shape[0]
    if replica_span is not None:
        if tokens is None or not (isinstance(replica_span, tuple) and len(replica_span) == 2
                                  and all(is_int(x) for x in replica_span) and 0 <= replica_span[0] <= replica_span[1]):
            raise PlanError(f"replica_span must be (a, b) with 0 <= a <= b and needs num_tokens, got {replica_span!r}")
    if tokens is not None and (sg.page_size != dg.page_size or tokens != n * sg.page_size or first
                               or replica_span is not None):
        return _plan_pieces(sg, dg, src_sharding, dst_sharding, src_layout, dst_layout, sp, dp, first, tokens,
                            lay, rng, replica_span)

    templates: dict[tuple[int, int], _PairTemplate] = {}
    by_src: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # chunk -> pages in src order

    def chunk(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        # Pages ordered by source page once per chunk: every pair's blocks then come in sorted
        # runs (one per plane) and the stable sort in _pair_template only merges them.
        if (a, b) not in by_src:
            o = np.argsort(sp[a:b], kind="stable")
            by_src[a, b] = sp[a:b][o], dp[a:b][o]
        return by_src[a, b]

    for d in range(dst_sharding.tp_size):
        dheads = dst_sharding.heads(d, kv_heads)
        for h0, nh, cands, src_h0 in _segments(dheads, src_sharding, kv_heads):
            inner_s, inner_d, run = _inner(sg, dg, nh, src_h0, h0 - dheads.start)
            r = len(cands)
            owners = [int(c) for c in (rng.permutation(np.asarray(cands)) if r > 1 else cands)]
            for j, s in enumerate(owners):
                a, b = -(-j * n // r), -(-(j + 1) * n // r)  # chunk j of r, contiguous in list order
                # a source rank is a candidate for at most one segment of a destination rank
                assert (s, d) not in templates
                templates[(s, d)] = _pair_template(*chunk(a, b), sg, dg, inner_s, inner_d, run)
    return TransferPlan(src_tp=src_sharding.tp_size, dst_tp=dst_sharding.tp_size, layers=lay, num_pages=n,
                        src_geometry=sg, dst_geometry=dg, src_order=src_layout.order,
                        dst_order=dst_layout.order, templates=templates,
                        num_tokens=n * sg.page_size if tokens is None else tokens)


def _plan_pieces(sg: RankGeometry, dg: RankGeometry, src_sharding: Sharding, dst_sharding: Sharding,
                 src_layout: KVLayout, dst_layout: KVLayout, sp: np.ndarray, dp: np.ndarray, first: int,
                 tokens: int, lay: tuple[int, ...], rng: np.random.Generator,
                 replica_span: tuple[int, int] | None = None) -> TransferPlan:
    """``plan`` at token granularity: replicas get contiguous chunks of the source page list
    as on the page path (each within one source page of its share), and each source page's
    tokens go as its (phase, length) class's pattern says."""
    kv_heads, n = src_layout.kv_heads, sp.shape[0]
    lo = first // sg.page_size if first < tokens else n  # the source pages holding tokens to move
    span_lo, span_hi = (lo, n) if replica_span is None else (int(replica_span[0]), int(replica_span[1]))
    templates: dict[tuple[int, int], _PairTemplate] = {}
    patterns: dict[tuple[int, int, int, int], PagePattern] = {}  # (head count, phase, skip, length)
    chunks: dict[tuple[int, int], PieceChunk] = {}
    for d in range(dst_sharding.tp_size):
        dheads = dst_sharding.heads(d, kv_heads)
        for h0, nh, cands, src_h0 in _segments(dheads, src_sharding, kv_heads):
            r = len(cands)
            owners = [int(c) for c in (rng.permutation(np.asarray(cands)) if r > 1 else cands)]
            for j, s in enumerate(owners):
                # chunk j of r of the request's span, contiguous in list order; this plan's
                # pages of it (a chunk of a request plans only some of the span)
                w = span_hi - span_lo
                a, b = span_lo + -(-j * w // r), span_lo + -(-(j + 1) * w // r)
                a = min(max(a, lo), n)
                b = max(min(b, n), a)
                if (a, b) not in chunks:
                    chunks[a, b] = PieceChunk(sp, dp, a, b, first, tokens, sg, dg)
                ch = chunks[a, b]
                pats = []
                for key in ch.keys:
                    if (nh, *key) not in patterns:
                        patterns[(nh, *key)] = PagePattern(*key, sg, dg, nh)
                    pats.append(patterns[(nh, *key)])
                assert (s, d) not in templates
                templates[(s, d)] = _piece_template(ch, pats, src_h0 * sg.head_stride,
                                                    (h0 - dheads.start) * dg.head_stride, sg)
    return TransferPlan(src_tp=src_sharding.tp_size, dst_tp=dst_sharding.tp_size, layers=lay,
                        num_pages=n, src_geometry=sg, dst_geometry=dg, src_order=src_layout.order,
                        dst_order=dst_layout.order, templates=templates, num_tokens=tokens,
                        first_token=first)
