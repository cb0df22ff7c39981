"""An engine's scheduler loop on the messenger's non-blocking API only (issue 23): one thread
drives 200 concurrent requests through ``poll()`` on both sides, with aborts (``abort(timeout=0)``,
drawn per request), rejections, prefix offsets, one-shot sends and chunked ``add()``s; every
done request byte-exact, every page fenced at the end. The longest single call, each call's
p99, and the time the loop's own thread spent inside ``Engine.send`` (a control message the
engine may make it wait for) are recorded as figures (printed; docs/benchmarks.md); the
test asserts only a generous bound on the longest call and that the loop's thread never waited
for the engine to take a control message: what it sends itself (a REQUEST or ANNOUNCE flushed
by its poster, kvxfer/messenger/peers.py) is one try (``timeout=0``), everything else goes
through the messenger's sender thread."""

from __future__ import annotations

import random
import threading
import time
import zlib

import numpy as np
import pytest

import kvxfer
from kvxfer import KVLayout
from kvxfer.errors import RejectedError

from _api import Cluster

BIG = KVLayout.vllm(2, 4, 8, 4, 1024, "float16")
N = 200


def _plan_of(rid: str) -> tuple:
    """A request's fixed shape from its id: (num_tokens, first_token, source pages, mode, the
    loop step at which the engine gives up on it or None). Giving up is drawn per request, not
    per turn of the loop: a loop that spins while the peers' threads are off a CPU would
    otherwise give up on nearly everything (the count of requests done is then a bet on timing)."""
    rng = random.Random(zlib.crc32(rid.encode()))
    n = rng.randint(1, 16)
    first = rng.randrange(n) if rng.random() < 0.3 else 0
    src = [rng.randrange(BIG.num_pages) for _ in range(-(-n // 4))]
    mode = rng.choices(["reject", "one", "chunks"], [0.1, 0.4, 0.5])[0]
    give_up = rng.choice([0, 0, 1, 2, 3, 4, 6, 8, 12]) if rng.random() < 0.15 else None    # 0: before the loop
    return n, first, np.array(src), mode, give_up


@pytest.mark.parametrize("per_rank", [False, True], ids=["node", "per_rank"])
def test_scheduler_loop_through_poll_only(provider, per_rank, monkeypatch):
    cl = Cluster(provider, per_rank, layout=BIG, context_slots=N)
    rng = random.Random(23)
    longest = {"t": 0.0, "what": "", "cpu": 0.0}
    by_call: dict = {}
    loop_thread = threading.get_ident()
    in_send: list = []                            # seconds the loop's thread spent in Engine.send
    waited: list = []                             # the timeouts of its sends that were not one try
    real_send = kvxfer.Engine.send

    def timed_send(self, peer, data, timeout=30.0):    # the real send; timed when the loop's thread calls it
        if threading.get_ident() != loop_thread:
            return real_send(self, peer, data, timeout)
        if timeout != 0:
            waited.append(timeout)
        t0 = time.perf_counter()
        try:
            return real_send(self, peer, data, timeout)
        finally:
            in_send.append(time.perf_counter() - t0)

    monkeypatch.setattr(kvxfer.Engine, "send", timed_send)

    def call(what, fn, *a, **kw):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*a, **kw)
        dt = time.perf_counter() - t0
        by_call.setdefault(what, []).append(dt)
        if dt > longest["t"]:                     # its CPU time: the rest it waited (a lock, the GIL, a CPU)
            longest.update(t=dt, what=what, cpu=time.thread_time() - c0)
        return out

    try:
        d = cl.d
        call("poll", d.poll)
        for p in cl.pre:
            call("poll", p.poll)
        free = list(range(BIG.num_pages))
        rng.shuffle(free)
        recvs, meta = {}, {}
        for i in range(N):
            rid = f"s{i}"
            n, first, src, mode, give_up = _plan_of(rid)
            k = -(-n // 4) - first // 4
            dst = np.array([free.pop() for _ in range(k)])
            recvs[rid] = call("receive", d.receive, cl.peer, rid, dst, n, first_token=first, meta=rid.encode())
            meta[rid] = (n, first, src, mode, dst, give_up)
        final, fenced = {}, set()
        chunked: list = []                        # (send, src, next end)
        sends_final = 0
        sends_made = 0
        aborted = set()
        steps = 0

        def give_up_on_some():                    # the engine gives up on some (preemption)
            for rid, r in recvs.items():
                when = meta[rid][5]
                if when is not None and when <= steps and not r.done and rid not in aborted:
                    aborted.add(rid)
                    call("abort", r.abort, 0)

        give_up_on_some()                         # before P's engine saw them: these end aborted
        before_any = set(aborted)
        deadline = time.monotonic() + 120
        while len(fenced) < N or sends_final < sends_made or chunked:
            assert time.monotonic() < deadline, (len(fenced), sends_final, sends_made, len(chunked))
            steps += 1
            for pi, p in enumerate(cl.pre):
                for q in call("requests", p.requests, 0):
                    n, first, src, mode = meta[q.request_id][:4]
                    assert q.meta == q.request_id.encode() and q.first_token == first and q.num_tokens == n
                    if mode == "reject" and pi == 0:
                        call("reject", q.reject, "evicted")
                    elif mode == "chunks":
                        sends_made += 1
                        chunked.append([call("send", p.send, q, chunked=True), src, 0])
                    else:
                        sends_made += 1
                        call("send", p.send, q, src, context=q.request_id.encode())
            for c in list(chunked):
                s, src, done_to = c
                n = s.request.num_tokens
                end = min(n, done_to + rng.randint(1, 6))
                call("add", s.add, src[:-(-end // 4)], end)
                c[2] = end
                if end == n or s.stopped:
                    if not s.stopped:
                        call("finish", s.finish, s.request.request_id.encode())
                    chunked.remove(c)
            give_up_on_some()
            for r in call("poll", d.poll):
                final[r.request_id] = r.state
                if r.fenced:
                    fenced.add(r.request_id)
            for p in cl.pre:
                sends_final += len(call("poll", p.poll))
        outcomes = {"done": 0, "failed": 0, "aborted": 0}
        for rid, r in recvs.items():
            n, first, src, mode, dst, _ = meta[rid]
            outcomes[r.state] += 1
            assert r.fenced
            if r.state == "done":
                assert mode != "reject"
                cl.check(dst, src, num_tokens=n, first_token=first)
                assert bytes(r.context) == rid.encode()
            elif r.state == "failed":
                assert isinstance(r.error, RejectedError) and mode == "reject", (rid, r.error)
            else:
                assert rid in aborted
        assert before_any and all(recvs[rid].state == "aborted" for rid in before_any), before_any
        assert outcomes["done"] > N // 3 and outcomes["failed"] > 0 and outcomes["aborted"] > 0, outcomes
        assert not d._busy_pages.any()
        print(f"\nscheduler loop [{provider}, {'per-rank' if per_rank else 'node'}]: {N} requests, {steps} steps, "
              f"outcomes {outcomes} (gave up on {len(aborted)}, {len(before_any)} before the loop), longest call {longest['t'] * 1e3:.2f} ms ({longest['what']}, "
              f"{longest['cpu'] * 1e3:.2f} ms of it on a CPU); by call, "
              "longest / p99 (ms): "
              + ", ".join(f"{k} {max(v) * 1e3:.2f} / {np.percentile(v, 99) * 1e3:.2f}" for k, v in sorted(by_call.items()))
              + f"; Engine.send on the loop's thread: {len(in_send)} calls, {sum(in_send) * 1e3:.1f} ms in all, "
              f"longest {max(in_send, default=0) * 1e3:.2f} ms")
        assert longest["t"] < 1.0, longest            # generous: a figure, not a speed goal
        assert not waited, f"the loop's thread waited for the engine in {len(waited)} send(s): {waited[:5]}"
    finally:
        cl.close()
