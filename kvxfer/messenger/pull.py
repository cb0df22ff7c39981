"""The pull road's two halves: a layout exposed for reading, and a plan's rank pair read in one call.

The mirror of ``paged.py`` for pull (the decoder reads the prefiller's finished pages, so it
alone knows when they are complete): ``expose_layout`` registers one rank's regions readable
(``Engine.register(..., readable=True)``) and gives one region table of **reads-only**
descriptors (read keys, no write key: ``MemoryRegion.descriptor(reads_only=True)``), which a
peer decodes with ``paged.remote_layout``; ``pull_plan`` reads a ``TransferPlan``'s pieces for
one (source rank, destination rank), or one layer of them, with one ``Engine.read_groups``
call: the same planner and the same plan as push (``plan(src layout, src sharding, dst
layout, dst sharding, src_pages, dst_pages)``), each write of the plan posted as a read from
the source region into the destination region, so the bytes that land are exactly those a
push of the same plan writes. The reader's transfer completes on its own CQ; nothing is
counted at the exposer (reads carry no immediate).

What a messenger on top must keep (docs/messenger.md, "Push or pull"): the exposer's pages
stay as they are until the reader reports its reads complete (or aborted and drained:
``ReadTransfer.cancel`` then ``wait``), or until the reader is declared dead
(``peer_timeout``); a read never changes the exposer's memory, so that rule protects what the
reader gets, never the exposer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

from kvxfer.errors import InvalidArgumentError, PlanError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger.paged import PlanTransfer, RegionTable, RemoteRegionTable, plan_batches, register_regions

__all__ = ["ExposedLayout", "expose_layout", "pull_plan"]


class ExposedLayout(RegionTable):
    """One rank's regions registered readable; ``descriptor()`` is their reads-only table."""

    def descriptors(self) -> list[bytes]:
        return [r.descriptor(reads_only=True) for r in self.regions]


def expose_layout(engine: Any, layout: KVLayout, sharding: Sharding, regions: Sequence[Any]) -> ExposedLayout:
    """Register one rank's regions (region-id order) readable, in one call: each at least
    ``layout.region_sizes(sharding)``; on any refusal the regions registered so far are closed
    again. Peers may read them (with the table's read keys) until ``close()``."""
    return ExposedLayout(engine, layout, sharding, register_regions(engine, layout, sharding, regions, readable=True))


def pull_plan(engine: Any, plan: Any, src_rank: int, dst_rank: int, dst: RegionTable, peer: Any,
              src: RemoteRegionTable, *, layers: Optional[Iterable[int]] = None, rail: Optional[int] = None) -> PlanTransfer:
    """Read every piece of ``plan`` from ``src_rank`` (the peer's ``src`` table, from its
    ``expose_layout``) into ``dst_rank`` (this engine's ``dst``), or of ``layers`` only (an
    empty list reads nothing), in one ``Engine.read_groups`` call (one region pair per
    group; ``rail`` pins it to one local rail). Region ids are checked against both tables
    before anything is posted; the engine checks every offset and refuses a source region
    not offered for reading. ``result.num_writes`` counts the read messages."""
    if layers is not None:
        layers = list(layers)
        if not layers:
            return PlanTransfer([], None)
        if len(set(layers)) != len(layers):
            raise PlanError(f"layers {layers} name a layer twice")
        bad = [x for x in layers if x not in plan.layers]
        if bad:
            raise PlanError(f"layers {bad} are not in the plan")
        batches = []
        want = set(layers)
        for lay in plan.layers:
            if lay in want:
                batches += plan_batches(plan.layer(lay), src_rank, dst_rank)
    else:
        batches = plan_batches(plan, src_rank, dst_rank)
    for sr, dr, *_ in batches:
        if not (0 <= sr < len(src)) or not (0 <= dr < len(dst)):
            raise InvalidArgumentError(f"plan names region pair ({sr}, {dr}); tables have {len(src)} and {len(dst)}")
    groups = [(dst[dr], src[sr], do, so, ln) for sr, dr, so, do, ln in batches]
    return PlanTransfer([engine.read_groups(peer, groups, rail=rail)], None)
