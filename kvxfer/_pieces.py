"""Where a source page's tokens land when the two sides' page sizes differ: the planner's
token path in pieces (a leaf over :mod:`kvxfer.layout`; numpy only).

A source page of ``ps`` tokens whose first moved token sits ``phase`` tokens into a
destination page of ``pd`` tokens is cut where destination pages end; how its tokens travel
depends only on ``phase``, on the slot of its first moved token (``skip``, 0 but for the first
page of a plan that starts mid-page) and on how many it moves (``length``, short for the last
page), so the planner builds one :class:`PagePattern` per (head count, phase, skip, length)
class, at most ``lcm(ps, pd) / ps`` classes plus the first and the last page, and shifts it to
every page of the class. A :class:`PieceChunk`
holds what every (source rank, destination rank) pair dealt one chunk of the source page list
shares: its blocks (page, plane) in (group, src offset) order, each block's class, and the
destination page offsets the classes reach.
"""

from __future__ import annotations

import numpy as np

from kvxfer.layout import RankGeometry

__all__ = ["PagePattern", "PieceChunk"]


class PagePattern:
    """The writes of one source page's tokens relative to that page (``src``), to the first
    destination page they reach (``dst``, plus ``rel`` pages further on), each ``run`` bytes,
    sorted by source offset: one per (phase, skip, length) class of source pages, where the
    page's tokens moved are its slots ``[skip, skip + length)`` and the first of them sits
    ``phase`` tokens into a destination page."""

    __slots__ = ("src", "dst", "rel", "run", "by_rel")

    def __init__(self, phase: int, skip: int, length: int, sg: RankGeometry, dg: RankGeometry, nh: int) -> None:
        pd, c = dg.page_size, sg.chunk
        # pieces: cut where a destination page ends
        start = np.union1d([0], np.arange((-phase) % pd, length, pd, dtype=np.int64))
        count = np.diff(np.append(start, length))
        dtok = phase + start
        src = (skip + start) * sg.token_stride
        dst = (dtok % pd) * dg.token_stride
        rel = dtok // pd
        # fold an axis whose stride is the run on both sides (as `_inner` does in a page)
        heads_fold = nh == 1 or (sg.head_stride == c and dg.head_stride == c)
        hrun = nh * c if heads_fold else c
        if sg.token_stride == hrun and dg.token_stride == hrun:
            run = count * hrun
        else:  # one write per token of each piece
            rep = np.repeat(np.arange(start.shape[0]), count)
            tok = np.arange(length, dtype=np.int64) - np.repeat(start, count)
            src, dst, rel = src[rep] + tok * sg.token_stride, dst[rep] + tok * dg.token_stride, rel[rep]
            run = np.full(src.shape[0], hrun, np.int64)
        if not heads_fold:
            h = np.arange(nh, dtype=np.int64)
            src = (src[:, None] + h * sg.head_stride).ravel()
            dst = (dst[:, None] + h * dg.head_stride).ravel()
            rel, run = np.repeat(rel, nh), np.repeat(run, nh)
        o = np.argsort(src, kind="stable")
        self.src, self.dst, self.rel, self.run = src[o], dst[o], rel[o], run[o]
        # the columns that reach each destination page (a slice where they are one run)
        self.by_rel: list[tuple[int, slice | np.ndarray]] = []
        for r in np.unique(self.rel).tolist():
            cols = np.flatnonzero(self.rel == r)
            one_run = cols[-1] - cols[0] + 1 == cols.shape[0]
            self.by_rel.append((r, slice(int(cols[0]), int(cols[-1]) + 1) if one_run else cols))


