"""``kvxfer-bench bw --vs nixl``: the same cases through NIXL (UCX backend), in the same run.

NIXL is optional (``pip install nixl``; on a machine without a GPU it still installs the CUDA
and torch wheels but runs on host memory). Nothing here imports it until a comparison is
asked for, and ``make test`` never needs it.

Same cases, same checks, same timing as kvxfer's rows (docs/benchmarks.md, "Method"):
a target process registers a ``Checker`` buffer (the same ``--target-memory`` kind as
kvxfer's target: a memfd by default) with its own NIXL agent; the initiator
registers the same source pattern, prepares one descriptor list per side once per case
(``prep_xfer_dlist``: every source page, every destination page) and, per iteration, makes
the request for that iteration's scattered destination pages (``make_prepped_xfer``, counted
as posting, like kvxfer's ``write_pages``) and posts it with the iteration as notification.
Neither side runs NIXL's progress thread (it spins without pause, and on a 2-core machine
three spinners starve each other): the initiator progresses while it polls its request, the
target while it polls notifications, yielding the CPU between empty polls as kvxfer's
waiters do. A single write's request is made once per case and posted again each
iteration (NIXL's fastest path for repeated writes; the notification changes per post). When the notification arrives the
target stamps its clock (both processes share CLOCK_MONOTONIC) and sends the stamp
(``landed``) at once, then checks every page and the guard, re-poisons, and sends the result
(``ready``), as kvxfer's target does. ``p50`` is write call → target's stamp; ``acked p50``
is write call → ``landed`` read by the initiator (the check is not in it); ``sender p50`` is
write call → NIXL reports the request DONE at the initiator.

``--op read`` (``NixlPeer.bw_read``): the target registers the case's source pattern and the
initiator pulls it with NIXL's READ into a poisoned, guarded buffer, page j into page
``Checker.mapping(i)[j]`` as kvxfer's ``--op read`` does (``_bw_read``), one prepared request
per iteration; a READ completes at the reader, so its ``p50`` is the read call → DONE.

The provider maps to UCX transports as NIXL's fastest users run them: ``shm`` →
``UCX_TLS=sm,self`` (shared memory and CMA only) with the UCX backend created with
``ucx_error_handling_mode=none`` (NIXL's UCX endpoints ask for peer failure handling by default,
which UCX's shared-memory transports lack: with it ``createBackend`` fails; until issue 28 "shm"
kept tcp beside sm, and NIXL's shm rows were partly tcp), ``tcp;ofi_rxm`` → ``UCX_TLS=tcp,self``
on the loopback device; ``KVXFER_NIXL_UCX_TLS`` overrides the choice. The control channel is the target's
stdin/stdout (JSON lines), not kvxfer.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

import numpy as np

from kvxfer.cli._bw_read import record_read, run_reads
from kvxfer.cli._cases import Case, Checker, dst_pages, parse_case, pattern
from kvxfer.cli._results import CaseResult
from kvxfer.cli._vs import PeerProcess, TargetChannel, VsPeer, record_iteration

__all__ = ["available", "ucx_env", "NixlPeer"]

#: kvxfer provider → UCX transports for NIXL's UCX backend
UCX_TLS = {"shm": "sm,self", "tcp;ofi_rxm": "tcp,self", "tcp": "tcp,self"}

#: UCX transports within one host: with only these NIXL's UCX backend is created with
#: ``ucx_error_handling_mode=none`` (they have no peer failure handling; with the default
#: mode ``createBackend`` fails with NIXL_ERR_BACKEND)
_LOCAL_TLS = frozenset({"sm", "shm", "self", "posix", "sysv", "xpmem", "cma", "knem"})


def available() -> Optional[str]:
    """None when ``import nixl`` works, else why not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA probe failing inside the wheel
        return f"{type(exc).__name__}: {exc}"
    return None


def ucx_env(provider: str) -> dict:
    """The environment for a NIXL agent standing in for ``provider``."""
    tls = os.environ.get("KVXFER_NIXL_UCX_TLS") or UCX_TLS.get(provider, "tcp,self")
    env = {"UCX_TLS": tls, "NIXL_LOG_LEVEL": "WARN"}
    if "tcp" in env["UCX_TLS"]:
        env["UCX_NET_DEVICES"] = "lo"
    return env


def _agent(name: str, progress_thread: bool):
    from nixl._api import nixl_agent, nixl_agent_config

    tls = {t.strip() for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()}
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"} if tls and tls <= _LOCAL_TLS else {})
    return agent


