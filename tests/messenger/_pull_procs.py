"""Messengers on the pull road for tests/messenger/test_pull_road.py: in-process sets (node or
per-rank mode, one engine per messenger) and node processes to kill -9.

The prefillers' KV is the logical cache of ``_nodes.logical`` scattered into each rank's
regions (``tests/unit/_planner_ref.py``'s views, independent of the planner); the decoders'
regions start as ``SENTINEL``. ``check_tokens`` (from ``_nodes``) checks a request token by token, whatever
the page sizes.
"""

from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import numpy as np

from _nodes import SENTINEL, _ref, check_tokens, logical, scatter, src_pages_for  # noqa: F401 (check_tokens: test_pull_road's)

CTX_BYTES = 32


def ctx_for(rid) -> bytes:
    return (f"ctx<{rid!r}>" * 4).encode()[:CTX_BYTES]


def src_for(rid, tokens: int, layout) -> np.ndarray:
    """A request's source pages at the prefiller (a function of its id)."""
    return src_pages_for(rid, -(-tokens // layout.page_size), layout.num_pages)


def open_set(provider: str, sl, ss, dl, ds, mode: str, *, peer_timeout: float = 10.0, offer_pull: bool = True,
             serve: bool = True, seed: int = 5) -> SimpleNamespace:
    """Prefill messengers (every rank in one, or one per rank) offering pull and decode
    messengers (likewise) each connected to every prefiller. With ``serve`` every request is
    sent at once from ``src_for`` with ``ctx_for`` as its context. ``close()`` closes all."""
    import kvxfer

    ref = _ref()
    cache = logical(sl, seed)
    groups_p = [list(range(ss.tp_size))] if mode == "node" else [[r] for r in range(ss.tp_size)]
    groups_d = [list(range(ds.tp_size))] if mode == "node" else [[r] for r in range(ds.tp_size)]
    engines, prefill, decode, sends = [], [], [], []
    ns = SimpleNamespace(cache=cache, prefill=prefill, decode=decode, sends=sends, errors=[], mems={}, pgs=[])

    def on_request(m):
        def fn(req):
            try:
                sends.append(m.send(req, src_for(req.request_id, req.num_tokens, sl), context=ctx_for(req.request_id)))
            except Exception:
                ns.errors.append(traceback.format_exc())
        return fn

    try:
        for ranks in groups_p:
            eng = kvxfer.Engine(provider, "127.0.0.1")
            engines.append(eng)
            mems = {r: ref.RankMemory(sl, ss, r, fill=0) for r in ranks}
            for mem in mems.values():
                scatter(mem, cache)
            holder: list = []
            m = kvxfer.Messenger(eng, sl, ss, {r: mems[r].regions for r in ranks}, ranks=ranks,
                                 peer_timeout=peer_timeout, offer_pull=offer_pull,
                                 on_request=(lambda req, h=holder: h[0](req)) if serve else None)
            holder.append(on_request(m))
            m.src_mems = mems
            prefill.append(m)
        for ranks in groups_d:
            eng = kvxfer.Engine(provider, "127.0.0.1")
            engines.append(eng)
            mems = {r: ref.RankMemory(dl, ds, r, fill=SENTINEL) for r in ranks}
            m = kvxfer.Messenger(eng, dl, ds, {r: mems[r].regions for r in ranks}, ranks=ranks,
                                 context_slots=8, context_bytes=CTX_BYTES, peer_timeout=peer_timeout)
            m.mems = mems
            decode.append(m)
            ns.pgs.append([m.connect(p.handshake(), timeout=30) for p in prefill])
    except BaseException:
        _close(prefill + decode, engines)
        raise
    ns.close = lambda: _close(prefill + decode, engines)
    return ns


def _close(messengers, engines) -> None:
    for m in messengers:
        try:
            m.close()
        except Exception:
            traceback.print_exc()
    for e in engines:
        e.close()


# -- processes to kill -------------------------------------------------------------------------

def big_layout():
    """160 pages of 512 KiB (both planes of both layers; 80 MiB): a pull long enough to kill during."""
    from kvxfer import KVLayout

    return KVLayout.vllm(2, 8, 128, 64, 160, "float16")


def prefill_proc(conn, provider: str, peer_timeout: float, fill: int, tp: int = 1, rank: int = 0) -> None:
    """A prefiller offering pull (rank ``rank`` of TP ``tp``), every page ``fill``; serves
    each request at once (source pages 0..n-1). Commands: "stats", "exit"."""
    import kvxfer
    from kvxfer import Sharding

    eng = m = None
    try:
        lay = big_layout()
        eng = kvxfer.Engine(provider, "127.0.0.1")
        regions = [np.full(s, fill, np.uint8) for s in lay.region_sizes(Sharding(tp))]
        holder: list = []
        m = kvxfer.Messenger(eng, lay, Sharding(tp), {rank: regions}, peer_timeout=peer_timeout, offer_pull=True,
                             on_request=lambda req: holder[0].send(req, np.arange(len(req.dst_pages)), context=None))
        holder.append(m)
        conn.send(("ready", m.handshake(), os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd == "stats":
                conn.send(("ok", m.stats()))
            elif cmd == "exit":
                conn.send(("ok", None))
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        for x in (m, eng):
            if x is not None:
                x.close()


def decode_proc(conn, provider: str, peer_timeout: float, blob: bytes, n: int) -> None:
    """A decoder pulling ``n`` requests of every page's half from the prefiller of ``blob``,
    over and over; says "reading" once the first one's reads are posted, then is killed."""
    import time

    import kvxfer
    from kvxfer import Sharding

    lay = big_layout()
    eng = kvxfer.Engine(provider, "127.0.0.1")
    regions = [np.zeros(s, np.uint8) for s in lay.region_sizes(Sharding(1))]
    m = kvxfer.Messenger(eng, lay, Sharding(1), {0: regions}, peer_timeout=peer_timeout)
    pg = m.connect(blob, timeout=30)
    half = lay.num_pages // n
    told = False
    k = 0
    while True:
        rs = [m.receive(pg, f"k{k}-{i}", np.arange(i * half, (i + 1) * half), half * lay.page_size, pull=True)
              for i in range(n)]
        k += 1
        while not told and rs[0].state == "pending":
            time.sleep(0.0005)
        if not told:
            conn.send("reading")
            told = True
        for r in rs:
            r.wait(60)


def start(target, *args):
    from _procs import CTX

    parent, child = CTX.Pipe()
    p = CTX.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


def kill(p) -> None:
    import signal

    from _procs import remove_shm_files

    if p.is_alive():
        os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    remove_shm_files(p.pid)


