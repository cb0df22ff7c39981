"""One node of ``kvxfer-bench cluster``: a prefill instance (one process holding both TP
ranks, or with ``--rank R`` one of its two rank processes) or a decode instance, finding the others through a rendezvous store.

Run as ``python -m kvxfer.cli._cluster_node prefill|decode --store URL --instance NAME
--node ADDR ...``; it talks to its parent in lines on stdout (``READY``, ``PROGRESS``,
``LOOKUP``, ``RESULT``, ``ERROR``, each followed by JSON) and takes commands on stdin
(``run``, ``lookup NAME``, ``list``, ``stats``, ``stop``, ``exit``). SIGALRM ends it after ``--deadline`` s.

Every prefill instance serves the same KV cache (a seeded logical cache ``[layers, planes,
pages, heads, tokens, bytes]`` scattered into its ranks through the layout's geometry), and a
request's source pages are a function of its id, so a request retried on another instance
lands the same bytes; a decode instance checks every destination page against the cache.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
import zlib
from typing import Any

import numpy as np

LAYERS, HEADS, DIM, PAGE, PAGES = 4, 4, 16, 8, 128
DTYPE = "float16"
CTX_BYTES = 64
INFLIGHT = 12
MAX_PAGES = 4


def layout() -> Any:
    from kvxfer import KVLayout

    return KVLayout.vllm(LAYERS, HEADS, DIM, PAGE, PAGES, DTYPE)


def cache(seed: int) -> np.ndarray:
    lay = layout()
    shape = (lay.num_layers, lay.planes, lay.num_pages, lay.kv_heads, lay.page_size, lay.head_dim * lay.itemsize)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def page_view(lay: Any, sharding: Any, regions: list, layer: int, plane: int) -> np.ndarray:
    """``[pages, local heads, tokens, bytes]`` of ``(layer, plane)`` in one rank's regions."""
    g = lay.resolve(sharding)
    reg = regions[g.region(layer, plane)]
    return np.lib.stride_tricks.as_strided(reg[g.base(layer, plane):], (g.num_pages, g.local_heads, g.page_size, g.chunk),
                                           (g.page_stride, g.head_stride, g.token_stride, 1))


def src_pages(rid: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(rid.encode()))
    return rng.choice(PAGES, n, replace=False)


def context_for(rid: str) -> bytes:
    return (f"ctx<{rid}>" * 8).encode()[:CTX_BYTES]


