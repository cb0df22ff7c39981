"""The transfer plan: per (source rank, destination rank) layer-0 templates, shifted to every layer.

:func:`kvxfer.planner.plan` builds a ``TransferPlan``; this module holds the plan object and
its write lists, with no planning in it (``kvxfer.planner`` re-exports both names).

| member | what |
|---|---|
| `writes(s, d) -> Writes` | arrays `src_region` (int32), `src_offset`, `dst_region` (int32), `dst_offset`, `length` (int64), `layer` (int32), layer by layer; `len(w)`, `w.nbytes` |
| `groups(s, d)` | yields `(src_region, dst_region, src_offsets, dst_offsets, lengths)`, one engine `write_batch` each, layer by layer |
| `layer(l)` | the same plan restricted to layer `l` (shares the template) |
| `expected_writes[d]`, `expected_bytes[d]` | what destination rank `d` receives (all planned layers) |
| `writes_per_pair`, `bytes_per_pair` | `[src_tp, dst_tp]` matrices |
| `num_triples`, `num_bytes`, `pairs` | totals, and the pairs that carry writes |
| `str(plan)` | summary: writes per layer, bytes per write, the pair matrix, `expected_writes` |

`expected_writes` counts the plan's writes after coalescing. The engine may still pack several
into one message or split a long one (iovecs per message, maximum message size);
`kvxfer.count_writes` (engine side) turns a write list into the number of messages, and that is
what a completion counter should wait for.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvxfer.errors import PlanError
from kvxfer.layout import RankGeometry

__all__ = ["TransferPlan", "Writes"]

_EMPTY_I64 = np.zeros(0, np.int64)
_EMPTY_I32 = np.zeros(0, np.int32)


@dataclass(frozen=True)
class Writes:
    """A list of RDMA writes as parallel arrays; offsets are bytes relative to each region."""

    src_region: np.ndarray  #: int32
    src_offset: np.ndarray  #: int64
    dst_region: np.ndarray  #: int32
    dst_offset: np.ndarray  #: int64
    length: np.ndarray  #: int64
    layer: np.ndarray  #: int32

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Payload bytes of all writes."""
        return int(self.length.sum())


_NO_WRITES = Writes(_EMPTY_I32, _EMPTY_I64, _EMPTY_I32, _EMPTY_I64, _EMPTY_I64, _EMPTY_I32)


class _PairTemplate:
    """Layer-0 writes of one (source rank, destination rank), sorted by (src region, dst region,
    src offset), with the slices where each (src region, dst region) group starts and stops."""

    __slots__ = ("src_region", "src_offset", "dst_region", "dst_offset", "length", "groups", "nbytes")

    def __init__(self, src_region: np.ndarray, src_offset: np.ndarray, dst_region: np.ndarray,
                 dst_offset: np.ndarray, length: np.ndarray, groups: list[tuple[int, int, int, int]]) -> None:
        for a in (src_region, src_offset, dst_region, dst_offset, length):
            a.flags.writeable = False
        self.src_region, self.src_offset = src_region, src_offset
        self.dst_region, self.dst_offset = dst_region, dst_offset
        self.length = length
        self.groups: list[tuple[int, int, int, int]] = groups
        self.nbytes = int(length.sum())

    def __len__(self) -> int:
        return int(self.length.shape[0])


