"""``kvxfer-bench bw --vs mooncake``: the same cases through Mooncake's transfer engine, in the
same run.

Mooncake is optional (``pip install mooncake-transfer-engine-non-cuda`` on a machine without a
GPU); nothing here imports it until a comparison is asked for, and ``make test`` never needs it.
It stands in for ``tcp;ofi_rxm`` only, with its TCP transport on 127.0.0.1 and its
peer-to-peer handshake (no metadata server); its other transports need RDMA devices or GPUs,
so the shm rows are skipped with that reason.

Same cases, same target buffer (``--target-memory``), same checks. The initiator registers the
source pattern; each iteration writes the case's pages to that iteration's scattered
destination pages with ``batch_transfer_sync_write`` (in batches of at most ``MAX_BATCH``
pages: a batch of 4096 fails with -1 in 0.3.13, and asynchronous batches failed here too), or
one ``transfer_sync_write`` for a single write. Mooncake's TCP transport completes a write once
its bytes are written to the socket (its server places them with no answer), and its target
is told nothing, so there is no landing to time: ``p50`` and ``sender p50`` are both that
completion, an optimistic figure for Mooncake (bytes may still be in the socket buffers). The
target then verifies every page and the guard, again until they are all there (at most
``timeout``), re-poisons, and answers; ``acked`` is the write call → that answer.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from kvxfer.cli._cases import Case, Checker, dst_pages, parse_case
from kvxfer.cli._results import CaseResult
from kvxfer.cli._vs import PeerProcess, TargetChannel, VsPeer, record_iteration

__all__ = ["available", "supports", "MooncakePeer", "MAX_BATCH"]

MAX_BATCH = 1024
HOST = "127.0.0.1"


def available() -> Optional[str]:
    """None when Mooncake's transfer engine imports, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def supports(provider: str) -> Optional[str]:
    """None when Mooncake has a transport standing in for ``provider``, else why not."""
    if provider.startswith("tcp"):
        return None
    return "Mooncake has no shared-memory transport without RDMA devices or GPUs; it stands in for tcp only"


def _engine():
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    rc = eng.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return eng


def _register(eng, buf: np.ndarray) -> None:
    rc = eng.register_memory(int(buf.ctypes.data), int(buf.nbytes))
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")


def target_main() -> int:
    """The Mooncake target process: ``python -m kvxfer.cli._mooncake``; requests on stdin."""
    ch = TargetChannel()      # first: it pins the process where kvxfer-bench --pin asked
    eng = _engine()
    ch.say(t="hello", session=f"{HOST}:{eng.get_rpc_port()}")
    for req in ch.requests():
        if req["t"] == "bye":
            return 0
        case, seed, total = parse_case(req["case"]), int(req["seed"]), int(req["total"])
        timeout = float(req["timeout"])
        chk = Checker(case, seed, req.get("memory", "anon"))
        _register(eng, chk.buf)
        ch.say(t="desc", addr=int(chk.buf.ctypes.data))
        bad_iters = 0
        for i in range(total):
            ch_req = next(ch.requests())
            if ch_req["t"] != "check" or ch_req["i"] != i:
                ch.say(t="error", error=f"expected check {i}, got {ch_req}")
                return 1
            deadline = time.monotonic() + timeout
            bad, guard = chk.verify(i)
            while bad and time.monotonic() < deadline:     # bytes still in the socket
                os.sched_yield()
                bad, guard = chk.verify(i)
            clock = time.perf_counter()
            chk.poison()
            bad_iters += bool(bad or not guard)
            ch.say(t="landed", i=i, clock=clock, bad=bad, guard=guard)
        eng.unregister_memory(int(chk.buf.ctypes.data))
        chk.close()
        ch.say(t="done", bad_iters=bad_iters)
    return 0


class MooncakePeer(VsPeer):
    """The initiator's side: a Mooncake engine in this process and a Mooncake target process."""

    clock = "sender completion"

    def __init__(self, provider: str, *, timeout: float) -> None:
        why = supports(provider)
        if why:
            raise RuntimeError(why)
        self.provider = provider
        self.timeout = timeout
        self.p = PeerProcess("kvxfer.cli._mooncake", "Mooncake")
        try:
            self.session = self.p.recv("hello")["session"]
            self.eng = _engine()
        except BaseException:
            self.close()
            raise

    def _register(self, src: np.ndarray) -> None:
        _register(self.eng, src)

    def _unregister(self, reg, src: np.ndarray) -> None:
        self.eng.unregister_memory(int(src.ctypes.data))

    def _run(self, case: Case, seed: int, src: np.ndarray, n: int, first: int, res: Optional[CaseResult],
             progress: Callable[[int, int], None], memory: str) -> float:
        pb, pages, base = case.page_bytes, case.pages, int(src.ctypes.data)
        self.p.send(t="case", case=case.spec, seed=seed, total=first + n, timeout=self.timeout, memory=memory)
        dst = int(self.p.recv("desc")["addr"])
        srcs = [base + k * pb for k in range(pages)]
        wall = 0.0
        for i in range(first + n):
            t_start = time.perf_counter()
            t0 = time.perf_counter()
            if case.kind == "pages":
                dsts = (dst_pages(seed, i, pages) * pb + dst).tolist()
                lens = [pb] * pages
                t1 = time.perf_counter()
                for j in range(0, pages, MAX_BATCH):
                    rc = self.eng.batch_transfer_sync_write(self.session, srcs[j:j + MAX_BATCH],
                                                            dsts[j:j + MAX_BATCH], lens[j:j + MAX_BATCH])
                    if rc != 0:
                        raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc} (iteration {i})")
            else:
                t1 = t0
                rc = self.eng.transfer_sync_write(self.session, base, dst, case.nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake transfer_sync_write returned {rc} (iteration {i})")
            t2 = time.perf_counter()
            self.p.send(t="check", i=i)
            msg = self.p.recv("landed")
            t3 = time.perf_counter()
            record_iteration(res, i, first, n, t0, t1, t2, t3, t2, msg, progress)
            wall = time.perf_counter() - t_start
        done = self.p.recv("done")
        if res is not None and done["bad_iters"] != res.bad_iterations:
            res.problems.append(f"Mooncake target counted {done['bad_iters']} bad iterations")
        return wall


if __name__ == "__main__":
    raise SystemExit(target_main())
