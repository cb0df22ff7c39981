"""vLLM P/D with kvxfer's connector against vLLM P/D with vLLM's NixlConnector (CPU buffers,
UCX): the same run, model and prompts, the connectors interleaved request by request.

``python bench/vllm_pd.py [--requests N] [--tokens T] [--provider P] [--out FILE]`` in the vLLM
venv, kvxfer importable (installed, or ``PYTHONPATH`` = this tree), ``nixl`` and ``nixl-cu13``
installed; ``--resummarize WORKDIR`` prints a kept run's summary again (its rows and events).
Four vLLM instances (kvxfer P and D, NIXL P and D), each its own process
(bench/vllm_pd_probe.py: tests/vllm/_instance.py with timestamps inside vLLM's scheduler), a
Llama of 8 layers and 8 KV heads of 128 made here (64 KiB of KV per token in float32: 32 MiB
for 512 tokens), prefix caching off (each prompt runs three times), one request at a time.
Three flows per prompt, their order rotated each prompt, each with the other connector's pair
stopped (`--together` leaves it running; `--idle-wait S` sets kvxfer's `idle_wait`):

* ``kvxfer`` and ``nixl``, P first (the proxy convention): P prefills with
  ``do_remote_decode``, its ``kv_transfer_params`` go to D, D loads and decodes.
* ``kvxfer-dfirst``: D gets the request first (kvxfer's D-first flow), its REQUEST waits at P,
  then P computes the prompt and streams each layer's KV while the next layer computes.

Per flow: the client's TTFT (the proxy's first call to D's first token), D's TTFT (D's request
to its first token), D's load (its scheduler's allocation to ``finished_recving``: what vLLM
waits), the KV still moving after P's prefill (P's ``request_finished`` to D's
``finished_recving``: streaming shows as this shrinking), the library's own transfer time
(NIXL's telemetry, kvxfer's load time), P's prefill, requests/s, and whether D's tokens agree
across the three flows. A request that fails or times out (300 s) ends the run: the summary
covers the prompts before it and names it. Not a test: figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from _cluster import Instance

SHAPE = {"layers": 8, "kv_heads": 8, "heads": 8, "head_dim": 128}
FLOWS = ("kvxfer", "nixl", "kvxfer-dfirst")


class Probed(Instance):
    """An ``Instance`` run by bench/vllm_pd_probe.py, its events in ``self.events``."""

    def __init__(self, name: str, model: Path, role: str, opts: dict, logdir: Path, env: dict) -> None:
        self.events = logdir / f"{name}.events"
        real = subprocess.Popen

        def popen(argv, **kw):             # Instance starts _instance.py: start the probe instead
            return real([argv[0], str(ROOT / "bench" / "vllm_pd_probe.py"), str(self.events)] + argv[2:], **kw)

        subprocess.Popen = popen
        try:
            super().__init__(name, model, role, opts, logdir, env=env)
        finally:
            subprocess.Popen = real

    def read_events(self) -> list[dict]:
        return self.load(self.events)

    @staticmethod
    def load(path: Path) -> list[dict]:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 1) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--provider", default="tcp;ofi_rxm", help="kvxfer's libfabric provider (shm: one host)")
    ap.add_argument("--idle-wait", type=float, default=None,
                    help="kvxfer's idle_wait option (seconds; default: the connector's own)")
    ap.add_argument("--together", action="store_true",
                    help="leave the other connector's pair running during a flow (default: stopped, SIGSTOP)")
    ap.add_argument("--resummarize", default=None, help="a finished run's directory: its summary again")
    a = ap.parse_args()
    if a.resummarize:
        w = Path(a.resummarize)
        saved = json.loads((w / "rows.json").read_text())
        a.requests, a.tokens = saved["requests"], saved["tokens"]
        ev = {k: Probed.load(w / f"{k}.events") for k in ("kvxfer-p", "kvxfer-d", "nixl-p", "nixl-d")}
        print(json.dumps(summarize(saved["rows"], ev, a, saved["loads"]), indent=1))
        return
    work = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-pd-"))
    print(json.dumps({"workdir": str(work)}), flush=True)
    model = work / "model"
    subprocess.run([sys.executable, "-c", (f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'vllm')!r}); "
                                           f"from _model import make_model; make_model({str(model)!r}, **{SHAPE!r})")],
                   check=True, stdout=subprocess.DEVNULL)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    base = {"prefix_caching": False}
    extra = {"provider": a.provider, "node": "127.0.0.1", "peer_timeout": 10}
    if a.idle_wait is not None:
        extra["idle_wait"] = a.idle_wait
    inst = {                 # (shm ignores the node: it names its region after the process)
        "kvxfer-p": Probed("kvxfer-p", model, "kv_producer", dict(base, extra=extra), work, env),
        "kvxfer-d": Probed("kvxfer-d", model, "kv_consumer", dict(base, extra=extra), work, env),
    }
    for side, port in (("p", 5600), ("d", 5700)):
        inst[f"nixl-{side}"] = Probed(f"nixl-{side}", model, "kv_both", dict(base, connector="nixl", side=side), work,
                                      dict(env, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                                           VLLM_NIXL_SIDE_CHANNEL_PORT=str(port)))
    loads: list[str] = []
    try:
        for x in inst.values():
            x.wait_ready()
        rng = np.random.default_rng(7)
        ps = [rng.integers(3, 380, a.tokens).tolist() for _ in range(a.requests + 1)]
        hs = None
        for c in ("kvxfer", "nixl"):                       # warm up: connects, first steps
            p, d = inst[f"{c}-p"], inst[f"{c}-d"]
            with alone(inst, c, a.together):
                rp = p.call(op="generate", prompts=[ps[-1]], max_tokens=1, params=[{"do_remote_decode": True}],
                            ids=[f"warm-{c}"])
                kp = rp["outputs"][0]["kv_transfer_params"]
                d.call(op="generate", prompts=[ps[-1]], max_tokens=4, params=[kp], ids=[f"warm-{c}-d"])
            hs = kp["remote_handshakes"] if c == "kvxfer" else hs
        rows: list[dict] = []
        failed: list[dict] = []
        loads.append(loadavg())
        for i, q in enumerate(ps[:-1]):
            order = FLOWS[i % 3:] + FLOWS[:i % 3]
            for flow in order:
                c = flow.split("-")[0]
                p, d = inst[f"{c}-p"], inst[f"{c}-d"]
                rid = f"q{i}-{flow}"
                try:
                    with alone(inst, c, a.together):
                        t0 = time.monotonic()
                        rows.append(run_flow(flow, rid, q, p, d, hs, t0))
                except (TimeoutError, RuntimeError, AssertionError) as exc:   # say it, keep the rows
                    print(json.dumps({"flow": flow, "i": i, "failed": str(exc)[:300]}), flush=True)
                    failed.append({"flow": flow, "i": i, "error": str(exc)[:2000]})
                    break
                rows[-1]["i"] = i
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
                (work / "rows.json").write_text(json.dumps({"requests": a.requests, "tokens": a.tokens, "rows": rows,
                                                            "loads": loads, "failed": failed}))
            if failed:
                break
            loads.append(loadavg())
        for x in inst.values():                 # let P's last sends finish before events are read
            if x.name.startswith("kvxfer") and not failed:
                x.call(op="drain", timeout=60)
        ev = {k: x.read_events() for k, x in inst.items()}
        out = summarize(rows, ev, a, loads)
        out["failed"] = failed
        print(json.dumps(out, indent=1))
        if a.out:
            Path(a.out).write_text(json.dumps({"summary": out, "rows": rows}, indent=1))
    finally:
        for x in inst.values():
            try:
                x.close(timeout=30)
            except (OSError, subprocess.TimeoutExpired) as exc:    # a NIXL process stuck in the kernel
                print(f"{x.name}: close: {exc}", flush=True)


@contextlib.contextmanager
def alone(inst: dict, c: str, together: bool):
    """The other connector's two instances stopped (SIGSTOP of their process groups) while
    ``c``'s pair serves a request: each connector is measured at its best, without the other's
    idle threads on the two cores (NIXL's progress thread spins while idle; kvxfer's P steps
    every 2 ms while it holds blocks). Both of a pair stop and go on together, so neither
    hears the other fall silent (kvxfer forgives its own stall: docs/messenger.md)."""
    others = [] if together else [x for n, x in inst.items() if not n.startswith(c)]
    for x in others:
        os.killpg(x.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for x in others:
            os.killpg(x.pid, signal.SIGCONT)


def run_flow(flow: str, rid: str, q: list[int], p: Probed, d: Probed, hs, t0: float) -> dict:
    """One request through P and D in ``flow``; the row of its client-side timings."""
    if flow == "kvxfer-dfirst":
        d.send(op="generate", prompts=[q], max_tokens=4, ids=[rid + "-d"], params=[{
            "do_remote_prefill": True, "kvxfer": 1, "remote_request_id": rid,
            "remote_handshakes": hs, "remote_num_tokens": len(q)}])
        while rid not in p.call(op="inspect")["asked"]:
            if time.monotonic() - t0 > 120:
                raise TimeoutError(f"{rid}: D's REQUEST never reached P")
            time.sleep(0.005)
        t_asked = time.monotonic()
        rp = p.call(op="generate", prompts=[q], max_tokens=1, ids=[rid],
                    params=[{"do_remote_decode": True, "kvxfer_request_key": rid}])
        rd = d.answer(timeout=300)
    else:
        rp = p.call(op="generate", prompts=[q], max_tokens=1, ids=[rid], params=[{"do_remote_decode": True}])
        kp = rp["outputs"][0]["kv_transfer_params"]
        t_asked = None
        rd = d.call(op="generate", prompts=[q], max_tokens=4, ids=[rid + "-d"], params=[kp], timeout=300)
    t_end = time.monotonic()
    o = rd["outputs"][0]
    d_start = t_end - rd["seconds"]                  # D's generate began (the answer's own clock)
    return {"flow": flow, "t0": t0, "t_end": t_end, "prefill_s": rp["seconds"],
            "d_ttft_s": o["first_token_s"], "ttft_s": d_start + o["first_token_s"] - t0,
            "ask_s": None if t_asked is None else t_asked - t0, "tokens": o["tokens"],
            "rid": rid, "drid": rid + "-d"}


def first(evs: list[dict], name: str, rid: str) -> float | None:
    """The first ``name`` event of the bench's request ``rid`` (vLLM appends ``-<hex>``)."""
    ts = [e["t"] for e in evs if e["ev"] == name and e.get("rid", "").rsplit("-", 1)[0] == rid]
    return min(ts) if ts else None