def target_main() -> int:
    """The NIXL target process: ``python -m kvxfer.cli._nixl``; requests on stdin."""
    ch = TargetChannel()      # first: it pins the process where kvxfer-bench --pin asked
    agent = _agent("kvxfer-bench-nixl-target", False)
    ch.say(t="hello", meta=agent.get_agent_metadata().hex())
    for req in ch.requests():
        if req["t"] == "bye":
            return 0
        if req["t"] == "peer":
            agent.add_remote_agent(bytes.fromhex(req["meta"]))
            ch.say(t="ok")
            continue
        if req["t"] == "read_case":      # --op read: the source bytes, registered, until the reader is done
            case = parse_case(req["case"])
            src = pattern(int(req["seed"]), case.nbytes)
            reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
            ch.say(t="desc", addr=int(src.ctypes.data), meta=agent.get_agent_metadata().hex())
            # progress while the initiator reads: UCX's tcp transport serves a get with active
            # messages at the target (a target blocked on its stdin stalls every read); shared
            # memory needs none, and the polls cost it no more than a write target's
            ch.serve_until("read_done", agent.get_new_notifs)
            agent.deregister_memory(reg)
            ch.say(t="done", bad_iters=0)
            continue
        # one case: register, publish the buffer, then check each iteration's pages
        case, seed, total = parse_case(req["case"]), int(req["seed"]), int(req["total"])
        chk = Checker(case, seed, req.get("memory", "anon"))      # the same kind as kvxfer's target
        reg = agent.register_memory([(chk.buf.ctypes.data, chk.buf.nbytes, 0, "")], "DRAM")
        # the registration's remote keys travel in the agent's metadata: publish it again
        ch.say(t="desc", addr=int(chk.buf.ctypes.data), meta=agent.get_agent_metadata().hex())
        bad_iters = 0
        for i in range(total):
            want = str(i).encode()
            deadline = time.monotonic() + float(req["timeout"])
            while True:
                notifs = agent.get_new_notifs()
                if any(want in msgs for msgs in notifs.values()):
                    break
                if time.monotonic() > deadline:
                    ch.say(t="error", error=f"no notification for iteration {i}")
                    return 1
                os.sched_yield()     # polls like kvxfer's drive loop; 2 cores are shared
            # the stamp first, as kvxfer's target does: "acked" is the word that it landed, not
            # that and the data check (which follows in "ready")
            ch.say(t="landed", i=i, clock=time.perf_counter())
            bad, guard = chk.check(i)
            bad_iters += bool(bad or not guard)
            ch.say(t="ready", i=i, bad=bad, guard=guard)
        agent.deregister_memory(reg)
        chk.close()
        ch.say(t="done", bad_iters=bad_iters)
    return 0


