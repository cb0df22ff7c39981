"""``kvxfer-bench msg``: the messenger's request rate, CPU cost and latency, two processes.

This process is the decode node; it spawns a prefill node (``python -m kvxfer.cli.msg
_prefill``) that answers every request with ``send(...).finish()``. Per provider it measures

* **small requests/s**: 1 page x 32 layers, TP 1 -> 1, ``--window`` requests in flight,
  for one-region-per-layer (vLLM) and layer-major layouts;
* **CPU per request**: each side's CPU time over that phase divided by the requests, split
  into the engines' native progress threads and the rest (the messenger's and the
  caller's Python threads: "messenger CPU");
* **minimal request latency**: 1 page, 1 layer, one request at a time, ``receive()`` to
  done, p50/p99; beside it the engine's own write round trip (an 8-byte write with imm
  echoed back, as ``kvxfer-bench lat``) between the same two processes in the same run;
  and each side's CPU per minimal request (messenger and progress threads apart), where
  no window amortises anything.

``--per-rank``: TP 2 -> 1 instead, the prefill side once as one node process holding both
ranks and once as two rank processes (``Messenger(..., ranks=[r])``, the shape of vLLM and
SGLang) that the decoder receives from together; small requests/s and the minimal request's
p50 of both, in the same run.

Uses the public API only (``kvxfer.Engine``, ``kvxfer.Messenger``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from kvxfer.cli._args import nonnegative_int, positive_int, writable_file, write_json

__all__ = ["add_parser", "run_msg"]

LOOPBACK = "127.0.0.1"


def _layouts(args: Any) -> dict:
    from kvxfer import KVLayout

    kw = dict(dtype="float16")
    out = {}
    for placement in ("per_layer", "layer_major"):
        if args.placement not in ("both", placement):
            continue
        out[placement] = KVLayout(args.layers, args.kv_heads, args.head_dim, args.page_size, args.pages,
                                  layer_regions=placement, **kw)
    out["minimal"] = KVLayout(1, args.kv_heads, args.head_dim, args.page_size, args.pages, **kw)
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "msg", help="messenger: small requests/s, CPU per request, minimal request latency vs write round trip",
        description="Two processes (this one decodes, a spawned one prefills). Small requests (1 page x 32 "
                    "layers, TP 1->1) with a window in flight, for per-layer and layer-major layouts; "
                    "messenger CPU per request on each side; minimal request (1 page, 1 layer) latency "
                    "p50/p99 beside the engine's write round trip in the same run.")
    p.add_argument("--provider", action="append", metavar="P", help="libfabric provider (default: shm, then tcp;ofi_rxm)")
    p.add_argument("--requests", type=positive_int, default=20000, metavar="N",
                   help="small requests per layout (default 20000)")
    p.add_argument("--window", type=positive_int, default=256, metavar="N", help="requests in flight (default 256)")
    p.add_argument("--latency-iters", type=positive_int, default=2000, metavar="N",
                   help="minimal requests and round trips (default 2000)")
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=1)
    p.add_argument("--head-dim", type=positive_int, default=16)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--pages", type=positive_int, default=1024, help="pages per pool (default 1024)")
    p.add_argument("--placement", choices=("both", "per_layer", "layer_major"), default="both")
    p.add_argument("--context", type=nonnegative_int, default=0, metavar="BYTES",
                   help="context bytes per request (default 0)")
    p.add_argument("--progress", choices=("block", "spin"), default="block")
    p.add_argument("--serve", choices=("inline", "requests"), default="inline",
                   help="prefill side: answer on the messenger thread (on_request, inline_requests=True; "
                        "default) or from a server thread that takes requests()")
    p.add_argument("--per-rank", action="store_true",
                   help="TP 2 -> 1: a node-mode prefill process against two per-rank prefill processes")
    p.add_argument("--json", metavar="FILE", type=writable_file, help="write the results as JSON")
    p.set_defaults(func=run_msg)


def _cpu() -> dict:
    """This process's CPU seconds: the engines' native progress threads apart from the rest
    (the messenger's and the caller's Python threads), from /proc (Linux); and their
    voluntary context switches (``*_sleeps``: each a wait that a wake-up ended, so a thread
    hand-off's count)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"progress": 0.0, "python": 0.0, "progress_sleeps": 0, "python_sleeps": 0, "by_thread": {}}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {**out, "python": time.process_time()}
    names = {t.native_id: t.name for t in threading.enumerate()}
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{t}/status") as f:
                sleeps = next((int(x.split()[1]) for x in f if x.startswith("voluntary_ctxt_switches")), 0)
        except OSError:
            continue                      # the thread ended meanwhile
        secs = (int(fields[11]) + int(fields[12])) / tick     # utime + stime
        kind = "progress" if comm == "kvxfer-progress" else "python"
        out[kind] += secs
        out[kind + "_sleeps"] += sleeps
        name = names.get(int(t), comm)
        out["by_thread"][name] = out["by_thread"].get(name, 0) + sleeps
    return out


# -- the prefill process ------------------------------------------------------------------

def _prefill_main(argv: list[str]) -> int:
    import kvxfer
    from kvxfer import Sharding

    ap = argparse.ArgumentParser(prog="kvxfer.cli.msg _prefill")
    for name in ("layers", "kv_heads", "head_dim", "page_size", "pages"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, required=True)
    ap.add_argument("--placement", required=True)
    ap.add_argument("--provider", required=True)
    ap.add_argument("--progress", default="block")
    ap.add_argument("--serve", default="inline")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=-1, help="the one rank this process holds (-1: all)")
    args = ap.parse_args(argv)
    sh = Sharding(args.tp)
    ranks = list(range(args.tp)) if args.rank < 0 else [args.rank]
    layouts = _layouts(args)
    engines, ms = [], {}
    node = None if args.provider.startswith("shm") else LOOPBACK
    cursor = [0]
    inline = args.serve == "inline"
    for name, lay in layouts.items():
        e = kvxfer.Engine(args.provider, node, progress=args.progress)
        engines.append(e)
        kv = {r: [np.full(s, 7, np.uint8) for s in lay.region_sizes(sh)] for r in ranks}
        ms[name] = kvxfer.Messenger(e, lay, sh, kv, peer_timeout=30,
                                    on_request=(lambda req, name=name: answer_in(name, req)) if inline else None,
                                    inline_requests=inline)
    pong = kvxfer.Engine(args.provider, node, progress=args.progress)
    engines.append(pong)
    pbuf = np.zeros(8, np.uint8)
    pmr = pong.register(pbuf)
    stop = threading.Event()

    def send_one(m, req):
        n = len(req.dst_pages)
        src = (np.arange(n) + cursor[0]) % args.pages
        cursor[0] += n
        m.send(req, src).finish(b"c" * req.peer.handshake.context_bytes if req.peer.handshake.context_slots else None)

    def answer_in(name, req):          # --serve inline: on the messenger thread that read it
        send_one(ms[name], req)

    def serve(m):                      # --serve requests: a server thread takes requests()
        try:
            while not stop.is_set():
                for req in m.requests(timeout=0.2):
                    send_one(m, req)
        except kvxfer.errors.ClosedError:
            pass

    threads = [] if inline else [threading.Thread(target=serve, args=(m,), daemon=True) for m in ms.values()]
    for t in threads:
        t.start()
    print(json.dumps({"blobs": {k: m.handshake().hex() for k, m in ms.items()},
                      "pong": pong.address.hex(), "pong_desc": pmr.descriptor().hex()}), flush=True)
    peer = rr = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "cpu":
            print(json.dumps({"cpu": _cpu()}), flush=True)
        elif cmd["cmd"] == "pong":
            peer = pong.connect(bytes.fromhex(cmd["address"]))
            rr = pong.remote(bytes.fromhex(cmd["desc"]))
            for i in range(cmd["n"]):
                pong.expect(1 + i % 1000, 1).wait(30)
                pong.write(pmr, 0, peer, rr, 0, 8, imm=1 + i % 1000)
            print(json.dumps({"pong": "done"}), flush=True)
        elif cmd["cmd"] == "quit":
            break
    stop.set()
    for m in ms.values():
        m.close()
    pmr.close()
    for e in engines:
        e.close()
    return 0


