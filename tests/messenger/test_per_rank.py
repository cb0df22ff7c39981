"""Per-rank endpoints in processes as the engines run them: every prefill (or decode) TP rank is
its own process with its own Engine and ``Messenger(..., ranks=[r])``, torch CPU tensors as its
KV where torch is installed (numpy otherwise); byte-exact against the independent reference
(tests/unit/_planner_ref.py), context checked; kill -9 of one rank on either side; an abort
storm across ranks with sentinels."""

from __future__ import annotations

import time

import pytest

from kvxfer import KVLayout, Sharding

from _nodes import Node

CASES = {
    # name: (src layout, src sharding, prefill per-rank, dst layout, dst sharding, decode per-rank)
    "tp2-1": (KVLayout.vllm(3, 4, 8, 4, 64, "float16"), Sharding(2), True,
              KVLayout.flash_attn(3, 4, 8, 4, 96, "float16"), Sharding(1), False),
    "tp1-2": (KVLayout.vllm(3, 4, 8, 4, 64, "float16"), Sharding(1), False,
              KVLayout.vllm(3, 4, 8, 4, 96, "float16"), Sharding(2), True),
    "tp4-2": (KVLayout.layer_major(3, 8, 8, 4, 64, "float16"), Sharding(4), True,
              KVLayout.vllm(3, 8, 8, 4, 96, "float16", order="NHD"), Sharding(2), True),
    "gqa2-tp4": (KVLayout.vllm(3, 2, 8, 4, 64, "float16"), Sharding(4), True,
                 KVLayout.vllm(3, 2, 8, 4, 96, "float16"), Sharding(1), False),
    "mla2-2": (KVLayout.mla(3, 24, 4, 64, "float16"), Sharding(2, replicated=True), True,
               KVLayout.mla(3, 24, 4, 96, "float16"), Sharding(2, replicated=True), True),
}


def _spec(provider, layout, sharding, seed, **kw):
    return dict(provider=provider, layout=layout, sharding=sharding, seed=seed, **kw)


def _prefills(nodes, provider, layout, sharding, per_rank, seed, **kw):
    """The prefill instance: one process per rank, or one node process; returns (nodes, blob
    or blobs)."""
    ranks = [[r] for r in range(sharding.tp_size)] if per_rank else [None]
    out = []
    for rs in ranks:
        n = Node("prefill", _spec(provider, layout, sharding, seed, ranks=rs, **kw))
        nodes.append(n)
        out.append(n)
    return out, ([n.blob for n in out] if per_rank else out[0].blob)


def _decoders(nodes, provider, layout, sharding, per_rank, seed, **kw):
    ranks = [[r] for r in range(sharding.tp_size)] if per_rank else [None]
    out = []
    for rs in ranks:
        n = Node("decode", _spec(provider, layout, sharding, seed, ranks=rs, **kw))
        nodes.append(n)
        out.append(n)
    return out


def _run_all(decs, args, timeout=120):
    for d in decs:
        d.parent.send(("run", args))
    outs = []
    for d in decs:
        st, out = d._recv(timeout)
        assert st == "ok", out
        outs.append(out)
    return outs


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_rank_byte_exact(provider, case, nodes):
    sl, ss, spr, dl, ds, dpr = CASES[case]
    pres, blob = _prefills(nodes, provider, sl, ss, spr, 11)
    decs = _decoders(nodes, provider, dl, ds, dpr, 12, context_slots=64, context_bytes=48)
    for d in decs:
        d.call("connect", "p", blob)
    n = 12
    for out in _run_all(decs, dict(requests=n, max_pages=5, inflight=6, seed=3, src_seed=11, src_layout=sl)):
        assert out["failed"] == [] and out["done"] == n, out
    for p in pres:
        assert not p.call("stats")["errors"]
        assert all(x == ("done", None, True) for x in p.call("wait_sends", 20))
    if spr:
        # each rank process announced its own share: between them, every request of every decoder
        # (a rank that writes nothing to a decoder rank is not asked)
        assert sum(p.call("stats")["stats"].get("send_done", 0) for p in pres) >= n * len(decs)


def test_abort_storm_across_ranks(provider, nodes):
    """Requests over a per-rank TP2 instance whose ranks answer in any order (random delays),
    some aborted at random moments: after abort() returned True the aborted pages never change,
    and reusing them is byte-exact."""
    sl = KVLayout.vllm(3, 4, 8, 4, 256, "float16")
    dl = KVLayout.vllm(3, 4, 8, 4, 1024, "float16")
    pres, blobs = _prefills(nodes, provider, sl, Sharding(2), True, 41, delay=0.004)
    (dec,) = _decoders(nodes, provider, dl, Sharding(1), False, 42, context_slots=256, context_bytes=32)
    dec.call("connect", "p", blobs)
    (out,) = _run_all([dec], dict(requests=60, max_pages=4, inflight=12, seed=5, src_seed=41, src_layout=sl,
                                  abort_frac=0.3))
    assert out["failed"] == [], out
    assert out["aborted"] > 0 and out["done"] + out["aborted"] == 60 + out["reused"], out
    assert out["sentinel_pages"] > 0 and out["reused"] == out["aborted"], out
    for p in pres:
        assert not p.call("stats")["errors"]


