"""The KV messenger: handshakes, requests, exact completion, abort fences, dead peers.

``Messenger`` (one per node, or one per TP rank process holding only its rank) is the entry
point; ``publish``/``collect`` hand TP workers' KV buffers to a node's messenger process; ``register_layout``/``post_plan`` are the two
helpers for engines that drive kvxfer without the messenger. See docs/messenger.md.
"""

from __future__ import annotations

from kvxfer.messenger.messenger import Messenger, PeerGroup, Receive, Request, Send, context_stride
from kvxfer.messenger.stream import LayerCounter, Pass, pages_completed
from kvxfer.messenger.context import pack_context, unpack_context
from kvxfer.messenger.paged import (
    RegionTable,
    PlanTransfer,
    RemoteRegionTable,
    post_plan,
    register_layout,
    remote_layout,
)
from kvxfer.messenger.workers import collect, publish

__all__ = [
    "Messenger", "PeerGroup", "Receive", "Request", "Send", "context_stride", "LayerCounter", "Pass",
    "pages_completed", "pack_context", "unpack_context",
    "RegionTable", "RemoteRegionTable", "PlanTransfer", "register_layout", "remote_layout", "post_plan",
    "publish", "collect",
]


# >>> issue 22: deprecated names: LayoutRegions -> RegionTable, RemoteLayout -> RemoteRegionTable.
def __getattr__(name: str) -> object:
    if name in ("LayoutRegions", "RemoteLayout"):
        from kvxfer.messenger import paged
        return getattr(paged, name)      # warns
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
# <<< issue 22