def emit(tag: str, payload: Any) -> None:
    """One tagged line on stdout, written whole (several threads emit)."""
    sys.stdout.write(f"{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


def _regions(lay: Any, sharding: Any, fill: int) -> list:
    return [np.full(s, fill, np.uint8) for s in lay.region_sizes(sharding)]


def _prefill(a: argparse.Namespace) -> int:
    import kvxfer
    import kvxfer.rendezvous as R
    from kvxfer import Sharding

    lay, sh = layout(), Sharding(2)
    data = cache(a.seed)
    kv = {}
    held = (0, 1) if a.rank is None else (a.rank,)     # node mode: both ranks; per-rank: one
    for r in held:
        regs = _regions(lay, sh, 0)
        heads = list(sh.heads(r, lay.kv_heads))
        for layer in range(lay.num_layers):
            for plane in range(lay.planes):
                page_view(lay, sh, regs, layer, plane)[:] = data[layer, plane][:, heads]
        kv[r] = regs
    eng = kvxfer.Engine(a.provider, a.node)
    served = [0]
    errors: list[str] = []
    hold = threading.Event()         # "hold": new requests stay unserved (in flight) until the kill
    unserved: list[Any] = []

    def on_request(req: Any) -> None:
        rid = req.request_id.decode() if isinstance(req.request_id, bytes) else str(req.request_id)
        if hold.is_set():
            unserved.append(req)
            emit("HELD", {"held": len(unserved), "request": rid})
            return
        try:
            m.send(req, src_pages(rid, len(req.dst_pages))).finish(context_for(rid))
            served[0] += 1
        except kvxfer.errors.KvxferError as exc:   # the decoder is gone or aborted: it fails there
            errors.append(f"{rid}: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    m = kvxfer.Messenger(eng, lay, sh, kv, ranks=list(held), peer_timeout=a.peer_timeout, secret=a.secret,
                         on_request=on_request)
    silence: dict[str, float] = {}       # decoder uid -> the longest it was silent while alive
    quiet = threading.Event()

    def sample() -> None:
        while not quiet.wait(0.05):
            now = time.monotonic()
            for g in m.peers:
                k = f"{g.uid:016x}"
                silence[k] = max(silence.get(k, 0.0), now - g.last_heard)

    threading.Thread(target=sample, name="silence", daemon=True).start()
    store = R.open(a.store, op_timeout=a.op_timeout)
    ann = R.Announcement(store, m, "prefill", a.instance, ttl=a.ttl)
    emit("READY", {"instance": a.instance, "pid": os.getpid(), "keys": list(ann.keys)})
    try:
        for line in sys.stdin:
            if line.strip() == "exit":
                break
            if line.strip() == "hold":
                hold.set()
            if line.strip() == "stats":
                emit("STATS", {"served": served[0], "lease": ann.state, "errors": errors[-5:], "stats": m.stats(),
                               "silence": {k: round(v, 3) for k, v in silence.items()},
                               "reestablished": sum(le.reestablished for le in ann.leases)})
    finally:
        quiet.set()
        ann.close()
        store.close()
        m.close()
        eng.close()
    emit("RESULT", {"served": served[0]})
    return 0


class _Load:
    """The decode instance's load: requests routed at random over the listed prefill
    instances, retried on another when one fails, every completed one checked byte for byte."""

    def __init__(self, m: Any, d: Any, regions: list, seed: int, prefix: str, minimum: int, timeout: float,
                 peer_timeout: float) -> None:
        from kvxfer import Sharding

        self.m, self.d, self.regions = m, d, regions
        self.lay, self.sh = layout(), Sharding(1)
        self.data = cache(seed)
        self.rng = random.Random(zlib.crc32(prefix.encode()))
        self.prefix, self.minimum, self.timeout = prefix, minimum, timeout
        self.stop = threading.Event()
        self.suspect: dict[str, float] = {}
        self.hold = 2 * peer_timeout
        self.out: dict[str, Any] = {"done": 0, "bytes_checked": 0, "failures": [], "retried": 0, "lost": [],
                                    "by_instance": {}, "route_errors": {}, "bad": []}

    def check(self, rid: str, dst: np.ndarray) -> bool:
        src = src_pages(rid, len(dst))
        for layer in range(self.lay.num_layers):
            for plane in range(self.lay.planes):
                got = page_view(self.lay, self.sh, self.regions, layer, plane)[dst]
                if not np.array_equal(got, self.data[layer, plane][src]):
                    return False
        return True

    def route(self, rid: str, pages: np.ndarray) -> Any:
        import kvxfer

        for _ in range(20):                      # bounded: names change only between tries
            now = time.monotonic()
            listed = self.d.names()
            # a router's circuit breaker: an instance that just failed a request is skipped for
            # a while (its death is being declared; a send to it may block until then)
            names = [n for n in listed if self.suspect.get(n, 0) < now] or listed
            if not names:
                time.sleep(0.05)
                continue
            name = self.rng.choice(names)
            try:
                inst = self.d.connect(name)
                # node mode: one group holds both ranks; per-rank: one group per rank process
                peers = inst.groups if len(inst.groups) > 1 else inst.peer
                return self.m.receive(peers, rid, pages, self.rng.randint((len(pages) - 1) * PAGE + 1,
                                                                           len(pages) * PAGE)), name
            except kvxfer.errors.KvxferError as exc:
                self.suspect[name] = time.monotonic() + self.hold
                k = type(exc).__name__
                self.out["route_errors"][k] = self.out["route_errors"].get(k, 0) + 1
                time.sleep(0.01)
        return None

    def run(self) -> dict:
        import kvxfer

        free = list(range(PAGES))
        self.rng.shuffle(free)
        todo: list[tuple[str, int]] = []         # (request id, attempt) waiting for a route
        live: list[Any] = []
        n = 0
        t_end = time.monotonic() + self.timeout
        while time.monotonic() < t_end:
            if (self.stop.is_set() and n >= self.minimum and not todo and not live):
                break
            while len(live) < INFLIGHT and (todo or not (self.stop.is_set() and n >= self.minimum)):
                k = self.rng.randint(1, MAX_PAGES)
                if k > len(free):
                    break
                if todo:
                    rid, attempt = todo.pop(0)
                else:
                    rid, attempt = f"{self.prefix}-{n}", 0
                    n += 1
                pages = np.array([free.pop() for _ in range(k)])
                routed = self.route(rid, pages)
                if routed is None:
                    free.extend(pages.tolist())
                    todo.insert(0, (rid, attempt))
                    time.sleep(0.05)
                    break
                live.append((*routed, attempt))
            if not live:
                time.sleep(0.01)
                continue
            r, where, attempt = live.pop(0)
            try:
                r.wait(max(0.1, min(self.timeout, t_end - time.monotonic())))
            except kvxfer.errors.KvxferError:
                pass
            rid = r.request_id.decode() if isinstance(r.request_id, bytes) else str(r.request_id)
            if r.state == "done":
                ok = self.check(rid, r.dst_pages) and bytes(r.context) == context_for(rid)
                if not ok:
                    self.out["bad"].append(rid)
                self.out["done"] += 1
                self.out["bytes_checked"] += len(r.dst_pages) * LAYERS * 2 * HEADS * PAGE * DIM * 2
                self.out["by_instance"][where] = self.out["by_instance"].get(where, 0) + 1
                r.release()
                free.extend(r.dst_pages.tolist())
                if self.out["done"] % 20 == 0:
                    emit("PROGRESS", {"done": self.out["done"]})
            else:
                self.suspect[where] = time.monotonic() + self.hold
                at = time.time()
                # per-rank: the request fails as soon as one leg's peer dies; it is fenced
                # once the live legs' ABORTED counts landed too (bounded wait)
                fence_end = time.monotonic() + 2 * self.hold
                while not r.fenced and time.monotonic() < fence_end:
                    time.sleep(0.01)
                self.out["failures"].append({"rid": rid, "instance": where, "state": r.state,
                                             "error": type(r.error).__name__, "fenced": bool(r.fenced),
                                             "at": at, "fenced_after": round(time.time() - at, 3)})
                if r.fenced:
                    r.release()
                    free.extend(r.dst_pages.tolist())
                if attempt < 3:
                    todo.append((rid, attempt + 1))
                    self.out["retried"] += 1
                else:
                    self.out["lost"].append(rid)
        self.out["lost"] += [t[0] for t in todo] + [str(x[0].request_id) for x in live]
        self.out["requests"] = n
        self.out["dir"] = dict(self.d.counts)
        self.out["stats"] = {k: v for k, v in self.m.stats().items() if k.startswith(("peers_", "receive_"))}
        return self.out


def _decode(a: argparse.Namespace) -> int:
    import kvxfer
    import kvxfer.rendezvous as R
    from kvxfer import Sharding

    lay, sh = layout(), Sharding(1)
    regions = _regions(lay, sh, 0xEE)
    eng = kvxfer.Engine(a.provider, a.node)
    m = kvxfer.Messenger(eng, lay, sh, {0: regions}, peer_timeout=a.peer_timeout, secret=a.secret,
                         context_slots=4 * INFLIGHT, context_bytes=CTX_BYTES)
    store = R.open(a.store, op_timeout=a.op_timeout)
    ann = R.Announcement(store, m, "decode", a.instance, ttl=a.ttl)
    d = R.Directory(store, m, "prefill", interval=0.1, grace=a.grace, connect_timeout=a.peer_timeout * 2,
                    ranks=2)
    load = None
    th = None
    silence: dict[str, float] = {}       # instance -> the longest a live group of it was silent
    quiet = threading.Event()

    def sample() -> None:                # every 50 ms: how long since each group was heard
        while not quiet.wait(0.05):
            now = time.monotonic()
            for n in ("p0", "p1", "p2"):
                inst = d.instance(n)
                for g in inst.groups if inst is not None else ():
                    if g.alive:
                        silence[n] = max(silence.get(n, 0.0), now - g.last_heard)

    threading.Thread(target=sample, name="silence", daemon=True).start()
    try:
        names = d.wait_for(a.expect, 30)
        emit("READY", {"instance": a.instance, "pid": os.getpid(), "prefill": names})
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "run":
                load = _Load(m, d, regions, a.seed, a.instance, int(cmd[1]), float(cmd[2]), a.peer_timeout)
                th = threading.Thread(target=lambda: emit("RESULT", load.run()), daemon=True)
                th.start()
            elif cmd[0] == "lookup":
                t0 = time.monotonic()
                try:
                    inst = d.connect(cmd[1])
                    emit("LOOKUP", {"ok": True, "state": inst.state})
                except kvxfer.errors.KvxferError as exc:
                    emit("LOOKUP", {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300],
                                    "connection_error": isinstance(exc, ConnectionError),
                                    "s": time.monotonic() - t0})
            elif cmd[0] == "stats":
                emit("STATS", {"lease": ann.state, "reestablished": sum(le.reestablished for le in ann.leases),
                               "store_ok": d.store_ok, "names": d.names(),
                               "instances": {n: [i.state, [g.state for g in i.groups], repr(i.error)]
                                             for n in ("p0", "p1", "p2") if (i := d.instance(n)) is not None},
                               "stats": m.stats(), "silence": {k: round(v, 3) for k, v in silence.items()}})
            elif cmd[0] == "list":           # the store as this node sees it (instances listed)
                try:
                    emit("LIST", {"ok": True, "instances": sorted({k.split("/")[1] for k in store.list("")})})
                except kvxfer.errors.KvxferError as exc:
                    emit("LIST", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            elif cmd[0] == "stop" and load is not None:
                load.stop.set()
            elif cmd[0] == "exit":
                break
        if th is not None:
            th.join(a.deadline)
    finally:
        quiet.set()
        d.close()
        ann.close()
        store.close()
        m.close()
        eng.close()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvxfer.cli._cluster_node")
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--store", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--rank", type=int, choices=(0, 1), help="prefill per-rank: the one TP rank this process holds")
    p.add_argument("--provider", default="tcp;ofi_rxm")
    p.add_argument("--node", default="127.0.0.1")
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--peer-timeout", type=float, default=1.5)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--op-timeout", type=float, default=1.0)
    p.add_argument("--expect", type=int, default=2, help="prefill instances a decoder waits for")
    p.add_argument("--deadline", type=float, default=240.0)
    p.add_argument("--secret-hex", default="")
    a = p.parse_args(argv)
    a.secret = bytes.fromhex(a.secret_hex) if a.secret_hex else None
    signal.alarm(max(1, int(a.deadline)))
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # a stuck node tells where
    try:
        return _prefill(a) if a.role == "prefill" else _decode(a)
    except BaseException:
        emit("ERROR", traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
