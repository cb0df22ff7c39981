"""A prefill and a decode messenger on a small layout, each on its own engine, with a shared
secret: the fixture ``pair`` of the bad-input and hostile-peer tests (tests/messenger/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import kvxfer
from kvxfer import KVLayout, Sharding

LAYOUT = KVLayout.vllm(2, 4, 8, 4, 32, "float16")
SH = Sharding(1)
SECRET = b"test-secret-0123456789"


def regions(fill: int) -> list:
    """The layout's regions on one rank, every byte ``fill``."""
    return [np.full(s, fill, np.uint8) for s in LAYOUT.region_sizes(SH)]


def open_pair(provider: str) -> SimpleNamespace:
    """p (prefill, regions of 7), d (decode, regions of 0xEE, 4 context slots of 16 bytes),
    pg (d's group for p), back (p's group for d), src, dst; ``close()`` closes all."""
    ea, eb = kvxfer.Engine(provider, "127.0.0.1"), kvxfer.Engine(provider, "127.0.0.1")
    src, dst = regions(7), regions(0xEE)
    p = kvxfer.Messenger(ea, LAYOUT, SH, {0: src}, peer_timeout=5, secret=SECRET)
    d = kvxfer.Messenger(eb, LAYOUT, SH, {0: dst}, context_slots=4, context_bytes=16, peer_timeout=5, secret=SECRET)
    pg = d.connect(p.handshake())

    def close() -> None:
        d.close()
        p.close()
        eb.close()
        ea.close()

    return SimpleNamespace(p=p, d=d, pg=pg, back=p._peers[d.uid], src=src, dst=dst, close=close)
