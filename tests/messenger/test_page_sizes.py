"""A prefiller and a decoder whose page sizes differ (either way, by any ratio), in two
processes on both providers: the handshake accepts them, each request names pages in each
side's own page size, num_tokens decides each last page, and every token lands byte-exact
where the decoder's layout puts it (nothing past num_tokens touched), with TP mismatch,
GQA replication and MLA at the same time; a streamed prefill in chunks as well."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout, Sharding

from _nodes import SENTINEL, Node, _ref, check_tokens, logical, src_pages_for


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


CASES = {
    # name: (src layout, src sharding, dst layout, dst sharding)
    "16->32 HND TP2->1": (KVLayout.vllm(2, 4, 8, 16, 24, "float16"), Sharding(2),
                          KVLayout.vllm(2, 4, 8, 32, 16, "float16"), Sharding(1)),
    "32->16 NHD TP1->2": (KVLayout.flash_attn(2, 4, 8, 32, 16, "float16"), Sharding(1),
                          KVLayout.flash_attn(2, 4, 8, 16, 24, "float16"), Sharding(2)),
    "12->20 GQA TP4->1": (KVLayout.vllm(2, 2, 8, 12, 24, "float16"), Sharding(4),
                          KVLayout.layer_major(2, 2, 8, 20, 16, "float16", order="NHD"), Sharding(1)),
    "8->5 MLA 2->2": (KVLayout.mla(2, 16, 8, 24, "float16"), Sharding(2, replicated=True),
                      KVLayout.mla(2, 16, 5, 40, "float16"), Sharding(2, replicated=True)),
    "16->32 packed": (KVLayout.vllm_packed(2, 4, 8, 16, 24, "float16", order="NHD"), Sharding(2),
                      KVLayout.vllm_packed(2, 4, 8, 32, 16, "float16"), Sharding(1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_differing_page_sizes_byte_exact(provider, case, nodes):
    sl, ss, dl, ds = CASES[case]
    node = Node("prefill", {"provider": provider, "layout": sl, "sharding": ss, "seed": 5})
    nodes.append(node)
    ref = _ref()
    cache = logical(sl, 5)
    eng = kvxfer.Engine(provider, "127.0.0.1")
    d = None
    try:
        mems = {r: ref.RankMemory(dl, ds, r, fill=SENTINEL) for r in range(ds.tp_size)}
        d = kvxfer.Messenger(eng, dl, ds, {r: m.regions for r, m in mems.items()}, peer_timeout=10)
        pg = d.connect(node.blob)
        rng = np.random.default_rng(1)
        free = list(rng.permutation(dl.num_pages))
        for n, tokens in enumerate([1, sl.page_size, dl.page_size, 3 * sl.page_size + 1, 47, 100]):
            nd = _ceil(tokens, dl.page_size)
            if nd > len(free) or _ceil(tokens, sl.page_size) > sl.num_pages:
                continue
            dp = np.array([free.pop() for _ in range(nd)], np.int64)
            rid = f"r{n}"
            r = d.receive(pg, rid, dp, tokens)
            assert r.wait(30) == "done", r.error
            sp = np.asarray(src_pages_for(rid, _ceil(tokens, sl.page_size), sl.num_pages))
            check_tokens(mems, cache, sl, sp, dl, dp, tokens, tail=True)
        assert node.call("stats")["errors"] == []
    finally:
        if d is not None:
            d.close()
        eng.close()


# -- a streamed prefill: chunks move their own tokens ---------------------------------------

def _stream_prefill(conn, spec) -> None:
    """A prefill node that streams each request in chunks of ``spec["chunk"]`` tokens: one
    pass per chunk (its source pages so far), the model bumping every layer."""
    import traceback

    from _nodes import _as_engine_tensors, _close, _engine, scatter

    eng = m = None
    try:
        layout, sh = spec["layout"], spec["sharding"]
        ref = _ref()
        cache = logical(layout, spec["seed"])
        mems = {r: ref.RankMemory(layout, sh, r, fill=0) for r in range(sh.tp_size)}
        for mem in mems.values():
            scatter(mem, cache)
        eng = _engine(spec["provider"])
        m = kvxfer.Messenger(eng, layout, sh, {r: _as_engine_tensors(x.regions) for r, x in mems.items()},
                             peer_timeout=10)
        conn.send(("ready", m.handshake(), os.getpid()))
        lc, served, states = m.layer_counter, 0, []
        while served < spec["expect"]:
            for req in m.requests(timeout=0.1):
                s = m.stream(req)
                T, ps = req.num_tokens, layout.page_size
                src = np.asarray(src_pages_for(req.request_id, _ceil(T, ps), layout.num_pages))
                for a in range(0, T, spec["chunk"]):
                    b = min(T, a + spec["chunk"])
                    m.schedule([(s, a, b, src[:_ceil(b, ps)])])
                    if s.last_chunk:
                        s.finish(None)
                    for _ in range(layout.num_layers):
                        lc.bump()
                s.wait(30)
                states.append((s.state, repr(s.error) if s.error else None))
                served += 1
        cmd = conn.recv()
        assert cmd == ("exit",), cmd
        conn.send(("ok", states))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        _close(m, eng)


@pytest.mark.parametrize("case", ["16->32 HND TP2->1", "12->20 GQA TP4->1", "32->16 NHD TP1->2"])
def test_streamed_chunks_with_differing_page_sizes(provider, case):
    """Chunks of 7 tokens (cutting pages on both sides anywhere): each pass moves its chunk's
    tokens, the decoder's count is exact, and the pages end byte-exact."""
    import multiprocessing as mp

    sl, ss, dl, ds = CASES[case]
    tokens_list = [5, 50]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stream_prefill, args=(child, {
        "provider": provider, "layout": sl, "sharding": ss, "seed": 9, "chunk": 7, "expect": len(tokens_list)}))
    proc.start()
    eng = d = None
    try:
        assert parent.poll(60), "the prefill node did not start"
        msg = parent.recv()
        assert msg[0] == "ready", msg[1]
        eng = kvxfer.Engine(provider, "127.0.0.1")
        ref = _ref()
        cache = logical(sl, 9)
        mems = {r: ref.RankMemory(dl, ds, r, fill=SENTINEL) for r in range(ds.tp_size)}
        d = kvxfer.Messenger(eng, dl, ds, {r: x.regions for r, x in mems.items()}, peer_timeout=10)
        pg = d.connect(msg[1])
        free = list(np.random.default_rng(2).permutation(dl.num_pages))
        for n, tokens in enumerate(tokens_list):
            dp = np.array([free.pop() for _ in range(_ceil(tokens, dl.page_size))], np.int64)
            r = d.receive(pg, f"s{n}", dp, tokens)
            assert r.wait(60) == "done", r.error
            sp = np.asarray(src_pages_for(f"s{n}", _ceil(tokens, sl.page_size), sl.num_pages))
            check_tokens(mems, cache, sl, sp, dl, dp, tokens, tail=True)
        parent.send(("exit",))
        assert parent.poll(30)
        st, states = parent.recv()
        assert st == "ok", states
        assert all(s == "done" for s, _ in states), states
    finally:
        if d is not None:
            d.close()
        if eng is not None:
            eng.close()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        from _procs import remove_shm_files   # what its shm endpoints left in /dev/shm

        remove_shm_files(proc.pid)
