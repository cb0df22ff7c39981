"""``kvxfer-bench kv``: the disaggregation benchmark, layer-by-layer streaming against a model.

This process is the decode node; it spawns a prefill node (``python -m kvxfer.cli.kv
_prefill``) whose "model" bumps the messenger's layer counter once per layer after a
simulated compute time. Per model preset and prompt length, over ``--repeat`` requests:

* **bulk**: the whole prompt's KV at once (every layer bumped together): decoder done -
  bump = the prompt's transfer time; / layers = **one layer's transfer time**;
* **stream**: layers computed ``--layer-ms`` apart, each layer's writes posted by the native
  watcher when its bump lands; **tail** = decoder done - last bump (cross-process
  CLOCK_MONOTONIC, one host), the **TTFT overhead** of disaggregation against a colocated
  run (which would be done at the last bump);
* **after**: the classic form, the whole KV sent once the model finished: its tail;
* **bump -> first post**: CPU ``bump()`` to the watcher's first native post call (and its
  return), p50/p99 over every layer of every stream run;
* bytes and writes per layer; a timeline (layers computed vs layers landed at the decoder,
  from the Receive's credited arrivals) as a PNG (matplotlib if installed, else a tiny
  built-in PNG writer).

Presets are scaled to fit this machine: the prompt is capped so one side's KV stays under
``--max-mib``. Uses the public API only.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import threading
import time
import zlib
from typing import Any, Optional

import numpy as np

from kvxfer.cli._args import (nonnegative_float, nonnegative_int, positive_float, positive_int, writable_file,
                            write_json)

__all__ = ["add_parser", "run_kv", "PRESETS"]

LOOPBACK = "127.0.0.1"

#: name: (layers, kv heads, head dim, src TP, dst TP, mla, prefill tokens/s of the source node)
#: (the tokens/s figures are assumptions for the simulated compute, given with the results)
PRESETS = {
    "llama-3.1-8b": (32, 8, 128, 1, 1, False, 20000),
    "llama-3.1-70b": (80, 8, 128, 8, 4, False, 8000),
    "qwen3-235b-a22b": (94, 4, 128, 4, 8, False, 6000),
    "deepseek-r1": (61, 1, 576, 8, 8, True, 4000),
    # not a model: issue 28's streaming acceptance shape, TP2 -> TP1, 16 layers of 1.5 MiB at
    # --tokens 384 (8 KV heads x 128, fp16: 4 KiB per token and layer); not in the default set
    "stream-tp2-tp1": (16, 8, 128, 2, 1, False, 20000),
}

#: the presets run when none is named (the models)
DEFAULT_PRESETS = tuple(k for k in sorted(PRESETS) if not k.startswith("stream-"))


def token_list(text: str) -> list[int]:
    """``--tokens``: comma-separated positive prompt lengths."""
    out = []
    for x in str(text).split(","):
        if not x.strip():
            continue
        try:
            v = int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"prompt lengths are positive integers, comma-separated; "
                                             f"got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"prompt lengths must be positive, got {v} in {text!r}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"no prompt length in {text!r}")
    return out


def poll_us(text: str) -> float:
    """``--poll-us``: what ``Engine.watcher`` takes (0: never polls, woken by each bump; else
    at least 0.001 and at most 1e9 µs), refused here rather than by the spawned prefill process."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v == 0 or 1e-3 <= v <= 1e9):
        raise argparse.ArgumentTypeError(f"a poll interval in µs, 0 or from 0.001 to 1e9, expected, got {text!r}")
    return v


def rt_priority(text: str) -> int:
    """``--rt``: a SCHED_FIFO priority, 0..99."""
    v = nonnegative_int(text)
    if v > 99:
        raise argparse.ArgumentTypeError(f"a SCHED_FIFO priority in 0..99 expected, got {text!r}")
    return v


