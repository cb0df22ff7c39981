"""Node processes for the streaming tests: a prefill node with a simulated model, a decode
node that watches its pages land layer by layer.

The prefill node runs a batch scheduler (a token budget per forward pass; requests join
between passes, leave when their last chunk is scheduled or they were aborted) and a model
thread that bumps the messenger's layer counter once per layer with a delay. Before each
bump it stores the value the counter is about to reach in a **mirror** word in a file both
nodes map: a decode node that reads the mirror right after it saw layer ``l`` land knows
the counter had not yet passed that value when the layer landed (the mirror is never
behind the counter), so "layer ``l`` landed before layer ``l + 4`` was bumped" is checked
without comparing clocks.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from _nodes import (
    _CTX,
    SENTINEL,
    Node,
    RemoteError,
    _check,
    _close,
    _engine,
    _fill,
    _ref,
    _sentinel_ok,
    context_for,
    logical,
    scatter,
    src_pages_for,
)

__all__ = ["StreamNode", "RemoteError", "SENTINEL"]


def _mirror(path):
    return np.memmap(path, dtype=np.uint64, mode="r+", shape=(8,))


def _stream_prefill(conn, spec):
    import kvxfer

    eng = m = None
    try:
        layout, sh = spec["layout"], spec["sharding"]
        ref = _ref()
        eng = _engine(spec["provider"])
        cache = logical(layout, spec["seed"])
        # per-rank (``ranks``): this process holds only those ranks, as a TP rank process does
        ranks = spec.get("ranks") or list(range(sh.tp_size))
        mems = {r: ref.RankMemory(layout, sh, r, fill=0) for r in ranks}
        for mem in mems.values():
            scatter(mem, cache)
        m = kvxfer.Messenger(eng, layout, sh, {r: mems[r].regions for r in mems}, ranks=ranks)
        conn.send(("ready", m.handshake(), os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "serve":
                conn.send(("ok", _serve(m, layout, **args[0])))
            elif cmd == "stats":
                conn.send(("ok", m.stats()))
            elif cmd == "exit":
                m.close()
                eng.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        _close(m, eng)


def _serve(m, layout, *, expect: int, budget: int, layer_delay: float, mirror: str, abandon=None,
           finish_early: bool = True, gather: bool = False, close_at=None, timeout: float = 60.0,
           mirror_word: int = 0) -> dict:
    """Serve ``expect`` requests with chunked prefill: each pass gives at most ``budget``
    tokens, first come first served; the model bumps every layer after ``layer_delay`` s.
    ``abandon=(pass index, layers)``: that pass is abandoned after that many layers.
    ``mirror_word``: the mirror's word this node's counter is mirrored in (one per rank
    process in per-rank streaming)."""
    lc = m.layer_counter
    L = layout.num_layers
    mir = _mirror(mirror)
    active: list = []                    # [send, tokens done]
    seen = 0
    out = {"passes": [], "chunks": {}, "unfired_before_last_bump": [], "sends": {}, "abandoned": []}
    sends = []
    deadline = time.monotonic() + timeout
    npass = 0
    while seen < expect or active:
        if time.monotonic() > deadline:
            raise TimeoutError(f"served {seen}/{expect} requests, {len(active)} active")
        for req in m.requests(timeout=0 if active and not (gather and seen < expect) else 0.05):
            s = m.stream(req)
            sends.append(s)
            seen += 1
            if s.state == "pending":
                active.append(s)
        active = [s for s in active if not s.done]
        if not active or (gather and seen < expect):
            continue
        left = budget
        chunks = []
        for s in active:
            if left == 0:
                break
            a = s.next_token
            b = min(s.request.num_tokens, a + left)
            left -= b - a
            n_src = -(-b // layout.page_size)
            src = src_pages_for(s.request.request_id, len(s.request.dst_pages), layout.num_pages)
            chunks.append((s, a, b, src[:n_src]))
            out["chunks"].setdefault(repr(s.request.request_id), []).append((a, b))
        p = m.schedule(chunks)
        for s, a, b, _ in chunks:
            if finish_early and s.last_chunk:    # before the last layer is computed: written after it
                ctx = context_for(s.request.request_id, s.request.peer.handshake.context_bytes)
                s.finish(ctx if s.request.peer.handshake.context_slots else None)
        out["passes"].append((p.base, p.end, [repr(s.request.request_id) for s in p.sends]))
        stop_at = L
        if abandon is not None and abandon[0] == npass:
            stop_at = abandon[1]
        if close_at is not None and close_at[0] == npass:
            stop_at = close_at[1]
        for layer in range(stop_at):           # the model: one bump per layer
            time.sleep(layer_delay)
            if layer == L - 1:
                # the last bump: every earlier layer's writes are already posted
                early = [t for s in p.sends for t in s.entries if t.threshold < p.end and not t.fired]
                out["unfired_before_last_bump"].append(len(early))
                out.setdefault("last_bump", []).append(time.monotonic())
            mir[mirror_word] = lc.value + 1
            lc.bump()
        if close_at is not None and close_at[0] == npass:
            t0 = time.monotonic()
            m.close()                            # mid-stream: armed writes never post
            out["closed_in"] = time.monotonic() - t0
            out["close_states"] = [(s.state, type(s.error).__name__ if s.error else None) for s in sends]
            out["unposted"] = sum(1 for s in sends for t in s.entries if t.state in ("armed", "disarmed"))
            return out
        if stop_at < L:
            out["abandoned"].append((p.base, p.end, p.abandon(), [repr(s.request.request_id) for s in p.sends]))
            mir[mirror_word] = lc.value
            active = [s for s in active if s not in p.sends]
        for s, a, b, _ in chunks:
            if not finish_early and s.last_chunk and not s.done:
                ctx = context_for(s.request.request_id, s.request.peer.handshake.context_bytes)
                s.finish(ctx if s.request.peer.handshake.context_slots else None)
        active = [s for s in active if not s.last_chunk and not s.done]
        npass += 1
    for s in sends:
        try:
            s.wait(30)
        except kvxfer_errors():
            pass
        out["sends"][repr(s.request.request_id)] = (s.state, s.num_writes)
    lat = lc.latencies()
    out["latency_call_ns"], out["latency_post_ns"] = lat
    out["watcher"] = lc.stats()
    return out


def kvxfer_errors():
    import kvxfer

    return kvxfer.errors.KvxferError


def _stream_decode(conn, spec):
    import kvxfer

    eng = m = None
    try:
        layout, sh = spec["layout"], spec["sharding"]
        ref = _ref()
        eng = _engine(spec["provider"])
        mems = {r: ref.RankMemory(layout, sh, r, fill=SENTINEL) for r in range(sh.tp_size)}
        m = kvxfer.Messenger(eng, layout, sh, {r: mems[r].regions for r in mems},
                             context_slots=spec.get("context_slots", 16), context_bytes=spec.get("context_bytes", 64))
        conn.send(("ready", m.handshake(), os.getpid()))
        src_layout, src_seed = spec["src_layout"], spec["src_seed"]
        cache = logical(src_layout, src_seed)
        peer = None
        recvs: dict = {}
        watch = {}
        while True:
            cmd, *args = conn.recv()
            if cmd == "connect":              # one blob, or a list (a per-rank prefill instance)
                blobs = args[0]
                peer = ([m.connect(b, timeout=20) for b in blobs] if isinstance(blobs, list)
                        else m.connect(blobs, timeout=20))
                conn.send(("ok", None))
            elif cmd == "receive":            # [(rid, pages, num_tokens)], hot
                for rid, pages, nt in args[0]:
                    recvs[rid] = m.receive(peer, rid, np.asarray(pages), nt, hot=len(args) > 1 and args[1])
                conn.send(("ok", None))
            elif cmd == "watch":              # record the mirror when each layer of these requests landed
                rids, mirror = args
                watch["result"] = [None] * layout.num_layers
                watch["thread"] = threading.Thread(
                    target=_watch_layers, args=(mems, cache, [recvs[r] for r in rids], src_layout, _mirror(mirror),
                                                watch["result"]), daemon=True)
                watch["thread"].start()
                conn.send(("ok", None))
            elif cmd == "watch_legs":         # per source rank: the mirror word of that rank's process
                rids, mirror, legs = args
                watch["result"] = {w: [None] * layout.num_layers for w, _ in legs}
                watch["thread"] = threading.Thread(
                    target=_watch_legs, args=(mems, cache, [recvs[r] for r in rids], src_layout, _mirror(mirror),
                                              legs, watch["result"]), daemon=True)
                watch["thread"].start()
                conn.send(("ok", None))
            elif cmd == "watched":
                watch["thread"].join(args[0])
                conn.send(("ok", watch["result"]))
            elif cmd == "abort_when":         # abort rid once the mirror reached a value
                rid, mirror, value = args
                mir = _mirror(mirror)
                t_end = time.monotonic() + 30
                while int(mir[0]) < value and time.monotonic() < t_end:
                    time.sleep(0.0005)
                r = recvs[rid]
                was = r.state
                ok = r.abort(timeout=20)
                if ok and r.state == "aborted":
                    r.release()
                    _fill(mems, r.dst_pages, SENTINEL)
                conn.send(("ok", (was, ok, r.state, int(mir[0]))))
            elif cmd == "wait":               # wait for these, check bytes; return states
                rids, timeout = args
                res = {}
                t0 = time.monotonic()
                for rid in rids:
                    r = recvs[rid]
                    try:
                        r.wait(max(0.0, timeout - (time.monotonic() - t0)))
                    except kvxfer.errors.KvxferError:
                        pass
                    res[rid] = (r.state, type(r.error).__name__ if r.error else None, r.fenced,
                                r.t_done)
                    if r.state == "done":
                        src = src_pages_for(rid, len(r.dst_pages), src_layout.num_pages)
                        _check(mems, cache, r.dst_pages, src)
                        got = bytes(r.context)
                        if got != context_for(rid, m.context_bytes):
                            raise AssertionError(f"context of {rid!r} is {got!r}")
                        r.release()
                conn.send(("ok", res))
            elif cmd == "sentinel":
                conn.send(("ok", _sentinel_ok(mems, np.asarray(args[0]))))
            elif cmd == "fill":
                _fill(mems, np.asarray(args[0]), SENTINEL)
                conn.send(("ok", None))
            elif cmd == "exit":
                m.close()
                eng.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        _close(m, eng)


def _watch_layers(mems, cache, recvs, src_layout, mir, result) -> None:
    """Poll the requests' destination pages; when all of layer l's bytes match, store the
    mirror value (and the time) for l."""
    want = []
    for layer in range(cache.shape[0]):
        parts = []
        for r in recvs:
            src = src_pages_for(r.request_id, len(r.dst_pages), src_layout.num_pages)
            for mem in mems.values():
                for plane in range(cache.shape[1]):
                    parts.append((mem, layer, plane, r.dst_pages, cache[layer, plane][src][:, mem.heads]))
        want.append(parts)
    # layers are posted in order: check the lowest not yet seen (cheap, so this observer
    # lags the landing as little as possible), then the next
    nxt = 0
    t_end = time.monotonic() + 60
    while nxt < len(want) and time.monotonic() < t_end:
        while nxt < len(want) and all(np.array_equal(mem.page_view(lay, plane)[pages], w)
                                      for mem, lay, plane, pages, w in want[nxt]):
            result[nxt] = (int(mir[0]), time.monotonic())
            nxt += 1
        time.sleep(0.0002)


def _watch_legs(mems, cache, recvs, src_layout, mir, legs, result) -> None:
    """Per-rank streaming: for each leg ``(word, heads)`` (the destination heads one source
    rank writes, its process mirroring its counter in ``mir[word]``), store ``mir[word]``
    when all of layer l's bytes of those heads landed."""
    (mem,) = mems.values()                 # a TP1 decoder: one rank holds every head
    todo = {}
    for word, heads in legs:
        per_layer = []
        for layer in range(cache.shape[0]):
            parts = []
            for r in recvs:
                src = src_pages_for(r.request_id, len(r.dst_pages), src_layout.num_pages)
                for plane in range(cache.shape[1]):
                    parts.append((layer, plane, r.dst_pages, cache[layer, plane][src][:, heads]))
            per_layer.append(parts)
        todo[word] = (heads, per_layer)
    nxt = {w: 0 for w in todo}
    t_end = time.monotonic() + 60
    while any(nxt[w] < cache.shape[0] for w in todo) and time.monotonic() < t_end:
        for w, (heads, per_layer) in todo.items():
            while nxt[w] < len(per_layer) and all(
                    np.array_equal(mem.page_view(lay, plane)[pages][:, heads], want)
                    for lay, plane, pages, want in per_layer[nxt[w]]):
                result[w][nxt[w]] = (int(mir[w]), time.monotonic())
                nxt[w] += 1
        time.sleep(0.0002)


class StreamNode(Node):
    """A streaming prefill (``role="prefill"``) or decode node process."""

    def __init__(self, role: str, spec: dict, timeout: float = 60.0) -> None:
        self.parent, child = _CTX.Pipe()
        target = _stream_prefill if role == "prefill" else _stream_decode
        self.proc = _CTX.Process(target=target, args=(child, spec))
        self.proc.start()
        child.close()
        msg = self._recv(timeout)
        if msg[0] != "ready":
            self.kill()
            raise RemoteError(f"{role} node failed to start:\n{msg[1]}")
        self.blob, self.pid = msg[1], msg[2]

    def start(self, *cmd) -> None:
        """Send a command without waiting for its answer (``result`` reads it)."""
        self.parent.send(cmd)

    def result(self, timeout: float = 120.0):
        st, val = self._recv(timeout)
        if st == "error":
            raise RemoteError(val)
        return val
