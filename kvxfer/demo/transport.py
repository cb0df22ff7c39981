"""Moving a request's KV between two TP groups' pools.

``copy_plan`` is the fabric-free transport: it executes a ``kvxfer.plan`` write list as numpy
byte copies, region to region, exactly the bytes an RDMA transfer of the same plan would
write. The demo's ``--transport numpy`` and the phase-1 tests use it; the messenger
transports use the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxfer.planner import TransferPlan

__all__ = ["copy_plan"]


def copy_plan(plan: TransferPlan, src_regions: Sequence[Sequence[np.ndarray]],
              dst_regions: Sequence[Sequence[np.ndarray]]) -> tuple[int, int]:
    """Copy every write of ``plan``: ``src_regions[s][region]`` and ``dst_regions[d][region]``
    are uint8 arrays. Returns (writes, bytes) copied."""
    writes = nbytes = 0
    for s, d in plan.pairs:
        w = plan.writes(s, d)
        src, dst = src_regions[s], dst_regions[d]
        for sr, so, dr, do, n in zip(w.src_region.tolist(), w.src_offset.tolist(), w.dst_region.tolist(),
                                     w.dst_offset.tolist(), w.length.tolist()):
            dst[dr][do:do + n] = src[sr][so:so + n]
        writes += len(w)
        nbytes += w.nbytes
    return writes, nbytes
