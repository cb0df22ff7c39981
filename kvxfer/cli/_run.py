"""One provider's session of ``kvxfer-bench``: this engine, the target process (or a remote one), the results.

``_Run`` is a context manager: it opens the engine, spawns the target (``TargetProcess``) on
127.0.0.1 or connects to ``--connect``'s address, and on exit says goodbye, stops the target
(killing it after an error) and closes the engine. ``default_node`` says what to bind here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from kvxfer.cli._cases import DEFAULT_CASES

__all__: list[str] = []

LOOPBACK = "127.0.0.1"


class _Run:
    """One provider's session: this engine, the target (spawned or remote), the results."""

    def __init__(self, args: argparse.Namespace, provider: Optional[str]) -> None:
        self.args = args
        self.provider = provider
        self.record: dict[str, Any] = {"provider": provider, "results": [], "error": None}
        self.eng = None
        self.target = None
        self.target_death: Optional[str] = None
        self.ini = None

    def __enter__(self) -> "_Run":
        import kvxfer
        from kvxfer.cli._initiator import Initiator
        from kvxfer.cli._target_process import TargetProcess

        a = self.args
        try:
            if a.connect:
                addr = bytes.fromhex(a.connect.strip())
                node = a.node
                alive = None
                self.record["mode"] = "connect"
            else:
                node = a.node or default_node(self.provider)
                self.record["mode"] = "local"
            self.eng = kvxfer.Engine(self.provider, node=node, progress=a.progress, rails=getattr(a, "rails", 1),
                                     iov=getattr(a, "iov", None), max_write=getattr(a, "max_write", None),
                                     delivery_complete=False if getattr(a, "no_delivery_complete", False) else None)
            self.provider = self.eng.provider
            self.record["provider"] = self.provider
            self.record["info"] = self.eng.info
            if not a.connect:
                budget = _target_budget(a)
                # it watches this process (its parent) for the whole session, so the wait
                # for the next request may last as long as any case here can (a memmove, a
                # --vs peer's case) without it giving up
                self.target = TargetProcess(self.provider, node, progress=a.progress,
                                            idle_timeout=budget, deadline=budget,
                                            rails=getattr(a, "rails", 1))
                addr = self.target.address
                alive = self.target.dead
            self.ini = Initiator(self.eng, addr, timeout=a.timeout, alive=alive)
            self.record["target"] = {"info": self.ini.target_info, "machine": self.ini.target_machine}
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, et, ev, tb) -> None:
        if self.ini is not None and et is None:
            self.ini.bye()
        if self.target is not None:
            if et is not None:      # did it go by itself? (asked below, it exits 143)
                self.target_death = self.target.dead()
            rc = self.target.stop(kill=et is not None, timeout=10)
            if et is None and rc not in (0, None):
                self.record["error"] = f"target exited with status {rc}"
            self.target.close()
        if self.eng is not None:
            self.eng.close()


def _target_budget(a: argparse.Namespace) -> float:
    """Seconds a spawned target may live (its SIGALRM, the last resort when all else hung):
    what the options ask for, generously (each case of each library and round, and lat's gaps)."""
    n = len(getattr(a, "case", None) or DEFAULT_CASES) * getattr(a, "rounds", 1) * (1 + len(getattr(a, "vs", None) or []))
    t = 900.0 + n * (120.0 + 2.0 * float(getattr(a, "seconds", 0) or 0))
    gap_ms = float(getattr(a, "gap", 0) or 0)
    if gap_ms:
        t += 2.0 * ((getattr(a, "iters", 0) or 0) + (getattr(a, "warmup", 0) or 0)) * gap_ms / 1000.0
    return t


def default_node(provider: Optional[str]) -> Optional[str]:
    """What to bind when both processes run here. tcp needs 127.0.0.1 named (without a node
    it binds whichever interface libfabric lists first); for shm the node is the
    shared-memory region's *name* ("<node>:<ep>:<n>"), so two processes both naming
    127.0.0.1 collide (fi_enable: EBUSY) and shm is left to name itself after the pid."""
    return None if provider == "shm" else LOOPBACK