class NixlPeer(VsPeer):
    """The initiator's side: a NIXL agent in this process and a NIXL target process."""

    def __init__(self, provider: str, *, timeout: float) -> None:
        self.provider = provider
        self.timeout = timeout
        for k, v in ucx_env(provider).items():   # UCX reads its environment when the agent starts
            os.environ[k] = v
        self.p = PeerProcess("kvxfer.cli._nixl", "NIXL", env=dict(os.environ))
        try:
            hello = self.p.recv("hello")
            self.agent = _agent("kvxfer-bench-nixl", False)
            self.remote = self.agent.add_remote_agent(bytes.fromhex(hello["meta"]))
            self.p.send(t="peer", meta=self.agent.get_agent_metadata().hex())
            self.p.recv("ok")
        except BaseException:
            self.close()
            raise

    def _descs(self, case: Case, local_addr: int, remote_addr: int) -> tuple:
        """The case's NIXL descriptors between this process's buffer at ``local_addr`` and the
        target's at ``remote_addr``: (local, remote) prepared lists of every page for a paged
        case, else (ld, rd), one descriptor of the whole range each side; the others None."""
        agent, pb, pages = self.agent, case.page_bytes, case.pages
        if case.kind != "pages":
            return (None, None, agent.get_xfer_descs([(local_addr, case.nbytes, 0)], "DRAM"),
                    agent.get_xfer_descs([(remote_addr, case.nbytes, 0)], "DRAM"))
        so = np.arange(pages, dtype=np.uint64) * np.uint64(pb)
        col = np.zeros(pages, dtype=np.uint64)
        rows = lambda base: np.stack([so + np.uint64(base), np.full(pages, pb, np.uint64), col], axis=1)  # noqa: E731
        return (agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(local_addr), "DRAM"),
                agent.prep_xfer_dlist(self.remote, rows(remote_addr), "DRAM"), None, None)

    def _finish(self, h, st: str) -> str:
        """Progress the request ``h`` (``transfer`` said ``st``) in this thread until it is no
        longer in progress, yielding the CPU between polls; its final state."""
        while st == "PROC":
            st = self.agent.check_xfer_state(h)
            if st == "PROC":
                os.sched_yield()
        return st

    def _register(self, src: np.ndarray):
        return self.agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")

    def _unregister(self, reg, src: np.ndarray) -> None:
        self.agent.deregister_memory(reg)

    def _run(self, case: Case, seed: int, src: np.ndarray, n: int, first: int, res: Optional[CaseResult],
             progress: Callable[[int, int], None], memory: str) -> float:
        agent, pages = self.agent, case.pages
        self.p.send(t="case", case=case.spec, seed=seed, total=first + n, timeout=self.timeout, memory=memory)
        desc = self.p.recv("desc")
        dst = int(desc["addr"])
        agent.add_remote_agent(bytes.fromhex(desc["meta"]))
        # the target numbers iterations from 0: replay the ones before `first` untimed
        local, remote, ld, rd = self._descs(case, int(src.ctypes.data), dst)
        lidx = np.arange(pages, dtype=np.int32)
        wall = 0.0
        h_write = None
        try:
            for i in range(first + n):
                t_start = time.perf_counter()
                notif = str(i).encode()
                if case.kind == "pages":
                    perm = dst_pages(seed, i, pages).astype(np.int32)
                    t0 = time.perf_counter()
                    h = agent.make_prepped_xfer("WRITE", local, lidx, remote, perm, notif)
                else:
                    if h_write is None:
                        h_write = agent.initialize_xfer("WRITE", ld, rd, self.remote, notif)
                    h = h_write
                    t0 = time.perf_counter()
                st = agent.transfer(h, notif)
                t1 = time.perf_counter()
                st = self._finish(h, st)
                t2 = time.perf_counter()
                if st != "DONE":
                    raise RuntimeError(f"NIXL transfer {i} ended {st}")
                msg = self.p.recv("landed")
                t3 = time.perf_counter()
                chk = self.p.recv("ready")         # the target's data check, after the stamp
                if msg["i"] != i or chk["i"] != i:
                    raise RuntimeError(f"NIXL target answered iteration {msg['i']}/{chk['i']}, expected {i}")
                if h is not h_write:
                    h.release()
                record_iteration(res, i, first, n, t0, t1, t2, t3, msg["clock"], chk, progress)
                wall = time.perf_counter() - t_start
        finally:
            for hd in (local, remote, h_write):
                if hd is not None:
                    hd.release()
        done = self.p.recv("done")
        if res is not None and done["bad_iters"] != res.bad_iterations:
            res.problems.append(f"NIXL target counted {done['bad_iters']} bad iterations")
        return wall


    def bw_read(self, case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float, min_iters: int,
                max_iters: int, progress: Callable[[int, int], None]) -> CaseResult:
        """``--op read``: the case pulled with NIXL's READ, as ``_bw_read.bw_read`` pulls it with
        kvxfer: the target registers the source pattern, this process reads page j of it into
        page ``Checker.mapping(i)[j]`` of a poisoned buffer with a guard and checks it. A READ
        completes at the reader (``check_xfer_state`` DONE): landed = acked = local = that."""
        agent, pages = self.agent, case.pages
        res = CaseResult(case, warmup=warmup, clock="local completion")
        self.p.send(t="read_case", case=case.spec, seed=seed)
        desc = self.p.recv("desc")
        src = int(desc["addr"])
        agent.add_remote_agent(bytes.fromhex(desc["meta"]))
        local = remote = h_read = reg = None
        n = 0
        try:
            with Checker(case, seed) as chk:
                buf = chk.buf
                reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
                local, remote, ld, rd = self._descs(case, int(buf.ctypes.data), src)
                ridx = np.arange(pages, dtype=np.int32)

                def one(i: int, keep: bool) -> float:
                    nonlocal h_read
                    t_start = time.perf_counter()
                    perm = chk.mapping(i)
                    if perm is not None:
                        perm = perm.astype(np.int32)
                        t0 = time.perf_counter()
                        h = agent.make_prepped_xfer("READ", local, perm, remote, ridx)
                    else:
                        if h_read is None:
                            h_read = agent.initialize_xfer("READ", ld, rd, self.remote)
                        h = h_read
                        t0 = time.perf_counter()
                    st = agent.transfer(h)
                    t1 = time.perf_counter()
                    st = self._finish(h, st)
                    t2 = time.perf_counter()
                    if st != "DONE":
                        raise RuntimeError(f"NIXL read {i} ended {st}")
                    if h is not h_read:
                        h.release()
                    record_read(res, chk, i, keep, t0, t1, t2)
                    return time.perf_counter() - t_start

                n = run_reads(one, warmup=warmup, iters=iters, budget=budget, min_iters=min_iters,
                              max_iters=max_iters, progress=progress)
        finally:
            for hd in (local, remote, h_read):
                if hd is not None:
                    hd.release()
            if reg is not None:
                agent.deregister_memory(reg)
            self.p.send(t="read_done")
            self.p.recv("done")
        res.iterations = n
        res.num_writes = case.pages
        return res


if __name__ == "__main__":
    sys.exit(target_main())
