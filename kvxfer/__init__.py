"""kvxfer: KV-cache transfer for disaggregated LLM serving, over libfabric.

Names and submodules are loaded lazily, so ``import kvxfer`` and the pure-numpy planner work on a
machine without libfabric; the engine's native module loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # engine (needs the native module kvxfer._fabric)
    "Engine": "kvxfer.engine",
    "Peer": "kvxfer.engine",
    "MemoryRegion": "kvxfer.engine",
    "RemoteRegion": "kvxfer.engine",
    "Transfer": "kvxfer.engine",
    "Counter": "kvxfer.engine",
    "providers": "kvxfer.engine",
    "count_writes": "kvxfer.wire",
    # planners (pure numpy)
    "KVLayout": "kvxfer.layout",
    "Sharding": "kvxfer.layout",
    "plan": "kvxfer.planner",
    "TransferPlan": "kvxfer.planner",
    # topology (pyhwloc)
    "Topology": "kvxfer.topology",
    "Placement": "kvxfer.topology",
    # messenger
    "Messenger": "kvxfer.messenger",
    # buffers
    "KVBuffer": "kvxfer.buffers",
    "SharedHandle": "kvxfer.buffers",
}

# public submodules, imported on first attribute access (``kvxfer.share.send_handles``)
_SUBMODULES = ("buffers", "cli", "demo", "engine", "errors", "integrations", "layout", "messenger", "planner",
               "rendezvous", "share", "topology", "wire")

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from kvxfer.buffers import KVBuffer, SharedHandle
    from kvxfer.engine import Counter, Engine, MemoryRegion, Peer, RemoteRegion, Transfer, providers
    from kvxfer.layout import KVLayout, Sharding
    from kvxfer.messenger import Messenger
    from kvxfer.planner import TransferPlan, plan
    from kvxfer.topology import Placement, Topology
    from kvxfer.wire import count_writes

from kvxfer import errors  # noqa: E402  (leaf module, always importable)
from kvxfer import _environ  # noqa: E402

_environ.apply()  # before anything loads libfabric (see kvxfer/_environ.py)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"kvxfer.{name}")
        globals()[name] = value
        return value
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