def summarize(rows: list[dict], ev: dict, a, loads: list[str]) -> dict:
    out: dict = {"requests": a.requests, "tokens": a.tokens, "loadavg_1m_during": loads,
                 "kvxfer_provider": getattr(a, "provider", "tcp;ofi_rxm"),
                 "idle_wait": getattr(a, "idle_wait", None), "together": getattr(a, "together", True),
                 "kv_mib_per_request": a.tokens * SHAPE["layers"] * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2 * 4 / 2**20}
    toks = {}
    for r in rows:
        if r.get("tokens") is not None:
            toks.setdefault(r["i"], {})[r["flow"]] = r["tokens"]
    out["tokens_agree"] = None if not toks else sum(len({json.dumps(v) for v in t.values()}) == 1 for t in toks.values())
    nixl_x = [e for e in ev["nixl-d"] if e["ev"] == "nixl_xfer"]
    kv_x = [e for e in ev["kvxfer-d"] if e["ev"] == "kvxfer_load" and e["outcome"] == "done"]
    for flow in FLOWS:
        c = flow.split("-")[0]
        rs = [r for r in rows if r["flow"] == flow]
        load, after_p = [], []
        for r in rs:
            s = first(ev[f"{c}-d"], "load_start", r["drid"])
            e = first(ev[f"{c}-d"], "load_end", r["drid"])
            pf = first(ev[f"{c}-p"], "p_finished", r["rid"])
            if pf is None and r["flow"] != "kvxfer-dfirst":     # P's answer came back (a run before the HMA hook)
                pf = r["t0"] + r["prefill_s"]
            if s is not None and e is not None:
                load.append(1e3 * (e - s))
            if pf is not None and e is not None:
                after_p.append(1e3 * (e - pf))
        wall = sum(r["t_end"] - r["t0"] for r in rs)
        res = {
            "ttft_ms_p50": pct([1e3 * r["ttft_s"] for r in rs], 50), "ttft_ms_p99": pct([1e3 * r["ttft_s"] for r in rs], 99),
            "d_ttft_ms_p50": pct([1e3 * r["d_ttft_s"] for r in rs], 50), "d_ttft_ms_p99": pct([1e3 * r["d_ttft_s"] for r in rs], 99),
            "d_load_ms_p50": pct(load, 50), "d_load_ms_p99": pct(load, 99),
            "kv_after_prefill_ms_p50": pct(after_p, 50), "kv_after_prefill_ms_p99": pct(after_p, 99),
            "prefill_ms_p50": pct([1e3 * r["prefill_s"] for r in rs], 50), "requests_per_s": round(len(rs) / wall, 4),
            "n": len(rs), "n_load": len(load),
        }
        if flow == "kvxfer-dfirst":
            res["ask_ms_p50"] = pct([1e3 * r["ask_s"] for r in rs], 50)
        out[flow] = res
    out["nixl_xfer_ms"] = {"p50": pct([1e3 * e["s"] for e in nixl_x], 50), "p99": pct([1e3 * e["s"] for e in nixl_x], 99),
                           "n": len(nixl_x), "descs": sorted({e["descs"] for e in nixl_x}),
                           "mib": sorted({round(e["bytes"] / 2**20, 1) for e in nixl_x})}
    out["kvxfer_load_ms"] = {"p50": pct([e["ms"] for e in kv_x], 50), "p99": pct([e["ms"] for e in kv_x], 99), "n": len(kv_x)}
    out["kvxfer_stages_ms"] = stages(rows, ev)
    return out


