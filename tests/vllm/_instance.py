"""One vLLM instance in its own process (the KV-transfer group is process-global), driven by
JSON lines on stdin and answering JSON lines on stdout: the tests' P, D and reference.

``python _instance.py MODEL ROLE OPTIONS_JSON`` with ROLE ``kv_producer``, ``kv_consumer`` or
``none``. While it has writes to push and no command is waiting, a producer keeps calling
``llm_engine.step()`` (an offline ``LLM`` does not step on its own: docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

OUT = sys.stdout
sys.stdout = sys.stderr          # vLLM's prints stay off the answer channel


def answer(obj: dict) -> None:
    OUT.write(json.dumps(obj) + "\n")
    OUT.flush()


def _totals(w) -> dict:
    w.stats()                          # moves what vLLM's stats hook has not taken into the totals
    return w.totals.reduce()


def _worker_messenger_stats(worker) -> dict:
    """In a worker process (``collective_rpc``): its rank's messenger counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return _messenger_state(get_kv_transfer_group().connector_worker.messenger)


def _messenger_state(m) -> dict:
    """A messenger's counters and its liveness histograms (the time between two messages of a
    live peer, one round of its thread): what a false death would be read from."""
    secs = m.metrics()["seconds"]
    return {"stats": m.stats(), **{k: secs[k] for k in ("peer_silence", "loop_gap") if k in secs}}


def _layout_check(eng, w) -> dict:
    """Write random K and V of a few tokens into a scratch cache with the real attention layer's
    ``impl.do_kv_cache_update`` (vLLM's CPU write path), then look for them through the
    connector's ``KVLayout``: every (head, block) has its K block where the layout puts the K
    plane and its V rows at the layout's per-token offsets; the K block is stored transposed
    (``[head_size, block_size]``, the vec ISA's), so only whole blocks are exact for K."""
    import numpy as np
    import torch

    from kvxfer.layout import KVLayout, Sharding

    layer = eng.vllm_config.compilation_config.static_forward_context[w.cache.layer_names[0]]
    lay = w.cache.layout
    H, d, bs, n = lay.kv_heads, lay.head_dim, lay.page_size, 4
    cache = torch.zeros(n, H, bs, 2 * d, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 5, bs - 1, bs, 2 * bs + 7, 4 * bs - 1], dtype=torch.int64)
    key = torch.randn(len(slots), H, d, generator=g)
    value = torch.randn(len(slots), H, d, generator=g)
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
    f = cache.numpy().ravel()
    geo = KVLayout.vllm_packed(1, H, d, bs, n, "float32", "HND").resolve(Sharding(1))
    k_bad = v_bad = k_rows = v_rows_form = 0
    for i, s in enumerate(slots.tolist()):
        page, t = divmod(s, bs)
        for h in range(H):
            kb = geo.offset(0, 0, page, h, 0) // 4
            k_bad += not np.array_equal(f[kb:kb + bs * d].reshape(d, bs)[:, t], key[i, h].numpy())
            k_rows += np.array_equal(f[kb + t * d:kb + (t + 1) * d], key[i, h].numpy())
            vo = geo.offset(0, 1, page, h, t) // 4
            v_bad += not np.array_equal(f[vo:vo + d], value[i, h].numpy())
            row = (page * geo.page_stride + h * bs * 2 * d * 4 + t * 2 * d * 4 + d * 4) // 4
            v_rows_form += np.array_equal(f[row:row + d], value[i, h].numpy())
    return {"vectors": len(slots) * H, "k_block_mismatches": k_bad, "v_mismatches": v_bad,
            "k_found_as_rows": k_rows, "v_found_row_wise": v_rows_form, "written": int((cache != 0).sum())}


