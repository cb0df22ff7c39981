"""Prefill and decode nodes in their own processes, driven over pipes, for messenger tests.

Every node builds the same logical KV cache from a seed (``logical``), independently of the
planner: ``tests/unit/_planner_ref.py`` views each rank's regions through numpy reshapes of
the engines' documented tensor shapes. A prefill node scatters the logical cache into its
ranks (in TP worker processes when ``workers`` is set: their memfd KVBuffers are imported
into the node's messenger process); a decode node checks every destination page byte for
byte against it. A child's exception comes back as its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
import traceback
import zlib

import numpy as np

_CTX = mp.get_context("spawn")
SENTINEL = 0xEE
#: KVXFER_FULL=1 runs the issue's full counts (1000 requests in flight, more aborts)
FULL = os.environ.get("KVXFER_FULL", "") not in ("", "0")
HERE = os.path.dirname(os.path.abspath(__file__))


def _ref():
    sys.path.insert(0, os.path.join(HERE, "..", "unit"))
    import _planner_ref

    return _planner_ref


def logical(layout, seed: int) -> np.ndarray:
    """``[layers, planes, pages, heads, page_size, head bytes]`` random bytes."""
    planes = 1 if layout.kv == "mla" else 2
    cb = layout.head_dim * layout.np_dtype.itemsize
    shape = (layout.num_layers, planes, layout.num_pages, layout.kv_heads, layout.page_size, cb)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def scatter(mem, cache: np.ndarray) -> None:
    for layer in range(cache.shape[0]):
        for plane in range(cache.shape[1]):
            mem.page_view(layer, plane)[:] = cache[layer, plane][:, mem.heads]


def check_tokens(mems, cache, src_layout, sp, dst_layout, dp, tokens: int, tail: bool) -> None:
    """Token t of every layer, plane and held head: at slot t % pd of dp[t // pd], equal to
    the prefiller's logical cache at slot t % ps of sp[t // ps]; with ``tail`` the slots past
    num_tokens in the last page still hold the sentinel (the token path)."""
    ps, pd = src_layout.page_size, dst_layout.page_size
    t = np.arange(tokens)
    for mem in mems.values():
        for layer in range(cache.shape[0]):
            for plane in range(cache.shape[1]):
                view = mem.page_view(layer, plane)
                got = view[dp[t // pd], :, t % pd]
                want = cache[layer, plane][sp[t // ps], :, t % ps][:, mem.heads]
                if not np.array_equal(got, want):
                    bad = np.flatnonzero((got != want).reshape(tokens, -1).any(axis=1))
                    raise AssertionError(f"layer {layer} plane {plane}: tokens {bad[:8].tolist()} differ")
                if tail:
                    rest = view[dp[-1], :, tokens - (len(dp) - 1) * pd:]
                    assert (rest == SENTINEL).all(), "a slot past num_tokens was written"


def src_pages_for(rid, n: int, num_pages: int) -> np.ndarray:
    """The prefiller's source pages of a request, a function of its id (the decoder checks)."""
    rng = np.random.default_rng(zlib.crc32(repr(rid).encode()))
    if rng.random() < 0.5 and n <= num_pages:          # a contiguous run: exercises coalescing
        start = int(rng.integers(0, num_pages - n + 1))
        return np.arange(start, start + n)
    return rng.choice(num_pages, n, replace=n > num_pages)


def _src_count(req, layout) -> int:
    """A request's source pages: as many as its destination pages, or, where the decoder's page
    size differs, ceil(num_tokens / this layout's page size)."""
    if req.peer.layout.page_size == layout.page_size:
        return len(req.dst_pages)
    return -(-req.num_tokens // layout.page_size)


def context_for(rid, nbytes: int) -> bytes:
    return (f"ctx<{rid!r}>" * 8).encode()[:nbytes]


def _engine(provider):
    import kvxfer

    return kvxfer.Engine(provider, "127.0.0.1")


# -- TP workers -----------------------------------------------------------------------------

def _worker(path, rank, layout, sharding, seed, conn):
    try:
        from kvxfer.buffers import KVBuffer
        from kvxfer.messenger import publish

        ref = _ref()
        mem = ref.RankMemory(layout, sharding, rank, fill=0)
        bufs = [KVBuffer.allocate(s, "cpu") for s in mem.sizes]
        mem.regions = [b.numpy(np.uint8, s) for b, s in zip(bufs, mem.sizes)]
        scatter(mem, logical(layout, seed))            # "the model writes KV into its buffers"
        publish(path, rank, bufs, timeout=30)
        mem.regions = []
        for b in bufs:
            b.close()                                  # the memory lives on in the messenger process
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# -- node processes -------------------------------------------------------------------------

def _prefill(conn, spec):
    import kvxfer

    eng = m = None
    workers = []
    try:
        layout, sh = spec["layout"], spec["sharding"]
        ref = _ref()
        eng = _engine(spec["provider"])
        ranks = spec.get("ranks") or list(range(sh.tp_size))    # a subset: a per-rank prefill process
        bufs = None
        if spec.get("workers"):
            from kvxfer.messenger import collect

            path = os.path.join(spec["tmp"], f"kv-{os.getpid()}.sock")
            pipes = []
            for r in ranks:
                a, b = _CTX.Pipe()
                p = _CTX.Process(target=_worker, args=(path, r, layout, sh, spec["seed"], b), daemon=True)
                p.start()
                workers.append(p)
                pipes.append(a)
            bufs = collect(path, ranks, timeout=60)
            for a in pipes:
                if not a.poll(30):
                    raise RuntimeError("a TP worker did not report")
                st, tb = a.recv()
                if st != "ok":
                    raise RuntimeError("TP worker failed:\n" + tb)
            kv = {r: bufs[r] for r in ranks}
        else:
            cache = logical(layout, spec["seed"])
            mems = {r: ref.RankMemory(layout, sh, r, fill=0) for r in ranks}
            for mem in mems.values():
                scatter(mem, cache)
            kv = {r: _as_engine_tensors(mems[r].regions) for r in ranks}
        m = kvxfer.Messenger(eng, layout, sh, kv, peer_timeout=spec.get("peer_timeout", 10.0),
                             secret=spec.get("secret"))
        if bufs is not None:
            for bl in bufs.values():
                for b in bl:
                    b.close()               # registered regions hold leases
        conn.send(("ready", m.handshake(), os.getpid()))
        stop = threading.Event()
        state = {"sends": [], "held": [], "errors": []}
        delay = spec.get("delay", 0.0)
        hold = spec.get("hold", False)
        holding = threading.Event()
        if hold:
            holding.set()
        rng = random.Random(spec["seed"])

        def serve():
            try:
                while not stop.is_set():
                    for req in m.requests(timeout=0.1):
                        if holding.is_set():
                            state["held"].append(req)
                            continue
                        if delay:
                            time.sleep(rng.random() * delay)
                        src = src_pages_for(req.request_id, _src_count(req, layout), layout.num_pages)
                        s = m.send(req, src)
                        if delay:
                            time.sleep(rng.random() * delay)
                        ctx = context_for(req.request_id, req.peer.handshake.context_bytes)
                        s.finish(ctx if req.peer.handshake.context_slots else None)
                        state["sends"].append(s)
            except kvxfer.errors.ClosedError:
                pass
            except BaseException:
                state["errors"].append(traceback.format_exc())

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        while True:
            cmd, *args = conn.recv()
            if cmd == "stats":
                conn.send(("ok", {"stats": m.stats(), "errors": state["errors"],
                                  "sends": [s.state for s in state["sends"]], "held": len(state["held"])}))
            elif cmd == "send_held":
                # post the held requests without finishing them: the sends stay in flight
                out = []
                for req in state["held"]:
                    src = src_pages_for(req.request_id, _src_count(req, layout), layout.num_pages)
                    s = m.send(req, src)
                    state["sends"].append(s)
                    out.append(s.state)
                state["held"] = []
                conn.send(("ok", out))
            elif cmd == "hold":
                (holding.set if args[0] else holding.clear)()
                conn.send(("ok", None))
            elif cmd == "finish_held_sends":
                out = []
                for s in state["sends"]:
                    ctx = context_for(s.request.request_id, s.request.peer.handshake.context_bytes)
                    s.finish(ctx if s.request.peer.handshake.context_slots else None)
                    out.append(s.state)
                conn.send(("ok", out))
            elif cmd == "wait_sends":
                timeout = args[0]
                deadline = time.monotonic() + timeout
                released = []
                for s in state["sends"]:
                    ev = threading.Event()
                    s.add_done_callback(lambda _s, ev=ev: ev.set())
                    ev.wait(max(0.0, deadline - time.monotonic()))
                    released.append((s.state, type(s.error).__name__ if s.error else None, ev.is_set()))
                conn.send(("ok", released))
            elif cmd == "exit":
                stop.set()
                m.close()
                th.join(5)
                eng.close()
                conn.send(("ok", state["errors"]))
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


def _decode(conn, spec):
    import kvxfer

    eng = m = None
    try:
        layout, sh = spec["layout"], spec["sharding"]
        ref = _ref()
        eng = _engine(spec["provider"])
        ranks = spec.get("ranks") or list(range(sh.tp_size))
        mems = {r: ref.RankMemory(layout, sh, r, fill=SENTINEL) for r in ranks}
        m = kvxfer.Messenger(eng, layout, sh, {r: mems[r].regions for r in ranks},
                             context_slots=spec.get("context_slots", 0), context_bytes=spec.get("context_bytes", 0),
                             peer_timeout=spec.get("peer_timeout", 10.0), secret=spec.get("secret"))
        conn.send(("ready", m.handshake(), os.getpid()))
        peers = {}
        pending = []
        while True:
            cmd, *args = conn.recv()
            if cmd == "connect":
                name, blob = args
                if isinstance(blob, list):        # a per-rank prefill instance: one blob per rank
                    peers[name] = [m.connect(b, timeout=20) for b in blob]
                else:
                    peers[name] = m.connect(blob, timeout=20)
                conn.send(("ok", None))
            elif cmd == "run":
                conn.send(("ok", _run(m, peers, mems, layout, **args[0])))
            elif cmd == "start":          # requests that are left in flight (kill tests)
                name, n = args
                for i in range(n):
                    pending.append(m.receive(peers[name], f"hold-{i}", [2 * i, 2 * i + 1], layout.page_size + 1))
                conn.send(("ok", [r.state for r in pending]))
            elif cmd == "abort_pending":
                res = []
                for r in pending:
                    was = r.state
                    ok = r.abort(timeout=20)
                    if ok and r.state == "aborted":
                        _fill(mems, r.dst_pages, SENTINEL)
                        r.release()
                    res.append((was, ok, r.state))
                conn.send(("ok", res))
            elif cmd == "sentinel_pending":
                conn.send(("ok", all(_sentinel_ok(mems, r.dst_pages) for r in pending)))
            elif cmd == "wait_pending":
                timeout = args[0]
                out = []
                t0 = time.monotonic()
                for r in pending:
                    try:
                        r.wait(max(0.0, timeout - (time.monotonic() - t0)))
                    except kvxfer.errors.KvxferError:
                        pass
                    # a failed request is fenced once every leg is (the live prefill ranks' ABORTED)
                    while r.done and not r.fenced and time.monotonic() - t0 < timeout:
                        time.sleep(0.005)
                    out.append((r.state, type(r.error).__name__ if r.error else None, r.fenced))
                conn.send(("ok", {"results": out, "elapsed": time.monotonic() - t0, "stats": m.stats()}))
            elif cmd == "states":
                conn.send(("ok", [r.state for r in pending]))
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


def _as_engine_tensors(regions: list) -> list:
    """A rank's regions as its engine allocates them: torch CPU tensors over the same memory
    where torch is installed (registered through DLPack), the numpy arrays otherwise."""
    try:
        import torch
    except ImportError:
        return regions
    return [torch.from_numpy(r) for r in regions]


def _close(m, eng) -> None:
    """Close in order on every exit path: the messenger's threads before the engine."""
    for x in (m, eng):
        if x is not None:
            try:
                x.close()
            except Exception:
                traceback.print_exc()


def _check(mems, cache, dst_pages, src_pages) -> None:
    for mem in mems.values():
        for layer in range(cache.shape[0]):
            for plane in range(cache.shape[1]):
                got = mem.page_view(layer, plane)[dst_pages]
                want = cache[layer, plane][src_pages][:, mem.heads]
                if not np.array_equal(got, want):
                    bad = np.flatnonzero((got != want).reshape(len(dst_pages), -1).any(axis=1))
                    raise AssertionError(f"layer {layer} plane {plane}: pages {dst_pages[bad].tolist()} differ "
                                         f"(heads {mem.heads})")


def _fill(mems, pages, value) -> None:
    for mem in mems.values():
        for layer in range(mem.layout.num_layers):
            for plane in range(mem.planes):
                mem.page_view(layer, plane)[pages] = value


def _sentinel_ok(mems, pages) -> bool:
    for mem in mems.values():
        for layer in range(mem.layout.num_layers):
            for plane in range(mem.planes):
                if not (mem.page_view(layer, plane)[pages] == SENTINEL).all():
                    return False
    return True


def _run(m, peers, mems, layout, *, requests: int, max_pages: int, inflight: int, seed: int, src_seed: int,
         src_layout, abort_frac: float = 0.0, timeout: float = 60.0, prefix: str = "r") -> dict:
    """``requests`` requests of 1..max_pages pages, up to ``inflight`` at once, spread over
    the connected prefillers; abort some at random moments; check every byte."""
    import kvxfer

    rng = random.Random(seed)
    cache = logical(src_layout, src_seed)
    free = list(range(layout.num_pages))
    rng.shuffle(free)
    names = sorted(peers)
    live: list = []
    out = {"done": 0, "aborted": 0, "abort_false": 0, "failed": [], "checked_pages": 0, "sentinel_pages": 0,
           "reused": 0, "aborted_mid_transfer": 0, "peak_inflight": 0}
    quarantine: list[np.ndarray] = []       # aborted pages, filled with the sentinel
    ctx_bytes = m.context_bytes

    def settle(r, aborted_ok):
        if r.state == "done":
            src = src_pages_for(r.request_id, len(r.dst_pages), src_layout.num_pages)
            _check(mems, cache, r.dst_pages, src)
            if m.context_slots:
                got = bytes(r.context)
                if got != context_for(r.request_id, ctx_bytes):
                    raise AssertionError(f"context of {r.request_id!r} is {got!r}")
            r.release()
            out["done"] += 1
            out["checked_pages"] += len(r.dst_pages)
            free.extend(r.dst_pages.tolist())
        elif r.state == "aborted" and aborted_ok:
            r.release()
            _fill(mems, r.dst_pages, SENTINEL)
            quarantine.append(r.dst_pages)
            out["aborted"] += 1
        else:
            out["failed"].append((r.request_id, r.state, repr(r.error)))

    n = 0
    deadline = time.monotonic() + timeout
    while n < requests or live:
        while n < requests and len(live) < inflight and free:
            k = rng.randint(1, max_pages)
            if k > len(free):
                break
            pages = np.array([free.pop() for _ in range(k)])
            # num_tokens fill exactly the k pages (the last one partly, or whole)
            ps = layout.page_size
            r = m.receive(peers[names[n % len(names)]], f"{prefix}{n}", pages, rng.randint((k - 1) * ps + 1, k * ps))
            live.append(r)
            n += 1
            out["peak_inflight"] = max(out["peak_inflight"], len(live))
        if abort_frac and live and rng.random() < abort_frac:
            r = live.pop(0 if rng.random() < 0.5 else rng.randrange(len(live)))  # the oldest is being served
            time.sleep(rng.random() * 0.003)
            was = r.state
            ok = r.abort(timeout=20)
            if ok and r.state == "aborted" and was == "transferring":
                out["aborted_mid_transfer"] += 1
            if not ok:
                out["abort_false"] += 1
                out["failed"].append((r.request_id, r.state, "abort returned False"))
            else:
                settle(r, True)
            continue
        if not live:
            break
        r = live.pop(0)
        try:
            r.wait(max(0.1, deadline - time.monotonic()))
        except kvxfer.errors.KvxferError:
            pass
        settle(r, False)
    # the aborted pages never changed while the rest of the traffic went on
    for pages in quarantine:
        if not _sentinel_ok(mems, pages):
            raise AssertionError(f"aborted pages {pages.tolist()} changed after abort() returned True")
        out["sentinel_pages"] += len(pages)
    # and their reuse is byte-exact
    for i, pages in enumerate(quarantine):
        r = m.receive(peers[names[0]], f"{prefix}reuse{i}", pages, len(pages) * layout.page_size)
        r.wait(timeout)
        settle(r, False)
        out["reused"] += 1
    return out


class RemoteError(AssertionError):
    """An exception in a node process, with its traceback."""


class Node:
    """A prefill (``role="prefill"``) or decode node process."""

    def __init__(self, role: str, spec: dict, timeout: float = 60.0) -> None:
        self.parent, child = _CTX.Pipe()
        target = _prefill if role == "prefill" else _decode
        self.proc = _CTX.Process(target=target, args=(child, spec))  # not daemonic: TP workers are its children
        self.proc.start()
        child.close()
        msg = self._recv(timeout)
        if msg[0] != "ready":
            self.kill()
            raise RemoteError(f"{role} node failed to start:\n{msg[1]}")
        self.blob, self.pid = msg[1], msg[2]

    def _recv(self, timeout: float):
        if not self.parent.poll(timeout):
            raise RemoteError(f"node {self.proc.pid} did not answer within {timeout} s")
        try:
            return self.parent.recv()
        except EOFError:
            raise RemoteError(f"node {self.proc.pid} died (exit code {self.proc.exitcode})") from None

    def call(self, *cmd, timeout: float = 60.0):
        self.parent.send(cmd)
        st, val = self._recv(timeout)
        if st == "error":
            raise RemoteError(val)
        return val

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        from _procs import remove_shm_files   # tests/ is on sys.path (tests/conftest.py)

        remove_shm_files(self.proc.pid)       # what its shm endpoints left in /dev/shm

    def close(self, timeout: float = 20.0):
        try:
            if self.proc.is_alive():
                return self.call("exit", timeout=timeout)
        except (RemoteError, BrokenPipeError, OSError):
            pass
        finally:
            self.kill()


def hostile_request(d, pg, imm: int = 2**31 - 5):
    """Speak the protocol directly as a buggy or hostile decoder would, bypassing
    ``receive()``'s own checks: a REQUEST naming page 40, outside the decoder's pool. Returns
    the Receive that the prefiller's REJECT fails."""
    import kvxfer
    from kvxfer.messenger import _codec as C

    from kvxfer.messenger.decode import Leg, Receive

    r = Receive(d._decode, [Leg(pg, imm, -1)], "hostile", np.array([0]), 1, -1, None)
    with d._lock:
        d._decode.receives[imm] = r
    d._send(pg, C.REQUEST, imm=imm, num_tokens=1, slot=-1, request_id="hostile", pages=np.array([40]))
    return r
