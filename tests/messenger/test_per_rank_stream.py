"""Per-rank streaming between processes (issue 21, item 6): a TP2 prefill instance as two
rank processes, each with its own engine, messenger, layer counter and watcher, each bumped
by its own model thread (no IPC hop per layer), streaming to a TP1 decoder that watches
each rank's heads land layer by layer; byte-exact, on tcp;ofi_rxm and shm."""

from __future__ import annotations

import pytest

from kvxfer import KVLayout, Sharding

from _stream_nodes import StreamNode

L = 16


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_each_rank_process_streams_from_its_own_counter(provider, nodes, tmp_path, order):
    mirror = tmp_path / "mirror.u64"
    mirror.write_bytes(bytes(64))
    mirror = str(mirror)
    sl = KVLayout.vllm(L, 4, 16, 16, 64, "float16")
    dl = KVLayout.vllm(L, 4, 16, 16, 96, "float16", order=order)
    pres = []
    for r in (0, 1):
        p = StreamNode("prefill", dict(provider=provider, layout=sl, sharding=Sharding(2), seed=5, ranks=[r]))
        nodes.append(p)
        pres.append(p)
    dec = StreamNode("decode", dict(provider=provider, layout=dl, sharding=Sharding(1), src_layout=sl, src_seed=5))
    nodes.append(dec)
    dec.call("connect", [p.blob for p in pres])
    reqs = [("a", [3, 4, 5, 6], 61), ("b", [50, 20], 32)]
    dec.call("receive", reqs)
    # rank r of the source holds kv heads [2r, 2r + 2): the decoder's heads 2r, 2r + 1
    dec.call("watch_legs", ["a", "b"], mirror, [(0, [0, 1]), (1, [2, 3])])
    for r, p in enumerate(pres):
        p.start("serve", dict(expect=2, budget=1000, layer_delay=0.01, mirror=mirror, gather=True, mirror_word=r))
    outs = [p.result(120) for p in pres]
    res = dec.call("wait", ["a", "b"], 30)
    assert {k: v[0] for k, v in res.items()} == {"a": "done", "b": "done"}, res     # byte-exact, context
    landed = dec.call("watched", 30)
    for r, out in enumerate(outs):
        (base, end, rids), = out["passes"]             # one pass of both requests, on this rank's counter
        assert end - base == L and sorted(rids) == ["'a'", "'b'"]
        assert out["unfired_before_last_bump"] == [0]  # its own watcher posted each layer at its bump
        assert all(st == "done" for st, _ in out["sends"].values()), out["sends"]
        got = landed[r]
        assert None not in got, (r, got)
        # rank r's heads of layer l landed before rank r's own counter passed l + 4 (the
        # mirror word of that process is never behind its counter): streamed, not at the end
        late = [(layer, mir - base) for layer, (mir, _t) in enumerate(got) if mir - base > layer + 4]
        assert not late, (r, late, got)