STAGES = (("alloc_to_receive", "load_start", "start"), ("receive_to_p_read", "start", "arrived"),
          ("p_read_to_callback", "arrived", "callback"), ("callback_to_posted", "callback", "returned"),
          ("posted_to_d_done", "returned", "done"), ("d_done_to_fenced", "done", "fenced"),
          ("fenced_to_worker_saw", "fenced", "seen"), ("worker_saw_to_sched", "seen", "load_end"))


def stages(rows: list[dict], ev: dict) -> dict:
    """kvxfer P first, where D's load time goes (p50 and max of each stage, ms): D's scheduler
    allocates (``load_start``), its worker's step makes the ``Receive`` (``start``), P's
    messenger reads the REQUEST (``arrived``), P's callback runs (``callback``) and returns
    with the writes posted (``returned``), D's count is reached (``done``) and fenced, D's
    worker sees it in a step (``seen``), D's scheduler gets it (``load_end``)."""
    per: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for r in rows:
        if r["flow"] != "kvxfer":
            continue
        t = {"load_start": first(ev["kvxfer-d"], "load_start", r["drid"]),
             "load_end": first(ev["kvxfer-d"], "load_end", r["drid"])}
        for e in ev["kvxfer-d"]:
            if e["ev"] == "kx_recv" and e["rid"].rsplit("-", 1)[0] == r["drid"]:
                t.update(start=e["start"], done=e["done"], fenced=e["fenced"], seen=e["seen"])
        for e in ev["kvxfer-p"]:             # P's own id (vLLM's suffix), not the D-first flow's key
            if e["ev"] == "kx_req" and e["key"].rsplit("-", 1)[0] == r["rid"] and e["key"] != r["rid"] + "-dfirst":
                t.update(arrived=e["arrived"], callback=e["callback"], returned=e["returned"])
        for name, a, b in STAGES:
            if t.get(a) is not None and t.get(b) is not None:
                per[name].append(1e3 * (t[b] - t[a]))
    return {name: {"p50": pct(xs, 50), "max": round(max(xs), 1) if xs else None} for name, xs in per.items()}


if __name__ == "__main__":
    main()