# -- the decode side (this process) -------------------------------------------------------

def _pct(a: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(a), q)) if a else float("nan")


class _Prefill:
    def __init__(self, args: Any, provider: str, tp: int = 1, rank: int = -1) -> None:
        cmd = [sys.executable, "-m", "kvxfer.cli.msg", "_prefill", "--provider", provider, "--progress", args.progress,
               "--placement", args.placement, "--serve", args.serve, "--tp", str(tp), "--rank", str(rank)]
        for name in ("layers", "kv_heads", "head_dim", "page_size", "pages"):
            cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.read()

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited ({self.p.wait()})")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.p.stdin.flush()
            self.p.wait(15)
        except Exception:
            self.p.kill()
            self.p.wait()


def _prefill_cpu(pres: list) -> dict:
    out = {"progress": 0.0, "python": 0.0, "progress_sleeps": 0, "python_sleeps": 0}
    for pre in pres:
        c = pre.ask(cmd="cpu")["cpu"]
        for k in out:
            out[k] += c.get(k, 0)
    return out


def _throughput(m: Any, pg: Any, args: Any, pre: Any) -> dict:
    pres = pre if isinstance(pre, list) else [pre]
    n, window, pages = args.requests, args.window, args.pages
    warm = min(500, n)
    for i in range(warm):                       # warm-up: plans, staging, sleeping threads
        m.receive(pg, f"w{i}", [i % pages], 1).wait(30)
    live: list = []
    free = list(range(pages))
    c0 = _cpu()
    p0 = _prefill_cpu(pres)
    t0 = time.perf_counter()
    for i in range(n):
        if len(live) >= window or not free:
            r = live.pop(0)
            r.wait(30)
            r.release()
            free.append(int(r.dst_pages[0]))
        live.append(m.receive(pg, i, [free.pop()], 1))
    for r in live:
        r.wait(30)
        r.release()
    wall = time.perf_counter() - t0
    c1 = _cpu()
    p1 = _prefill_cpu(pres)

    def per(a, b, k):
        return (b[k] - a[k]) / n * 1e6

    return {"requests": n, "seconds": wall, "req_per_s": n / wall,
            "decoder_cpu_us": per(c0, c1, "python"), "decoder_progress_cpu_us": per(c0, c1, "progress"),
            "prefill_cpu_us": per(p0, p1, "python"), "prefill_progress_cpu_us": per(p0, p1, "progress")}


