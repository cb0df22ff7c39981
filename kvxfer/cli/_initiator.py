"""``Initiator``: this process's engine, connected to one benchmark target, writing and timing its cases."""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

import kvxfer
from kvxfer.cli._cases import Case, dst_pages, pattern
from kvxfer.cli._channel import Channel
from kvxfer.cli._machine import machine_info
from kvxfer.cli._memmove import iterations as _iterations, memmove
from kvxfer.cli._results import CaseResult, LatResult
from kvxfer.errors import KvxferError, PeerError, TimeoutError
from kvxfer.wire import Address

__all__ = ["Initiator"]


class Initiator:
    """This process's engine, connected to one target, running cases one after another."""

    def __init__(self, eng: "kvxfer.Engine", target_addr: bytes, *, timeout: float,
                 alive: Optional[Callable[[], Optional[str]]] = None) -> None:
        a = Address.decode(target_addr)
        if a.provider != eng.provider:
            raise PeerError(f"the target runs {a.provider!r}, this engine {eng.provider!r}")
        self.eng = eng
        self.timeout = timeout
        self.ch = Channel(eng, alive)
        self.ch.peer = eng.connect(target_addr)
        self.next_imm = 1
        self.ch.send("hello", addr=eng.address.hex())
        h = self.ch.recv("hello", timeout)
        self.target_info: dict = h["info"]
        self.target_machine: dict = h["machine"]
        mine = machine_info()
        #: Both processes read the same CLOCK_MONOTONIC (one kernel), so the target's
        #: timestamp of its counter completing can end the measurement directly.
        self.shared_clock = bool(mine["boot_id"]) and mine["boot_id"] == self.target_machine.get("boot_id")

    def bye(self) -> None:
        try:
            self.ch.send("bye")
        except KvxferError:
            pass

    # -- bw ------------------------------------------------------------------------------
    def bw(self, case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float,
           min_iters: int, max_iters: int, progress: Callable[[int, int], None], memory: str = "anon", target_wait: str = "block") -> CaseResult:
        """One case, timed and checked; ``memory``: the target's buffer (``_cases.TARGET_MEMORY``);
        ``target_wait``: "hot" keeps the target's progress threads polling while its writes
        are due (``Engine.hold_awake``), "block" lets them sleep in their back-off."""
        if case.kind == "memmove":
            return memmove(case, seed, warmup=warmup, iters=iters, budget=budget, min_iters=min_iters,
                            max_iters=max_iters, progress=progress)
        eng, ch, timeout = self.eng, self.ch, self.timeout
        shared = self.shared_clock
        res = CaseResult(case, warmup=warmup, clock="target clock" if shared else "ack")
        src = pattern(seed, case.nbytes)
        base = self.next_imm
        with eng.register(src) as mr:
            ch.send("bw", case=case.spec, seed=seed, warmup=warmup, imm_base=base, iov=eng.iov,
                    max_write=eng.max_write, pack_min=eng.pack_min, rails=eng.rails, timeout=timeout, memory=memory,
                    target_wait=target_wait)
            rr = eng.remote(bytes.fromhex(ch.recv("desc", timeout)["desc"]))
            res.direct = rr.direct
            src_pages = np.arange(case.pages, dtype=np.int64)

            def one(i: int, keep: bool) -> float:
                t_start = time.perf_counter()
                if case.kind == "pages":
                    perm = dst_pages(seed, i, case.pages)
                    t0 = time.perf_counter()
                    t = eng.write_pages(mr, src_pages, ch.peer, rr, perm, case.page_bytes, imm=base + i)
                else:
                    t0 = time.perf_counter()
                    t = eng.write(mr, 0, ch.peer, rr, 0, case.nbytes, imm=base + i)
                t1 = time.perf_counter()
                t.wait(timeout)
                t2 = time.perf_counter()
                msg = ch.recv("landed", timeout, i)
                t3 = time.perf_counter()
                r = ch.recv("ready", timeout, i)
                if r["writes"] != t.num_writes:
                    res.problems.append(f"iteration {i}: posted {t.num_writes} writes, target expected {r['writes']}")
                if r["bad"] or not r["guard"]:
                    res.bad_iterations += 1
                    if len(res.problems) < 5:
                        what = f"{r['bad']} pages differ" if r["bad"] else "guard bytes overwritten"
                        res.problems.append(f"iteration {i}: {what}")
                if keep:
                    res.landed.append((msg["clock"] if shared else t3) - t0)
                    res.acked.append(t3 - t0)
                    res.local.append(t2 - t0)
                    res.post.append(t1 - t0)
                res.num_writes = t.num_writes
                return time.perf_counter() - t_start

            wall = 0.0
            for i in range(warmup):
                wall = one(i, False)
            n = iters if iters is not None else _iterations(budget, wall, min_iters, max_iters)
            ch.send("measure", n=n)
            for k in range(n):
                one(warmup + k, True)
                progress(k + 1, n)
            done = ch.recv("done", timeout)
            res.iterations = n
            if done["bad_iters"] != res.bad_iterations:
                res.problems.append(f"target counted {done['bad_iters']} bad iterations")
        self.next_imm = base + warmup + n
        return res

    # -- lat -----------------------------------------------------------------------------
    def lat(self, size: int, *, warmup: int, iters: int, progress: Callable[[int, int], None],
            gap: float = 0.0) -> LatResult:
        eng, ch, timeout = self.eng, self.ch, self.timeout
        sbuf = np.zeros(max(size, 8), dtype=np.uint8)
        rbuf = np.zeros(max(size, 8), dtype=np.uint8)
        sword = sbuf[:8].view(np.uint64)
        rword = rbuf[:8].view(np.uint64)
        base, total = self.next_imm, warmup + iters
        rtt = np.empty(iters, dtype=np.float64)
        bad = 0
        step = max(1, iters // 200)
        with eng.register(sbuf) as smr, eng.register(rbuf) as rmr:
            ch.send("lat", size=size, imm_base=base, total=total, timeout=timeout, desc=rmr.descriptor().hex())
            rr = eng.remote(bytes.fromhex(ch.recv("desc", timeout)["desc"]))
            alive = ch._alive
            mask = (1 << 8 * min(size, 8)) - 1     # the bytes of the word a write of `size` carries
            for i in range(total):
                if gap:
                    time.sleep(gap)
                sword[0] = i
                c = eng.expect(base + i, 1)
                t0 = time.perf_counter()
                eng.write(smr, 0, ch.peer, rr, 0, size, imm=base + i)
                try:
                    c.wait(timeout)
                except TimeoutError:
                    why = alive() if alive else None
                    if why:
                        raise PeerError(why) from None
                    raise TimeoutError(f"no echo of write {i} within {timeout} s") from None
                t1 = time.perf_counter()
                bad += int(rword[0]) & mask != i & mask
                if i >= warmup:
                    rtt[i - warmup] = t1 - t0
                    if (i - warmup + 1) % step == 0:
                        progress(i - warmup + 1, iters)
            bad += int(ch.recv("done", timeout)["bad"])
        self.next_imm = base + total
        return LatResult(size, iters, warmup, rtt.tolist(), bad)


