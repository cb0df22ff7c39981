"""The messenger's metrics: counters and histograms an operator scrapes, as plain data
(``Messenger.metrics()``), and an optional Prometheus exporter over ``prometheus_client``
(the ``metrics`` extra).

What is counted (the counters are ``Node.counts``, the histograms ``Histograms``, both fed at
the rooms' transitions):

* requests by outcome: ``receives`` (decode side: done, failed, aborted; rejected and
  timed_out are failed ones), ``sends`` (prefill side: done, failed, aborted; rejected: the
  engine's ``Request.reject``), ``requests`` received, queued on a connecting peer;
* bytes: ``send_bytes`` (what the prefiller's settled Sends posted), ``receive_bytes`` (the
  data bytes of the decoder's done receives' pages: whole pages, every layer and plane, of
  every rank it holds; page padding not counted);
* seconds (histograms): ``receive`` (``receive()`` to final), ``receive_announce``
  (``receive()`` to the first ANNOUNCE: the prefiller has posted), ``send`` (REQUEST in to the
  Send final), ``send_first_post`` (REQUEST in to its first write posted: the prefiller's time
  to first byte), ``fence`` (ABORTED in to the leg fenced), ``peer_silence`` (at each message
  accepted from a live peer: the time since the one before, so how near ``peer_timeout`` a
  live peer came), ``loop_gap`` (one round of the messenger thread: its wait of at most
  ``peer_timeout / 8``, the messages it read, and any time it was not scheduled: a round far
  past the wait says this process, not its peer, was starved);
* peers: ``up`` (HELLO answered), ``left`` (a clean BYE), ``dead`` (silence, a broken
  protocol, a failed send: a BYE is not one), ``closed`` (this messenger closed), ``connects_failed``;
* control messages dropped, by reason (``drop_*`` of ``stats()``).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import Any, Optional

__all__ = ["Histograms", "BUCKETS", "snapshot", "PrometheusCollector", "PrometheusServer", "serve_prometheus"]

#: histogram bucket upper bounds, seconds (then +Inf)
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0, 30.0, 60.0)


class Histograms:
    """Named histograms of seconds with fixed ``BUCKETS``; ``observe`` from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._h: dict[str, list] = {}          # name -> [counts per bucket + inf, count, sum]

    def observe(self, name: str, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            h = self._h.get(name)
            if h is None:
                h = self._h[name] = [[0] * (len(BUCKETS) + 1), 0, 0.0]
            h[0][i] += 1
            h[1] += 1
            h[2] += float(seconds)

    def snapshot(self) -> dict[str, dict]:
        """``name -> {"count", "sum", "buckets": [(upper bound, cumulative count), ...]}``."""
        with self._lock:
            out = {}
            for name, (counts, n, total) in self._h.items():
                cum, acc = [], 0
                for le, c in zip(BUCKETS + (float("inf"),), counts):
                    acc += c
                    cum.append((le, acc))
                out[name] = {"count": n, "sum": total, "buckets": cum}
            return out


def snapshot(counts: dict[str, int], hist: Histograms) -> dict[str, Any]:
    """``Messenger.metrics()``'s plain data from the counters and histograms."""
    c = counts.get

    def outcomes(prefix: str, extra: Iterable[str]) -> dict[str, int]:
        return {k: c(f"{prefix}_{k}", 0) for k in ("done", "failed", "aborted", *extra)}

    return {
        "receives": outcomes("receive", ("rejected", "timed_out")),
        "sends": outcomes("send", ("rejected",)),
        "requests": {"received": c("requests", 0), "rejected_here": c("requests_rejected", 0),
                     "sent": c("receives", 0), "queued_on_connect": c("receives_queued", 0),
                     "pulled": c("receives_pull", 0), "exposed": c("sends_pull", 0)},
        "bytes": {"sent": c("send_bytes", 0), "received": c("receive_bytes", 0), "read": c("pull_read_bytes", 0)},
        "seconds": hist.snapshot(),
        "peers": {"up": c("peers_up", 0), "left": c("peers_left", 0), "dead": c("peers_dead", 0),
                  "closed": c("peers_closed", 0), "connects_failed": c("connects_failed", 0)},
        "dropped": {k[len("drop_"):]: v for k, v in counts.items() if k.startswith("drop_")},
        "messages": {"sent": {k[5:]: v for k, v in counts.items() if k.startswith("sent_")},
                     "received": {k[5:]: v for k, v in counts.items() if k.startswith("recv_")}},
    }


class PrometheusCollector:
    """A ``prometheus_client`` collector reading ``messenger.metrics()`` at each scrape, every
    family prefixed ``kvxfer_messenger_`` and labelled with the messenger's ``uid``."""

    def __init__(self, messengers: Iterable[Any]) -> None:
        self.messengers = list(messengers)

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        fams: dict[str, Any] = {}

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            if name not in fams:
                fams[name] = CounterMetricFamily("kvxfer_messenger_" + name, doc, labels=["uid", *labels])
            return fams[name]

        hists: dict[str, Any] = {}
        for m in self.messengers:
            if m.closed:
                continue
            uid = f"{m.uid:016x}"
            x = m.metrics()
            for side in ("receives", "sends"):
                for outcome, v in x[side].items():
                    counter(side, f"{side} by outcome", ["outcome"]).add_metric([uid, outcome], v)
            for k, v in x["requests"].items():
                counter("requests", "requests by what happened to them", ["what"]).add_metric([uid, k], v)
            for k, v in x["bytes"].items():
                counter("bytes", "KV bytes sent (posted) and received (page bytes)", ["direction"]).add_metric([uid, k], v)
            for k, v in x["peers"].items():
                counter("peers", "peer transitions", ["event"]).add_metric([uid, k], v)
            for k, v in x["dropped"].items():
                counter("dropped_messages", "control messages dropped, by reason", ["reason"]).add_metric([uid, k], v)
            for name, h in x["seconds"].items():
                fam = hists.get(name)
                if fam is None:
                    fam = hists[name] = HistogramMetricFamily(f"kvxfer_messenger_{name}_seconds",
                                                              f"seconds: {name}", labels=["uid"])
                fam.add_metric([uid], [(("+Inf" if le == float("inf") else repr(le)), n) for le, n in h["buckets"]],
                               h["sum"])
        yield from fams.values()
        yield from hists.values()


class PrometheusServer:
    """A running Prometheus exporter (``serve_prometheus``): ``registry``, ``port`` (the one it
    bound), ``url``; ``close()`` stops serving, frees the port and joins its thread
    (idempotent; also as a context manager)."""

    def __init__(self, registry: Any, server: Any, thread: Any) -> None:
        self.registry = registry          #: the CollectorRegistry it serves
        self._server = server
        self._thread = thread
        self.port: int = int(server.server_port)     #: the port it listens on
        self.url = f"http://{server.server_address[0]}:{self.port}/metrics"    #: where Prometheus scrapes
        self.closed = False               #: close() was called

    def close(self, timeout: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()           # serve_forever returns
        self._server.server_close()       # the listening socket goes
        self._thread.join(timeout)

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PrometheusServer {self.url}{' closed' if self.closed else ''}>"


def serve_prometheus(messengers: Iterable[Any], port: int, addr: str = "127.0.0.1",
                     registry: Optional[Any] = None) -> PrometheusServer:
    """Serve ``messengers``' metrics for Prometheus on ``addr:port`` (``prometheus_client``'s
    HTTP server on a daemon thread; ``port=0``: any free port, read ``.port``). Returns the
    running ``PrometheusServer``: ``close()`` it to stop. Needs the ``metrics`` extra."""
    from kvxfer._check import as_int

    port = as_int(port, "port", minimum=0, maximum=65535)
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:      # pragma: no cover - the extra is missing
        from kvxfer.errors import UnsupportedError

        raise UnsupportedError("the Prometheus exporter needs prometheus_client: pip install 'kvxfer[metrics]'") from exc
    reg = CollectorRegistry() if registry is None else registry
    reg.register(PrometheusCollector(messengers))
    # prometheus_client >= 0.17 returns its server and thread (the extra asks for >= 0.20)
    server, thread = start_http_server(port, addr=addr, registry=reg)
    return PrometheusServer(reg, server, thread)