def _latency(m: Any, pg: Any, iters: int, pres: Optional[list] = None, cpu: Optional[dict] = None,
             split: Optional[list] = None) -> list[float]:
    """Seconds per minimal request, one at a time (200 warm-up ones first). With ``pres``
    (the prefill processes) and ``cpu``: each side's CPU per request over the measured ones
    goes into ``cpu`` (us, ``decoder_cpu_us`` and so on, as ``_throughput``'s). With ``split``:
    per request, seconds from calling ``receive()`` to the Receive made (``t_start``), to the
    engine's count (``Receive.t_landed``), to done, and to ``wait()`` returning."""
    out = []
    c0 = p0 = None
    for i in range(200 + iters):
        if i == 200 and cpu is not None:
            c0, p0 = _cpu(), _prefill_cpu(pres)
        t0 = time.perf_counter()
        called = time.monotonic()
        r = m.receive(pg, f"l{i}", [i % min(64, m.layout.num_pages)], 1)
        r.wait(30)
        t1 = time.perf_counter()
        back = time.monotonic()
        r.release()
        if i >= 200:
            out.append(t1 - t0)
            if split is not None and r.t_landed is not None:
                # receive() called -> the Receive made (its checks and legs) -> counted (the
                # engine's stamp: the later of the last write's crediting and the ANNOUNCE's
                # arming; the REQUEST's way, the prefiller, the ANNOUNCE back and its
                # decoding) -> the messenger made it done -> the caller's wait() returned
                split.append((r.t_start - called, r.t_landed - r.t_start, r.t_done - r.t_landed,
                              back - r.t_done))
    if cpu is not None:
        c1, p1 = _cpu(), _prefill_cpu(pres)
        for key, a, b, k in (("decoder_cpu_us", c0, c1, "python"), ("decoder_progress_cpu_us", c0, c1, "progress"),
                             ("prefill_cpu_us", p0, p1, "python"), ("prefill_progress_cpu_us", p0, p1, "progress")):
            cpu[key] = (b[k] - a[k]) / iters * 1e6
        for key, a, b, k in (("decoder_sleeps", c0, c1, "python_sleeps"),
                             ("decoder_progress_sleeps", c0, c1, "progress_sleeps"),
                             ("prefill_sleeps", p0, p1, "python_sleeps"),
                             ("prefill_progress_sleeps", p0, p1, "progress_sleeps")):
            cpu[key] = (b[k] - a[k]) / iters        # wake-ups per request
        # the decoder's, thread by thread (by name): which hand-offs a minimal request costs
        cpu["decoder_sleeps_by_thread"] = {t: (n - c0["by_thread"].get(t, 0)) / iters
                                           for t, n in sorted(c1["by_thread"].items())
                                           if n - c0["by_thread"].get(t, 0) > 0}
    return out


