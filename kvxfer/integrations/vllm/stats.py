"""The connector's transfer statistics in vLLM's form (``KVConnectorStats``): loads and sends by
outcome and the time each load took, summed over workers and reduced per logging interval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTS = ("loads_done", "loads_failed", "loads_aborted", "sends_done", "sends_failed", "sends_unclaimed",
           "bytes_loaded")


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """``data``: the counters above and ``load_ms`` (one entry per finished load)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in _COUNTS}
        self.data["load_ms"] = []

    def record_load(self, outcome: str, ms: float, nbytes: int = 0) -> None:
        self.data["loads_" + outcome] += 1
        self.data["bytes_loaded"] += int(nbytes)
        self.data["load_ms"].append(float(ms))

    def record_send(self, outcome: str) -> None:
        self.data["sends_" + outcome] += 1

    def aggregate(self, other: KVConnectorStats) -> "KvxferConnectorStats":
        if not other.is_empty():
            for k in _COUNTS:
                self.data[k] = self.data.get(k, 0) + int(other.data.get(k, 0))
            self.data.setdefault("load_ms", []).extend(other.data.get("load_ms", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in _COUNTS}
        ms = np.asarray(self.data.get("load_ms", []), float)
        if ms.size:
            out["load_ms_p50"] = round(float(np.percentile(ms, 50)), 3)
            out["load_ms_p99"] = round(float(np.percentile(ms, 99)), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _COUNTS) and not self.data.get("load_ms")

    def to_dict(self) -> dict[str, Any]:
        return self.data
