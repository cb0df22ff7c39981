"""The vLLM P/D benchmark (not a test): the same model, prompts and run for kvxfer's connector
and vLLM's NixlConnector (CPU buffers, UCX), P first, one request at a time.

``python tests/vllm/_bench.py [--requests N] [--tokens T] [--connectors kvxfer,nixl]``
(in the vLLM venv, kvxfer installed; NixlConnector needs ``nixl`` and ``nixl-cu13``).
Prints, per connector: D's TTFT (D's ``add_request`` to its first token: the load, then one
step; 4 tokens per request) p50/p99, P's prefill time p50, requests/s over P+D, the load time kvxfer's stats
report, and whether D's tokens equal a reference instance's. The model is larger than the
tests' (8 layers, 8 KV heads of 128: 64 KiB of KV per token, float32)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cluster import HERE, Instance  # noqa: E402

SHAPE = {"layers": 8, "kv_heads": 8, "heads": 8, "head_dim": 128}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--connectors", default="kvxfer,nixl")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-bench-"))
    model = work / "model"
    import subprocess

    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); from _model import "
                    f"make_model; make_model({str(model)!r}, **{SHAPE!r})"], check=True, stdout=subprocess.DEVNULL)
    extra = {"provider": "tcp;ofi_rxm", "node": "127.0.0.1", "peer_timeout": 10}
    env_kv = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    inst = {"ref": Instance("bench-ref", model, "none", {}, work, env=env_kv)}
    for c in a.connectors.split(","):
        if c == "kvxfer":
            inst["kvxfer-p"] = Instance("bench-kvxfer-p", model, "kv_producer", {"extra": extra}, work, env=env_kv)
            inst["kvxfer-d"] = Instance("bench-kvxfer-d", model, "kv_consumer", {"extra": extra}, work, env=env_kv)
        elif c == "nixl":
            for side, port in (("p", 5600), ("d", 5700)):
                inst[f"nixl-{side}"] = Instance(
                    f"bench-nixl-{side}", model, "kv_both", {"connector": "nixl", "side": side}, work,
                    env=dict(env_kv, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(port)))
    try:
        for x in inst.values():
            x.wait_ready()
        rng = np.random.default_rng(7)
        ps = [rng.integers(3, 380, a.tokens).tolist() for _ in range(a.requests)]
        ref = [inst["ref"].call(op="generate", prompts=[q], max_tokens=4)["outputs"][0]["tokens"] for q in ps]
        out = {"requests": a.requests, "tokens": a.tokens, "kv_mib_per_request":
               a.tokens * SHAPE["layers"] * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2 * 4 / 2**20}
        for c in a.connectors.split(","):
            p, d = inst[f"{c}-p"], inst[f"{c}-d"]
            for q in ps[:2]:                                   # warm up (connects, first steps)
                rp = p.call(op="generate", prompts=[q], max_tokens=1, params=[{"do_remote_decode": True}])
                d.call(op="generate", prompts=[q], max_tokens=4, params=[rp["outputs"][0]["kv_transfer_params"]])
            ttft, prefill, same = [], [], 0
            t0 = time.monotonic()
            for q, r in zip(ps, ref):
                rp = p.call(op="generate", prompts=[q], max_tokens=1, params=[{"do_remote_decode": True}])
                prefill.append(rp["seconds"])
                kp = rp["outputs"][0]["kv_transfer_params"]
                rd = d.call(op="generate", prompts=[q], max_tokens=4, params=[kp])
                ttft.append(rd["outputs"][0]["first_token_s"])
                same += rd["outputs"][0]["tokens"] == r
            took = time.monotonic() - t0
            res = {"ttft_ms_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_ms_p99": 1e3 * float(np.percentile(ttft, 99)),
                   "prefill_ms_p50": 1e3 * float(np.percentile(prefill, 50)), "requests_per_s": a.requests / took,
                   "tokens_equal": same}
            if c == "kvxfer":
                st = d.call(op="inspect")["stats"]
                res.update(load_ms_p50=st.get("load_ms_p50"), load_ms_p99=st.get("load_ms_p99"))
            out[c] = res
            print(json.dumps({c: res}), flush=True)
        print(json.dumps(out, indent=1))
    finally:
        for x in inst.values():
            x.close()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
