"""The benchmark target: it answers one initiator's cases, checks every byte that lands and reports back."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Optional

import numpy as np

import kvxfer
from kvxfer.cli._bw_read import serve_read
from kvxfer.cli._cases import Checker, parse_case
from kvxfer.cli._channel import ADDR_PREFIX, Channel, RemoteFailure, wait_counter
from kvxfer.cli._machine import machine_info
from kvxfer.errors import PeerError, TimeoutError
from kvxfer.wire import count_writes, split_write

__all__ = ["serve", "target_main"]


def serve(eng: "kvxfer.Engine", *, parent_pid: Optional[int] = None, idle_timeout: float = 60.0,
          first_timeout: Optional[float] = None) -> int:
    """Answer one initiator's requests until it says ``bye``. Returns an exit status."""

    def alive() -> Optional[str]:
        if parent_pid is not None and os.getppid() != parent_pid:
            return "the initiator process exited"
        return None

    ch = Channel(eng, alive)
    try:
        hello = ch.recv("hello", first_timeout)
    except (TimeoutError, PeerError) as exc:
        print(f"kvxfer-bench target: no initiator: {exc}", file=sys.stderr)
        return 3
    ch.peer = eng.connect(bytes.fromhex(hello["addr"]))
    ch.send("hello", info=eng.info, machine=machine_info(), pid=os.getpid())
    try:
        while True:
            req = ch.recv(("bw", "bw_read", "lat", "bye"), idle_timeout)
            if req["t"] == "bye":
                return 0
            if req["t"] == "bw":
                _serve_bw(eng, ch, req, alive)
            elif req["t"] == "bw_read":     # --op read (kvxfer/cli/_bw_read.py)
                serve_read(eng, ch, req)
            else:
                _serve_lat(eng, ch, req, alive)
    except (TimeoutError, PeerError, RemoteFailure) as exc:
        print(f"kvxfer-bench target: giving up: {exc}", file=sys.stderr)
        return 3
    except BaseException as exc:
        trace = traceback.format_exc()
        print(trace, file=sys.stderr)
        try:
            ch.send("error", error=str(exc), trace=trace[-8000:])
        except Exception:
            pass
        return 1


def _serve_bw(eng, ch: Channel, req: dict, alive) -> None:
    case = parse_case(req["case"])
    seed, base, timeout = int(req["seed"]), int(req["imm_base"]), float(req["timeout"])
    iov, max_write, pack_min = int(req["iov"]), int(req["max_write"]), int(req.get("pack_min", 0))
    rails = int(req.get("rails", 1))
    # "hot": poll while a case's writes are due, as the NIXL target polls its notifications
    hot = req.get("target_wait", "block") == "hot"
    with Checker(case, seed, req.get("memory", "anon")) as chk, eng.register(chk.buf) as mr:
        ch.send("desc", desc=mr.descriptor().hex())
        # the initiator's message rule, into this region: no rule 3 where its descriptor
        # carries a host share (the initiator writes directly or, failing that, over RMA)
        if mr.host_share is not None:
            pack_min = 0
        total = int(req["warmup"])
        i = 0
        measuring = False
        bad_iters = 0
        while True:
            if i == total:
                if measuring:
                    break
                total += int(ch.recv("measure", timeout)["n"])
                measuring = True
                continue
            perm = chk.mapping(i)
            if perm is None:      # Engine.write: one range per rail of the initiator
                so, do, ln = split_write(0, 0, case.nbytes, rails)
            else:
                so = np.arange(case.pages, dtype=np.uint64) * np.uint64(case.page_bytes)
                do = perm.astype(np.uint64) * np.uint64(case.page_bytes)
                ln = np.full(case.pages, case.page_bytes, np.uint64)
            n = count_writes(so, do, ln, iov, max_write, pack_min, rails=rails)
            c = eng.expect(base + i, n)
            if hot:
                eng.hold_awake(True)
            try:
                wait_counter(c, timeout, alive)
            finally:
                if hot:
                    eng.hold_awake(False)
            ch.send("landed", i=i, clock=time.perf_counter())
            bad, guard = chk.check(i)
            bad_iters += bool(bad or not guard)
            ch.send("ready", i=i, bad=bad, guard=guard, writes=n)
            i += 1
        ch.send("done", bad_iters=bad_iters)


def _serve_lat(eng, ch: Channel, req: dict, alive) -> None:
    size, base, total, timeout = int(req["size"]), int(req["imm_base"]), int(req["total"]), float(req["timeout"])
    buf = np.zeros(max(size, 8), dtype=np.uint8)
    word = buf[:8].view(np.uint64)
    with eng.register(buf) as mr:
        peer_rr = eng.remote(bytes.fromhex(req["desc"]))
        ch.send("desc", desc=mr.descriptor().hex())
        bad = 0
        mask = (1 << 8 * min(size, 8)) - 1     # the bytes of the word a write of `size` carries
        for i in range(total):
            wait_counter(eng.expect(base + i, 1), timeout, alive)
            bad += int(word[0]) & mask != i & mask
            # echo what landed straight back: the initiator's clock stops when it arrives
            eng.write(mr, 0, ch.peer, peer_rr, 0, size, imm=base + i)
        ch.send("done", bad=bad)


def target_main(provider: str, node: Optional[str], *, progress: str, parent_pid: Optional[int],
                idle_timeout: float, deadline: Optional[float], listen: bool = False, rails: int = 1,
                listen_timeout: Optional[float] = None) -> int:
    """Entry of ``kvxfer-bench _target`` (spawned) and ``--listen`` (by hand)."""
    if deadline:
        signal.alarm(max(1, int(deadline)))  # the last resort: SIGALRM ends the process

    def _stop(signum, frame):   # asked to stop (the initiator failed or was interrupted): close the engine
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    with kvxfer.Engine(provider, node=node, progress=progress, rails=rails) as eng:
        addr = eng.address.hex()
        if listen:
            print(f"kvxfer-bench: target on {eng.provider} is listening; on the other host run\n"
                  f"  kvxfer-bench {listen} --connect {addr}", file=sys.stderr, flush=True)
        print(ADDR_PREFIX + addr, flush=True)
        return serve(eng, parent_pid=parent_pid, idle_timeout=idle_timeout,
                     first_timeout=listen_timeout if listen else idle_timeout)
