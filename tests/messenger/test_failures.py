"""Aborts mid-transfer, dead peers (kill -9 of either side), on tcp;ofi_rxm and shm."""

from __future__ import annotations

import time

from _nodes import Node

from kvxfer import KVLayout, Sharding

LAYOUT = KVLayout.vllm(3, 4, 8, 4, 64, "float16")
PEER_TIMEOUT = 1.0
MARGIN = 4.0       # a deadline for the test, not a speed goal


def _spec(provider, seed, **kw):
    return dict(provider=provider, layout=LAYOUT, sharding=Sharding(2), seed=seed, **kw)


def _until(node, want, deadline=20.0):
    """Poll a decode node until its pending requests reach the wanted state."""
    end = time.monotonic() + deadline
    while True:
        states = node.call("states")
        if all(s == want for s in states) or time.monotonic() > end:
            return states
        time.sleep(0.02)


def _wait_held(pre, n, deadline=20.0):
    """Poll a prefill node (``hold=True``) until it holds ``n`` requests (a bounded wait)."""
    end = time.monotonic() + deadline
    while pre.call("stats")["held"] < n and time.monotonic() < end:
        time.sleep(0.02)


def test_abort_mid_transfer_fences(provider, nodes):
    """The KV writes of three requests are posted but the context is not: each request is
    'transferring'. abort() returns True; the pages, filled with a sentinel, never change
    again (also when the prefiller later tries to finish), and new traffic reusing them is
    byte-exact."""
    pre = Node("prefill", _spec(provider, 51, hold=True))
    nodes.append(pre)
    dec = Node("decode", dict(provider=provider, layout=KVLayout.vllm(3, 4, 8, 4, 64, "float16"),
                              sharding=Sharding(1), seed=52, context_slots=64, context_bytes=24))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    dec.call("start", "p", 3)
    _wait_held(pre, 3)
    assert pre.call("send_held") == ["transferring"] * 3
    assert _until(dec, "transferring") == ["transferring"] * 3
    assert dec.call("abort_pending") == [("transferring", True, "aborted")] * 3
    assert pre.call("finish_held_sends") == ["aborted"] * 3      # too late: nothing more is posted
    assert dec.call("sentinel_pending")
    pre.call("hold", False)
    out = dec.call("run", dict(requests=40, max_pages=3, inflight=40, seed=7, src_seed=51, src_layout=LAYOUT))
    assert out["failed"] == [] and out["done"] == 40, out
    assert dec.call("sentinel_pending") is False    # the pages were reused (and checked byte-exact)


def test_prefiller_killed_fails_requests(provider, nodes):
    pre = Node("prefill", _spec(provider, 61, hold=True, peer_timeout=PEER_TIMEOUT))
    nodes.append(pre)
    dec = Node("decode", dict(provider=provider, layout=LAYOUT, sharding=Sharding(1), seed=62,
                              peer_timeout=PEER_TIMEOUT))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    dec.call("start", "p", 3)
    pre.kill()
    out = dec.call("wait_pending", PEER_TIMEOUT + MARGIN)
    assert out["results"] == [("failed", "PeerError", True)] * 3, out
    assert out["stats"].get("peers_dead") == 1


def test_decoder_killed_fails_sends_and_releases_pages(provider, nodes):
    pre = Node("prefill", _spec(provider, 71, hold=True, peer_timeout=PEER_TIMEOUT))
    nodes.append(pre)
    dec = Node("decode", dict(provider=provider, layout=LAYOUT, sharding=Sharding(1), seed=72,
                              context_slots=4, context_bytes=16, peer_timeout=PEER_TIMEOUT))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    dec.call("start", "p", 3)
    _wait_held(pre, 3)
    assert pre.call("send_held") == ["transferring"] * 3     # posted, not finished: in flight
    dec.kill()
    # every Send fails with PeerError and its done callback (pages may be freed) runs
    assert pre.call("wait_sends", PEER_TIMEOUT + MARGIN) == [("failed", "PeerError", True)] * 3


def test_a_stalled_decoder_does_not_declare_its_live_prefiller_dead(provider, nodes):
    """A decoder process stopped (SIGSTOP) for more than twice its ``peer_timeout`` while its
    requests wait: on waking, the time it could not listen is nobody's silence (its messenger
    thread's round ran far past its wait, ``stalls_forgiven``), so it reads the heartbeats its
    live prefiller sent meanwhile and does not declare it dead; the held requests then
    complete byte-exact. (Seen in vLLM: a decoder starved of CPU for 5-10 s declared both
    live prefill ranks dead on waking, at peer_timeout 3 s.) The prefiller's own timeout is
    long, so only the decoder's verdict is tested."""
    import os
    import signal

    pre = Node("prefill", _spec(provider, 81, hold=True, peer_timeout=60.0))
    nodes.append(pre)
    dec = Node("decode", dict(provider=provider, layout=LAYOUT, sharding=Sharding(1), seed=82,
                              peer_timeout=PEER_TIMEOUT * 1.5))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    dec.call("start", "p", 2)
    _wait_held(pre, 2)
    os.kill(dec.pid, signal.SIGSTOP)
    try:
        time.sleep(PEER_TIMEOUT * 1.5 * 2.5)
    finally:
        os.kill(dec.pid, signal.SIGCONT)
    time.sleep(PEER_TIMEOUT)                      # awake, reading what came meanwhile
    assert dec.call("states") == ["pending"] * 2
    assert pre.call("send_held") == ["transferring"] * 2
    pre.call("finish_held_sends")
    assert pre.call("wait_sends", 20) == [("done", None, True)] * 2
    out = dec.call("wait_pending", 20)
    assert out["results"] == [("done", None, True)] * 2, out
    assert out["stats"].get("peers_dead", 0) == 0 and out["stats"]["stalls_forgiven"] >= 1, out["stats"]