class PieceChunk:
    """What every pair dealt one chunk ``[a, b)`` of the source page list shares on the token
    path: its blocks (page, plane) sorted by (group, src offset) as on the page path, each
    block's page class (where the page starts in a destination page, how many tokens it
    holds), and the destination page offsets each class's pattern reaches."""

    def __init__(self, sp: np.ndarray, dp: np.ndarray, a: int, b: int, first: int, tokens: int,
                 sg: RankGeometry, dg: RankGeometry) -> None:
        ps, pd, n = sg.page_size, dg.page_size, b - a
        self.nb: int = sg.planes * n
        self.keys: list[tuple[int, int, int]] = []
        if n == 0:  # more replicas than pages
            return
        o = np.argsort(sp[a:b], kind="stable")
        t0 = (a + o) * ps  # first token of each page, in source page order
        skip = np.maximum(first - t0, 0)  # tokens [first, tokens) move
        t1 = t0 + skip
        phase, length = t1 % pd, np.minimum(tokens - t0, ps) - skip
        key = (phase * ps + skip) * (ps + 1) + length
        keys = np.unique(key)
        self.keys = [(k // (ps + 1) // ps, k // (ps + 1) % ps, k % (ps + 1)) for k in keys.tolist()]
        cls = np.searchsorted(keys, key) if len(keys) > 1 else np.zeros(n, np.int64)
        planes = sg.planes
        spo = sp[a:b][o] * sg.page_stride
        sblk = np.concatenate([spo + sg.plane_base[k] for k in range(planes)])
        grp = np.repeat([sg.plane_region[k] * 2 + dg.plane_region[k] for k in range(planes)], n)
        dpl = np.repeat([dg.plane_base[k] for k in range(planes)], n)
        order = np.argsort(grp * sg.region_size + sblk, kind="stable")  # merges sorted runs
        self.sblk, self.dplane, grp = sblk[order], dpl[order], grp[order]
        page = order % n
        bcls = cls[page]
        self.gb = np.concatenate(([0], np.flatnonzero(np.diff(grp)) + 1))  # blocks where the group changes
        self.gval = grp[self.gb]
        self.grp = grp
        self.members: list[slice | np.ndarray] = (
            [slice(None)] if len(self.keys) == 1 else [np.flatnonzero(bcls == c) for c in range(len(self.keys))])
        self._dfirst = (t1 // pd)[page]
        self._dp, self._pstride = dp, dg.page_stride
        self._dtab: dict[tuple[int, int], np.ndarray] = {}

    def dst_pages(self, c: int, r: int) -> np.ndarray:
        """Byte offset of the destination page ``r`` pages after the first one each block of
        class ``c`` reaches."""
        if (c, r) not in self._dtab:
            self._dtab[c, r] = self._dp[self._dfirst[self.members[c]] + r] * self._pstride + self.dplane[self.members[c]]
        return self._dtab[c, r]

    def expand(self, pats: list[PagePattern], src_shift: int,
               dst_shift: int) -> tuple[np.ndarray, np.ndarray, int | np.ndarray, np.ndarray]:
        """The writes of one pair: ``(src offsets, dst offsets, runs (one int where all are
        equal), writes per block)``, block after block, each block's sorted by src offset.
        ``pats``: the pattern of each of the chunk's classes for the pair's head count;
        ``src_shift`` / ``dst_shift``: the pair's first head's offset on each side. One row
        per block, as wide as the widest pattern (padding: run 0, dropped after)."""
        widths = [q.src.shape[0] for q in pats]
        m, nb = max(widths), self.nb
        S = np.empty((nb, m), np.int64)
        D = np.empty((nb, m), np.int64)
        R = np.zeros((nb, m), np.int64) if len(set(widths)) > 1 else None
        for c, q in enumerate(pats):
            bc = self.members[c]
            w = widths[c]
            S[bc, :w] = (self.sblk[bc] + src_shift)[:, None] + q.src
            for r, cols in q.by_rel:
                rows = bc[:, None] if isinstance(cols, np.ndarray) and not isinstance(bc, slice) else bc
                D[rows, cols] = (self.dst_pages(c, r) + dst_shift)[:, None] + q.dst[cols]
            if R is not None:
                R[bc, :w] = q.run
        runs: int | np.ndarray
        if R is None:
            allrun = np.concatenate([q.run for q in pats])
            if (allrun == allrun[0]).all():
                runs = int(allrun[0])
            else:  # equal widths, different runs: each block its class's runs
                cls = np.empty(nb, np.int64)
                for c in range(len(pats)):
                    cls[self.members[c]] = c
                runs = np.stack([q.run for q in pats])[cls].ravel()
            return S.ravel(), D.ravel(), runs, np.full(nb, m, np.int64)
        keep = R > 0
        runs = R[keep]
        if (runs == runs[0]).all():
            runs = int(runs[0])
        return S[keep], D[keep], runs, keep.sum(axis=1)