def _write_rtt(eng: Any, pre: _Prefill, iters: int) -> list[float]:
    buf = np.zeros(8, np.uint8)
    mr = eng.register(buf)
    peer = eng.connect(bytes.fromhex(pre.info["pong"]))
    rr = eng.remote(bytes.fromhex(pre.info["pong_desc"]))
    total = 200 + iters
    pre.p.stdin.write(json.dumps({"cmd": "pong", "n": total, "address": eng.address.hex(),
                                  "desc": mr.descriptor().hex()}) + "\n")
    pre.p.stdin.flush()
    out = []
    for i in range(total):
        imm = 1 + i % 1000
        c = eng.expect(imm, 1)
        t0 = time.perf_counter()
        eng.write(mr, 0, peer, rr, 0, 8, imm=imm)
        c.wait(30)
        t1 = time.perf_counter()
        if i >= 200:
            out.append(t1 - t0)
    pre.read()
    mr.close()
    return out


def _cpu_line(c: dict) -> str:
    """One side's CPU per request and the ratio the issue asks about: the messenger's (every
    Python thread) over the native progress threads'."""
    def ratio(py: float, prog: float) -> str:
        return f"{py / prog:.1f}x" if prog > 0 else "-"
    return (f"decode {c['decoder_cpu_us']:.0f} (progress {c['decoder_progress_cpu_us']:.0f}, "
            f"{ratio(c['decoder_cpu_us'], c['decoder_progress_cpu_us'])}), prefill {c['prefill_cpu_us']:.0f} "
            f"(progress {c['prefill_progress_cpu_us']:.0f}, {ratio(c['prefill_cpu_us'], c['prefill_progress_cpu_us'])}); "
            f"wake-ups/request: decode {c['decoder_sleeps']:.1f} (progress {c['decoder_progress_sleeps']:.1f}), "
            f"prefill {c['prefill_sleeps']:.1f} (progress {c['prefill_progress_sleeps']:.1f})"
            + ("; decode by thread: " + ", ".join(f"{t} {n:.1f}" for t, n in c["decoder_sleeps_by_thread"].items())
               if c.get("decoder_sleeps_by_thread") else ""))