def test_kill9_one_prefill_rank(provider, nodes):
    """Rank 1 of a per-rank TP2 prefill instance is SIGKILLed mid-request (rank 0 posted its
    share, not finished): the decoder's requests fail with PeerError within peer_timeout + a
    margin, fenced (rank 0's writes fenced by its ABORTED, rank 1's connection torn down); rank 0
    keeps serving, and with a new rank 1 the same pages are reused byte-exact."""
    pt = 2.0
    sl = KVLayout.vllm(3, 4, 8, 4, 64, "float16")
    dl = KVLayout.vllm(3, 4, 8, 4, 96, "float16")
    pres, blobs = _prefills(nodes, provider, sl, Sharding(2), True, 51, hold=True, peer_timeout=pt)
    (dec,) = _decoders(nodes, provider, dl, Sharding(1), False, 52, context_slots=16, context_bytes=32,
                       peer_timeout=pt)
    dec.call("connect", "p", blobs)
    assert dec.call("start", "p", 4) == ["pending"] * 4
    deadline = time.monotonic() + 20
    while pres[0].call("stats")["held"] < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pres[0].call("send_held") == ["transferring"] * 4     # posted and announced, no context yet
    pres[1].kill()
    t0 = time.monotonic()
    res = dec.call("wait_pending", pt + 10, timeout=pt + 30)
    assert time.monotonic() - t0 < pt + 5, res["elapsed"]
    assert [(s, e) for s, e, _ in res["results"]] == [("failed", "PeerError")] * 4, res
    assert all(f for *_, f in res["results"]), res          # fenced: the pages are free again
    released = pres[0].call("wait_sends", 20)
    assert [s for s, *_ in released] == ["aborted"] * 4, released
    # rank 0 keeps serving: with a new rank 1 the instance serves the same pages again
    pres[0].call("hold", False)
    new1 = Node("prefill", _spec(provider, sl, Sharding(2), 51, ranks=[1], peer_timeout=pt))
    nodes.append(new1)
    dec.call("connect", "p", [blobs[0], new1.blob])     # the instance, with its new rank 1
    (out,) = _run_all([dec], dict(requests=12, max_pages=3, inflight=4, seed=7, src_seed=51, src_layout=sl,
                                  prefix="again"))
    assert out["failed"] == [] and out["done"] == 12, out


def test_kill9_one_decode_rank(provider, nodes):
    """Rank 1 of a per-rank TP2 decoder is SIGKILLed with requests in flight: the prefiller's
    Sends to it fail with PeerError within peer_timeout + a margin (their source pages free),
    the Sends to rank 0 complete, and rank 0 goes on receiving byte-exact."""
    pt = 2.0
    sl = KVLayout.vllm(3, 4, 8, 4, 64, "float16")
    dl = KVLayout.vllm(3, 4, 8, 4, 96, "float16")
    (pre,), blob = _prefills(nodes, provider, sl, Sharding(1), False, 61, hold=True, peer_timeout=pt)
    decs = _decoders(nodes, provider, dl, Sharding(2), True, 62, peer_timeout=pt, context_slots=16, context_bytes=16)
    for d in decs:
        d.call("connect", "p", blob)
        assert d.call("start", "p", 3) == ["pending"] * 3
    deadline = time.monotonic() + 20
    while pre.call("stats")["held"] < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pre.call("send_held") == ["transferring"] * 6
    decs[1].kill()
    t0 = time.monotonic()
    pre.call("finish_held_sends")
    released = pre.call("wait_sends", pt + 10, timeout=pt + 30)
    assert time.monotonic() - t0 < pt + 5
    assert sorted((s, e) for s, e, _ in released) == [("done", None)] * 3 + [("failed", "PeerError")] * 3, released
    res = decs[0].call("wait_pending", 10)
    assert [s for s, *_ in res["results"]] == ["done"] * 3, res
    pre.call("hold", False)
    (out,) = _run_all([decs[0]], dict(requests=10, max_pages=3, inflight=4, seed=9, src_seed=61, src_layout=sl,
                                      prefix="after"))
    assert out["failed"] == [] and out["done"] == 10, out
