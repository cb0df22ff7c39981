"""Byte-exact request life cycles between node processes, on tcp;ofi_rxm and shm."""

from __future__ import annotations

import pytest

from kvxfer import KVLayout, Sharding

from _nodes import FULL, Node

CASES = {
    # name: (src layout, src sharding, dst layout, dst sharding)
    "tp1-2": (KVLayout.vllm(3, 4, 8, 4, 64, "float16"), Sharding(1),
              KVLayout.vllm(3, 4, 8, 4, 96, "float16"), Sharding(2)),
    "tp2-1": (KVLayout.vllm(3, 4, 8, 4, 64, "float16"), Sharding(2),
              KVLayout.flash_attn(3, 4, 8, 4, 96, "float16"), Sharding(1)),
    "tp4-2": (KVLayout.layer_major(3, 8, 8, 4, 64, "float16"), Sharding(4),
              KVLayout.vllm(3, 8, 8, 4, 96, "float16", order="NHD"), Sharding(2)),
    "tp2-4": (KVLayout.sglang(3, 4, 8, 4, 64, "float16"), Sharding(2),
              KVLayout.vllm(3, 4, 8, 4, 96, "float16"), Sharding(4)),
    "gqa2-tp4": (KVLayout.vllm(3, 2, 8, 4, 64, "float16"), Sharding(4),
                 KVLayout.vllm(3, 2, 8, 4, 96, "float16"), Sharding(2)),
    "mla4-2": (KVLayout.mla(3, 24, 4, 64, "float16"), Sharding(4, replicated=True),
               KVLayout.mla(3, 24, 4, 96, "float16"), Sharding(2, replicated=True)),
}


def _spec(provider, layout, sharding, seed, **kw):
    return dict(provider=provider, layout=layout, sharding=sharding, seed=seed, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_pairs_byte_exact(provider, case, nodes):
    sl, ss, dl, ds = CASES[case]
    pre = Node("prefill", _spec(provider, sl, ss, 11))
    nodes.append(pre)
    dec = Node("decode", _spec(provider, dl, ds, 12, context_slots=64, context_bytes=48))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    out = dec.call("run", dict(requests=24, max_pages=5, inflight=8, seed=3, src_seed=11, src_layout=sl))
    assert out["failed"] == [] and out["done"] == 24, out
    assert not pre.call("stats")["errors"]


def test_tp2_workers_feed_two_decoders(provider, nodes, tmp_path):
    """A prefill node of two TP worker processes (memfd buffers imported into its messenger)
    serves a TP=1 and a TP=4 decode node at once."""
    sl = KVLayout.vllm(4, 4, 8, 4, 64, "float16")
    pre = Node("prefill", _spec(provider, sl, Sharding(2), 21, workers=True, tmp=str(tmp_path)))
    nodes.append(pre)
    decs = []
    for tp, kw in ((1, dict(context_slots=1024, context_bytes=40)), (4, {})):
        d = Node("decode", _spec(provider, KVLayout.vllm(4, 4, 8, 4, 4096, "float16"), Sharding(tp), 30 + tp, **kw))
        nodes.append(d)
        d.call("connect", "p", pre.blob)
        decs.append(d)
    n = 1000 if FULL else 60
    for i, d in enumerate(decs):
        d.parent.send(("run", dict(requests=n, max_pages=3, inflight=n, seed=i, src_seed=21, src_layout=sl,
                                   prefix=f"d{i}-")))
    for d in decs:
        st, out = d._recv(120)
        assert st == "ok", out
        assert out["failed"] == [] and out["done"] == n and out["peak_inflight"] == n, out
    released = pre.call("wait_sends", 30)           # every Send's done callback ran
    assert released == [("done", None, True)] * (2 * n)
    assert not pre.call("stats")["errors"]


def test_many_in_flight_with_random_aborts(provider, nodes):
    """Requests in flight at once, some aborted at random moments: after abort() returned True
    the aborted pages (sentinel-filled) never change while the traffic goes on, and reusing
    them is byte-exact."""
    sl = KVLayout.vllm(3, 4, 8, 4, 256, "float16")
    dl = KVLayout.vllm(3, 4, 8, 4, 4096, "float16")
    pre = Node("prefill", _spec(provider, sl, Sharding(2), 41, delay=0.004))
    nodes.append(pre)
    dec = Node("decode", _spec(provider, dl, Sharding(1), 42, context_slots=1024, context_bytes=32))
    nodes.append(dec)
    dec.call("connect", "p", pre.blob)
    n = 1000 if FULL else 150
    out = dec.call("run", dict(requests=n, max_pages=3, inflight=n, seed=5, src_seed=41, src_layout=sl,
                               abort_frac=0.15), timeout=300)
    assert out["failed"] == [] and out["peak_inflight"] == n, out
    assert out["done"] + out["aborted"] == n + out["reused"], out
    assert out["aborted"] > 0 and out["reused"] == out["aborted"], out
    # (aborts of requests being written are tested deterministically in test_failures.py)
    assert not pre.call("stats")["errors"]
