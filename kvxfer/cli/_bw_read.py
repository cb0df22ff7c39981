"""``kvxfer-bench bw --op read``: the same cases as writes, pulled by the initiator with ``Engine.read_pages``.

The target registers the case's source bytes readable (``Engine.register(..., readable=True)``)
and hands out its reads-only descriptor; the initiator reads them into a poisoned buffer with a
guard behind it (``_cases.Checker``, the target's check of a write, here at the reader), page j
of the source into page ``Checker.mapping(i)[j]`` on iteration i, exactly where a write of
the same case lands, so one case moves the same bytes over the same scatter both ways. A
read completes on the reader's own CQ: ``landed`` = ``acked`` = ``local`` = that completion
(timing "local completion"); the target takes no part until the case ends.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from kvxfer.cli._cases import Case, Checker, parse_case, pattern
from kvxfer.cli._memmove import iterations as _iterations
from kvxfer.cli._results import CaseResult

__all__ = ["bw_read", "record_read", "run_reads", "serve_read", "as_read_row"]


def bw_read(ini: Any, case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float, min_iters: int,
            max_iters: int, progress: Callable[[int, int], None]) -> CaseResult:
    """One case read from the target (``Initiator``'s engine and channel), timed and checked."""
    eng, ch, timeout = ini.eng, ini.ch, ini.timeout
    res = CaseResult(case, warmup=warmup, clock="local completion")
    ch.send("bw_read", case=case.spec, seed=seed, timeout=timeout)
    rr = eng.remote(bytes.fromhex(ch.recv("desc", timeout)["desc"]))
    src_pages = np.arange(case.pages, dtype=np.int64)
    n = 0
    try:
        with Checker(case, seed) as chk, eng.register(chk.buf, remote=False) as mr:

            def one(i: int, keep: bool) -> float:
                t_start = time.perf_counter()
                perm = chk.mapping(i)
                t0 = time.perf_counter()
                if perm is not None:
                    t = eng.read_pages(mr, perm, ch.peer, rr, src_pages, case.page_bytes)
                else:
                    t = eng.read(mr, 0, ch.peer, rr, 0, case.nbytes)
                t1 = time.perf_counter()
                t.wait(timeout)
                record_read(res, chk, i, keep, t0, t1, time.perf_counter())
                res.num_writes = t.num_reads
                return time.perf_counter() - t_start

            n = run_reads(one, warmup=warmup, iters=iters, budget=budget, min_iters=min_iters, max_iters=max_iters,
                          progress=progress)
    finally:
        ch.send("read_done")
        ch.recv("done", timeout)
    res.iterations = n
    return res


def record_read(res: CaseResult, chk: Checker, i: int, keep: bool, t0: float, posted: float, done: float) -> None:
    """Iteration ``i``'s read: its pages and guard checked (then poisoned again) into ``res``,
    and, for a timed iteration (``keep``), its times from the read call ``t0``: a read lands,
    is acknowledged and completes locally at once (``done``); ``posted`` ends its posting."""
    bad, guard = chk.check(i)
    if bad or not guard:
        res.bad_iterations += 1
        if len(res.problems) < 5:
            res.problems.append(f"iteration {i}: " + (f"{bad} pages differ" if bad else "guard bytes overwritten"))
    if keep:
        for times in (res.landed, res.acked, res.local):
            times.append(done - t0)
        res.post.append(posted - t0)


def run_reads(one: Callable[[int, bool], float], *, warmup: int, iters: Optional[int], budget: float,
              min_iters: int, max_iters: int, progress: Callable[[int, int], None]) -> int:
    """A read case's iterations: ``warmup`` untimed calls of ``one(i, keep)`` (it returns its
    wall time), then ``iters`` timed ones, or as many as ``budget`` seconds allow; their count."""
    wall = 0.0
    for i in range(warmup):
        wall = one(i, False)
    n = iters if iters is not None else _iterations(budget, wall, min_iters, max_iters)
    for k in range(n):
        one(warmup + k, True)
        progress(k + 1, n)
    return n


def serve_read(eng: Any, ch: Any, req: dict) -> None:
    """The target's side: the case's source bytes, readable, until the initiator is done."""
    case = parse_case(req["case"])
    src = pattern(int(req["seed"]), case.nbytes)
    with eng.register(src, readable=True) as mr:
        ch.send("desc", desc=mr.descriptor(reads_only=True).hex())
        ch.recv("read_done", None)
    ch.send("done", bad_iters=0)


def as_read_row(summary: dict) -> dict:
    """A read case's summary as its row: the label says ``read``, ``op`` names it."""
    out = dict(summary)
    out["op"] = "read"
    label = summary["label"]
    out["label"] = "read " + (label[len("write "):] if label.startswith("write ") else label)
    return out
