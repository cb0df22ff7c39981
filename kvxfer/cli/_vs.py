"""What every ``kvxfer-bench bw --vs PEER`` shares: the peer's target process and its JSON-line
channel (the target's stdin and its original stdout; whatever the peer library prints goes to
stderr), and the bookkeeping of one timed, checked iteration, so each peer (``_nixl``,
``_mooncake``) only says how it posts a write and how its target learns that it landed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Optional

from kvxfer.cli._results import CaseResult

__all__ = ["TargetChannel", "PeerProcess", "record_iteration"]


class TargetChannel:
    """The target side: answers on the process's original stdout, requests from stdin."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)            # whatever the library prints goes to stderr, not into the channel

    def say(self, **msg) -> None:
        self._out.write(json.dumps(msg) + "\n")
        self._out.flush()

    def requests(self):
        for line in sys.stdin:
            yield json.loads(line)


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
