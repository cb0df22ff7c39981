"""A whole KV layout as one registered set, and a plan's writes for a rank pair in one call.

For engines that drive kvxfer without the messenger (the messenger uses the same two
helpers): ``register_layout`` registers every region of one rank's layout and gives one
descriptor blob; a peer turns the blob into a region table indexed by the planner's region
ids with ``remote_layout``; ``post_plan`` posts a ``TransferPlan``'s writes for one
(source rank, destination rank), or one layer of them, and returns one ``PlanTransfer``.

Only the engine's public API is used. A plan spanning several region pairs (one region per
layer, say) is posted by one ``Engine.write_groups`` call, one group per region pair (the
planner's groups of one region pair concatenated across layers first), so a rank pair is
one engine ``Transfer`` whatever the layout.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np

from kvxfer.errors import DescriptorError, InvalidArgumentError, KvxferError, PlanError
from kvxfer.layout import KVLayout, Sharding
from kvxfer.messenger._codec import pack_item, read_items

__all__ = ["RegionTable", "RemoteRegionTable", "PlanTransfer", "register_layout", "register_regions", "remote_layout", "post_plan",
           "plan_batches"]

_TABLE_MAGIC = b"KXLT"
_TABLE_VERSION = 1
_U16 = struct.Struct("<H")


class RegionTable:
    """One rank's registered regions, indexed by the planner's region ids."""

    def __init__(self, engine: Any, layout: KVLayout, sharding: Sharding, regions: list) -> None:
        self.engine = engine
        self.layout = layout
        self.sharding = sharding
        self.regions = regions      #: ``MemoryRegion`` per region id

    def __getitem__(self, region: int) -> Any:
        return self.regions[region]

    def __len__(self) -> int:
        return len(self.regions)

    def descriptors(self) -> list[bytes]:
        return [r.descriptor() for r in self.regions]

    def descriptor(self) -> bytes:
        """One versioned blob: ``b"KXLT" | u8 version | u16 count | per region: u16 len + descriptor``."""
        ds = self.descriptors()
        return b"".join([_TABLE_MAGIC, bytes([_TABLE_VERSION]), _U16.pack(len(ds))] + [pack_item(d) for d in ds])

    def close(self) -> None:
        """Deregister every region (refused while a transfer from one is in flight)."""
        for r in self.regions:
            r.close()

    def __repr__(self) -> str:
        return f"<RegionTable {len(self.regions)} region(s)>"


class RemoteRegionTable:
    """A peer's regions (``RemoteRegion`` per region id), decoded once."""

    def __init__(self, regions: list) -> None:
        self.regions = regions

    def __getitem__(self, region: int) -> Any:
        return self.regions[region]

    def __len__(self) -> int:
        return len(self.regions)


def register_layout(engine: Any, layout: KVLayout, sharding: Sharding, regions: Sequence[Any], *,
                    remote: bool = True, readable: bool = False) -> RegionTable:
    """Register one rank's regions (numpy, torch, ``KVBuffer`` or ``(ptr, nbytes)``, in
    region-id order) in one call. Each must be at least ``layout.region_sizes(sharding)``;
    on any refusal the regions registered so far are closed again. ``readable``: peers may
    also read them (``Engine.register(..., readable=True)``: the pull road)."""
    return RegionTable(engine, layout, sharding,
                       register_regions(engine, layout, sharding, regions, remote=remote, readable=readable))


def register_regions(engine: Any, layout: KVLayout, sharding: Sharding, regions: Sequence[Any],
                     **register: Any) -> list:
    """``register_layout``'s registrations as a list of ``MemoryRegion`` (``register`` goes to
    each ``Engine.register``: ``remote=``, ``readable=``), all or none."""
    sizes = layout.region_sizes(sharding)
    try:
        regions = list(regions)
    except TypeError:
        raise InvalidArgumentError(f"regions must list one rank's regions, got {type(regions).__name__}") from None
    if len(regions) != len(sizes):
        raise InvalidArgumentError(f"layout has {len(sizes)} region(s) per rank, got {len(regions)}")
    done: list = []
    try:
        for i, (obj, size) in enumerate(zip(regions, sizes)):
            mr = engine.register(obj, **register)
            done.append(mr)
            if mr.nbytes < size:
                raise InvalidArgumentError(f"region {i} has {mr.nbytes} bytes; the layout needs {size}")
    except BaseException:
        for mr in done:
            mr.close()
        raise
    return done


def _split_table(blob: bytes) -> list[bytes]:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise DescriptorError(f"a region table is bytes, not {type(blob).__name__}")
    blob = bytes(blob)
    if blob[:4] != _TABLE_MAGIC or len(blob) < 7:
        raise DescriptorError("not a kvxfer region table")
    if blob[4] != _TABLE_VERSION:
        raise DescriptorError(f"region table version {blob[4]} is not supported")
    (n,) = _U16.unpack_from(blob, 5)
    out, pos = read_items(blob, 7, n, "region table entry")
    if pos != len(blob):
        raise DescriptorError("region table has trailing bytes")
    return out


