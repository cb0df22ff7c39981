"""End-to-end disaggregated inference with a small numpy transformer (issue 11).

``model`` and ``runtime`` are numpy only (importable without libfabric): the model, its paged
KV cache in a ``kvxfer.KVLayout``, and the colocated reference. ``tp`` runs TP ranks as worker
processes whose KV lives in memfd ``KVBuffer``s; ``flow`` joins a prefill node and a decode
node; ``cli`` is ``kvxfer-demo``. Names load lazily, so ``kvxfer.demo.cli`` can set up the
process before numpy loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ModelConfig": "kvxfer.demo.model",
    "RankModel": "kvxfer.demo.model",
    "RankCache": "kvxfer.demo.model",
    "LocalGroup": "kvxfer.demo.runtime",
    "PagePool": "kvxfer.demo.runtime",
    "Generation": "kvxfer.demo.runtime",
    "colocated": "kvxfer.demo.runtime",
    "DemoConfig": "kvxfer.demo.flow",
    "run": "kvxfer.demo.flow",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvxfer.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
