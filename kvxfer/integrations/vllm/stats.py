"""The connector's transfer statistics in vLLM's form: ``KvxferConnectorStats``
(``KVConnectorStats``: loads and sends by outcome, the time each load took, and the
messenger's bytes and peer events from ``Messenger.metrics()``, summed over workers and
reduced per logging interval) and ``KvxferPromMetrics`` (the same on vLLM's ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: per-interval counters: the connector's outcomes, then deltas of the messenger's metrics
_COUNTS = ("loads_done", "loads_failed", "loads_rejected", "loads_aborted", "sends_done", "sends_failed",
           "sends_rejected", "sends_unclaimed", "sends_streamed", "stream_chunks", "stream_entries",
           "stream_entries_early", "bytes_loaded", "bytes_received", "bytes_sent", "peers_up", "peers_dead",
           "connects_failed")
#: the messenger metrics behind the deltas: (our name, section, key)
_FROM_METRICS = (("bytes_received", "bytes", "received"), ("bytes_sent", "bytes", "sent"),
                 ("peers_up", "peers", "up"), ("peers_dead", "peers", "dead"),
                 ("connects_failed", "peers", "connects_failed"))


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """``data``: the counters above and ``load_ms`` (one entry per finished load: the step that
    started it to the step that saw it final and fenced)."""

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

    def record_metrics(self, metrics: dict[str, Any], last: dict[str, int]) -> dict[str, int]:
        """Add what ``metrics`` (``Messenger.metrics()``) counted since ``last`` (what the
        previous call returned); returns the totals for the next call."""
        now = {name: int(metrics[sec][key]) for name, sec, key in _FROM_METRICS}
        for name, v in now.items():
            self.data[name] += v - last.get(name, 0)
        return now

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


class KvxferPromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus families for the connector: ``vllm:kvxfer_loads`` and
    ``vllm:kvxfer_sends`` (counters by outcome), ``vllm:kvxfer_bytes`` (by direction),
    ``vllm:kvxfer_peer_events`` and the ``vllm:kvxfer_load_seconds`` histogram, fed by
    ``observe`` with each interval's ``KvxferConnectorStats.data``."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        lab = list(labelnames)

        def counter(name: str, doc: str, extra: str) -> Any:
            return self._counter_cls(name=name, documentation=doc, labelnames=lab + [extra])

        self._loads = counter("vllm:kvxfer_loads", "kvxfer KV loads (decoder) by outcome", "outcome")
        self._sends = counter("vllm:kvxfer_sends", "kvxfer KV sends (prefiller) by outcome", "outcome")
        self._bytes = counter("vllm:kvxfer_bytes", "kvxfer KV bytes by direction", "direction")
        self._peers = counter("vllm:kvxfer_peer_events", "kvxfer peer events", "event")
        self._hist = self._histogram_cls(
            name="vllm:kvxfer_load_seconds", documentation="kvxfer load time (step to fenced), seconds",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0], labelnames=lab)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        lv = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        d = transfer_stats_data
        for k in _COUNTS:
            v = int(d.get(k, 0))
            if not v:
                continue
            side, what = k.split("_", 1)
            fam = {"loads": self._loads, "sends": self._sends, "bytes": self._bytes}.get(side, self._peers)
            fam.labels(*lv, what if side in ("loads", "sends", "bytes") else k).inc(v)
        h = self._hist.labels(*lv)
        for ms in d.get("load_ms", ()):
            h.observe(float(ms) / 1e3)