class TransferPlan:
    """The writes that move a set of pages from a prefill TP group to a decode TP group.

    ``writes(s, d)`` gives the arrays for one (source rank, destination rank); ``groups(s, d)``
    yields them per (source region, destination region), one engine ``write_batch`` each;
    ``layer(l)`` is the same plan restricted to one layer, for layer-by-layer streaming;
    ``expected_writes[d]`` is how many writes destination rank ``d`` receives. The engine may
    still pack or split writes into messages (iovecs per message, maximum message size);
    ``kvxfer.count_writes`` turns a write list into a message count.
    """

    def __init__(self, *, src_tp: int, dst_tp: int, layers: tuple[int, ...], num_pages: int,
                 src_geometry: RankGeometry, dst_geometry: RankGeometry,
                 src_order: str, dst_order: str, templates: dict[tuple[int, int], _PairTemplate],
                 num_tokens: int = 0, first_token: int = 0) -> None:
        self.src_tp = src_tp
        self.dst_tp = dst_tp
        self.layers = layers
        self.num_pages = num_pages  #: source pages
        self.num_tokens = num_tokens  #: tokens [first_token, num_tokens) move (whole pages: num_pages * page_size)
        self.first_token = first_token
        self.src_geometry = src_geometry
        self.dst_geometry = dst_geometry
        self.src_order = src_order
        self.dst_order = dst_order
        self._t = templates
        nl = len(layers)
        wpp = np.zeros((src_tp, dst_tp), np.int64)
        bpp = np.zeros((src_tp, dst_tp), np.int64)
        for (s, d), t in templates.items():
            wpp[s, d] = len(t) * nl
            bpp[s, d] = t.nbytes * nl
        wpp.flags.writeable = bpp.flags.writeable = False
        self.writes_per_pair: np.ndarray = wpp  #: [src_tp, dst_tp] number of writes
        self.bytes_per_pair: np.ndarray = bpp  #: [src_tp, dst_tp] payload bytes

    # -- counts ---------------------------------------------------------------------------
    @property
    def expected_writes(self) -> np.ndarray:
        """``[dst_tp]`` writes each destination rank receives (all planned layers)."""
        return self.writes_per_pair.sum(axis=0)

    @property
    def expected_bytes(self) -> np.ndarray:
        """``[dst_tp]`` bytes each destination rank receives."""
        return self.bytes_per_pair.sum(axis=0)

    @property
    def num_triples(self) -> int:
        """Total writes; compare HND with NHD here."""
        return int(self.writes_per_pair.sum())

    # >>> issue 22: deprecated name
    @property
    def num_writes(self) -> int:
        """Deprecated (issue 22): ``num_triples``; a plan's writes are triples, not messages."""
        warnings.warn("TransferPlan.num_writes is deprecated, use num_triples", DeprecationWarning, stacklevel=2)
        return self.num_triples
    # <<< issue 22

    @property
    def num_bytes(self) -> int:
        return int(self.bytes_per_pair.sum())

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(source rank, destination rank) pairs that carry at least one write."""
        return sorted(k for k, t in self._t.items() if len(t))

    # -- writes ---------------------------------------------------------------------------
    def _template(self, src_rank: int, dst_rank: int) -> _PairTemplate | None:
        if not (0 <= src_rank < self.src_tp and 0 <= dst_rank < self.dst_tp):
            raise PlanError(f"rank pair ({src_rank}, {dst_rank}) outside TP{self.src_tp} -> TP{self.dst_tp}")
        return self._t.get((src_rank, dst_rank))

    def writes(self, src_rank: int, dst_rank: int) -> Writes:
        """All writes from ``src_rank`` to ``dst_rank``, layer by layer in plan order."""
        t = self._template(src_rank, dst_rank)
        if t is None or not len(t):
            return _NO_WRITES
        sg, dg = self.src_geometry, self.dst_geometry
        lay = np.asarray(self.layers, np.int64)[:, None]
        m = len(t)

        def shift(a: np.ndarray, by: int) -> np.ndarray:
            return (a[None, :] + lay * by).ravel()

        return Writes(
            src_region=shift(t.src_region, sg.regions_per_layer).astype(np.int32),
            src_offset=shift(t.src_offset, sg.layer_stride),
            dst_region=shift(t.dst_region, dg.regions_per_layer).astype(np.int32),
            dst_offset=shift(t.dst_offset, dg.layer_stride),
            length=np.tile(t.length, len(self.layers)),
            layer=np.repeat(np.asarray(self.layers, np.int32), m),
        )

    def groups(self, src_rank: int, dst_rank: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
        """Yield ``(src_region, dst_region, src_offsets, dst_offsets, lengths)``, one per engine
        ``write_batch``, layer by layer in plan order."""
        t = self._template(src_rank, dst_rank)
        if t is None:
            return
        sg, dg = self.src_geometry, self.dst_geometry
        for layer in self.layers:
            so, do = layer * sg.layer_stride, layer * dg.layer_stride
            sr, dr = layer * sg.regions_per_layer, layer * dg.regions_per_layer
            for s_reg, d_reg, a, b in t.groups:
                yield (s_reg + sr, d_reg + dr, t.src_offset[a:b] + so, t.dst_offset[a:b] + do, t.length[a:b])

    def layer(self, layer: int) -> TransferPlan:
        """This plan restricted to one layer (shares the template; nothing is recomputed)."""
        if layer not in self.layers:
            raise PlanError(f"layer {layer} is not in this plan (layers {self.layers[0]}..{self.layers[-1]})"
                            if self.layers else f"layer {layer} is not in this empty plan")
        return TransferPlan(src_tp=self.src_tp, dst_tp=self.dst_tp, layers=(layer,), num_pages=self.num_pages,
                            src_geometry=self.src_geometry, dst_geometry=self.dst_geometry,
                            src_order=self.src_order, dst_order=self.dst_order, templates=self._t,
                            num_tokens=self.num_tokens, first_token=self.first_token)

    # -- printing -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"TransferPlan(TP{self.src_tp} {self.src_order} -> TP{self.dst_tp} {self.dst_order}, "
                f"{self.num_pages} pages x {len(self.layers)} layers, {self.num_triples} writes, "
                f"{self.num_bytes} bytes)")

    def __str__(self) -> str:
        nl = max(len(self.layers), 1)
        lines = [repr(self),
                 f"  writes per layer: {self.num_triples // nl}"
                 f" (avg {self.num_bytes / max(self.num_triples, 1):.0f} B per write)",
                 "  writes per (src rank, dst rank):"]
        width = max(len(str(int(self.writes_per_pair.max(initial=0)))), 3)
        lines.append("    src\\dst " + " ".join(f"{d:>{width}}" for d in range(self.dst_tp)))
        for s in range(self.src_tp):
            lines.append(f"    {s:>7} " + " ".join(f"{int(w):>{width}}" for w in self.writes_per_pair[s]))
        lines.append("  expected_writes: " + " ".join(str(int(w)) for w in self.expected_writes))
        return "\n".join(lines)