def run_msg(args: argparse.Namespace) -> int:
    """Exit status: 0, or 1 when a provider could not be opened or its run failed (one line
    each on stderr; the other providers still run)."""
    import kvxfer
    from kvxfer import Sharding
    from kvxfer.errors import KvxferError

    providers = args.provider or ["shm", "tcp;ofi_rxm"]
    if args.per_rank:
        return _run_per_rank(args, providers)
    layouts = _layouts(args)
    sh = Sharding(1)
    results = []
    status = 0
    print(f"kvxfer-bench msg: {args.requests} requests of 1 page x {args.layers} layers (TP 1->1), "
          f"window {args.window}; latency: {args.latency_iters} requests of 1 page x 1 layer")
    hdr = (f"{'provider':<12} {'layout':<12} {'req/s':>9}  CPU us/request: {'decode':>7} {'(progress)':>10} "
           f"{'prefill':>8} {'(progress)':>10}")
    for prov in providers:
        pre = None
        engines, ms = [], {}
        node = None if prov.startswith("shm") else LOOPBACK
        try:
            try:  # here first: a provider that cannot open is one line, before a process is spawned
                for _ in layouts:
                    engines.append(kvxfer.Engine(prov, node, progress=args.progress))
            except (KvxferError, ImportError) as exc:  # ImportError: kvxfer built without its engine
                why = f"{type(exc).__name__}: {exc}"
                print(f"kvxfer-bench msg: provider {prov!r} cannot be opened here: {why}", file=sys.stderr)
                results.append({"provider": prov, "error": why})
                status = 1
                continue
            pre = _Prefill(args, prov)
            res: dict = {"provider": prov, "layouts": {}}
            for e, (name, lay) in zip(engines, layouts.items()):
                kv = [np.zeros(s, np.uint8) for s in lay.region_sizes(sh)]
                slots = args.window + 8 if args.context else 0
                m = kvxfer.Messenger(e, lay, sh, {0: kv}, context_slots=slots, context_bytes=args.context,
                                     peer_timeout=30)
                ms[name] = m
                pg = m.connect(bytes.fromhex(pre.info["blobs"][name]))
                if name == "minimal":
                    res["minimal_cpu"] = {}
                    split: list = []
                    lat = _latency(m, pg, args.latency_iters, [pre], res["minimal_cpu"], split)
                    for k, key in enumerate(("minimal_to_made_p50_us", "minimal_to_landed_p50_us",
                                             "minimal_landed_to_done_p50_us", "minimal_done_to_return_p50_us")):
                        res[key] = _pct([x[k] for x in split], 50) * 1e6
                    rtt = _write_rtt(e, pre, args.latency_iters)
                    res["minimal_p50_us"] = _pct(lat, 50) * 1e6
                    res["minimal_p99_us"] = _pct(lat, 99) * 1e6
                    res["write_rtt_p50_us"] = _pct(rtt, 50) * 1e6
                    res["write_rtt_p99_us"] = _pct(rtt, 99) * 1e6
                else:
                    res["layouts"][name] = _throughput(m, pg, args, pre)
            print(hdr)
            for name, t in res["layouts"].items():
                print(f"{prov:<12} {name:<12} {t['req_per_s']:>9.0f}  {'':>15} {t['decoder_cpu_us']:>7.0f} "
                      f"{t['decoder_progress_cpu_us']:>10.0f} {t['prefill_cpu_us']:>8.0f} "
                      f"{t['prefill_progress_cpu_us']:>10.0f}")
            print(f"{prov:<12} minimal request p50 {res['minimal_p50_us']:.0f} us, p99 {res['minimal_p99_us']:.0f} us; "
                  f"write round trip p50 {res['write_rtt_p50_us']:.0f} us, p99 {res['write_rtt_p99_us']:.0f} us "
                  f"(ratio {res['minimal_p50_us'] / res['write_rtt_p50_us']:.2f})")
            print(f"{prov:<12} minimal request CPU us/request: {_cpu_line(res['minimal_cpu'])}")
            print(f"{prov:<12} minimal request, the p50 of each step (apart): receive() -> Receive made "
                  f"{res['minimal_to_made_p50_us']:.0f} us, -> counted (engine's stamp: last write, or "
                  f"ANNOUNCE armed) {res['minimal_to_landed_p50_us']:.0f} us, -> done (decoder's messenger) "
                  f"{res['minimal_landed_to_done_p50_us']:.0f} us, -> wait() returned "
                  f"{res['minimal_done_to_return_p50_us']:.0f} us")
            results.append(res)
        except (KvxferError, RuntimeError, OSError, ValueError) as exc:  # this provider's run failed
            why = f"{type(exc).__name__}: {exc}"
            print(f"kvxfer-bench msg: provider {prov!r} failed: {why}", file=sys.stderr)
            results.append({"provider": prov, "error": why})
            status = 1
        finally:
            for m in ms.values():
                m.close()
            if pre is not None:
                pre.close()
            for e in engines:
                e.close()
    if args.json and not write_json(args.json, {"argv": sys.argv, "results": results}, "kvxfer-bench msg"):
        status = 1
    return status


