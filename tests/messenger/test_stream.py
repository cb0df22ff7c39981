"""Layer-by-layer streaming (issue 10) between node processes, on tcp;ofi_rxm and shm: the
overlap is real, chunked prefill is byte-exact, aborts and abandoned passes obey the fence."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import KVLayout, Sharding
from kvxfer.messenger import pages_completed

from _stream_nodes import StreamNode

L = 32


def _mirror(tmp_path):
    path = tmp_path / "mirror.u64"
    path.write_bytes(bytes(64))
    return str(path)


def _pair(provider, nodes, sl, ss, dl, ds, seed=7):
    pre = StreamNode("prefill", dict(provider=provider, layout=sl, sharding=ss, seed=seed))
    nodes.append(pre)
    dec = StreamNode("decode", dict(provider=provider, layout=dl, sharding=ds, src_layout=sl, src_seed=seed))
    nodes.append(dec)
    dec.call("connect", pre.blob)
    return pre, dec


def test_chunk_rule():
    """Every page goes in exactly one chunk, the one holding its last token; the partial
    last page in the last chunk; boundaries inside pages are fine."""
    rng = np.random.default_rng(1)
    for _ in range(500):
        n, ps = int(rng.integers(1, 300)), int(rng.choice([1, 4, 16]))
        cuts = sorted(set(rng.integers(1, n, size=int(rng.integers(0, 5))).tolist())) if n > 1 else []
        bounds = [0, *cuts, n]
        got = np.concatenate([pages_completed(n, ps, a, b) for a, b in zip(bounds, bounds[1:])])
        assert got.tolist() == list(range(-(-n // ps)))
        assert pages_completed(n, ps, bounds[-2], n)[-1] == -(-n // ps) - 1


def test_layers_land_before_layer_plus_4(provider, nodes, tmp_path):
    """A model bumping 32 layers 5 ms apart: at the decoder, every layer's pages of both
    requests have landed before the counter reached layer l + 4; at the last bump every
    earlier layer's writes were already posted (only one layer's transfer is left)."""
    mirror = _mirror(tmp_path)
    sl = KVLayout.vllm(L, 4, 16, 16, 64, "float16")
    dl = KVLayout.vllm(L, 4, 16, 16, 96, "float16")
    pre, dec = _pair(provider, nodes, sl, Sharding(1), dl, Sharding(1))
    reqs = [("a", [3, 4, 5, 6], 61), ("b", [50, 20], 32)]
    dec.call("receive", reqs)
    dec.call("watch", ["a", "b"], mirror)
    out = pre.call("serve", dict(expect=2, budget=1000, layer_delay=0.005, mirror=mirror, gather=True), timeout=120)
    res = dec.call("wait", ["a", "b"], 30)
    assert {k: v[0] for k, v in res.items()} == {"a": "done", "b": "done"}, res
    landed = dec.call("watched", 30)
    (base, end, _), = out["passes"]
    assert end - base == L
    assert None not in landed, landed
    for layer, (mir, _t) in enumerate(landed):
        # the mirror holds the value the counter was about to reach (never behind it)
        assert mir - base <= layer + 4, (layer, mir - base, landed)
    assert out["unfired_before_last_bump"] == [0]
    assert out["sends"] == {"'a'": ("done", out["sends"]["'a'"][1]), "'b'": ("done", out["sends"]["'b'"][1])}


CHUNK_CASES = {
    "tp1-1": (KVLayout.vllm(6, 4, 8, 16, 64, "float16"), Sharding(1),
              KVLayout.flash_attn(6, 4, 8, 16, 128, "float16"), Sharding(1)),
    "tp2-1": (KVLayout.vllm(6, 4, 8, 16, 64, "float16"), Sharding(2),
              KVLayout.vllm(6, 4, 8, 16, 128, "float16"), Sharding(1)),
    "tp1-2": (KVLayout.layer_major(6, 4, 8, 16, 64, "float16"), Sharding(1),
              KVLayout.vllm(6, 4, 8, 16, 128, "float16", order="NHD"), Sharding(2)),
    "mla2-1": (KVLayout.mla(6, 24, 16, 64, "float16"), Sharding(2, replicated=True),
               KVLayout.mla(6, 24, 16, 128, "float16"), Sharding(1, replicated=True)),
}


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
def test_chunked_prefill_byte_exact(provider, case, nodes, tmp_path):
    """A 40-token budget per pass: prompts of 100, 37, 64, 5 and 90 tokens split into
    chunks whose boundaries fall inside 16-token pages, several requests per pass, requests
    joining (a second wave while passes run) and leaving between passes; byte-exact."""
    mirror = _mirror(tmp_path)
    sl, ss, dl, ds = CHUNK_CASES[case]
    pre, dec = _pair(provider, nodes, sl, ss, dl, ds)
    wave1 = [("r0", [0, 1, 2, 3, 4, 5, 6], 100), ("r1", [10, 11, 12], 37), ("r2", [20, 22, 21, 23], 64)]
    wave2 = [("r3", [30], 5), ("r4", [40, 41, 42, 43, 44, 45], 90)]
    dec.call("receive", wave1)
    pre.start("serve", dict(expect=5, budget=40, layer_delay=0.002, mirror=mirror))
    dec.call("receive", wave2)
    out = pre.result(120)
    res = dec.call("wait", [r[0] for r in wave1 + wave2], 30)
    assert {k: v[0] for k, v in res.items()} == {r[0]: "done" for r in wave1 + wave2}, res
    # r0 went in three or more chunks with boundaries inside pages; passes held several requests
    assert len(out["chunks"]["'r0'"]) >= 3, out["chunks"]
    assert any(b % 16 for _, b in out["chunks"]["'r0'"][:-1]), out["chunks"]
    assert max(len(p[2]) for p in out["passes"]) >= 2, out["passes"]
    assert all(st == "done" for st, _ in out["sends"].values()), out["sends"]


def test_abort_mid_stream_obeys_fence(provider, nodes, tmp_path):
    """The decoder aborts a request while its layers stream: abort() returns True, the
    pages (sentinel-filled) never change while another request streams on, and reusing
    them is byte-exact."""
    mirror = _mirror(tmp_path)
    sl = KVLayout.vllm(L, 4, 8, 16, 64, "float16")
    dl = KVLayout.vllm(L, 4, 8, 16, 96, "float16")
    pre, dec = _pair(provider, nodes, sl, Sharding(1), dl, Sharding(1))
    dec.call("receive", [("x", [1, 2, 3], 40), ("y", [7, 8], 20)])
    # 20 ms a layer: the ABORT (posted, then sent by the decoder's sender thread) lands mid-stream
    pre.start("serve", dict(expect=3, budget=1000, layer_delay=0.02, mirror=mirror))
    was, ok, state, at = dec.call("abort_when", "x", mirror, 10)
    assert ok and state == "aborted", (was, ok, state, at)
    res = dec.call("wait", ["y"], 30)
    assert res["y"][0] == "done", res
    assert dec.call("sentinel", [1, 2, 3])           # nothing of x landed after the fence
    dec.call("receive", [("z", [1, 2, 3], 48)])
    out = pre.result(120)
    res = dec.call("wait", ["z"], 30)
    assert res["z"][0] == "done", res
    assert out["sends"]["'x'"][0] == "aborted", out["sends"]


def test_abandoned_pass(provider, nodes, tmp_path):
    """The model gives up a pass after 5 of 32 layers: the rest is never posted, the
    decoder's requests fail (PeerError) fenced, their pages stop changing; the next pass
    gets the base after the abandoned one and serves a new request byte-exact."""
    mirror = _mirror(tmp_path)
    sl = KVLayout.vllm(L, 4, 8, 16, 64, "float16")
    dl = KVLayout.vllm(L, 4, 8, 16, 96, "float16")
    pre, dec = _pair(provider, nodes, sl, Sharding(1), dl, Sharding(1))
    dec.call("receive", [("p", [4, 5], 30)])
    pre.start("serve", dict(expect=2, budget=1000, layer_delay=0.002, mirror=mirror, abandon=(0, 5)))
    res = dec.call("wait", ["p"], 30)
    assert res["p"][0] == "failed" and res["p"][1] == "PeerError" and res["p"][2], res
    dec.call("fill", [4, 5])
    dec.call("receive", [("q", [9], 10)])
    out = pre.result(120)
    res = dec.call("wait", ["q"], 30)
    assert res["q"][0] == "done", res
    assert dec.call("sentinel", [4, 5])
    (base, end, disarmed, sends), = out["abandoned"]
    assert disarmed > 0 and sends == ["'p'"]
    assert out["passes"][1][0] == end                # the next pass starts where the abandoned one ended


def test_prefiller_closes_mid_stream(provider, nodes, tmp_path):
    """The prefill messenger closes after 6 of 32 layers: close returns (within the call's deadline) with
    writes still armed (they never post), its Send fails, and the decoder's request fails
    with PeerError (BYE), fenced."""
    mirror = _mirror(tmp_path)
    sl = KVLayout.vllm(L, 4, 8, 16, 64, "float16")
    dl = KVLayout.vllm(L, 4, 8, 16, 96, "float16")
    pre, dec = _pair(provider, nodes, sl, Sharding(1), dl, Sharding(1))
    dec.call("receive", [("c", [2, 3], 30)])
    out = pre.call("serve", dict(expect=1, budget=1000, layer_delay=0.002, mirror=mirror, close_at=(0, 6)),
                   timeout=60)
    assert out["unposted"] > 0
    assert out["close_states"] == [("failed", "ClosedError")], out["close_states"]
    res = dec.call("wait", ["c"], 30)
    assert res["c"][0] == "failed" and res["c"][1] == "PeerError" and res["c"][2], res