def main() -> None:
    model, role, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(enforce_eager=True, dtype="float32", block_size=32, max_model_len=1024, seed=0,
              enable_prefix_caching=opts.get("prefix_caching", True))
    if opts.get("max_batched"):           # a smaller token budget: longer prompts prefill in chunks
        kw["max_num_batched_tokens"] = opts["max_batched"]
    if opts.get("speculative"):           # speculative decoding by a draft model: this model itself
        kw["speculative_config"] = {"method": "draft_model", "model": model,
                                    "num_speculative_tokens": opts["speculative"]}
        kw["disable_log_stats"] = False   # its acceptance counters (op spec_metrics)
    if opts.get("tp", 1) > 1:             # one worker process per rank (vLLM's mp executor)
        kw["tensor_parallel_size"] = opts["tp"]
        kw["distributed_executor_backend"] = "mp"
    elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        kw["distributed_executor_backend"] = "uni"
    if role != "none":
        if opts.get("connector") == "nixl":     # vLLM's own NixlConnector, CPU buffers (the benchmark)
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu",
                kv_load_failure_policy=opts.get("policy", "recompute"))
        else:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                kv_role=role, kv_load_failure_policy=opts.get("policy", "recompute"),
                kv_connector_extra_config=opts.get("extra", {}))
    llm = LLM(model, **kw)
    eng = llm.llm_engine
    inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def scheduler():
        return eng.engine_core.engine_core.scheduler

    def worker_connector():
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().connector_worker

    def pending() -> bool:
        if opts.get("connector") == "nixl":    # P steps continuously (tried for D's stalled NIXL read)
            return inproc and role == "kv_both" and opts.get("side") == "p"
        return role == "kv_producer" and inproc and scheduler().connector.has_pending_push_work()

    from _stalls import StallWatch

    watch = StallWatch()             # windows where this process's threads did not run (finding 29)
    answer({"ready": True, "pid": os.getpid()})
    counter = 0
    while True:
        if pending():
            r, _, _ = select.select([sys.stdin], [], [], 0.002)   # a step at most every 2 ms
            if not r:
                eng.step()
                continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "generate":            # several prompts at once, in one engine
                ids = []
                for i, toks in enumerate(cmd["prompts"]):
                    counter += 1
                    rid = cmd.get("ids", [None] * len(cmd["prompts"]))[i] or f"r{counter}"
                    params = (cmd.get("params") or [None] * len(cmd["prompts"]))[i]
                    sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0, ignore_eos=True,
                                        extra_args={"kv_transfer_params": params} if params else None)
                    eng.add_request(rid, {"prompt_token_ids": toks}, sp)
                    ids.append(rid)
                outs, steps, t0 = {}, 0, time.monotonic()
                abort_at = cmd.get("abort_after_seconds")
                abort_at = None if abort_at is None else t0 + abort_at
                limit = t0 + cmd.get("timeout", 120)
                max_step, first = 0.0, {}
                while len(outs) < len(ids) and time.monotonic() < limit:
                    ts = time.monotonic()
                    for o in eng.step():
                        if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                            first[o.request_id] = time.monotonic() - t0
                        if o.finished:
                            outs[o.request_id] = o
                    max_step = max(max_step, time.monotonic() - ts)
                    steps += 1
                    if abort_at is not None and time.monotonic() >= abort_at:
                        eng.abort_request(ids)
                        break
                res = []
                for rid in ids:
                    o = outs.get(rid)
                    res.append(None if o is None else {
                        "id": rid, "tokens": list(o.outputs[0].token_ids),
                        "kv_transfer_params": o.kv_transfer_params, "num_cached_tokens": o.num_cached_tokens,
                        "finish_reason": o.outputs[0].finish_reason, "first_token_s": first.get(rid)})
                answer({"ok": True, "outputs": res, "seconds": time.monotonic() - t0, "max_step": max_step})
            elif op == "drain":             # step until nothing is in flight (bounded)
                t0 = time.monotonic()
                while time.monotonic() - t0 < cmd.get("timeout", 30):
                    s = scheduler()
                    busy = s.has_requests() or s.connector.has_pending_push_work() or \
                        (opts.get("tp", 1) == 1 and worker_connector().has_work())
                    if not busy:
                        break
                    eng.step()
                answer({"ok": True, "busy": busy, "seconds": time.monotonic() - t0})
            elif op == "inspect" and opts.get("tp", 1) > 1:   # the workers are other processes
                s = scheduler()
                answer({"ok": True, "free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
                        "external": s.connector.connector_scheduler.external,
                        "pending_push": s.connector.has_pending_push_work(),
                        "messenger": eng.collective_rpc(_worker_messenger_stats), "stalls": watch.stalls, "stuck": watch.stuck})
            elif op == "inspect":
                s, w = scheduler(), worker_connector()
                cs = s.connector.connector_scheduler
                answer({"ok": True, "free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
                        "external": cs.external, "held": sorted(w.sender.held()) if w.sender else [],
                        "asked": w.sender.asked() if w.sender else [],
                        "loads": dict(w.recent_loads), "sends": dict(w.recent_sends),
                        "stats": _totals(w), "has_work": w.has_work(), "messenger": _messenger_state(w.messenger),
                        "stalls": watch.stalls, "stuck": watch.stuck,
                        "progress_rt": {"asked": w.engine.progress_rt_priority,
                                        "granted": w.engine.stats()["progress_rt"],
                                        "errno": w.engine.stats()["progress_rt_errno"]},
                        "pending_push": cs.has_pending_push_work()})
            elif op == "spoil":             # overwrite the blocks P holds for a request
                import torch

                w = worker_connector()
                t0 = time.monotonic()          # the worker learns the held blocks at the next step
                while any(r not in w.sender.held() for r in cmd["ids"]) and time.monotonic() - t0 < 30:
                    eng.step()
                g = torch.Generator().manual_seed(1)
                # "draft": only the draft model's layers (speculative decoding's own KV)
                prefix = "draft_model." if cmd.get("layers") == "draft" else ""
                for rid in cmd["ids"]:
                    blocks = w.sender.held()[rid]
                    for name, t in zip(w.cache.layer_names, w.cache.owner):
                        if name.startswith(prefix):
                            t[blocks] = torch.randn(t[blocks].shape, generator=g, dtype=t.dtype)
                answer({"ok": True})
            elif op == "prom":              # vLLM's own Prometheus path for the connector's stats
                from prometheus_client import REGISTRY, generate_latest
                from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

                w = worker_connector()
                prom = KVConnectorProm(eng.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
                _totals(w)
                prom.observe(w.totals.data, 0)
                text = generate_latest(REGISTRY).decode()
                answer({"ok": True, "lines": [x for x in text.splitlines() if x.startswith("vllm:kvxfer_")]})
            elif op == "spec_metrics":      # speculative decoding's counters since start
                out = {}
                for m in (llm.get_metrics() if opts.get("speculative") else ()):
                    if m.name.startswith("vllm:spec_decode_num_"):
                        out[m.name[len("vllm:spec_decode_num_"):]] = m.value if hasattr(m, "value") \
                            else list(m.values)
                w = worker_connector() if role != "none" else None
                answer({"ok": True, "spec": out, "layers": list(w.cache.layer_names) if w and w.cache else None})
            elif op == "layout_check":      # vLLM's own cache write against KVLayout's offsets
                answer(dict(ok=True, **_layout_check(eng, worker_connector())))
            elif op == "exit":
                answer({"ok": True})
                break
            else:
                answer({"ok": False, "error": f"unknown op {op}"})
        except Exception:
            answer({"ok": False, "error": traceback.format_exc()})
    os._exit(0)


if __name__ == "__main__":
    main()