def _usage_problem(presets: list, lengths: list, page_size: int, max_mib: int) -> Optional[str]:
    """A preset whose KV cannot be capped under ``--max-mib`` (its smallest prompt, one page,
    holds more): said before anything runs, not as a failed allocation mid-run."""
    from kvxfer.errors import KvxferError

    for preset in presets:
        for want in lengths:
            try:
                tokens = fit_tokens(preset, want, page_size, max_mib)
                held = max(side_bytes(preset, tokens, page_size))
            except (KvxferError, ValueError, OverflowError) as exc:
                return f"--page-size {page_size}, --tokens {want}: {preset}: {exc}"
            if held > max_mib << 20:
                return (f"--page-size {page_size}: {preset} holds {held / 2**20:.0f} MiB for a {tokens}-token "
                        f"prompt, over --max-mib {max_mib}")
    return None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "kv", help="disaggregation: layer-by-layer streaming tail, per-layer transfer, TTFT overhead, bump->post",
        description="Two processes (this one decodes, a spawned one prefills with a simulated model that bumps "
                    "the layer counter). Per preset and prompt length: one layer's transfer time, the streaming "
                    "tail and TTFT overhead against a colocated run, the send-after-prefill tail, bump -> first "
                    "post p50/p99, bytes and writes per layer; a table, --json and --plot PNG.")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS), metavar="NAME",
                   help=f"model preset, repeatable (default: every model, {', '.join(DEFAULT_PRESETS)}; "
                        f"also stream-tp2-tp1, the streaming acceptance shape)")
    p.add_argument("--tokens", type=token_list, default="1024", help="prompt lengths, comma-separated (default 1024)")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--layer-ms", type=positive_float, default=None,
                   help="simulated compute per layer (default: prompt / the preset's tokens/s / layers, raised to "
                        "--min-ratio x this machine's measured per-layer transfer when the link is slower)")
    p.add_argument("--min-ratio", type=nonnegative_float, default=1.5,
                   help="without --layer-ms: compute per layer at least this x one layer's measured transfer "
                        "(a link slower than the model leaves a tail of L x the difference whatever streams; "
                        "0 keeps the preset's rate; default 1.5)")
    p.add_argument("--rt", type=rt_priority, default=0, metavar="PRIO",
                   help="run the prefill node's watcher thread SCHED_FIFO at this priority (default 0: normal)")
    p.add_argument("--progress-rt", type=rt_priority, default=0, metavar="PRIO",
                   help="open both nodes' engines with progress_rt_priority=PRIO: their progress threads run "
                        "SCHED_FIFO (default 0: normal; on a loaded machine they otherwise wait for a CPU at every "
                        "wake-up); the row's progress_rt / prefill_progress_rt say what was granted")
    p.add_argument("--tokens-per-s", type=positive_float, default=None, help="derive --layer-ms from this prefill rate")
    p.add_argument("--repeat", type=positive_int, default=5, help="requests per mode (default 5)")
    p.add_argument("--max-mib", type=positive_int, default=192,
                   help="cap one side's KV for a prompt at this (default 192)")
    p.add_argument("--provider", default="shm")
    p.add_argument("--poll-us", type=poll_us, default=None,
                   help="the watcher's poll interval while armed (default: the messenger's, 0 on a CPU counter: "
                        "woken by each bump, never polls)")
    p.add_argument("--hot", action="store_true",
                   help="receive with hot=True: the decoder's progress threads poll while the request is in flight")
    p.add_argument("--json", metavar="FILE", type=writable_file)
    p.add_argument("--plot", metavar="PNG", type=writable_file,
                   help="timeline of the median-tail stream run of each case")
    p.set_defaults(func=run_kv)