def _run_per_rank(args: argparse.Namespace, providers: list) -> int:
    """``--per-rank``: TP 2 -> 1, node mode against per-rank prefill, same run."""
    import kvxfer
    from kvxfer import Sharding
    from kvxfer.errors import KvxferError

    args.kv_heads = max(2, args.kv_heads)          # TP 2 without replicas
    args.placement = "per_layer"
    layouts = _layouts(args)
    sh = Sharding(1)
    results, status = [], 0
    print(f"kvxfer-bench msg --per-rank: TP 2 -> 1, {args.requests} requests of 1 page x {args.layers} layers, "
          f"window {args.window}; latency: {args.latency_iters} requests of 1 page x 1 layer")
    print(f"{'provider':<12} {'prefill':<22} {'req/s':>9} {'minimal p50 us':>15} {'p99 us':>8}  "
          f"CPU us/request: {'decode':>7} {'prefill':>8}")
    for prov in providers:
        node = None if prov.startswith("shm") else LOOPBACK
        res: dict = {"provider": prov}
        for mode in ("node", "per_rank"):
            pres, engines, ms = [], [], []
            try:
                pres = [_Prefill(args, prov, 2)] if mode == "node" else [_Prefill(args, prov, 2, r) for r in (0, 1)]
                out: dict = {}
                for name, lay in layouts.items():
                    e = kvxfer.Engine(prov, node, progress=args.progress)
                    engines.append(e)
                    kv = [np.zeros(s, np.uint8) for s in lay.region_sizes(sh)]
                    slots = args.window + 8 if args.context else 0
                    m = kvxfer.Messenger(e, lay, sh, {0: kv}, context_slots=slots, context_bytes=args.context,
                                         peer_timeout=30)
                    ms.append(m)
                    pgs = [m.connect(bytes.fromhex(p.info["blobs"][name])) for p in pres]
                    peer = pgs[0] if mode == "node" else pgs
                    if name == "minimal":
                        out["minimal_cpu"] = {}
                        lat = _latency(m, peer, args.latency_iters, pres, out["minimal_cpu"])
                        out["minimal_p50_us"] = _pct(lat, 50) * 1e6
                        out["minimal_p99_us"] = _pct(lat, 99) * 1e6
                    else:
                        out.update(_throughput(m, peer, args, pres))
                res[mode] = out
                label = "node (1 process, TP2)" if mode == "node" else "per-rank (2 processes)"
                print(f"{prov:<12} {label:<22} {out['req_per_s']:>9.0f} {out['minimal_p50_us']:>15.0f} "
                      f"{out['minimal_p99_us']:>8.0f}  {'':>15} {out['decoder_cpu_us']:>7.0f} "
                      f"{out['prefill_cpu_us']:>8.0f}")
                print(f"{prov:<12} {label:<22} minimal request CPU us/request: {_cpu_line(out['minimal_cpu'])}")
            except (KvxferError, RuntimeError, OSError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                print(f"kvxfer-bench msg: provider {prov!r} ({mode}) failed: {why}", file=sys.stderr)
                res[mode] = {"error": why}
                status = 1
            finally:
                for m in ms:
                    m.close()
                for p in pres:
                    p.close()
                for e in engines:
                    e.close()
        if "req_per_s" in res.get("node", {}) and "req_per_s" in res.get("per_rank", {}):
            a, b = res["node"], res["per_rank"]
            print(f"{prov:<12} per-rank / node: req/s {b['req_per_s'] / a['req_per_s']:.2f}, "
                  f"minimal p50 {b['minimal_p50_us'] / a['minimal_p50_us']:.2f}")
        results.append(res)
    if args.json and not write_json(args.json, {"argv": sys.argv, "results": results}, "kvxfer-bench msg"):
        status = 1
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["_prefill"]:
        sys.exit(_prefill_main(sys.argv[2:]))
    print("run it as: python -m kvxfer.cli.bench msg", file=sys.stderr)
    sys.exit(2)
