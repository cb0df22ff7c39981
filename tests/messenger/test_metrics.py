"""``Messenger.metrics()`` and the Prometheus exporter (issue 23), on both providers, in node and
per-rank mode: requests by outcome, bytes both ways, the histograms, a fence, peers up and
left (a clean BYE is not a death); ``PrometheusCollector`` renders them, ``serve_prometheus``
serves them over HTTP and stops when closed (its port is free again)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

from kvxfer.errors import InvalidArgumentError, RejectedError

from _api import LAYOUT, Cluster


@pytest.fixture(params=[False, True], ids=["node", "per_rank"])
def cl(request, provider):
    c = Cluster(provider, request.param)
    yield c
    c.close()


def test_metrics_count_outcomes_bytes_times_and_peers(cl):
    """One request of each outcome (done, rejected by the first prefill messenger, aborted by
    the decoder): the decoder counts each once whatever the number of legs; each prefill
    messenger counts its own Sends and its own rejection; bytes, histograms and peers add up."""
    prom = pytest.importorskip("prometheus_client")
    from kvxfer.messenger.metrics import PrometheusCollector

    d, pre = cl.d, cl.pre
    r = d.receive(cl.peer, "m-done", [0, 1], 8)
    sends = [p.send(q[0], [2, 3], context=b"x") for p, q in zip(pre, cl.requests(1))]
    assert r.wait(10) == "done" and all(s.wait(10) == "done" for s in sends)
    r = d.receive(cl.peer, "m-rej", [4], 4)
    qs = cl.requests(1)
    qs[0][0].reject("no")                              # the first rank's; the others are aborted
    with pytest.raises(RejectedError, match="no"):
        r.wait(10)
    r = d.receive(cl.peer, "m-ab", [5], 4)
    sends = [p.send(q[0], [6]) for p, q in zip(pre, cl.requests(1))]
    assert r.abort(10) is True
    # the first leg waits for the context, never given, so the ABORT always finds it open. A
    # later rank's leg (no context) may have landed whole before the ABORT: the decoder then
    # tells it nothing, and its Send is final once finish() is called, as the API asks of
    # every rank: done. (Without finish() it stayed transferring: the test's old race.)
    for s in sends[1:]:
        s.finish()
    ends = [s.wait(10) for s in sends]
    assert ends[0] == "aborted" and all(e in ("aborted", "done") for e in ends[1:])
    dm, pms = d.metrics(), [p.metrics() for p in pre]
    assert dm["receives"] == {"done": 1, "failed": 1, "aborted": 1, "rejected": 1, "timed_out": 0}
    assert pms[0]["requests"]["rejected_here"] == 1
    assert all(pm["requests"]["rejected_here"] == 0 for pm in pms[1:])
    assert all(pm["sends"]["done"] == 1 + (e == "done") and pm["sends"]["aborted"] == (e == "aborted")
               for pm, e in zip(pms, ends))
    page = 2 * 2 * LAYOUT.page_size * 4 * 8 * 2           # layers x planes x tokens x heads x dim x 2 bytes
    assert dm["bytes"]["received"] == 2 * page            # the decoder's pages, every rank's share
    assert sum(pm["bytes"]["sent"] for pm in pms) >= 2 * page
    assert dm["seconds"]["receive"]["count"] == 3 and dm["seconds"]["fence"]["count"] >= 1
    assert all(pm["seconds"]["send_first_post"]["count"] >= 1 and pm["seconds"]["send"]["count"] == 2
               for pm in pms)
    assert dm["peers"]["up"] == len(pre) and all(pm["peers"]["up"] == 1 for pm in pms)
    # liveness: every message accepted from a live peer is one silence observed (the decoder
    # accepted at least one ANNOUNCE or REJECT per prefill messenger); every round of the
    # messenger thread one loop gap
    accepted = sum(v for k, v in d.stats().items() if k.startswith("recv_") and k != "recv_HELLO")
    assert dm["seconds"]["peer_silence"]["count"] >= accepted >= len(pre)
    assert dm["seconds"]["loop_gap"]["count"] >= 1 and dm["seconds"]["loop_gap"]["sum"] > 0
    reg = prom.CollectorRegistry()
    reg.register(PrometheusCollector([d, *pre]))
    text = prom.generate_latest(reg).decode()
    assert 'kvxfer_messenger_receives_total{outcome="rejected"' in text
    assert "kvxfer_messenger_receive_seconds_bucket" in text
    assert text.count('kvxfer_messenger_peers_total{event="up"') == 1 + len(pre)     # one series per messenger
    for p in pre:
        p.close()                                          # a clean BYE each
    deadline = time.monotonic() + 10
    while d.metrics()["peers"]["left"] < len(pre) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.metrics()["peers"]["left"] == len(pre) and d.metrics()["peers"]["dead"] == 0


def _scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_prometheus_server_serves_and_stops(provider):
    """``serve_prometheus`` serves on the port asked (0: any free one), returns a handle whose
    ``close()`` stops it: the port refuses connections, can be bound again, and a second
    close does nothing; bad ports are refused before anything listens."""
    pytest.importorskip("prometheus_client")
    from kvxfer.messenger.metrics import serve_prometheus

    cl = Cluster(provider, False)
    try:
        srv = serve_prometheus([cl.d, cl.pre[0]], 0)
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        body = _scrape(srv.url)
        assert "kvxfer_messenger_receives_total" in body and f"{cl.d.uid:016x}" in body
        srv.close()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _scrape(srv.url)
        with socket.socket() as s:                         # the port is free again: nobody listens on it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # (the scrape's TIME_WAIT)
            s.bind(("127.0.0.1", srv.port))
            s.listen()
        srv.close()                                        # idempotent
        with serve_prometheus([cl.d], srv.port) as again:  # that port, once more, as a context manager
            assert "kvxfer_messenger" in _scrape(again.url)
        assert again.closed
        for bad in (-1, 65536, "9100", 1.5, True):
            with pytest.raises(InvalidArgumentError):
                serve_prometheus([cl.d], bad)
    finally:
        cl.close()