def _layouts(preset: str, tokens: int, page_size: int) -> tuple:
    from kvxfer import KVLayout, Sharding

    layers, heads, dim, stp, dtp, mla, _ = PRESETS[preset]
    pages = -(-tokens // page_size) + 1
    if mla:
        mk = lambda: KVLayout.mla(layers, dim, page_size, pages, "float16", layer_regions="layer_major")  # noqa: E731
        return mk(), Sharding(stp, replicated=True), mk(), Sharding(dtp, replicated=True)
    mk = lambda: KVLayout.layer_major(layers, heads, dim, page_size, pages, "float16")  # noqa: E731
    return mk(), Sharding(stp), mk(), Sharding(dtp)


def side_bytes(preset: str, tokens: int, page_size: int) -> tuple[int, int]:
    """KV bytes held by the prefill and the decode node for one prompt (all ranks)."""
    sl, ss, dl, ds = _layouts(preset, tokens, page_size)
    return (sum(sum(sl.region_sizes(ss)) for _ in range(ss.tp_size)),
            sum(sum(dl.region_sizes(ds)) for _ in range(ds.tp_size)))


def fit_tokens(preset: str, tokens: int, page_size: int, max_mib: int) -> int:
    """The prompt capped (to whole pages) so neither side holds more than max_mib of KV."""
    t = tokens
    while t > page_size and max(side_bytes(preset, t, page_size)) > max_mib << 20:
        t = max(page_size, (t // 2) // page_size * page_size)
    return t


# -- the prefill process ------------------------------------------------------------------

def _prefill_main(argv: list[str]) -> int:
    import kvxfer

    ap = argparse.ArgumentParser(prog="kvxfer.cli.kv _prefill")
    ap.add_argument("--provider", required=True)
    ap.add_argument("--poll-us", type=float, default=None)
    ap.add_argument("--rt", type=int, default=0)
    ap.add_argument("--progress-rt", type=int, default=0)
    args = ap.parse_args(argv)
    node = None if args.provider.startswith("shm") else LOOPBACK
    eng = kvxfer.Engine(args.provider, node, progress_rt_priority=args.progress_rt)
    m = None
    print(json.dumps({"ready": True, "progress_rt": eng.stats()["progress_rt"]}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "setup":
                if m is not None:
                    m.close()
                sl, ss, _, _ = _layouts(cmd["preset"], cmd["tokens"], cmd["page_size"])
                kv = {r: [np.full(s, r + 1, np.uint8) for s in sl.region_sizes(ss)] for r in range(ss.tp_size)}
                m = kvxfer.Messenger(eng, sl, ss, kv, peer_timeout=60, watch_poll_us=args.poll_us,
                                     watch_rt_priority=args.rt)
                rt = m.layer_counter.stats()["rt"]
                print(json.dumps({"blob": m.handshake().hex(), "rt": rt}), flush=True)
            elif cmd["cmd"] == "run":
                print(json.dumps(_prefill_run(m, cmd)), flush=True)
            elif cmd["cmd"] == "quit":
                break
    finally:
        if m is not None:
            m.close()
        eng.close()
    return 0


def _prefill_run(m: Any, cmd: dict) -> dict:
    lc = m.layer_counter
    L = m.layout.num_layers
    mode, layer_s = cmd["mode"], cmd["layer_ms"] / 1e3
    (req,) = m.requests(timeout=30)
    n = len(req.dst_pages)
    src = np.arange(n)
    bumps = []
    out: dict = {"mode": mode}
    lc.latencies()                                  # clear
    if mode == "after":
        t_next = time.perf_counter()
        for _ in range(L):                          # the model computes, nothing streams
            t_next += layer_s
            _sleep_until(t_next)
            bumps.append(time.monotonic_ns())
        t0 = time.perf_counter()
        s = m.send(req, src).finish()
        out["post_s"] = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        s = m.stream(req)
        p = m.schedule([(s, 0, req.num_tokens, src)])
        s.finish()
        out["schedule_s"] = time.perf_counter() - t0
        t_next = time.perf_counter()
        if mode == "bulk":
            bumps = [time.monotonic_ns()] * L
            lc.bump(L)
        else:
            for _ in range(L):
                t_next += layer_s
                _sleep_until(t_next)
                bumps.append(time.monotonic_ns())
                lc.bump()
        entries = list(s.entries)
        per = {}
        s.wait(60)
        for e in entries:
            lay = e.threshold - p.base - 1
            if lay >= L:
                continue                            # the context
            a = per.setdefault(lay, [0, 0, None])
            a[0] += e.nbytes
            a[1] += e.num_writes
            a[2] = e.fired_ns if a[2] is None else min(a[2], e.fired_ns)
        out["bytes_per_layer"] = [per[i][0] for i in range(L)]
        out["writes_per_layer"] = [per[i][1] for i in range(L)]
        out["first_post_ns"] = [per[i][2] for i in range(L)]
        call, post = lc.latencies()
        out["lat_call_ns"], out["lat_post_ns"] = call, post
    s.wait(60)
    out["bump_ns"] = bumps
    out["num_writes"] = s.num_writes
    return out


def _sleep_until(t: float) -> None:
    """Sleep to within ~0.2 ms of ``t`` (perf_counter), then yield until it: a model's layer."""
    while True:
        d = t - time.perf_counter()
        if d <= 0:
            return
        time.sleep(d - 0.0002 if d > 0.0004 else 0)


# -- the decode side (this process) -------------------------------------------------------

class _Prefill:
    def __init__(self, args: Any) -> None:
        poll = [] if args.poll_us is None else ["--poll-us", str(args.poll_us)]
        self.p = subprocess.Popen([sys.executable, "-m", "kvxfer.cli.kv", "_prefill", "--provider", args.provider,
                                   *poll, "--rt", str(args.rt), "--progress-rt", str(args.progress_rt)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        #: the SCHED_FIFO priority the prefill engine's progress threads got (0: none)
        self.progress_rt = int(self.read().get("progress_rt", 0))

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited ({self.p.wait()})")
        return json.loads(line)

    def send(self, **cmd: Any) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        try:
            self.send(cmd="quit")
            self.p.wait(15)
        except Exception:
            self.p.kill()
            self.p.wait()


def _pct(a: list, q: float) -> float:
    return float(np.percentile(np.asarray(a, dtype=float), q)) if len(a) else float("nan")


def _one(m: Any, pg: Any, pre: _Prefill, mode: str, layer_ms: float, tokens: int, i: int, hot: bool) -> dict:
    """One request: the decoder receives, the prefiller runs ``mode``; arrivals sampled."""
    npages = -(-tokens // m.layout.page_size)
    r = m.receive(pg, f"{mode}{i}", list(range(npages)), tokens, hot=hot)
    samples: list = []
    stop = threading.Event()

    def watch() -> None:                      # the decoder's view: credited arrivals over time
        last = -1
        while not stop.is_set():
            a = r.arrived
            if a != last:
                samples.append((time.monotonic_ns(), a))
                last = a
            if r.done:
                break
            time.sleep(0.00005)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    pre.send(cmd="run", mode=mode, layer_ms=layer_ms)
    res = pre.read()
    r.wait(60)
    stop.set()
    th.join(5)
    res["done_ns"] = int(r.t_done * 1e9)
    res["landed_native_ns"] = None if r.t_landed is None else int(r.t_landed * 1e9)
    res["arrivals"] = samples
    r.release()
    return res


def _landed(res: dict) -> list[int]:
    """When each layer had landed at the decoder: the first arrival sample at which the
    credited messages reached the writes of layers 0..l (they are posted in layer order)."""
    cum = np.cumsum(res["writes_per_layer"])
    out = []
    for c in cum:
        t = next((ts for ts, a in res["arrivals"] if a >= c), res["done_ns"])
        out.append(t)
    return out


def run_case(m: Any, pg: Any, pre: _Prefill, preset: str, tokens: int, layer_ms: Optional[float], repeat: int,
             hot: bool = False, model_ms: float = 0.0, min_ratio: float = 1.5) -> dict:
    """bulk (one layer's transfer), then stream and after at ``layer_ms`` (None: the
    model's ``model_ms``, raised to ``min_ratio`` x one layer's transfer)."""
    L = pg.layout.num_layers
    bulk = [_one(m, pg, pre, "bulk", 0.0, tokens, i, hot) for i in range(repeat)]
    t_all = [(b["done_ns"] - b["bump_ns"][0]) / 1e6 for b in bulk]
    t_layer = float(np.median(t_all)) / L
    t_layer_landed = _pct([(b["landed_native_ns"] - b["bump_ns"][0]) / 1e6 for b in bulk
                           if b["landed_native_ns"] is not None], 50) / L        # NaN without stamps
    scaled = False
    if layer_ms is None:
        layer_ms = model_ms
        if min_ratio and layer_ms < min_ratio * t_layer:
            layer_ms, scaled = min_ratio * t_layer, True
    stream = [_one(m, pg, pre, "stream", layer_ms, tokens, i, hot) for i in range(repeat)]
    after = [_one(m, pg, pre, "after", layer_ms, tokens, i, hot) for i in range(repeat)]
    tails = [(s["done_ns"] - s["bump_ns"][-1]) / 1e6 for s in stream]
    tails_after = [(a["done_ns"] - a["bump_ns"][-1]) / 1e6 for a in after]
    # the same tail to the engine's own stamp (Receive.t_landed: the thread that read the CQ
    # credited the last write; the ANNOUNCE goes with the last chunk, so it is armed by then),
    # before the decoder's messenger made the request done
    landed = _pct([(s["landed_native_ns"] - s["bump_ns"][-1]) / 1e6 for s in stream
                   if s["landed_native_ns"] is not None], 50)
    call = [x for s in stream for x in s["lat_call_ns"]]
    post = [x for s in stream for x in s["lat_post_ns"]]
    s0 = stream[int(np.argsort(tails)[len(tails) // 2])]     # the timeline of the median-tail run
    return {
        "preset": preset, "tokens": tokens, "layers": L, "layer_ms": layer_ms, "model_layer_ms": model_ms,
        "compute_scaled": scaled,
        "bytes_per_layer": s0["bytes_per_layer"][0], "writes_per_layer": s0["writes_per_layer"][0],
        "prompt_transfer_ms": float(np.median(t_all)), "layer_transfer_ms": t_layer,
        "stream_tail_ms": float(np.median(tails)), "stream_tail_max_ms": float(max(tails)),
        "tail_over_layer": float(np.median(tails)) / t_layer if t_layer else float("nan"),
        "after_tail_ms": float(np.median(tails_after)),
        "layer_transfer_landed_ms": t_layer_landed, "stream_landed_tail_ms": landed,
        "landed_over_layer": landed / t_layer_landed if t_layer_landed > 0 else float("nan"),
        "ttft_colocated_ms": L * layer_ms,
        "ttft_overhead_stream_ms": float(np.median(tails)), "ttft_overhead_after_ms": float(np.median(tails_after)),
        "bump_to_post_call_p50_us": _pct(call, 50) / 1e3, "bump_to_post_call_p99_us": _pct(call, 99) / 1e3,
        "bump_to_post_done_p50_us": _pct(post, 50) / 1e3, "bump_to_post_done_p99_us": _pct(post, 99) / 1e3,
        "bump_samples": len(call), "schedule_ms": float(np.median([s["schedule_s"] for s in stream])) * 1e3,
        "timeline": {"bump_ns": s0["bump_ns"], "first_post_ns": s0["first_post_ns"], "landed_ns": _landed(s0),
                     "done_ns": s0["done_ns"]},
    }


def run_kv(args: argparse.Namespace) -> int:
    """Exit status: 0, or 1 when the provider could not be opened or the run failed (one
    line on stderr; the cases run before the failure are still written), 2 when a preset's
    KV cannot fit ``--max-mib`` at this ``--page-size`` (before anything runs)."""
    import kvxfer
    from kvxfer.errors import KvxferError

    presets = args.preset or list(DEFAULT_PRESETS)
    lengths = args.tokens if isinstance(args.tokens, list) else token_list(args.tokens)
    problem = _usage_problem(presets, lengths, args.page_size, args.max_mib)
    if problem is not None:                    # a usage error: exit 2, before anything runs
        print(f"kvxfer-bench kv: error: {problem}", file=sys.stderr)
        return 2
    node = None if args.provider.startswith("shm") else LOOPBACK
    try:  # here first: a provider that cannot open is one line, before a process is spawned
        eng = kvxfer.Engine(args.provider, node, progress_rt_priority=args.progress_rt)
        granted_rt = eng.stats()["progress_rt"]      # 0 where refused (a SchedulingWarning says why)
    except (KvxferError, ImportError) as exc:  # ImportError: kvxfer built without its engine
        print(f"kvxfer-bench kv: provider {args.provider!r} cannot be opened here: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    pre = None
    results = []
    done = set()
    status = 0
    error = None
    try:
        pre = _Prefill(args)
        for preset in presets:
            for want in lengths:
                tokens = fit_tokens(preset, want, args.page_size, args.max_mib)
                if (preset, tokens) in done:
                    continue                        # capped to a length already run
                done.add((preset, tokens))
                layers, *_, tps = PRESETS[preset]
                rate = args.tokens_per_s or tps
                model_ms = tokens / rate / layers * 1e3
                _, _, dl, ds = _layouts(preset, tokens, args.page_size)
                pre.send(cmd="setup", preset=preset, tokens=tokens, page_size=args.page_size)
                info = pre.read()
                blob = bytes.fromhex(info["blob"])
                kv = {r: [np.zeros(s, np.uint8) for s in dl.region_sizes(ds)] for r in range(ds.tp_size)}
                with kvxfer.Messenger(eng, dl, ds, kv, peer_timeout=60) as m:
                    pg = m.connect(blob)
                    res = run_case(m, pg, pre, preset, tokens, args.layer_ms, args.repeat, args.hot, model_ms,
                                   args.min_ratio)
                res["tokens_asked"] = want
                res["provider"] = args.provider
                res["hot"] = args.hot
                res["watcher_rt"] = info["rt"]
                res["progress_rt"] = granted_rt
                res["prefill_progress_rt"] = pre.progress_rt
                results.append(res)
                _print_row(res, first=len(results) == 1)
    except (KvxferError, RuntimeError, OSError, ValueError) as exc:  # the run failed: one line
        error = f"{type(exc).__name__}: {exc}"
        print(f"kvxfer-bench kv: {args.provider}: failed: {error}", file=sys.stderr)
        status = 1
    finally:
        if pre is not None:
            pre.close()
        eng.close()
    if args.json:
        doc = {"argv": sys.argv, "results": results}
        if error:
            doc["error"] = error
        if not write_json(args.json, doc, "kvxfer-bench kv"):
            status = 1
    if args.plot and results:
        try:
            plot_timeline(results, args.plot)
            print(f"timeline: {args.plot}")
        except OSError as exc:
            print(f"kvxfer-bench kv: cannot write {args.plot!r}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    return status


def _print_row(r: dict, first: bool) -> None:
    if first:
        print(f"{'preset':<16} {'tokens':>7} {'L':>3} {'KiB/layer':>9} {'wr/layer':>8} {'layer ms':>8} "
              f"{'xfer/layer':>10} {'tail':>7} {'tail/layer':>10} {'landed':>7} {'after':>7} {'bump->post p50/p99 us':>22}")
    cap = "" if r["tokens"] == r["tokens_asked"] else f" (of {r['tokens_asked']})"
    if r["compute_scaled"]:
        cap += f" compute scaled from {r['model_layer_ms']:.3f} ms"
    print(f"{r['preset']:<16} {r['tokens']:>7} {r['layers']:>3} {r['bytes_per_layer'] / 1024:>9.0f} "
          f"{r['writes_per_layer']:>8} {r['layer_ms']:>8.3f} {r['layer_transfer_ms']:>9.3f}m {r['stream_tail_ms']:>6.2f}m "
          f"{r['tail_over_layer']:>10.2f} {r['stream_landed_tail_ms']:>6.2f}m {r['after_tail_ms']:>6.1f}m "
          f"{r['bump_to_post_call_p50_us']:>10.1f}/{r['bump_to_post_call_p99_us']:<9.1f}{cap}")


# -- the timeline plot ----------------------------------------------------------------------

def plot_timeline(results: list[dict], path: str) -> None:
    """Layers computed (bumps) and layers landed (decoder) against time, one panel per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plot_builtin(results, path)
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 3 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        tl = r["timeline"]
        t0 = tl["bump_ns"][0] - r["layer_ms"] * 1e6
        ys = np.arange(1, r["layers"] + 1)
        ax.step([(t - t0) / 1e6 for t in tl["bump_ns"]], ys, where="post", label="layers computed (bump)")
        ax.step([(t - t0) / 1e6 for t in tl["landed_ns"]], ys, where="post", label="layers landed (decoder)")
        ax.axvline((tl["done_ns"] - t0) / 1e6, color="k", lw=0.8, ls=":", label="request done")
        ax.set_title(f"{r['preset']}, {r['tokens']} tokens: tail {r['stream_tail_ms']:.2f} ms "
                     f"({r['tail_over_layer']:.2f} x one layer's transfer)", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("layer")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_builtin(results: list[dict], path: str) -> None:
    """Without matplotlib: a plain PNG (blue: computed, red: landed, black: done), one band
    per case, time left to right, layers bottom to top."""
    w, band = 800, 200
    h = band * len(results)
    img = np.full((h, w, 3), 255, np.uint8)
    for k, r in enumerate(results):
        tl = r["timeline"]
        t0 = tl["bump_ns"][0] - r["layer_ms"] * 1e6
        t1 = max(tl["done_ns"], tl["landed_ns"][-1]) - t0
        y0 = k * band
        img[y0 + band - 1, :] = 0
        for series, color in ((tl["bump_ns"], (40, 80, 220)), (tl["landed_ns"], (220, 40, 40))):
            for i, t in enumerate(series):
                x = int((t - t0) / t1 * (w - 20)) + 10
                y = y0 + band - 10 - int((i + 1) / r["layers"] * (band - 20))
                img[max(y - 2, y0):y + 3, max(x - 2, 0):x + 3] = color
        xd = int((tl["done_ns"] - t0) / t1 * (w - 20)) + 10
        img[y0:y0 + band - 1, min(xd, w - 1)] = 0
    _write_png(path, img)


def _write_png(path: str, img: np.ndarray) -> None:
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_prefill"]:
        sys.exit(_prefill_main(sys.argv[2:]))
    print("run it as: python -m kvxfer.cli.bench kv", file=sys.stderr)
    sys.exit(2)
