"""What every ``kvxfer-bench bw --vs PEER`` shares: the peer's target process and its JSON-line
channel (the target's stdin and its original stdout; whatever the peer library prints goes to
stderr), and the bookkeeping of one timed, checked iteration, so each peer (``_nixl``,
``_mooncake``) only says how it posts a write and how its target learns that it landed."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Callable, Optional

from kvxfer.cli._cases import Case, pattern
from kvxfer.cli._machine import pin_from_env
from kvxfer.cli._memmove import iterations as _iterations
from kvxfer.cli._results import CaseResult

__all__ = ["TargetChannel", "PeerProcess", "VsPeer", "record_iteration"]


class TargetChannel:
    """The target side: answers on the process's original stdout, requests from stdin. Made
    first thing in a peer's target process, it also pins the process where ``kvxfer-bench
    --pin`` asked (before the peer library starts any thread)."""

    def __init__(self) -> None:
        pin_from_env()
        self._out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)            # whatever the library prints goes to stderr, not into the channel

    def say(self, **msg) -> None:
        self._out.write(json.dumps(msg) + "\n")
        self._out.flush()

    def requests(self):
        for line in sys.stdin:
            yield json.loads(line)

    def serve_until(self, kind: str, poll: Callable[[], object]) -> None:
        """Call ``poll`` (the peer library's progress), yielding the CPU between calls, until
        the request ``kind`` arrives. Only when the initiator sends nothing else meanwhile (it
        waits for this target's answer): stdin is then empty but for that one line."""
        while True:
            poll()
            if select.select([sys.stdin], [], [], 0)[0]:
                req = json.loads(sys.stdin.readline() or "null")
                if not req or req["t"] != kind:
                    raise RuntimeError(f"expected {kind!r} from the initiator, got {req!r}")
                return
            os.sched_yield()


class PeerProcess:
    """The initiator side: the target process ``python -m <module>`` and its channel."""

    def __init__(self, module: str, name: str, env: Optional[dict] = None) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def send(self, **msg) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self, kind: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} target exited (status {self.proc.poll()}) before {kind!r}")
        msg = json.loads(line)
        if msg["t"] == "error":
            raise RuntimeError(f"{self.name} target: {msg['error']}")
        if msg["t"] != kind:
            raise RuntimeError(f"{self.name} target sent {msg['t']!r}, expected {kind!r}")
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(t="bye")
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def record_iteration(res: Optional[CaseResult], i: int, first: int, n: int, t0: float, posted: float,
                     done: float, acked: float, landed: float, msg: dict,
                     progress: Callable[[int, int], None]) -> None:
    """One iteration's times (from the write call ``t0``) and its target's check into ``res``;
    iterations before ``first`` (warm-up) are checked by the target but not recorded."""
    if res is None:
        return
    if i >= first:
        res.landed.append(landed - t0)
        res.acked.append(acked - t0)
        res.local.append(done - t0)
        res.post.append(posted - t0)
        progress(i - first + 1, n)
    if msg["bad"] or not msg["guard"]:
        res.bad_iterations += 1
        if len(res.problems) < 5:
            res.problems.append(f"iteration {i}: {msg['bad']} pages differ" if msg["bad"]
                                else f"iteration {i}: guard bytes overwritten")


class VsPeer:
    """The initiator side of a peer: its target process ``p`` and the case loop. A peer says
    how it registers the source (``_register`` / ``_unregister``) and runs ``n`` iterations
    (``_run``); ``clock`` names what its ``p50`` is measured to."""

    clock = "target clock"
    p: PeerProcess

    def close(self) -> None:
        self.p.close()

    def bw(self, case: Case, seed: int, *, warmup: int, iters: Optional[int], budget: float, min_iters: int,
           max_iters: int, progress: Callable[[int, int], None], memory: str = "anon") -> CaseResult:
        """One case through the peer, measured and checked like ``Initiator.bw``; the target's
        buffer is ``memory`` (``_cases.TARGET_MEMORY``), as kvxfer's is."""
        res = CaseResult(case, warmup=warmup, clock=self.clock)
        src = pattern(seed, case.nbytes)
        reg = self._register(src)
        # pass 1 measures one iteration's wall time to size the run, as Initiator.bw does
        first = min(warmup, 1) if iters is None else 0
        try:
            wall = self._run(case, seed, src, warmup + first, 0, None, progress, memory)
            n = iters if iters is not None else _iterations(budget, wall, min_iters, max_iters)
            self._run(case, seed, src, n, warmup + first, res, progress, memory)
            res.iterations = n
            res.num_writes = case.pages
        finally:
            self._unregister(reg, src)
        return res

    def _register(self, src):
        raise NotImplementedError

    def _unregister(self, reg, src) -> None:
        raise NotImplementedError

    def _run(self, case: Case, seed: int, src, n: int, first: int, res: Optional[CaseResult],
             progress: Callable[[int, int], None], memory: str) -> float:
        """n iterations numbered from `first` against a fresh target buffer; last wall time."""
        raise NotImplementedError
