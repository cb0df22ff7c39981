"""Transfers and counters: the sender's batch of posted writes, the target's expectations, the dispatcher.

A ``Transfer`` is what a write call posted (one native handle per rail used, each keeping
what the progress thread reads); a ``Counter`` an expectation of ``count`` writes carrying an
imm; ``dispatch`` the one Python thread that runs counters' callbacks, never per write.
"""

from __future__ import annotations

import errno as _errno
import threading
import time
from typing import Any, Callable, Optional

from kvxfer.engine._args import _timeout
from kvxfer.engine.rails import _fabric
from kvxfer.errors import ClosedError, KvxferError, TimeoutError



class Transfer:
    """A batch of posted writes. ``num_writes`` is the number of immediates the target sees."""

    __slots__ = ("_handles", "num_writes", "nbytes", "imm", "__weakref__")

    def __init__(self, handles: list, nbytes: int, imm: Optional[int]) -> None:
        self._handles = handles        # one TransferHandle per rail used; they keep what they read
        self.num_writes: int = handles[0].planned if len(handles) == 1 else sum(h.planned for h in handles)
        self.nbytes = nbytes
        self.imm = imm

    @property
    def done(self) -> bool:
        """True once every posted write has completed at the sender (successfully or not).
        After ``cancel()`` it also means posting has stopped for good: ``posted`` is final."""
        return all(x.done for x in self._handles)

    @property
    def posted(self) -> int:
        """Writes (messages, in the ``num_writes`` sense) handed to the provider so far.

        Final once ``done`` is True (after ``cancel()`` too): then at most this many writes of
        the transfer can arrive at the target (exactly this many unless some failed), so a
        target that has seen this many arrivals of ``imm`` may retire it (``Engine.discard``).
        While posting is under way it may briefly count one write per rail that the provider
        then refuses and kvxfer retries."""
        return sum(x.posted for x in self._handles)

    @property
    def error(self) -> Optional[KvxferError]:
        """The failure, once known; None while pending or on success."""
        err = next((x.errno for x in self._handles if x.errno), 0)
        return _fabric.error_from("fi_writemsg", err) if err else None

    def cancel(self) -> None:
        """Post nothing more of this transfer (for a peer that stopped answering): writes
        already posted still complete or fail; ``wait`` then raises ``PeerError``."""
        for x in self._handles:
            x.cancel()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every write completed at the sender; raise its error, or TimeoutError."""
        timeout = _timeout(timeout)
        handles = self._handles
        if len(handles) == 1:        # one rail: no deadline arithmetic (a small write's wait)
            x = handles[0]
            if not x.wait(timeout):
                raise TimeoutError(f"transfer not complete after {timeout} s ({x.completed}/{self.num_writes} writes done)")
            err = x.errno
            if err:
                raise _fabric.error_from("fi_writemsg", err)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for x in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not x.wait(left):
                done = sum(x.completed for x in self._handles)
                raise TimeoutError(f"transfer not complete after {timeout} s ({done}/{self.num_writes} writes done)")
        err = self.error
        if err is not None:
            raise err

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Transfer {self.num_writes} writes, {self.nbytes} bytes, {state}>"


class Counter:
    """An expectation: ``count`` writes carrying ``imm``. Arrivals before it was made count."""

    __slots__ = ("_handle", "imm", "count", "callback", "__weakref__")

    def __init__(self, handle: Any, imm: int, count: int, callback: Optional[Callable[["Counter"], Any]]) -> None:
        self._handle = handle
        self.imm = imm
        self.count = count
        self.callback = callback

    @property
    def done(self) -> bool:
        return self._handle.done

    @property
    def arrived(self) -> int:
        return self._handle.arrived

    @property
    def done_ns(self) -> int:
        """When the expectation was met, in ``time.monotonic_ns()``'s clock (CLOCK_MONOTONIC,
        comparable across processes of one host): stamped by the thread that credited the last
        of the ``count`` writes (the progress thread, or a waiter driving the CQ), before any
        callback runs; for writes banked before ``expect``, by ``expect``. 0 while pending,
        and for an expectation that was discarded or outlived by its engine."""
        return self._handle.done_ns

    @property
    def state(self) -> str:
        """``"pending"``, ``"done"`` (all arrived), ``"discarded"`` (withdrawn by
        ``Engine.discard``) or ``"closed"`` (the engine closed first)."""
        h = self._handle
        if not h.done:
            return "pending"
        if h.errno == _errno.EIDRM:
            return "discarded"
        return "closed" if h.errno else "done"

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until all ``count`` writes have landed; TimeoutError otherwise."""
        timeout = _timeout(timeout)
        if not self._handle.wait(timeout):
            raise TimeoutError(f"imm {self.imm}: {self._handle.arrived}/{self.count} writes arrived after {timeout} s")
        if self._handle.errno == _errno.EIDRM:
            raise ClosedError(f"imm {self.imm}: the expectation was discarded ({self.arrived}/{self.count} arrived)")
        if self._handle.errno:
            raise ClosedError(f"imm {self.imm}: engine closed before the writes arrived")

    def __repr__(self) -> str:
        return f"<Counter imm={self.imm} {self.arrived}/{self.count}>"


def dispatch(rail: Any, lock: threading.Lock, callbacks: dict) -> None:
    """The callback dispatcher's loop (thread ``kvxfer-dispatch``, started by the first
    ``Engine.expect`` with a callback): each counter whose writes all arrived comes back from
    the native side by address (``rail.next_done``), its callback runs here, once. Ends when
    the rail stops dispatching (-1). ``callbacks`` maps addresses to counters, under ``lock``."""
    while True:
        addr = rail.next_done(0.2)
        if addr == -1:
            return
        if addr is None:
            continue
        with lock:
            c = callbacks.pop(addr, None)
        if c is not None and c.callback is not None:
            try:
                c.callback(c)
            except BaseException:  # a user callback must not kill the dispatcher: a
                # SystemExit (sys.exit() in a callback) ended the thread, and no later
                # counter's callback ever ran
                import traceback

                traceback.print_exc()