def remote_layout(engine: Any, descriptors: bytes | Iterable[bytes]) -> RemoteRegionTable:
    """A region table from ``RegionTable.descriptor()`` (or a list of descriptors)."""
    if isinstance(descriptors, (bytes, bytearray, memoryview)):
        ds = _split_table(descriptors)
    else:
        try:
            ds = list(descriptors)
        except TypeError:
            raise DescriptorError(f"a region table is bytes or a list of descriptors, not "
                                  f"{type(descriptors).__name__}") from None
    return RemoteRegionTable([engine.remote(d) for d in ds])


def plan_batches(plan: Any, src_rank: int, dst_rank: int) -> list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]:
    """The plan's writes for one rank pair as ``(src_region, dst_region, so, do, ln)``, one per
    region pair, layers in plan order concatenated (what one ``write_batch`` each posts)."""
    merged: dict[tuple[int, int], list] = {}
    for sr, dr, so, do, ln in plan.groups(src_rank, dst_rank):
        merged.setdefault((sr, dr), []).append((so, do, ln))
    out = []
    for (sr, dr), parts in merged.items():
        if len(parts) == 1:
            so, do, ln = parts[0]
        else:
            so = np.concatenate([x[0] for x in parts])
            do = np.concatenate([x[1] for x in parts])
            ln = np.concatenate([x[2] for x in parts])
        out.append((sr, dr, so, do, ln))
    return out


class PlanTransfer:
    """The engine transfer(s) of one plan post, seen as one transfer."""

    __slots__ = ("transfers", "imm")

    def __init__(self, transfers: list, imm: Optional[int]) -> None:
        self.transfers = transfers
        self.imm = imm

    @property
    def num_writes(self) -> int:
        """Messages (= immediates at the target) of every region pair."""
        return sum(t.num_writes for t in self.transfers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @property
    def posted(self) -> int:
        """Messages handed to the provider (exact once ``done``, also after ``cancel``)."""
        return sum(int(t.posted) for t in self.transfers)

    @property
    def done(self) -> bool:
        return all(t.done for t in self.transfers)

    @property
    def error(self) -> Optional[KvxferError]:
        return next((t.error for t in self.transfers if t.error is not None), None)

    def cancel(self) -> None:
        for t in self.transfers:
            t.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.transfers:
            t.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return f"<PlanTransfer {len(self.transfers)} region pair(s), {self.num_writes} writes>"


def post_plan(engine: Any, plan: Any, src_rank: int, dst_rank: int, src: RegionTable, peer: Any,
              dst: RemoteRegionTable, *, imm: Optional[int] = None, layers: Optional[Iterable[int]] = None,
              rail: Optional[int] = None) -> PlanTransfer:
    """Post every write of ``plan`` from ``src_rank`` to ``dst_rank`` (or of ``layers`` only:
    an empty list posts nothing) with ``imm``, in one ``Engine.write_groups`` call (one region pair per group; ``rail``
    pins it to one local rail). Region ids are checked against both tables before anything
    is posted; the engine checks every offset. The target expects ``result.num_writes``
    arrivals."""
    p = plan
    if layers is not None:
        layers = list(layers)
        if not layers:          # nothing is ready yet: post nothing (None means every layer)
            return PlanTransfer([], imm)
        if len(set(layers)) != len(layers):
            raise PlanError(f"layers {layers} name a layer twice")
        if len(layers) == 1:
            p = plan.layer(layers[0])
        else:
            bad = [x for x in layers if x not in plan.layers]
            if bad:
                raise PlanError(f"layers {bad} are not in the plan")
    batches = plan_batches(p, src_rank, dst_rank)
    if layers is not None and len(layers) > 1:
        want = set(layers)
        batches = []
        for lay in plan.layers:
            if lay in want:
                batches += plan_batches(plan.layer(lay), src_rank, dst_rank)
    for sr, dr, *_ in batches:
        if not (0 <= sr < len(src)) or not (0 <= dr < len(dst)):
            raise InvalidArgumentError(f"plan names region pair ({sr}, {dr}); tables have {len(src)} and {len(dst)}")
    groups = [(src[sr], dst[dr], so, do, ln) for sr, dr, so, do, ln in batches]
    return PlanTransfer([engine.write_groups(peer, groups, imm=imm, rail=rail)], imm)


# >>> issue 22: deprecated names: LayoutRegions -> RegionTable, RemoteLayout -> RemoteRegionTable.
def __getattr__(name: str) -> Any:
    new = {"LayoutRegions": "RegionTable", "RemoteLayout": "RemoteRegionTable"}.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings
    warnings.warn(f"kvxfer.messenger.{name} is deprecated, use {new}", DeprecationWarning, stacklevel=2)
    return globals()[new]
# <<< issue 22
