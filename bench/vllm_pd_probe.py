"""The vLLM instance of bench/vllm_pd.py: tests/vllm/_instance.py with timestamps taken inside
vLLM's scheduler and both connectors' stats, the same hooks for kvxfer and NixlConnector.

``python bench/vllm_pd_probe.py EVENTS MODEL ROLE OPTIONS_JSON``: appends one JSON line per
event to EVENTS, ``time.monotonic()`` (one clock for every process on the host):
``load_start`` (D's scheduler allocated blocks for tokens to load: ``update_state_after_alloc``
with external tokens), ``load_end`` (D's scheduler got the request in ``finished_recving``),
``p_finished`` (P's request finished: ``request_finished``), ``sent`` (P's scheduler got it in
``finished_sending``), ``nixl_xfer`` (NIXL's own telemetry of one READ: post to completion) and
``kvxfer_load`` (kvxfer's load time: the step that started it to the one that saw it fenced),
``kx_recv`` (D: the load's ``Receive`` made, final, fenced, and seen by the worker's step) and
``kx_req`` (P: the decoder's REQUEST read by the messenger, its callback begun, and returned
with the writes posted).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_EVENTS = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115 (the process's life)


def _event(ev: str, **kw) -> None:
    _EVENTS.write(json.dumps(dict(ev=ev, t=time.monotonic(), **kw)) + "\n")


def _install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    init, xfer_done = Scheduler.__init__, Scheduler._update_from_kv_xfer_finished

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        c = self.connector
        if c is None:
            return
        alloc, finished = c.update_state_after_alloc, c.request_finished

        def update_state_after_alloc(request, blocks, num_external_tokens):
            if num_external_tokens:
                _event("load_start", rid=request.request_id, tokens=num_external_tokens)
            return alloc(request, blocks, num_external_tokens)

        def request_finished(request, block_ids):
            _event("p_finished", rid=request.request_id)
            return finished(request, block_ids)

        c.update_state_after_alloc, c.request_finished = update_state_after_alloc, request_finished
        if hasattr(c, "request_finished_all_groups"):        # what vLLM calls on an HMA connector (NIXL)
            all_groups = c.request_finished_all_groups

            def request_finished_all_groups(request, block_ids):
                _event("p_finished", rid=request.request_id)
                return all_groups(request, block_ids)

            c.request_finished_all_groups = request_finished_all_groups

    def _update_from_kv_xfer_finished(self, out):
        for rid in out.finished_recving or ():
            _event("load_end", rid=rid)
        for rid in out.finished_sending or ():
            _event("sent", rid=rid)
        return xfer_done(self, out)

    Scheduler.__init__, Scheduler._update_from_kv_xfer_finished = __init__, _update_from_kv_xfer_finished
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
            NixlKVConnectorStats,
        )

        record = NixlKVConnectorStats.record_transfer

        def record_transfer(self, res):
            if res is not None:
                _event("nixl_xfer", s=res.xferDuration / 1e6, post_s=res.postDuration / 1e6,
                       bytes=res.totalBytes, descs=res.descCount)
            return record(self, res)

        NixlKVConnectorStats.record_transfer = record_transfer
    except ImportError:
        pass
    from kvxfer.integrations.vllm.stats import KvxferConnectorStats

    record_load = KvxferConnectorStats.record_load

    def _record_load(self, outcome, ms, nbytes=0):
        _event("kvxfer_load", outcome=outcome, ms=ms, bytes=nbytes)
        return record_load(self, outcome, ms, nbytes)

    KvxferConnectorStats.record_load = _record_load

    # kvxfer's load, step by step (one clock for all: CLOCK_MONOTONIC is the machine's): D's
    # receive(), the REQUEST read at P, P's callback begun and its writes posted, D's count
    # reached and fenced, D's worker seeing it
    from kvxfer.integrations.vllm.loader import Loader
    from kvxfer.integrations.vllm.sender import Sender

    loader_finished, on_request = Loader.finished, Sender.on_request

    def finished(self, wait=0.0):
        loading = dict(self._loading)
        out = loader_finished(self, wait)
        now = time.monotonic()
        for rid in out[0]:
            r = loading[rid].receive if rid in loading else None
            if r is not None:
                _event("kx_recv", rid=rid, start=r.t_start, done=r.t_done, fenced=r.t_fenced, seen=now)
        return out

    def on_request_timed(self, req):
        t = time.monotonic()
        on_request(self, req)
        _event("kx_req", key=str(req.request_id), arrived=req.t_arrived, callback=t, returned=time.monotonic())

    Loader.finished, Sender.on_request = finished, on_request_timed


if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + sys.argv[2:]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))
    import _instance  # redirects stdout to stderr (its answer channel)

    _install()
    _instance.main()
